"""LiLiCorr's lattice objective (Model-Optimizer's; docs/algorithm.md section 10, "Objective") as functions of
a micro-batch's blocks: which slots are supervised, the teacher-forced node potentials, the candidate
cross-entropy, the margin hinge and the target-logit penalty, and the detached sums its logs are made of.
Plus `SoftValue`, the candidates' log-probs as a differentiable function of the drafted states whose
backward needs only the candidates' lm_head rows and each row's expected lm_head row under the
drafter's distribution (which the fused loss's cross-entropy gradient already forms).

Supervision, exactly: a block is valid when every drafted slot is supervised (weight > 0); slot s is in
the lattice when its gold token is among its k candidates; a slot is supervised when it and every slot
before it are in the lattice, in a valid block (past the first miss nothing can be accepted). The terms
are sums over supervised slots; the caller divides by their count.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.architectures.lilicorr.head import Factors
from dflash_ds.architectures.lilicorr.walk import greedy_path


class Oracle(NamedTuple):
    """Where the gold path runs through the lattice, for n blocks of S drafted slots (all detached)."""

    in_lattice: torch.Tensor  # [n, S] bool: the gold token is among the slot's candidates
    gold_index: torch.Tensor  # [n, S] long: its candidate index (0 where absent)
    valid: torch.Tensor  # [n] bool: every drafted slot of the block is supervised
    supervised: torch.Tensor  # [n, S] bool: valid, and every slot up to this one in the lattice


class Weights(NamedTuple):
    """The lattice terms' weights and the hinge's margin (objective.lilicorr)."""

    ce: float
    margin_weight: float
    penalty: float
    margin: float
    soft_value: bool = True  # the candidates' log-probs carry the head's gradient into the backbone


def oracle(candidates: torch.Tensor, gold: torch.Tensor, slot_weights: torch.Tensor) -> Oracle:
    """The oracle of blocks whose candidates are `candidates` [n, S, k], gold tokens `gold` [n, S] and
    slot weights `slot_weights` [n, S] (the DFlash loss's, > 0 where supervised)."""
    with torch.no_grad():
        hit = candidates == gold[..., None]
        in_lattice = hit.any(-1)
        gold_index = hit.to(torch.uint8).argmax(-1)
        valid = (slot_weights > 0).all(-1)
        supervised = in_lattice.to(torch.int32).cumprod(-1).bool() & valid[:, None]
    return Oracle(in_lattice, gold_index, valid, supervised)


def nodes(factors: Factors, gold_index: torch.Tensor) -> torch.Tensor:
    """Teacher-forced node potentials [n, S, k]: the start factors at slot 1, then the row leaving the
    gold candidate of the slot before."""
    k = factors.start.shape[-1]
    if factors.pair.shape[1] == 0:
        return factors.start[:, None]
    prev = gold_index[:, :-1, None, None].expand(-1, -1, 1, k)
    rows = factors.pair.gather(2, prev).squeeze(2)
    return torch.cat([factors.start[:, None], rows], dim=1)


class TermSums(NamedTuple):
    """The lattice terms summed over supervised slots (differentiable) and their count."""

    ce: torch.Tensor
    hinge: torch.Tensor
    penalty: torch.Tensor
    supervised: torch.Tensor


def lattice_terms(node: torch.Tensor, found: Oracle, target_logits: torch.Tensor, weights: Weights) -> TermSums:
    """The terms of node potentials `node` [n, S, k] (fp32 or wider), the oracle `found`, and the target's
    logits at every slot's candidates `target_logits` [n, S, k] (detached; its log-normaliser cancels in
    the penalty's differences). The hinge only with a hinge weight and k > 1, the penalty only with its
    weight (Model-Optimizer skips them otherwise)."""
    sup = found.supervised.to(node.dtype)
    gi = found.gold_index[..., None]
    gold = node.gather(-1, gi).squeeze(-1)
    ce = ((node.logsumexp(-1) - gold) * sup).sum()
    zero = node.new_zeros(())
    k = node.shape[-1]
    hinge = zero
    if weights.margin_weight > 0 and k > 1:
        hinge = (F.relu(weights.margin - _gap(node, gi, gold)) * sup).sum()
    penalty = zero
    if weights.penalty > 0:
        zt = target_logits.detach().to(node.dtype)
        reject = F.relu(zt.gather(-1, gi) - zt)
        penalty = ((node.softmax(-1) * reject).sum(-1) * sup).sum()
    return TermSums(ce, hinge, penalty, sup.sum())


def weighted(sums: TermSums, weights: Weights) -> torch.Tensor:
    """w_ce * CE + w_margin * hinge + w_pen * penalty, summed over supervised slots (the caller normalises)."""
    return weights.ce * sums.ce + weights.margin_weight * sums.hinge + weights.penalty * sums.penalty


def _gap(node: torch.Tensor, gi: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """The gold's potential minus the best other candidate's [n, S] (0 when k = 1)."""
    if node.shape[-1] == 1:
        return torch.zeros_like(gold)
    others = node.scatter(-1, gi, float("-inf"))
    return gold - others.amax(-1)


def prefix(hits: torch.Tensor) -> torch.Tensor:
    """Leading run of True per row [n, S] -> [n] long."""
    return hits.to(torch.int32).cumprod(-1).sum(-1).long()


def _spread(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the unbiased std of `values` [..., m] over its last axis (none when m = 1)."""
    if values.shape[-1] < 2 or values.numel() == 0:
        return values.new_zeros(()), values.new_zeros(())
    std = values.std(-1, unbiased=True)
    return std.sum(), values.new_tensor(float(std.numel()))


@torch.no_grad()
def lattice_logs(factors: Factors, node: torch.Tensor, found: Oracle, candidates: torch.Tensor, *,
                 gold: torch.Tensor) -> dict[str, torch.Tensor]:
    """The detached sums the logs are made of (names without the `lilicorr_` prefix), for n blocks:
    the greedy walk's, the backbone's top-1 and the oracle's prefix lengths over valid blocks, exact
    blocks, zero-prefix blocks, lattice coverage of the supervised slot mask, the walk's accuracy on
    supervised slots, the gap, the log-factor spread (unbiased std of the start row per block and of
    every pair matrix; the collapse signal) and per-position acceptance of the walk."""
    valid = found.valid
    v = valid.to(node.dtype)
    walk = greedy_path(factors).index
    tokens = candidates.gather(-1, walk[..., None]).squeeze(-1)
    selected, top1, oracle_len = prefix(tokens == gold), prefix(candidates[..., 0] == gold), prefix(found.in_lattice)
    slots = gold.shape[1]
    sup = found.supervised
    gi = found.gold_index[..., None]
    gap = _gap(node, gi, node.gather(-1, gi).squeeze(-1))
    start_std, start_n = _spread(factors.start)
    pair_std, pair_n = _spread(factors.pair.flatten(2))
    out = {"blocks": v.sum(), "selected_sum": (selected * v).sum(), "top1_sum": (top1 * v).sum(),
           "oracle_sum": (oracle_len * v).sum(), "exact_sum": ((selected == slots) * v).sum(),
           "zero_prefix_sum": ((~found.in_lattice[:, 0]) * v).sum(),
           "in_lattice_sum": (found.in_lattice * valid[:, None]).sum().to(node.dtype),
           "slot_count": (valid[:, None].expand_as(sup)).sum().to(node.dtype),
           "walk_hit_sum": ((walk == found.gold_index) & sup).sum().to(node.dtype),
           "gap_sum": (gap * sup).sum(), "gap_hit_sum": ((gap > 0) & sup).sum().to(node.dtype),
           "start_std_sum": start_std, "start_std_count": start_n, "pair_std_sum": pair_std,
           "pair_std_count": pair_n}
    for k in range(1, slots + 1):
        out[f"accept_sum_{k}"] = ((selected >= k) * v).sum()
        out[f"accept_count_{k}"] = ((selected >= k - 1) * v).sum()
    return out


class SoftValue(torch.autograd.Function):
    """The candidates' log-probs `log_probs` [r, k] (their raw logits minus the row's log-normaliser, computed
    by the fused loss) as a function of the drafted states `hidden` [r, D]: d log q_c / d h = W_c - E_q[W].
    The backward gathers only the k candidates' lm_head rows (an embedding bag) and reads `expected` [r, D]
    = q @ W, so nothing vocabulary-sized is formed."""

    @staticmethod
    def forward(ctx, hidden, log_probs, ids, weight, expected):
        ctx.save_for_backward(ids, weight, expected)
        return log_probs.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        ids, weight, expected = ctx.saved_tensors
        g = grad.to(weight.dtype)
        picked = F.embedding_bag(ids, weight, per_sample_weights=g, mode="sum")
        return picked - g.sum(-1, keepdim=True) * expected.to(weight.dtype), None, None, None, None


def soft_log_probs(hidden: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, *,
                   expected: torch.Tensor) -> torch.Tensor:
    """`SoftValue` applied (hidden [r, D], log_probs and ids [r, k], the lm_head weight [V, D], expected [r, D])."""
    return SoftValue.apply(hidden, log_probs, ids, weight.detach(), expected.detach())
