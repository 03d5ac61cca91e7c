"""Blocks from one micro-batch (docs/algorithm.md sections 4-5): positions, anchors, block inputs,
same-position labels, decay weights, and the order of the supervised slots.

Conventions: a row has S tokens; N anchors per row; B = block size; Q = N*B block slots, slot k
of the block for anchor a sits at position a + k and is trained to predict the token AT a + k
(same-position labels; slot 0 is the anchor itself and has weight 0). An anchor-first architecture
(`Spec.label_offset` 1) trains slot k on the token at a + k + 1 instead (`anchor_first_targets`).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dflash_ds.network.attention import DFlashMask, build_layer_masks


def position_ids_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every document of a packed row (padding counts as one more run)."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand(doc_ids.shape)
    new = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    new[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    return idx - torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=-1).values


# The paper's decay constants; other block sizes interpolate between them (see default_gamma).
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for a block size: 7 for 16, 5 for 10, 4 for 8 (the paper's values).

    Other sizes: piecewise-linear through those three points, extended with the slope of the
    nearest segment (B=2 -> 1, B=12 -> 5.67, B=32 -> 12.33), so gamma keeps growing with the
    block size as the paper's choices do and the last slots keep a usable weight.
    """
    assert block_size >= 2, block_size  # DrafterShape refuses smaller blocks; this is a caller's bug
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
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float64, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w = torch.where(k == 0, torch.zeros_like(w), w)
    return w.float()


