"""Acceptance length tau (docs/algorithm.md section 7), computed exactly offline.

Convention (the one `dflash_ds.eval.specdec.speculative_generate` runs online, cycle for cycle):

- Sequence `x` = prompt (`P` tokens) + the target's greedy response `y`, so `x[P]` is the first
  generated token and `end = len(x)`. The response ends at EOS (included) or at the token budget.
- The target's prefill emits `x[P]` on its own; that token belongs to no cycle.
- A cycle is anchored at the position `t` of the last token the target emitted (its bonus).
  The drafter sees the target's tapped hidden states of positions `< t` and the block
  `[x[t], MASK x (B-1)]` at positions `t .. t+B-1`; block slot `k` proposes the token at `t + k`.
- `a(t)` = the number of leading slots `k = 1 .. B-1` whose drafted token equals `x[t + k]` (the
  argmax for v1; for DFlash2 the token on the candidate selector's greedy path, for DSpark the
  token on the Markov chain, walked from the anchor exactly as the engines walk it,
  `DraftModel.draft`); an anchor-first drafter (DSpark) drafts from every slot, slot `k` proposing
  `x[t + k + 1]`, so its drafts run `k = 1 .. B` and a cycle emits up to B + 1 tokens; capped at
  `end - t - 2` so that the cycle's last token, the target's own token at `t + a(t) + 1`, lies in
  the response. The cycle emits `a(t) + 1` tokens; the next cycle is anchored at `t + a(t) + 1`.
- The walk starts at `t = P` and stops at `t = end - 1` (the last response token, which anchors
  nothing). It therefore covers exactly the response: `sum(cycles) = len(y) - 1`.

Because greedy speculative decoding emits exactly the target's greedy text and the target is
causal, one teacher-forced target pass over `x` gives every cycle's context, so tau needs no
online loop (and no cache, which hybrid Gated DeltaNet targets cannot crop).

tau per response = mean of its cycles' emitted tokens; `tau_mean` averages the per-response
means (z-lab's way), `tau_pooled` = total tokens / total cycles.

Per-position acceptance: the conditional rate at draft slot k = P(slot k accepted | slots
1..k-1 accepted), counted over the cycles. A cycle that emitted `e` tokens accepted slots
1..e-1 and, when e < B, rejected slot e. The last cycle of every response is cut by the end of
the response (its a(t) is capped), so its first non-accepted slot is unobserved, not rejected:
that cycle contributes its accepted slots only. Rates are None at slots no cycle reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dflash_ds.network.arch_types import Proposal
from dflash_ds.network.attention import build_layer_masks
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.objective.blocks import block_inputs

DEFAULT_BATCH_ANCHORS = 64


@torch.no_grad()
def accept_lengths(model: DraftModel, taps: torch.Tensor, input_ids: torch.Tensor, start: int, *, end: int,
                   batch_anchors: int = DEFAULT_BATCH_ANCHORS) -> torch.Tensor:
    """a(t) for every anchor t in [start, end) of one sequence (see the module docstring).

    taps [S, T*D]: the target's tapped states of `input_ids` [S] (teacher-forced), S >= end - 1.
    Returns a LongTensor [end - start] on the CPU.
    """
    drafts = anchor_drafts(model, taps, input_ids, start, end=end, batch_anchors=batch_anchors)
    return matched_prefix(drafts, input_ids, start, end)


def matched_prefix(drafts: torch.Tensor, input_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """a(t) from the drafts [end - start, L] of every anchor: the leading slots equal to the
    sequence, capped at end - t - 2 (module docstring)."""
    slots = drafts.shape[1]
    ids = input_ids.reshape(-1)[:end].cpu()
    anchors = torch.arange(start, end)
    where = anchors[:, None] + torch.arange(1, slots + 1)[None]
    inside = where < end
    match = (drafts.cpu() == ids[where.clamp(max=end - 1)]) & inside
    a = match.long().cumprod(1).sum(1)
    return torch.minimum(a, (end - 2 - anchors).clamp(min=0))


def anchor_drafts(model: DraftModel, taps: torch.Tensor, input_ids: torch.Tensor, start: int, *, end: int,
                  batch_anchors: int = DEFAULT_BATCH_ANCHORS) -> torch.Tensor:
    """The drafter's greedy tokens at every anchor t in [start, end): LongTensor [end - start, L]
    (L = B - 1 drafts per block, B anchor-first; draft j proposes the token at t + 1 + j)."""
    return anchor_proposals(model, taps, input_ids, start, end=end, batch_anchors=batch_anchors).tokens


@torch.no_grad()
def anchor_proposals(model: DraftModel, taps: torch.Tensor, input_ids: torch.Tensor, start: int, *, end: int,
                     p_min: float = 0.0, batch_anchors: int = DEFAULT_BATCH_ANCHORS,
                     temperature: float = 0.0) -> Proposal:
    """`anchor_drafts`'s tokens, how many of each anchor's llama.cpp verifies under `--spec-draft-p-min
    p_min` and the confidences its cut reads (`DraftModel.propose`), on the CPU. With `temperature` > 0
    also `text_q`: q of the text's own next tokens under an architecture's sampled draft
    (`DraftModel.text_probabilities`; 0 past the end), when it samples its draft.

    All anchors go through the drafter in batches of `batch_anchors` blocks with the training
    masks (context strictly before the anchor and inside each layer's window, the own block as the
    layer attends to it), so this exercises the same drafter path as training.
    """
    drafter, B, mask_id = model.drafter, model.block_size, model.mask_token_id
    ids = input_ids.reshape(-1)
    if not 1 <= start <= end <= ids.numel():
        raise ValueError(f"need 1 <= start <= end <= sequence length, got start={start} end={end} S={ids.numel()}")
    if taps.dim() != 2 or taps.shape[0] < end - 1:
        raise ValueError(f"taps must be [S, T*D] covering positions < {end - 1}, got {tuple(taps.shape)}")
    p = next(drafter.parameters())
    device, dtype = p.device, p.dtype
    parts: list[Proposal] = []
    s_all = min(taps.shape[0], end)
    ctx = drafter.fuse(taps[None, :s_all].to(device=device, dtype=dtype))
    y = ids[:end].to(device)
    positions = torch.arange(end, device=device)[None]
    doc_ids = torch.zeros(1, s_all, dtype=torch.int32, device=device)
    for c0 in range(start, end, batch_anchors):
        anchors = torch.arange(c0, min(c0 + batch_anchors, end), device=device)
        n = anchors.numel()
        # Context columns at or after the last anchor are masked for every block of the chunk.
        s_ctx = min(int(anchors[-1]) + 1, s_all)
        block_ids, block_pos = block_inputs(y[None], positions, anchors[None], B, mask_token_id=mask_id)
        mask = build_layer_masks(anchors[None], torch.ones(1, n, dtype=torch.bool, device=device),
                                 doc_ids[:, :s_ctx], B, attentions=drafter.config.layer_attentions(), kind="dense")
        embeds = model.embed_tokens(block_ids, p)
        hidden = drafter(embeds, ctx[:, :s_ctx], block_pos, positions[:, :s_ctx], mask=mask)
        # The path the engines propose: the architecture's walk and its cut (DraftModel.propose).
        # Each anchor's context row (the fused state before it, start >= 1): LiLiCorr's head reads it.
        states, rows = model.drafting_states(hidden.view(n, B, -1)), ctx[0, anchors - 1]
        proposal = model.propose(states, block_ids.view(n, B)[:, 0], p_min, context=rows)
        if temperature > 0:
            # The text after each anchor, -1 (no candidate's id) past its end.
            at = anchors[:, None] + 1 + torch.arange(model.num_drafts, device=device)
            following = torch.where(at < end, y[at.clamp(max=end - 1)], torch.full_like(at, -1))
            proposal = proposal._replace(text_q=model.text_probabilities(states, following, temperature, context=rows))
        parts.append(proposal)
    if not parts:
        return Proposal(torch.zeros(0, model.num_drafts, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    confidence = None if parts[0].confidence is None else torch.cat([q.confidence.cpu() for q in parts])
    text_q = None if parts[0].text_q is None else torch.cat([q.text_q.cpu() for q in parts])
    return Proposal(torch.cat([q.tokens.cpu() for q in parts]), torch.cat([q.served.cpu() for q in parts]), confidence,
                    text_q=text_q)


def walk(a: Sequence[int] | torch.Tensor, first: int, end: int) -> list[int]:
    """Tokens emitted per cycle when decoding positions [first, end) (module docstring).

    `a[i]` is a(first + i), len(a) == end - first. Cycle anchors: t = first, then t + a(t) + 1,
    while t < end - 1. Each cycle records min(a(t), end - t - 2) + 1, so the cycles add up to
    end - 1 - first tokens.
    """
    a = [int(v) for v in (a.tolist() if isinstance(a, torch.Tensor) else a)]
    if len(a) != end - first:
        raise ValueError(f"walk needs a(t) for every t in [first, end): len(a)={len(a)}, first={first}, end={end}")
    cycles, t = [], first
    while t < end - 1:
        emitted = min(max(a[t - first], 0), end - t - 2) + 1
        cycles.append(emitted)
        t += emitted
    return cycles


def tau_from_taps(model: DraftModel, taps: torch.Tensor, input_ids: torch.Tensor, first: int, *, end: int,
                  batch_anchors: int = DEFAULT_BATCH_ANCHORS) -> list[int]:
    """Per-cycle emitted tokens of one response: `first` = prompt length, `end` = sequence length."""
    a = accept_lengths(model, taps, input_ids, first, end=end, batch_anchors=batch_anchors)
    return walk(a, first, end)


@dataclass
class TauReport:
    """tau over a set of responses, from each response's per-cycle emitted tokens."""

    block_size: int
    """The most tokens a cycle emits (`DraftModel.max_emitted`): the block size B, or B + 1 for an
    anchor-first drafter, whose B slots all draft."""
    cycles: list[list[int]] = field(default_factory=list)

    @property
    def per_response(self) -> list[float | None]:
        # A one-token response (EOS or budget right after prefill) has no cycle and no tau.
        return [sum(c) / len(c) if c else None for c in self.cycles]

    @property
    def tau_mean(self) -> float:
        taus = [t for t in self.per_response if t is not None]
        return sum(taus) / len(taus) if taus else math.nan

    @property
    def num_cycles(self) -> int:
        return sum(len(c) for c in self.cycles)

    @property
    def num_tokens(self) -> int:
        return sum(sum(c) for c in self.cycles)

    @property
    def tau_pooled(self) -> float:
        return self.num_tokens / self.num_cycles if self.num_cycles else math.nan

    @property
    def histogram(self) -> list[int]:
        """histogram[j] = number of cycles that accepted exactly j drafts (j = 0 .. B-1)."""
        h = [0] * self.block_size
        for c in self.cycles:
            for emitted in c:
                h[emitted - 1] += 1
        return h

    def position_counts(self) -> tuple[list[int], list[int]]:
        """(reached[k-1], accepted[k-1]) for slots k = 1 .. B-1 (module docstring)."""
        reached, accepted = [0] * (self.block_size - 1), [0] * (self.block_size - 1)
        for c in self.cycles:
            for i, emitted in enumerate(c):
                for k in range(emitted - 1):  # slots 1 .. e-1 were accepted
                    reached[k] += 1
                    accepted[k] += 1
                if i < len(c) - 1 and emitted < self.block_size:  # slot e rejected (not the censored last cycle)
                    reached[emitted - 1] += 1
        return reached, accepted

    @property
    def position_acceptance(self) -> list[float | None]:
        """Conditional acceptance rate at draft slots 1 .. B-1."""
        reached, accepted = self.position_counts()
        return [a / r if r else None for r, a in zip(reached, accepted)]

    def position_line(self) -> str:
        """One line: the conditional acceptance rate at each draft position."""
        rates = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(self.position_acceptance, 1))
        return f"acceptance by position (P(slot k | slots < k accepted)): {rates}"

    def metrics_record(self) -> dict:
        """What the in-training eval logs: lists for metrics.jsonl, flat numbers for wandb."""
        pos = self.position_acceptance
        rec = {"tau": self.tau_mean, "tau_pooled": self.tau_pooled, "tau_histogram": self.histogram,
               "tau_position_acceptance": pos}
        rec.update({f"tau_accept_pos_{k}": p for k, p in enumerate(pos, 1) if p is not None})
        return rec

    def as_dict(self) -> dict:
        def num(x):
            return None if x is None or math.isnan(x) else x

        return {
            "tau_mean": num(self.tau_mean),
            "tau_pooled": num(self.tau_pooled),
            "block_size": self.block_size,
            "num_responses": len(self.cycles),
            "num_cycles": self.num_cycles,
            "num_tokens": self.num_tokens,
            "accepted_histogram": self.histogram,
            "position_acceptance": self.position_acceptance,
            "position_reached": self.position_counts()[0],
            "tau_per_response": [num(t) for t in self.per_response],
            "cycles": self.cycles,
        }
