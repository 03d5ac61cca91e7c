"""tau under sampling, as vLLM and SGLang verify a DFlash drafter's block (docs/algorithm.md section 7).

The engines' rule for a greedy (argmax) draft d_1 .. d_{B-1}: the target's distribution p_k at each
verified position is softmax(logits / T) restricted to the top-k tokens, then to the top-p
nucleus, renormalised (`target_probs`). Slot k is accepted with probability p_k(d_k) (the draft
distribution is a point mass, so min(1, p/q) = p(d)); on the first rejection the emitted token is
drawn from p_k with d_k removed and renormalised; when every slot is accepted the bonus token is
drawn from p_B. Every emitted token is therefore distributed as p at its position, and slot k is
accepted exactly when the emitted token equals d_k: the cycles are a function of the emitted text.

So, offline: draw the target's own sampled continuation of each prompt (seeded), run the same
greedy walk as `eval.tau` on it (the drafts depend only on the context), and average over
responses with a standard error. Given the trajectory, the acceptance probability of each slot a
cycle reached is known exactly (p_k(d_k) from one teacher-forced pass): `tau_expected` replaces
each reached slot's 0/1 outcome by that probability (a Rao-Blackwellised estimate of the pooled
tau, with less variance).

An architecture whose engines sample its draft (LiLiCorr) is verified by min(1, p / q): the emitted
tokens are still distributed as p, and the walk accepts a slot by a coin against min(1, q(x) / p(x))
along the text (`tau_of_trajectory`; docs/algorithm.md section 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.specdec import logits_and_taps
from dflash_ds.eval.tau import DEFAULT_BATCH_ANCHORS, TauReport, anchor_proposals, matched_prefix, walk
from dflash_ds.network.draft_model import DraftModel


@dataclass(frozen=True)
class Sampling:
    """How the target samples: temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"top_k={self.top_k}")
        return " ".join(parts)

    def check(self, prefix: str = "--") -> None:
        """One ValueError naming the setting when a value is out of range."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"{prefix}temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"{prefix}top_k must be >= 0 (0 = off), got {self.top_k}")


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the engines sample and verify with, over the last dim, in float32 (float64 kept).

    Order as in both engines: temperature, then top-k (ties with the k-th logit kept), then top-p
    on the renormalised top-k distribution (the smallest set of most likely tokens whose mass
    reaches top_p; the most likely token is always kept).
    """
    if sampling.greedy:
        raise ValueError("target_probs needs a temperature > 0 (greedy verification compares argmaxes)")
    z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / sampling.temperature
    if 0 < sampling.top_k < z.shape[-1]:
        kth = z.topk(sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    p = torch.softmax(z, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = p.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


@torch.no_grad()
def sampled_continuation(target, prompt_ids: torch.Tensor, sampling: Sampling, generator: torch.Generator, *,
                         max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """prompt + the target's response sampled with `sampling` (KV cache, `generator`), [S] on the CPU.

    Stops after max_new_tokens tokens or after an EOS (kept).
    """
    stop = set(eos_ids(target, eos_token_id))
    device = next(target.parameters()).device
    ids = prompt_ids.reshape(1, -1).to(device)
    out_ids = prompt_ids.reshape(-1).tolist()
    # Every step is a new shape: run eager, as greedy_continuation does.
    with torch.compiler.set_stance("force_eager"):
        out = target(input_ids=ids, use_cache=True)
        for _ in range(max_new_tokens):
            probs = target_probs(out.logits[0, -1], sampling)
            tok = int(torch.multinomial(probs, 1, generator=generator))
            out_ids.append(tok)
            if tok in stop or len(out_ids) - prompt_ids.numel() >= max_new_tokens:
                break
            out = target(input_ids=torch.tensor([[tok]], device=device), past_key_values=out.past_key_values,
                         use_cache=True)
    return torch.tensor(out_ids, dtype=torch.long)


def draft_probabilities(logits: torch.Tensor, drafts: torch.Tensor, first: int, end: int, *, sampling: Sampling,
                        chunk: int = 64) -> torch.Tensor:
    """p(d_k) for every anchor t in [first, end) and slot k: [end - first, B-1] float64 on the CPU.

    Slot k of anchor t proposes the token at t + k, whose distribution comes from the logits at
    t + k - 1. Entries past the sequence are 0. Distributions are built `chunk` positions at a time.
    """
    n, slots = drafts.shape
    out = torch.zeros(n, slots, dtype=torch.float64)
    rows = torch.arange(first, end)[:, None] + torch.arange(slots)[None]  # the logit row of each (t, k)
    valid = rows < end - 1  # the token at t + k exists
    for r0 in range(first, end - 1, chunk):
        r1 = min(r0 + chunk, end - 1)
        p = target_probs(logits[r0:r1], sampling)
        sel = valid & (rows >= r0) & (rows < r1)
        idx = (rows[sel] - r0).to(p.device)
        out[sel] = p[idx, drafts[sel].to(p.device)].double().cpu()
    return out


@dataclass
class SampledTau:
    """tau of a prompt set under one sampling setting.

    `report` holds each response's realized cycles (the walk); `slot_probs[r][c]` the acceptance
    probabilities of the slots cycle c of response r reached and could observe (slot k is reached
    when slots < k were accepted; slots past the end of the response are not observable).
    """

    sampling: Sampling
    report: TauReport
    slot_probs: list[list[list[float]]] = field(default_factory=list)
    # Greedy rows: the mean acceptance length as llama-server and vLLM count it on the same responses
    # (eval.engine_count, eval.vllm_count); empty for a sampled row.
    engines: dict[str, float] = field(default_factory=dict)

    @property
    def tau_expected(self) -> float:
        """Pooled tau with each reached slot's outcome replaced by its acceptance probability."""
        num, den = self.expected_sums()
        return sum(num) / sum(den) if sum(den) else math.nan

    def expected_sums(self) -> tuple[list[float], list[int]]:
        """Per response: the expected tokens of its cycles (1 + the reached slots' probabilities), its cycles."""
        num = [sum(1.0 + sum(c) for c in resp) for resp in self.slot_probs]
        den = [len(resp) for resp in self.slot_probs]
        return num, den


def slots_reached(emitted: int, last: bool, observable: int, block_size: int) -> int:
    """How many slots a cycle that emitted `emitted` tokens reached and could observe: the accepted
    ones and the first rejected one (none beyond the response's end, `observable` slots)."""
    reached = emitted - 1 if (last or emitted == block_size) else emitted
    return min(reached, observable, block_size - 1)


def tau_of_trajectory(target, model: DraftModel, x: torch.Tensor, first: int, *, sampling: Sampling,
                      batch_anchors: int = DEFAULT_BATCH_ANCHORS, coins: torch.Tensor | None = None
                      ) -> tuple[list[int], list[list[float]]]:
    """The walk's cycles over one sampled response and the reached slots' acceptance probabilities.

    An architecture whose engines sample its draft (`DraftModel.text_probabilities`, LiLiCorr): the
    emitted token x is distributed as p either way, and given x the slot was accepted with probability
    min(1, q(x) / p(x)), q its draft's along the text; slot k of the anchor at t is accepted when the
    coin of its position, `coins[t + 1 + k]` (uniform, one a position of x), is below it. Each position
    is verified once along the walk, so one coin a position is one fresh draw a verification."""
    end = x.numel()
    logits, taps = logits_and_taps(target, x, model.layer_ids)
    proposal = anchor_proposals(model, taps, x, first, end=end, batch_anchors=batch_anchors,
                                temperature=sampling.temperature)
    if proposal.text_q is None:
        drafts = proposal.tokens
        return walk_with_probs(drafts, draft_probabilities(logits, drafts, first, end, sampling=sampling), x, first,
                               end=end)
    if coins is None or coins.numel() < end:
        raise ValueError(f"{model.config.spec.title}'s sampled draft needs a coin per position of the "
                         f"response ({end}); pass coins")
    slots = proposal.tokens.shape[1]
    at = torch.arange(first, end)[:, None] + 1 + torch.arange(slots)[None]
    inside = at < end
    following = torch.where(inside, x.reshape(-1)[at.clamp(max=end - 1)], torch.zeros_like(at))
    p_text = draft_probabilities(logits, following, first, end, sampling=sampling)
    accept = torch.where(p_text > 0, (proposal.text_q.double() / p_text.clamp(min=1e-300)).clamp(max=1.0),
                         torch.zeros_like(p_text))
    hit = (coins.double().cpu()[at.clamp(max=end - 1)] < accept) & inside
    a = torch.minimum(hit.long().cumprod(1).sum(1), (end - 2 - torch.arange(first, end)).clamp(min=0))
    return accepted_walk(a, accept, first, end=end)


def walk_with_probs(drafts: torch.Tensor, slot_p: torch.Tensor, x: torch.Tensor, first: int,
                    *, end: int) -> tuple[list[int], list[list[float]]]:
    """Cycles of the walk over x[first:end] and, per cycle, p(d_k) of the slots it reached.

    drafts, slot_p: [end - first, B-1], the drafts of every anchor and their acceptance probabilities.
    """
    return accepted_walk(matched_prefix(drafts, x, first, end), slot_p, first, end=end)


def accepted_walk(accepted: torch.Tensor, slot_p: torch.Tensor, first: int, *, end: int
                  ) -> tuple[list[int], list[list[float]]]:
    """Cycles of the walk over [first, end) given each anchor's accepted slots `accepted` [end - first],
    and, per cycle, `slot_p` [end - first, B-1] of the slots it reached."""
    block_size = slot_p.shape[1] + 1
    cycles = walk(accepted, first, end)
    probs, t = [], first
    for i, emitted in enumerate(cycles):
        n = slots_reached(emitted, i == len(cycles) - 1, end - t - 2, block_size)
        probs.append([float(v) for v in slot_p[t - first, :n]])
        t += emitted
    return cycles, probs


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); nan when undefined."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    n = len(vals)
    if n == 0:
        return math.nan, math.nan
    mean = sum(vals) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return mean, math.sqrt(var / n)


def ratio_se(num: Sequence[float], den: Sequence[float]) -> tuple[float, float]:
    """sum(num) / sum(den) and its standard error over the units (the delta method)."""
    pairs = [(a, b) for a, b in zip(num, den) if b > 0]
    n = len(pairs)
    total = sum(b for _, b in pairs)
    if n == 0 or total == 0:
        return math.nan, math.nan
    r = sum(a for a, _ in pairs) / total
    if n < 2:
        return r, math.nan
    mean_den = total / n
    var = sum((a - r * b) ** 2 for a, b in pairs) / (n - 1)
    return r, math.sqrt(var / n) / mean_den