def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor, prompt_end: bool = False) -> torch.Tensor:
    """bool `[b, S]`: a is valid iff a+1 < S, loss_mask[a] and loss_mask[a+1], same document at a and a+1.

    `prompt_end`: the last token before each supervised span is valid too (loss_mask[a+1] alone): the
    anchor of the round that drafts a turn's first tokens, which an engine that prefills the prompt
    without its last token runs first, and a multi-turn request starts each turn with.
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
    *, prompt_end: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, min(N, #valid) distinct valid anchors, shared out per document, sorted.

    Each document of a packed row gets its anchor_quota (proportional to its valid anchor
    positions) and draws that many of its valid positions uniformly without replacement; a row of
    one document is plain uniform sampling of min(N, #valid) positions. Returns `anchors[b, N]`
    (int64) and `valid[b, N]` (bool); the tail is padded with invalid anchors at position 0 so shapes
    are static. Vectorised (sorts, scatters, no host round trip). Random numbers come from
    `generator` only (drawn on the generator's device), so a seeded generator gives the same anchors
    on any rank. Give it a generator on the data's device: otherwise the keys are copied host ->
    device, a blocking copy. `prompt_end`: valid_anchor_mask's.
    """
    valid = valid_anchor_mask(loss_mask, doc_ids, prompt_end)
    b, s = valid.shape
    assert num_anchors >= 1, num_anchors  # config/checks.py refuses the recipe value
    if num_anchors > s:
        raise ValueError(
            f"num_anchors = {num_anchors} exceeds the row length {s}: a row has fewer possible anchors than that"
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
    *, mask_token_id: int,
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
    *, valid: torch.Tensor,
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


def anchor_first_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                         anchors: torch.Tensor, *, valid: torch.Tensor, block_size: int,
                         gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[b, N, B]` (slot k: the token at a + k + 1) and float32 weights `[b, N, B]` of the
    anchor-first block (an architecture whose `Spec.label_offset` is 1, DSpark's), DeepSpec's rule:
    `exp(-k / gamma)` times a mask that is 1 on the longest prefix of slots whose label is inside the
    row, supervised and in the anchor's document (the first slot that is not ends the block's
    supervision), times block validity. Labels where the weight is 0 are 0."""
    b, n = anchors.shape
    s = input_ids.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    idx = anchors.long().unsqueeze(-1) + 1 + k
    flat = idx.clamp(max=s - 1).view(b, n * block_size)
    labels = torch.gather(input_ids, 1, flat).view(b, n, block_size)
    supervised = torch.gather(loss_mask.bool(), 1, flat).view(b, n, block_size)
    anchor_doc = torch.gather(doc_ids, 1, anchors.long()).unsqueeze(-1)
    same_doc = torch.gather(doc_ids, 1, flat).view(b, n, block_size) == anchor_doc
    ok = (idx < s) & supervised & same_doc & valid.bool().unsqueeze(-1)
    keep = ok.to(torch.int32).cumprod(-1).bool()
    # exp(-k / gamma) for slot k: DFlash's decay of a block one longer, without its slot 0.
    decay = decay_weights(block_size + 1, gamma, anchors.device)[1:]
    return torch.where(keep, labels, torch.zeros_like(labels)), decay * keep


def slot_rows(t: torch.Tensor, block_size: int, first: int = 1) -> torch.Tensor:
    """`[b, Q, ...]` -> `[rows, ...]`: the drafting slots (`first` .. B-1 of every block: without
    slot 0, or all of them anchor-first) in the loss's row order, the order of
    `objective.loss.LossOutput.candidates` and of a LogitBias's features."""
    b, q = t.shape[:2]
    # A strided view until the reshape: slot 0 of every block is dropped by shape, not by its weight.
    u = t.reshape(b * (q // block_size), block_size, *t.shape[2:])[:, first:]
    return u.reshape(u.shape[0] * u.shape[1], *t.shape[2:])


def slot_target_index(anchors: torch.Tensor, block_size: int, seq_len: int, label_offset: int = 0) -> torch.Tensor:
    """[R, N] anchors -> [R, N*B] rows of the target's states flattened to [R*S, D]: for slot k of the
    block at anchor a, position a+k-1+label_offset, whose next-token distribution is the one for the
    slot's label (the token at a+k+label_offset). Positions past the row are clamped; their slots have
    weight 0."""
    pos = (anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1 + label_offset).clamp(0, seq_len - 1)
    rows = torch.arange(anchors.shape[0], device=anchors.device).view(-1, 1, 1) * seq_len
    return (pos + rows).reshape(anchors.shape[0], -1)


def slot_target_states(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int,
                       label_offset: int = 0) -> torch.Tensor:
    """[R, S, D] -> [R, N*B, D]: the states `slot_target_index` names."""
    r, s, d = final_hidden.shape
    return final_hidden.reshape(r * s, d)[slot_target_index(anchors, block_size, s, label_offset)]


@dataclass
class MicroBatch:
    taps: torch.Tensor  # [R, S, T*D]
    input_ids: torch.Tensor  # [R, S] int64
    loss_mask: torch.Tensor  # [R, S] bool
    doc_ids: torch.Tensor  # [R, S] int32, -1 = padding
    final_hidden: torch.Tensor | None = None  # [R, S, D] target final-norm states (when the loss reads the target's logits)


@dataclass
class Blocks:
    anchors: torch.Tensor  # [R, N]
    valid: torch.Tensor  # [R, N]
    block_ids: torch.Tensor  # [R, N*B]
    block_positions: torch.Tensor  # [R, N*B]
    ctx_positions: torch.Tensor  # [R, S]
    labels: torch.Tensor  # [R, N*B]
    weights: torch.Tensor  # [R, N*B] float32
    mask: tuple[DFlashMask, ...]  # one per drafter layer: dense boolean (CPU) or flex BlockMask (GPU)


def anchor_generator(seed: int, micro_index: int, device="cpu") -> torch.Generator:
    """Anchors depend only on (seed, micro-batch id, device type): identical in split, colocated and
    resumed runs. The generator lives on the data's device so sampling needs no host round trip."""
    digest = hashlib.blake2b(f"{seed}:{micro_index}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


@torch.no_grad()
def make_blocks(mb: MicroBatch, s, micro_index: int) -> Blocks:
    """The blocks of micro-batch `micro_index` under `s` (objective.drafter_loss.StepSettings: the anchors'
    seed and count, whether prompt ends anchor, block size, mask id, gamma, the layers' attentions, the
    mask kind; the labels and weights follow the architecture's `Spec.label_offset`: same-position
    `block_targets`, or `anchor_first_targets`)."""
    device = mb.input_ids.device
    anchors, valid = sample_anchors(mb.loss_mask, mb.doc_ids, s.num_anchors,
                                    anchor_generator(s.seed, micro_index, device), prompt_end=s.anchor_prompt_end)
    ctx_positions = position_ids_from_doc_ids(mb.doc_ids)
    block_ids, block_positions = block_inputs(mb.input_ids, ctx_positions, anchors, s.block_size,
                                              mask_token_id=s.mask_token_id)
    targets = block_targets if s.shape.first_draft_slot else anchor_first_targets
    labels, weights = targets(mb.input_ids, mb.loss_mask, mb.doc_ids, anchors, valid=valid, block_size=s.block_size,
                              gamma=s.gamma)
    mask = build_layer_masks(anchors, valid, mb.doc_ids, s.block_size, attentions=s.attentions, kind=s.mask_kind)
    r = anchors.shape[0]
    return Blocks(anchors, valid, block_ids, block_positions, ctx_positions,
                  labels.reshape(r, -1), weights.reshape(r, -1).float(), mask)
