"""LiLiCorr's terms in the fused loss: what the chunk loop gives (every drafted row's top-k candidates and
their raw logits, and, through a zero-weight row term, each row's log-normaliser) feeds the head, whose
lattice terms (terms.py) are added after the loop as an output term. No second pass over the vocabulary:
the candidates' log-probs are their raw logits minus the row's log-normaliser, and the target's logits at
the candidates are the target's states times the candidates' lm_head rows (k rows a slot).

`lattice_inputs` takes from drafter_loss what the head reads besides the loss's output: each anchor's
context row and the target's states at every slot's label; with `soft_value` the loop also returns each
row's q @ W (`LossOutput.expected`), the rest of a candidate log-prob's gradient.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.architectures.lilicorr.logs import TOP_LOG_Q
from dflash_ds.architectures.lilicorr.terms import (Weights, lattice_logs, lattice_terms, nodes, oracle, soft_log_probs,
                                                     weighted)
from dflash_ds.objective.blocks import slot_rows, slot_target_states
from dflash_ds.objective.loss_terms import OutputTerm, RowTerm

if TYPE_CHECKING:
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.objective.blocks import Blocks, MicroBatch

# TOP_LOG_Q: the row term whose per-row values are log q of each row's argmax: the row's log-normaliser is
# then its top raw logit minus this (logits untransformed: LiLiCorr refuses targets with a logit transform).


def top_log_q(q: torch.Tensor, tz: torch.Tensor | None, grad: bool):
    """log max_v q[v] per row, with no gradient of its own (its term's weight is 0)."""
    return q.amax(-1).log(), (torch.zeros_like(q) if grad else None)


class LatticeInputs(NamedTuple):
    """What the lattice terms read besides the loss's output, for the micro-batch's R*N blocks."""

    hidden: torch.Tensor  # [R, N*B, D] the drafter's final states
    context: torch.Tensor  # [R*N, D] each anchor's context row, hidden_norm(fc(taps)) at anchor - 1
    context_valid: torch.Tensor  # [R*N] bool: that row exists (in the sequence and the anchor's document)
    target_states: torch.Tensor  # [R, N*B, D] the target's final-norm states of every slot's label position


def lattice_inputs(blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor, mb: MicroBatch) -> LatticeInputs:
    """What the head reads of micro-batch `mb` besides the loss's output: the context row before each
    anchor (ctx `[R, S, D]`, drafter.fuse of the taps) where it is in the anchor's document, as the
    engines have it (none before a request's first token), and the target's state at every slot's label."""
    if mb.final_hidden is None:
        raise ValueError("LiLiCorr's penalty reads the target's logits at the candidates, but the payload carries no "
                         "target final-norm states")
    r, n = blocks.anchors.shape
    before = (blocks.anchors - 1).clamp(min=0)
    context = ctx.gather(1, before[..., None].expand(-1, -1, ctx.shape[-1])).reshape(r * n, -1)
    same_doc = mb.doc_ids.gather(1, before) == mb.doc_ids.gather(1, blocks.anchors)
    valid = ((blocks.anchors >= 1) & same_doc).reshape(-1)
    b = blocks.labels.shape[1] // n  # the block size
    return LatticeInputs(hidden, context, valid, slot_target_states(mb.final_hidden, blocks.anchors, b))


class LatticeLoss(OutputTerm):
    """(w_ce * CE + w_margin * hinge + w_pen * penalty) summed over supervised slots, over their count, as a
    share of the step by the micro-batch's slot weight (the DFlash loss's normaliser is the step's)."""

    name = "lilicorr_ce_sum"

    def __init__(self, model: DraftModel, blocks: Blocks, inputs: LatticeInputs, weights: Weights):
        self.model, self.blocks, self.inputs, self.weights = model, blocks, inputs, weights
        self.weight = weights.ce  # the term's headline weight (OutputTerm); the three are in `weights`
        self.top_k = model.drafter.lilicorr.geometry.top_k
        self.reads_expected = weights.soft_value

    def contribute(self, out, normaliser):
        model, blocks, inputs = self.model, self.blocks, self.inputs
        b, k = model.config.block_size, self.top_k
        hidden = slot_rows(inputs.hidden, b)
        rows, d = hidden.shape
        s = b - 1
        n = rows // s
        cands = out.candidates.view(n, s, k)
        raw = out.candidate_logits.to(torch.promote_types(out.candidate_logits.dtype, torch.float32))
        lse = raw[:, 0] - out.rows[TOP_LOG_Q].to(raw.dtype)
        log_probs = raw - lse[:, None]
        if self.reads_expected:  # the soft-value channel into the drafted states
            if out.expected is None:
                raise ValueError("LiLiCorr's soft_value needs each row's q @ W from the loss (LossOutput.expected), "
                                 "and this loss returned none")
            log_probs = soft_log_probs(hidden, log_probs, out.candidates, model.lm_head, expected=out.expected)
        with torch.no_grad():
            w_rows = model.lm_head.to(hidden.dtype)
            target = slot_rows(inputs.target_states, b).to(hidden.dtype)
            target_logits = torch.einsum("rd,rkd->rk", target, F.embedding(out.candidates, w_rows)).view(n, s, k)
            embeddings = F.embedding(cands, model.embed.to(hidden.dtype))
        factors = model.drafter.lilicorr(embeddings, log_probs.view(n, s, k), hidden.view(n, s, d), inputs.context,
                                         valid=inputs.context_valid)
        labels = slot_rows(blocks.labels, b).view(n, s)
        slot_weights = slot_rows(blocks.weights, b).view(n, s)
        found = oracle(cands, labels, slot_weights)
        node = nodes(factors, found.gold_index)
        sums = lattice_terms(node, found, target_logits.to(raw.dtype), self.weights)  # fp32 or wider
        total = weighted(sums, self.weights)
        share = slot_weights.sum() / normaliser
        loss = total / sums.supervised.clamp(min=1) * share
        logs = {"lilicorr_ce_sum": sums.ce.detach(), "lilicorr_hinge_sum": sums.hinge.detach(),
                "lilicorr_penalty_sum": sums.penalty.detach(), "lilicorr_supervised": sums.supervised.detach()}
        logs.update({f"lilicorr_{name}": v for name, v in lattice_logs(factors, node, found, cands,
                                                                        gold=labels).items()})
        return loss, logs


def lattice_loss_terms(model: DraftModel, blocks: Blocks, inputs: LatticeInputs, weights: Weights) -> tuple:
    """The loss terms LiLiCorr adds after the cross-entropy: the zero-weight row term giving each row's
    log-normaliser, then the lattice terms."""
    return (RowTerm(TOP_LOG_Q, 0.0, top_log_q, reads_target=False), LatticeLoss(model, blocks, inputs, weights))
