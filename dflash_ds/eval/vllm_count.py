"""Acceptance as vLLM counts it (docs/algorithm.md section 7.3, "How the engines count"), from the same
drafts as tau.

vLLM's V1 engine counts one draft per scheduler step in which a request verified draft tokens, accepted =
the tokens that step produced minus one, and per position k the drafts whose first k + 1 tokens were
accepted; its mean acceptance length is 1 + accepted / drafts. Its first draft is anchored at the first
generated token (the prefill drafts nothing), as tau's first cycle. Three rules make its count differ
from both the project's cycles and llama.cpp's rounds:

1. Acceptance is counted before the stop check. A drafted end-of-generation token that the target
   confirms counts as accepted, and so does every draft after it that equals the target's greedy
   continuation past it (the target verifies the whole draft; the tokens after the stop are dropped
   from the output only after they were counted).
2. Every draft verifies all K = `num_speculative_tokens` tokens, at the end of the token budget too:
   what lies past `max_tokens` is dropped from the output, not from the count.
3. The drafter runs a K + 1-token block (anchor + K mask slots), not the B it was trained with: with
   K < B - 1 a DFlash drafter's drafts are those of the shorter block (`with_block`), which differ from
   the trained block's where a layer sees its whole block.

So a round may verify tokens past the response's end; `vllm_rounds` names the length it needs and
`VllmCounts.add` extends the response with the target's greedy tokens (stop tokens ignored) that far.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from dflash_ds.eval.engine_count import Round
from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.tau import anchor_drafts
from dflash_ds.network.draft_model import DraftModel


class NeedsMoreTokens(Exception):
    """`vllm_rounds` verifies a position past the end of the ids it was given."""

    def __init__(self, length: int):
        super().__init__(f"vLLM's rounds verify up to position {length - 1}; extend the ids to {length} tokens")
        self.length = length


def vllm_rounds(drafts: torch.Tensor, ids: torch.Tensor, first: int, budget_end: int,
                *, stop: Collection[int]) -> list[Round]:
    """Every vLLM round of one greedy response whose first generated token is at `first` (= P).

    drafts [n, K]: the drafts at anchors first .. first + n - 1 with vLLM's block (`with_block`);
    ids: the prompt, the response and, where a round verifies past the response's end, the target's
    greedy tokens there (raises NeedsMoreTokens with the length needed); `budget_end` = P + max_tokens;
    `stop`: the end-of-generation ids.
    """
    ids = ids.reshape(-1).tolist()
    k = drafts.shape[1]
    rounds, t = [], first
    done = ids[first] in stop or first + 1 >= budget_end
    while not done:
        if t - first >= drafts.shape[0]:
            raise ValueError(f"no drafts at anchor {t}: pass drafts for anchors {first} .. {t} at least")
        d = drafts[t - first].tolist()
        a = 0
        while a < k:
            if t + 1 + a >= len(ids):
                raise NeedsMoreTokens(t + 2 + a)
            if d[a] != ids[t + 1 + a]:
                break
            a += 1
        if t + 1 + a >= len(ids):  # the target's own token after the accepted drafts
            raise NeedsMoreTokens(t + 2 + a)
        rounds.append(Round(a, k))
        # The step's tokens t + 1 .. t + 1 + a: a stop among them, or the budget, ends the request.
        done = any(i in stop for i in ids[t + 1: t + 2 + a]) or t + a + 2 >= budget_end
        t += a + 1
    return rounds


def with_block(model: DraftModel, num_speculative_tokens: int) -> DraftModel:
    """The drafter as vLLM runs it with `num_speculative_tokens` K: a block of K + 1 slots (anchor + K
    masks) for DFlash, K for an anchor-first architecture; the weights are shared, not copied."""
    block = num_speculative_tokens + model.config.first_draft_slot
    if not 2 <= block <= model.block_size:
        raise ValueError(f"num_speculative_tokens {num_speculative_tokens}: vLLM drafts 1 to {model.num_drafts} "
                         f"tokens with this drafter (block size {model.block_size})")
    if block == model.block_size:
        return model
    drafter = copy.copy(model.drafter)  # a new attribute dict: `config` changes here only
    drafter.config = dataclasses.replace(model.config, block_size=block)
    return dataclasses.replace(model, drafter=drafter)


@torch.no_grad()
def greedy_extension(target) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """ids -> ids followed by the target's greedy tokens up to a length, stop tokens ignored (a plain
    loop: only the few tokens a last round verifies past the response's end are needed)."""
    def extend(ids: torch.Tensor, length: int) -> torch.Tensor:
        device = next(target.parameters()).device
        x = ids.reshape(1, -1).to(device)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            while x.shape[1] < length:
                nxt = target(input_ids=x).logits[0, -1].argmax().view(1, 1)
                x = torch.cat([x, nxt], dim=1)
        return x[0].cpu()
    return extend


