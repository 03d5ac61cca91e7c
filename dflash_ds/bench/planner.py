"""The targets:drafters split of a node implied by two measured per-GPU rates (pure functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    target_tok_s: float  # targets x per-GPU target rate: what the target side can produce
    drafter_tok_s: float  # drafters x per-GPU drafter rate: what the drafter side can consume

    @property
    def tok_s(self) -> float:
        return min(self.target_tok_s, self.drafter_tok_s)

    @property
    def bound(self) -> str:
        if math.isclose(self.target_tok_s, self.drafter_tok_s):
            return "balanced"
        return "target" if self.target_tok_s < self.drafter_tok_s else "drafter"


def plan_splits(target_rate: float, drafter_rate: float, gpus_per_node: int) -> list[Split]:
    """Every integer split t + d = N (t, d >= 1) with its expected tok/s (transport assumed free)."""
    if gpus_per_node < 2:
        raise ValueError(f"--gpus-per-node must be >= 2 (one target and one drafter rank), got {gpus_per_node}")
    if not (target_rate > 0 and drafter_rate > 0):
        raise ValueError(f"rates must be > 0 tok/s (--target-rate {target_rate}, --drafter-rate {drafter_rate})")
    return [Split(t, gpus_per_node - t, t * target_rate, (gpus_per_node - t) * drafter_rate)
            for t in range(1, gpus_per_node)]


def best_split(splits: list[Split]) -> Split:
    """The split of highest tok/s; ties go to more drafter ranks (ZeRO-2 shards over more ranks)."""
    return max(splits, key=lambda s: (s.tok_s, s.drafters))


def fractional_split(target_rate: float, drafter_rate: float, gpus_per_node: int) -> tuple[float, float]:
    """The real-valued optimum: t* = N*d/(t+d) target GPUs, giving N*t*d/(t+d) tok/s."""
    t = gpus_per_node * drafter_rate / (target_rate + drafter_rate)
    return t, t * target_rate
