"""Acceptance as llama.cpp counts it (docs/algorithm.md section 7, "How the engines count"), from the same
drafts as tau.

llama.cpp reports `mean acc len = 1 + accepted drafts / verification rounds`, and its rounds are not
quite the project's cycles:

- llama-speculative-simple prefills the prompt without its last token, so its first round is anchored
  at the last prompt token (`first = P - 1`); llama-server samples the first token from the prefill,
  as the project does, and drafts from it (`first = P`).
- A drafted end-of-generation token that the target confirms ends the round as the target's token
  (the draft is not counted) unless it sits in the last drafted slot, where it counts as accepted.
- Near the token budget the draft is cut to what still fits (`budget_end - t - 2` slots, the budget
  counted in positions); a round with no room for a draft is a plain decoding step, not a round.
- An anchor-first drafter (DSpark) drafts B tokens a round (`--spec-draft-n-max B`), a DFlash block
  B - 1: the drafts' width. With `--spec-draft-p-min` llama.cpp cuts a DSpark draft at its first
  slot whose confidence is below the threshold (`served`, from `tau.anchor_proposals`); a draft cut
  to nothing is a plain decoding step too (llama-server counts no round; llama-speculative-simple
  logs it as `accepted 0/0` and, once it has verified a draft, counts it in its mean).

Given the drafts at every anchor and the response, the rounds follow exactly (greedy verification
accepts a drafted token iff it is the response's token there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, NamedTuple

import torch

from dflash_ds.eval.tau import anchor_drafts
from dflash_ds.network.draft_model import DraftModel


class Round(NamedTuple):
    accepted: int  # drafts the target confirmed
    drafted: int  # drafts it verified (the block's, less the budget's and the confidence cut's)


def engine_rounds(drafts: torch.Tensor, ids: torch.Tensor, first: int, end: int, *, budget_end: int,
                  stop: Collection[int], served: torch.Tensor | None = None) -> list[Round]:
    """Every llama.cpp round over the response `ids[P:end]`.

    drafts [end - first, L]: the drafter's tokens at anchors first .. end-1 (`tau.anchor_drafts`);
    `first`: the first round's anchor (P - 1 or P, module docstring); `budget_end` = P + the token
    budget (>= end); `stop`: the end-of-generation ids; `served` [end - first]: how many of each
    anchor's drafts llama.cpp verifies under its confidence cut (None: all L). Stops once a round
    reaches the response's end.
    """
    ids = ids.reshape(-1)[:end].tolist()
    slots = drafts.shape[1]
    cut = [slots] * drafts.shape[0] if served is None else served.tolist()
    rounds, t = [], first
    while t < end - 1:
        room = min(slots, cut[t - first], budget_end - t - 2)
        if room <= 0:
            t += 1
            continue
        d = drafts[t - first].tolist()
        a = 0
        while a < room and t + 1 + a < end and d[a] == ids[t + 1 + a]:
            if ids[t + 1 + a] in stop and a + 1 < room:
                break
            a += 1
        rounds.append(Round(a, room))
        t += a + 1
    return rounds


@dataclass
class EngineCount:
    """Rounds of many responses and llama.cpp's aggregate of them."""

    rounds: list[list[int]] = field(default_factory=list)  # each response's accepted drafts per round

    @property
    def mean_accept_length(self) -> float:
        """1 + accepted / rounds, pooled over the responses (llama.cpp's `mean acc len` over one run)."""
        n = sum(len(r) for r in self.rounds)
        return 1.0 + sum(sum(r) for r in self.rounds) / n if n else float("nan")

    def as_dict(self) -> dict:
        m = self.mean_accept_length
        return {"mean_accept_length": None if m != m else m, "rounds": self.rounds}


@dataclass
class LlamaCppCounts:
    """Both llama.cpp programs' rounds: llama-server's (first round at the first generated token) and
    llama-speculative-simple's (first round at the last prompt token), served with
    `--spec-draft-n-max` = the drafts a block has and no confidence cut."""

    server: EngineCount = field(default_factory=EngineCount)
    speculative_simple: EngineCount = field(default_factory=EngineCount)
    draft_max: int = 0  # the --spec-draft-n-max they assume (B - 1, or B anchor-first)

    def add(self, model: DraftModel, taps: torch.Tensor, ids: torch.Tensor, prompt_len: int, *, budget: int,
            stop: Collection[int]) -> None:
        """One response `ids[prompt_len:]` (taps [S, T*D] teacher-forced over ids) of at most `budget` tokens."""
        p, end = prompt_len, ids.numel()
        drafts = anchor_drafts(model, taps, ids, p - 1, end=end)
        self.draft_max = drafts.shape[1]
        self.speculative_simple.rounds.append(accepted(engine_rounds(drafts, ids, p - 1, end, budget_end=p + budget,
                                                                     stop=stop)))
        self.server.rounds.append(accepted(engine_rounds(drafts[1:], ids, p, end, budget_end=p + budget, stop=stop)))

    def line(self) -> str:
        return (f"llama.cpp mean acc len (--spec-draft-n-max {self.draft_max}): llama-server "
                f"{self.server.mean_accept_length:.3f}, llama-speculative-simple "
                f"{self.speculative_simple.mean_accept_length:.3f} (first round at the last prompt token)")

    def as_dict(self) -> dict:
        return {"spec_draft_n_max": self.draft_max, "llama_server": self.server.as_dict(),
                "llama_speculative_simple": self.speculative_simple.as_dict()}


def accepted(rounds: list[Round]) -> list[int]:
    """The accepted drafts of each round (what llama.cpp logs as `accepted N/M draft tokens`)."""
    return [r.accepted for r in rounds]