@dataclass
class VllmCounts:
    """vLLM's rounds of many greedy responses and its counters: drafts, accepted tokens, the
    per-position counts (`vllm:spec_decode_num_accepted_tokens_per_pos`) and the mean."""

    num_speculative_tokens: int
    rounds: list[list[int]] = field(default_factory=list)  # each response's accepted tokens per draft
    stop: Collection[int] = ()  # the target's end-of-generation ids
    extend: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # `greedy_extension` of the target

    @classmethod
    def of(cls, target, num_speculative_tokens: int) -> "VllmCounts":
        """Counts of responses of a loaded transformers target."""
        return cls(num_speculative_tokens, stop=frozenset(eos_ids(target)), extend=greedy_extension(target))

    def add(self, model: DraftModel, taps: torch.Tensor, ids: torch.Tensor, *, prompt_len: int,
            budget: int) -> list[Round]:
        """One greedy response `ids[prompt_len:]` (taps [S, T*D] teacher-forced over ids) of at most
        `budget` tokens. Returns its rounds."""
        p, end = prompt_len, ids.numel()
        drafts = anchor_drafts(with_block(model, self.num_speculative_tokens), taps, ids, p, end=max(end - 1, p))
        rounds = self.walk(drafts, ids, prompt_len=p, budget=budget)
        self.rounds.append([r.accepted for r in rounds])
        return rounds

    def walk(self, drafts: torch.Tensor, ids: torch.Tensor, *, prompt_len: int, budget: int) -> list[Round]:
        """`vllm_rounds` of the drafts [n, K] at anchors prompt_len.., the response extended by the
        target's greedy tokens as far as a round verifies."""
        while True:
            try:
                return vllm_rounds(drafts, ids, prompt_len, prompt_len + budget, stop=self.stop)
            except NeedsMoreTokens as e:
                if self.extend is None:
                    raise
                ids = self.extend(ids, e.length)

    @property
    def num_drafts(self) -> int:
        return sum(len(r) for r in self.rounds)

    @property
    def num_accepted(self) -> int:
        return sum(sum(r) for r in self.rounds)

    @property
    def per_position(self) -> list[int]:
        """Drafts whose first k + 1 tokens were accepted, k = 0 .. K - 1."""
        return [sum(a > k for r in self.rounds for a in r) for k in range(self.num_speculative_tokens)]

    @property
    def mean_accept_length(self) -> float:
        n = self.num_drafts
        return 1.0 + self.num_accepted / n if n else float("nan")

    def line(self) -> str:
        return (f"vLLM mean acceptance length (num_speculative_tokens {self.num_speculative_tokens}): "
                f"{self.mean_accept_length:.3f} ({self.num_drafts} drafts, {self.num_accepted} accepted; "
                f"per position {' '.join(map(str, self.per_position))})")

    def as_dict(self) -> dict:
        m = self.mean_accept_length
        return {"num_speculative_tokens": self.num_speculative_tokens, "mean_accept_length": None if m != m else m,
                "num_drafts": self.num_drafts, "num_draft_tokens": self.num_drafts * self.num_speculative_tokens,
                "num_accepted_tokens": self.num_accepted, "accepted_per_position": self.per_position,
                "rounds": self.rounds}
