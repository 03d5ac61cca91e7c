"""Ending a training run before its planned last step, annealed: at the held-out plateau
(eval.plateau_evals) or at the time box (optim.max_seconds).

Either way the run does not stop at the learning rate it had: it enters a cooldown (optim.cooldown_ratio
of the steps run so far, the rate falling linearly to the floor: resolve/plan.py `Cooldown`) and ends
after it with its final checkpoint, evaluation and export, as a planned end would. The lead drafter
rank decides (only it evaluates; it keeps the clock of the box); every drafter rank learns the decision
from one small all-reduce at the steps where the loop synchronises anyway (log and evaluation steps), so
all of them enter the cooldown at the same step boundary.

A resumed run reads its earlier evaluations and any cooldown already decided back from metrics.jsonl,
so a plateau or a cooldown is not forgotten by a restart. The time box counts from the first step of
the process that runs it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.resolve.plan import Cooldown


@dataclass
class Plateau:
    """The held-out tau stopped rising: the mean of the last two evaluations has not exceeded its best
    by more than `delta` for `patience` evaluations in a row (a mean of two: one evaluation's noise
    counts half)."""

    patience: int
    delta: float
    taus: list[float] = field(default_factory=list)
    best: float = -math.inf
    since: int = 0

    def add(self, tau: float) -> bool:
        self.taus.append(float(tau))
        recent = self.taus[-2:]
        smooth = sum(recent) / len(recent)
        if smooth > self.best + self.delta:
            self.best, self.since = smooth, 0
        else:
            self.since += 1
        return self.patience > 0 and self.since >= self.patience


class EarlyEnd:
    """Whether, and where, the run ends early; `end_step` is where its loop stops."""

    def __init__(self, recipe, total_steps: int, cooldown: Cooldown, *, group, device, lead: bool):
        self.total, self.cooldown, self.group, self.device, self.lead = total_steps, cooldown, group, device, lead
        self.ratio = recipe.optim.cooldown_ratio
        self.max_seconds = recipe.optim.max_seconds
        self.plateau = Plateau(recipe.eval.plateau_evals, recipe.eval.plateau_delta)
        self.reason: str | None = None
        self.active = bool(recipe.eval.plateau_evals or recipe.optim.max_seconds)

    @property
    def end_step(self) -> int:
        end = self.cooldown.end
        return self.total if end is None else min(end, self.total)

    def resume(self, metrics: Path, start: int) -> None:
        """The evaluations and the cooldown a run recorded before `start` (its metrics.jsonl)."""
        if not self.active or start == 0 or not metrics.is_file():
            return
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("step", math.inf) > start:
                continue
            if rec.get("eval") == "periodic" and rec.get("tau") is not None:
                self.plateau.add(rec["tau"])
            if "early_end" in rec:
                self.reason = rec["early_end"]
                self.cooldown.start, self.cooldown.steps = int(rec["step"]), int(rec["cooldown_steps"])

    def evaluated(self, tau: float) -> None:
        """The lead's periodic held-out tau."""
        if self.reason is None and self.plateau.add(tau):
            self.reason = "plateau"

    def decide(self, done: int, elapsed: float) -> dict | None:
        """Collective over the drafter ranks, after step `done`: the record of a cooldown that starts
        here (the lead's plateau or time box), None when the run goes on as planned."""
        if not self.active or self.cooldown.start is not None:
            return None
        if self.lead and self.reason is None and self.max_seconds and elapsed * (1 + self.ratio) >= self.max_seconds:
            self.reason = "time box"
        flag = torch.tensor([0 if self.reason is None else 1 if self.reason == "plateau" else 2],
                            dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        code = int(flag.item())
        if code == 0:
            return None
        self.reason = "plateau" if code == 1 else "time box"
        self.cooldown.steps = min(int(round(self.ratio * done)), self.total - done)
        self.cooldown.start = done
        rec = {"step": done, "early_end": self.reason, "cooldown_steps": self.cooldown.steps,
               "end_step": self.end_step}
        if self.reason == "plateau":
            rec["plateau_best_tau"] = self.plateau.best
        return rec
