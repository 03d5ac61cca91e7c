"""The DFlash training objective (docs/algorithm.md sections 4-5): anchors, blocks, labels, weights, chunked loss.

Conventions: a row has S tokens; N anchors per row; B = block size; Q = N*B block slots, slot k
of the block for anchor a sits at position a + k and is trained to predict the token AT a + k
(same-position labels; slot 0 is the anchor itself and has weight 0).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from dflash_ds.model.linear_ce import ChunkPlan, KLTerm, linear_cross_entropy_top_k
from dflash_ds.model.logit_transform import IDENTITY, LogitTransform
from dflash_ds.model.top_k import block_top_k

# The paper's decay constants; other block sizes interpolate between them (see default_gamma).
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for a block size: 7 for 16, 5 for 10, 4 for 8 (the paper's values).

    Other sizes: piecewise-linear through those three points, extended with the slope of the
    nearest segment (B=2 -> 1, B=12 -> 5.67, B=32 -> 12.33), so gamma keeps growing with the
    block size as the paper's choices do and the last slots keep a usable weight.
    """
    if block_size < 2:
        raise ValueError(f"drafter.block_size must be >= 2, got {block_size}")
    pts = _GAMMA_POINTS
    if block_size <= pts[1][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    else:
        (x0, y0), (x1, y1) = pts[1], pts[2]
    return y0 + (block_size - x0) * (y1 - y0) / (x1 - x0)


def decay_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Slot weights `[B]` float32: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1.

    Built directly on `device`: a host-made tensor copied to the GPU would be a blocking copy
    on the training path.
    """
    if not gamma > 0:
        raise ValueError(f"objective.gamma must be > 0 (or null for the default), got {gamma}")
    k = torch.arange(block_size, dtype=torch.float64, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w = torch.where(k == 0, torch.zeros_like(w), w)
    return w.float()


def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor, prompt_end: bool = False) -> torch.Tensor:
    """bool `[b, S]`: a is valid iff a+1 < S, loss_mask[a] and loss_mask[a+1], same document at a and a+1.

    `prompt_end` (objective.anchor_last_prompt_token): the last token before each supervised span is
    valid too (loss_mask[a+1] alone), the anchor of the round that drafts a turn's first tokens.
    (Padding, doc id -1, never anchors even if its loss mask were set.)
    """
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    here = lm[:, :-1] | prompt_end
    valid[:, :-1] = here & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return valid


def anchor_quota(valid: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int) -> torch.Tensor:
    """int64 `[b, S]`: anchors given to document d of each row (index d; doc ids are 0 .. S-1).

    A row's min(N, #valid) anchors are shared out in proportion to each document's valid anchor
    positions c_d (its supervised tokens), by largest remainder: document d first gets
    floor(n * c_d / C) (n = min(N, C), C = sum of c_d), then the n - sum(floor) anchors left go one
    each to the documents with the largest remainders n * c_d mod C, the earlier document first on
    ties. Integer arithmetic, so the total is exactly n and no document gets more than c_d.
    """
    b, s = valid.shape
    slot = torch.where(valid, doc_ids.long() + 1, torch.zeros_like(doc_ids, dtype=torch.long))
    counts = torch.zeros(b, s + 1, dtype=torch.long, device=valid.device)
    counts.scatter_add_(1, slot, torch.ones_like(slot))
    c = counts[:, 1:]
    total_valid = c.sum(1, keepdim=True)
    n = total_valid.clamp(max=num_anchors)
    denom = total_valid.clamp(min=1)
    share = n * c
    floor, rem = share // denom, share % denom
    left = n - floor.sum(1, keepdim=True)
    # Stable descending sort: equal remainders keep document order, so the earlier one wins ties.
    order = rem.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(s, device=valid.device).expand(b, s))
    return floor + (rank < left).long()


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    prompt_end: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, min(N, #valid) distinct valid anchors, shared out per document, sorted.

    Each document of a packed row gets its anchor_quota (proportional to its valid anchor
    positions) and draws that many of its valid positions uniformly without replacement; a row of
    one document is plain uniform sampling of min(N, #valid) positions. Returns `anchors[b, N]`
    (int64) and `valid[b, N]` (bool); the tail is padded with invalid anchors at position 0 so shapes
    are static. Vectorised (sorts, scatters, no host round trip). Random numbers come from
    `generator` only (drawn on the generator's device), so a seeded generator gives the same anchors
    on any rank. Give it a generator on the data's device: otherwise the keys are copied host ->
    device, a blocking copy.
    """
    valid = valid_anchor_mask(loss_mask, doc_ids, prompt_end)
    b, s = valid.shape
    if num_anchors < 1:
        raise ValueError(f"objective.num_anchors must be >= 1, got {num_anchors}")
    if num_anchors > s:
        raise ValueError(
            f"objective.num_anchors={num_anchors} exceeds the row length {s} (data.row_length); "
            "a row has fewer possible anchors than that: lower objective.num_anchors"
        )
    keys = torch.rand(b, s, generator=generator, device=generator.device).to(valid.device)
    quota = anchor_quota(valid, doc_ids, num_anchors)
    # Sort positions by (document, key descending); invalid positions go last. The `quota[d]`
    # largest keys of document d are a uniform quota[d]-subset of its valid positions.
    doc = torch.where(valid, doc_ids.long(), torch.full_like(doc_ids, s, dtype=torch.long))
    order = (doc.double() * 2 + (1 - keys.double())).sort(dim=1).indices
    doc_sorted = torch.gather(doc, 1, order)
    counts = torch.cat([quota.new_zeros(b, 1), torch.zeros_like(quota)], dim=1)
    counts[:, 1:].scatter_add_(1, doc_sorted.clamp(max=s - 1), (doc_sorted < s).long())
    group_start = counts.cumsum(1)[:, :-1]  # first sorted index of each document's valid positions
    d = doc_sorted.clamp(max=s - 1)
    rank_in_doc = torch.arange(s, device=valid.device) - torch.gather(group_start, 1, d)
    take_sorted = (doc_sorted < s) & (rank_in_doc < torch.gather(quota, 1, d))
    take = torch.zeros_like(valid).scatter_(1, order, take_sorted)
    pos = torch.where(take, torch.arange(s, device=valid.device).expand(b, s), torch.full_like(doc, s))
    pos = pos.topk(num_anchors, dim=1, largest=False, sorted=True).values
    anchor_valid = pos < s
    anchors = torch.where(anchor_valid, pos, torch.zeros_like(pos))
    return anchors, anchor_valid


def block_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids `[b, N*B]` ([anchor token, MASK x (B-1)] per block) and their positions.

    Positions continue the anchor's position id (which restarts per packed document), so the
    block for anchor a sits at position_ids[a] + 0 .. B-1, matching the context's positions.
    """
    b, n = anchors.shape
    anchors = anchors.long()
    block_ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    offsets = torch.arange(block_size, device=position_ids.device, dtype=position_ids.dtype)
    positions = torch.gather(position_ids, 1, anchors).unsqueeze(-1) + offsets
    return block_ids.view(b, n * block_size), positions.view(b, n * block_size)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels `[b, N, B]` (token at a + k) and float32 weights `[b, N, B]`.

    weight = decay_weights[k] * loss_mask[a+k] * (a+k < S) * (doc[a+k] == doc[a]) * valid.
    No block runs past its document's end: slots beyond it (the next packed document, padding or
    the row's end) get weight 0 and label 0. Other labels where the weight is 0 are arbitrary
    in-vocabulary ids. `gamma=None` uses default_gamma.
    """
    if gamma is None:
        gamma = default_gamma(block_size)
    b, n = anchors.shape
    s = input_ids.shape[1]
    idx = anchors.long().unsqueeze(-1) + torch.arange(block_size, device=anchors.device)
    in_row = idx < s
    flat = idx.clamp(max=s - 1).view(b, n * block_size)
    labels = torch.gather(input_ids, 1, flat).view(b, n, block_size)
    supervised = torch.gather(loss_mask.bool(), 1, flat).view(b, n, block_size)
    doc = torch.gather(doc_ids, 1, flat).view(b, n, block_size)
    same_doc = doc == doc[:, :, :1]
    inside = in_row & same_doc
    keep = supervised & inside & valid.bool().unsqueeze(-1)
    weights = decay_weights(block_size, gamma, device=anchors.device) * keep
    return torch.where(inside, labels, torch.zeros_like(labels)), weights


class LossOutput(NamedTuple):
    loss: torch.Tensor  # (sum(w * CE) + kl_weight * T^2 * sum(w * KL)) / normaliser, differentiable
    ce_sum: torch.Tensor  # sum(w * CE), detached, fp32 or wider (for logs and step-wide sums)
    correct: torch.Tensor  # bool [b, Q]: argmax == label on supervised slots, False elsewhere
    kl_sum: torch.Tensor | None = None  # sum(w * KL(p_target || p_drafter)), detached; 0 when the KL term is off
    # LossOptions.top_k > 0: int64 [rows, k] top-k token ids of every projected slot, best first, in
    # `slot_rows` order (taken from the loss's own logits); None otherwise.
    candidates: torch.Tensor | None = None
    # ... and their raw lm_head logits [rows, k] (before the target's transform; the lm_head's dtype,
    # detached): the selector's unary scores.
    candidate_logits: torch.Tensor | None = None
    # DFlash2 (model.loss.drafter_loss): detached (sum(w * selector CE), sum(w) of slots whose gold is
    # among the candidates, sum(w) of slots the selector ranks the gold first); None otherwise.
    selector: tuple | None = None


@dataclass(frozen=True)
class LossOptions:
    """How `chunked_loss` walks the slots (the result does not depend on it, up to rounding)."""

    num_chunks: int
    """At most this many chunks of slots (objective.loss_chunks); only one chunk's logits exist at a time."""
    block_size: int | None = None
    """Q = N * block_size: slot 0 of every block is skipped by shape. None: every slot is projected."""
    checkpoint: bool = True
    """Each chunk under non-reentrant activation checkpointing (the unfused path)."""
    fused: bool = False
    """linear_ce: the lm_head's input gradient computed in the forward (objective.fused_loss)."""
    top_k: int = 0
    """> 0: also return each projected slot's top-k token ids and logits (DFlash2's selector candidates)."""
    logits: LogitTransform = IDENTITY
    """The target's scaling / softcap of its logits (model/logit_transform.py), applied to the drafter's
    logits (and the target's, for the KL term) before the softmax."""


def slot_rows(t: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """`[b, Q, ...]` -> `[rows, ...]`: the projected slots in the loss's row order (blocks without
    their slot 0 when `block_size` is set), the order of `LossOutput.candidates`."""
    b, q = t.shape[:2]
    u = _units(t, b, q, block_size)
    return u.reshape(u.shape[0] * u.shape[1], *t.shape[2:])


def _chunk_loss(hidden, weight, labels, slot_weights, index, kl: KLTerm | None, options: LossOptions):
    # One chunk of `c` units of `u` slots: hidden [c, u, D] (a strided view), the rest [c, u].
    # The only lm_head matmul of the chunk; argmax, the top-k and the KL reuse its logits. `kl`,
    # when on, holds `target_logits_fn`.
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    w = slot_weights.reshape(-1)
    logits = F.linear(h, weight)
    top_k, transform = options.top_k, options.logits
    if top_k:
        top = block_top_k(logits.detach(), top_k)
    else:
        top = (logits.new_zeros(lab.shape[0], 0), lab.new_zeros(lab.shape[0], 0))
    logits = transform.apply(logits.to(w.dtype))
    hit = (logits.argmax(-1) == lab) & (w > 0)
    if kl is not None:
        temperature = kl.temperature
        logp = F.log_softmax(logits, dim=-1)
        ce = -logp.gather(1, lab.unsqueeze(1)).squeeze(1)
        logp_t = logp if temperature == 1.0 else F.log_softmax(logits / temperature, dim=-1)
        # The target is frozen: its distribution is a constant of the drafter's loss.
        target_logits = transform.apply(kl.target_logits_fn(index.reshape(-1)).detach().to(w.dtype))
        target = F.log_softmax(target_logits / temperature, dim=-1)
        kl_rows = F.kl_div(logp_t, target, reduction="none", log_target=True).sum(-1)
        kl_part = (kl_rows * w).sum()
    else:
        ce = F.cross_entropy(logits, lab, reduction="none")
        kl_part = w.new_zeros(())
    return (ce * w).sum(), kl_part, hit, top


def _units(t: torch.Tensor, b: int, q: int, block_size: int | None) -> torch.Tensor:
    """`[b, Q, ...]` -> `[units, u, ...]`: blocks without their slot 0 (u = B-1), or single slots."""
    rest = t.shape[2:]
    if block_size is None:
        return t.reshape(b * q, 1, *rest)
    # A strided view, no copy: slot 0 of every block is dropped by shape, not by its weight.
    return t.reshape(b * (q // block_size), block_size, *rest)[:, 1:]


def chunked_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    options: LossOptions,
    kl: KLTerm | None = None,
) -> LossOutput:
    """Weighted CE of `hidden[b, Q, D] @ lm_head_weight[V, D].T` without materialising all logits.

    `options`: num_chunks, block_size, checkpoint, fused (LossOptions). Static shapes and no host
    synchronisation: every slot is projected whatever its weight (zero-weight slots add exactly 0),
    except that with `block_size` (Q = N*B) slot 0 of every block is skipped by shape, so its
    weight is ignored (block_targets always makes it 0). The
    selected units (blocks of B-1 slots, or single slots when `block_size` is None) are cut into
    at most `num_chunks` chunks of ceil(units / num_chunks) units each; the last chunk is padded
    with zero-weight rows so every chunk has the same shape. With `checkpoint`, each chunk runs
    under non-reentrant activation checkpointing, so only one chunk's logits ever exist and the
    lm_head matmul runs exactly twice per chunk (forward + one recompute in backward). Logits are
    produced in the weight's dtype (bf16 GEMMs accumulate in fp32) and the CE is computed in fp32.
    `labels` at zero-weight slots may be anything.

    Optional KL term (`kl`, off by default): with `kl.weight > 0`, each slot also adds
    kl.weight * w * KL(p_target || p_drafter). `kl.target_logits_fn(index[n]) -> [n, V]` returns the
    target's logits for flat slot indices into `[b * Q]` (index i = row * Q + slot), i.e. the
    target's next-token distribution at position a+k-1, the one that predicts the token at a+k.
    It is called inside the checkpointed chunk (again in the recompute), so the target's logits
    never exist for more than one chunk; padding rows ask for index 0 and have weight 0.

    `kl.target_hidden` [b, Q, D] (instead of `target_logits_fn`): the target's final-norm hidden
    state that predicts each slot's token; the target's logits are then computed chunk by chunk
    with the same `lm_head_weight`. `kl.temperature` T softens both distributions and the term is
    scaled by T^2: loss = sum(w * (CE + kl.weight * T^2 * KL(p_T || q_T))) / normaliser.

    `fused=True` computes the same slots, loss and metrics with linear_ce: two lm_head matmuls
    per chunk (forward + input gradient, the gradient computed in the forward) instead of three,
    plus one for the target's logits with the KL term (which needs `target_hidden` there), and
    one fused pass over each chunk's logits. `checkpoint` does not apply there; chunks are cut by
    slots, not by units.
    """
    num_chunks, block_size, checkpoint = options.num_chunks, options.block_size, options.checkpoint
    kl_weight, kl_temperature = (kl.weight, kl.temperature) if kl is not None else (0.0, 1.0)
    target_logits_fn, target_hidden = (kl.target_logits_fn, kl.target_hidden) if kl is not None else (None, None)
    if num_chunks < 1:
        raise ValueError(f"objective.loss_chunks must be >= 1, got {num_chunks}")
    if not kl_weight >= 0:
        raise ValueError(f"objective.kl_weight must be >= 0, got {kl_weight}")
    if not kl_temperature > 0:
        raise ValueError(f"objective.kl_temperature must be > 0, got {kl_temperature}")
    if kl_weight > 0 and target_logits_fn is None and target_hidden is None:
        raise ValueError("objective.kl_weight > 0 needs the target's distribution (target_hidden or target_logits_fn); "
                         "set objective.kl_weight to 0")
    b, q, d = hidden.shape
    if block_size is not None and (block_size < 2 or q % block_size):
        raise ValueError(f"drafter.block_size={block_size} must be >= 2 and divide the {q} block slots per row")
    if options.fused:
        return _fused_loss(hidden, lm_head_weight, labels, weights, normaliser, options, kl)
    if kl_weight > 0 and target_logits_fn is None:
        flat_target = target_hidden.detach().reshape(b * q, d)

        def target_logits_fn(index):
            return F.linear(flat_target.index_select(0, index).to(lm_head_weight.dtype), lm_head_weight.detach())
    # CE in fp32 (float64 stays float64, for reference checks).
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = _units(weights.to(acc_dtype), b, q, block_size)
    # Zero-weight slots are projected too; a fixed in-vocabulary label keeps their CE finite.
    lab = torch.where(w > 0, _units(labels, b, q, block_size), 0)
    parts = [_units(hidden, b, q, block_size), lab, w]
    if kl_weight > 0:
        parts.append(_units(torch.arange(b * q, device=hidden.device).view(b, q), b, q, block_size))
    units, per_unit = w.shape
    size = -(-units // num_chunks)
    use_ckpt = checkpoint and torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    ce_total = hidden.new_zeros((), dtype=acc_dtype)
    kl_total = hidden.new_zeros((), dtype=acc_dtype)
    hits, tops = [], []
    # What a chunk needs of the KL term: the (possibly just built) target_logits_fn.
    chunk_kl = KLTerm(kl_weight, kl_temperature, target_logits_fn=target_logits_fn) if kl_weight > 0 else None
    for chunk in zip(*(t.split(size) for t in parts)):
        pad = size - chunk[0].shape[0]
        if pad:
            # Equal chunk shapes: zero rows with weight 0 (and label / index 0) fill the last one.
            chunk = (F.pad(chunk[0], (0, 0, 0, 0, 0, pad)),) + tuple(F.pad(t, (0, 0, 0, pad)) for t in chunk[1:])
        hc, lc, wc = chunk[:3]
        ic = chunk[3] if kl_weight > 0 else None
        args = (hc, lm_head_weight, lc, wc, ic, chunk_kl, options)
        if use_ckpt:
            # The chunk draws no random numbers, so no RNG state needs saving (and none is read
            # from the device, which CUDA graph capture would not allow).
            ce, kl, hit, top = _checkpoint(_chunk_loss, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            ce, kl, hit, top = _chunk_loss(*args)
        ce_total = ce_total + ce
        kl_total = kl_total + kl
        hits.append(hit.view(size, per_unit))
        tops.append(top)
    correct = torch.cat(hits)[:units]
    if block_size is not None:
        correct = torch.cat([correct.new_zeros(units, 1), correct], dim=1)
    total = ce_total + (kl_weight * kl_temperature ** 2) * kl_total if kl_weight > 0 else ce_total
    candidates = logits = None
    if options.top_k:
        logits, candidates = (torch.cat(t)[:units * per_unit] for t in zip(*tops))
    return LossOutput(total / normaliser, ce_total.detach(), correct.view(b, q), kl_total.detach(), candidates,
                      logits)


def _fused_loss(hidden, lm_head_weight, labels, weights, normaliser, options: LossOptions,
                kl: KLTerm | None) -> LossOutput:
    block_size = options.block_size
    kl_weight = kl.weight if kl is not None else 0.0
    if kl_weight > 0 and kl.target_hidden is None:
        raise ValueError(f"objective.kl_weight={kl_weight}: the fused lm_head loss takes the target's final-norm "
                         "states (target_hidden), not logits; pass them or use the unfused loss")
    b, q, d = hidden.shape
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = _units(weights.to(acc_dtype), b, q, block_size)
    units, per_unit = w.shape
    # With block_size this copies the B-1 supervised slots of every block into [n, D] rows
    # (cheap next to the lm_head); without it the reshape is a view.
    h = _units(hidden, b, q, block_size).reshape(units * per_unit, d)
    lab = _units(labels, b, q, block_size).reshape(-1)
    rows_kl = None
    if kl_weight > 0:
        t = _units(kl.target_hidden, b, q, block_size).reshape(units * per_unit, d)
        rows_kl = KLTerm(kl_weight, kl.temperature, t)
    loss, ce_sum, hit, kl_sum, top, top_logits = linear_cross_entropy_top_k(
        h, lm_head_weight, lab, w.reshape(-1), normaliser, ChunkPlan(options.num_chunks, options.top_k, options.logits),
        rows_kl)
    correct = hit.view(units, per_unit)
    if block_size is not None:
        correct = torch.cat([correct.new_zeros(units, 1), correct], dim=1)
    return LossOutput(loss, ce_sum, correct.view(b, q), kl_sum.to(acc_dtype), top if options.top_k else None,
                      top_logits if options.top_k else None)


def acceptance_proxy(correct: torch.Tensor, weights: torch.Tensor, reduce: bool = True):
    """Mean over valid blocks of (leading run of correct supervised slots 1..B-1) + 1.

    The run stops at the first slot that is wrong or unsupervised. `correct` may be `[b, Q]` or
    `[b, N, B]`; `weights` is `[b, N, B]`. With `reduce=False` returns (sum, count) so callers can
    aggregate across micro-batches and ranks; the mean of no blocks is NaN.
    This is a cheap training signal, not the acceptance length tau (docs/algorithm.md section 7).
    """
    correct = correct.reshape(weights.shape)
    ok = (correct.bool() & (weights > 0))[..., 1:]
    run = torch.cumprod(ok.to(torch.int32), dim=-1).sum(-1).float() + 1.0
    block_valid = (weights > 0).any(-1)
    total = (run * block_valid).sum()
    count = block_valid.sum().float()
    if not reduce:
        return total, count
    # torch.where, not a Python `if count > 0`: that would wait for the device.
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))
