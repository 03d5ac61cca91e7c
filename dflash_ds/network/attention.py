"""The DFlash attention mask (docs/algorithm.md section 3), dense for CPU/tests, a flex BlockMask for GPUs.

Queries are the `Q = N*B` block tokens (block n = queries n*B .. n*B+B-1); keys are the `S`
context features followed by the same `Q` block tokens. Query k of block n (anchor a_n, so at
position a_n + k) under a layer's `LayerAttention(window W, causal c)` sees:
  - context j  iff  the block is valid, j < a_n, doc_ids[j] == doc_ids[a_n] and, with a window,
    (a_n + k) - j < W (the window counts the query's own position, as the serving engines do);
  - block key S + m  iff  m // B == n (its own block), and m % B <= k when the layer is causal.
Invalid (padding) blocks see their own block only, so no query row is fully masked. W >= B, so
a window never cuts into the query's own block.

The BlockMask is built from the anchors with tensor ops (no `create_block_mask`, whose per
element mask_mod evaluation over the full Q x KV grid is slow at real sizes). Its sparsity
must be exact: a tile marked "full" skips the mask_mod, so it is only marked when every
element in it is allowed; a context tile outside every row's window is left out of the
BlockMask entirely, so a window makes the kernel do less work.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_ds.compile import compile_once

FLEX_BLOCK = 128


@dataclass(frozen=True)
class LayerAttention:
    """What one drafter layer's queries see besides the DFlash rule (docs/algorithm.md section 3).

    `window`: None = every earlier context token of the document; W = only keys whose position is
    less than W before the query's (W >= block size). `causal`: block slot k sees slots <= k of
    its own block instead of all of them.
    """

    window: int | None = None
    causal: bool = False

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")


FULL = LayerAttention()


@dataclass
class DFlashMask:
    """Either `dense` (bool `[b, 1, Q, S+Q]`, True = attend) or `block_mask` (flex BlockMask).

    `query_len` / `kv_len` are the real lengths Q and S+Q. The BlockMask covers lengths padded
    up to multiples of `FLEX_BLOCK`; `attend` pads q/k/v to match (no copy at the real sizes,
    S=3072 and Q=8192, which are multiples already). `attention` is the layer attention the mask
    was built for; the drafter refuses a mask built for another one.
    """

    query_len: int
    kv_len: int
    dense: torch.Tensor | None = None
    block_mask: BlockMask | None = None
    attention: LayerAttention = FULL


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _query_lookups(anchors, anchor_valid, doc_ids):
    """Per-block anchor and document; invalid blocks get anchor 0 so `j < anchor` is empty."""
    anchors = anchors.long()
    anchor_eff = torch.where(anchor_valid, anchors, torch.zeros_like(anchors))
    doc_at_anchor = torch.gather(doc_ids.long(), 1, anchors.clamp(min=0, max=doc_ids.shape[1] - 1))
    return anchor_eff, doc_at_anchor


def _visible_context(anchor_eff, doc_a, doc_ids) -> torch.Tensor:
    """bool `[b, N, S]`: context position j is visible to block n (before its anchor, same document)."""
    j = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    return (j.view(1, 1, -1) < anchor_eff.unsqueeze(-1)) & (doc_ids.long().unsqueeze(1) == doc_a.unsqueeze(-1))


def _window_start(anchor_eff, block_size: int, att: LayerAttention) -> torch.Tensor:
    """`[b, N, B]`: the first context position slot k of block n may see (a_n + k - W + 1; 0 without a window)."""
    b, n = anchor_eff.shape
    if att.window is None:
        return torch.zeros(b, n, block_size, dtype=torch.long, device=anchor_eff.device)
    slot = torch.arange(block_size, device=anchor_eff.device)
    return anchor_eff.unsqueeze(-1) + slot - (att.window - 1)


def _dense_mask(anchors, anchor_valid, doc_ids, block_size, *, att: LayerAttention) -> torch.Tensor:
    b, n = anchors.shape
    q_len = n * block_size
    device = doc_ids.device
    anchor_eff, doc_a = _query_lookups(anchors, anchor_valid, doc_ids)
    ctx = _visible_context(anchor_eff, doc_a, doc_ids).repeat_interleave(block_size, dim=1)  # [b, Q, S]
    if att.window is not None:
        lo = _window_start(anchor_eff, block_size, att).reshape(b, q_len, 1)
        ctx = ctx & (torch.arange(doc_ids.shape[1], device=device).view(1, 1, -1) >= lo)
    qi = torch.arange(q_len, device=device)
    own = (qi.view(-1, 1) // block_size) == (qi.view(1, -1) // block_size)
    if att.causal:
        own = own & (qi.view(1, -1) <= qi.view(-1, 1))
    return torch.cat([ctx, own.expand(b, q_len, q_len)], dim=2).unsqueeze(1)


def _tile_counts(anchor_eff, doc_a, doc_ids, block_size, *, att: LayerAttention, n_kb: int) -> torch.Tensor:
    """int32 `[b, Q, KB]`: how many keys of each key tile every query row may see.

    Exact and without a `[Q, S]` grid: per block, `F[x]` counts the visible context positions
    below x (a prefix sum of the un-windowed visibility), so the count of a tile [t0, t1) above a
    row's window start lo is F[t1] - F[clamp(lo, t0, t1)]; the own block is the key interval
    [S + nB, S + nB + (k + 1 if causal else B)), intersected with each tile arithmetically.
    """
    b, n = anchor_eff.shape
    s = doc_ids.shape[1]
    device = doc_ids.device
    visible = _visible_context(anchor_eff, doc_a, doc_ids).to(torch.int32)
    prefix = torch.zeros(b, n, s + 1, dtype=torch.int32, device=device)
    prefix[:, :, 1:] = visible.cumsum(-1, dtype=torch.int32)
    n_kc = (s + FLEX_BLOCK - 1) // FLEX_BLOCK  # key tiles holding context
    ctx_lo = torch.arange(n_kc, device=device) * FLEX_BLOCK
    t0, t1 = ctx_lo, (ctx_lo + FLEX_BLOCK).clamp(max=s)
    lo = _window_start(anchor_eff, block_size, att).unsqueeze(-1)  # [b, N, B, 1]
    start = torch.maximum(torch.minimum(lo, t1), t0)  # [b, N, B, KC]
    upper = torch.gather(prefix, 2, t1.view(1, 1, -1).expand(b, n, -1)).unsqueeze(2)
    lower = torch.gather(prefix, 2, start.reshape(b, n, -1)).view(b, n, block_size, n_kc)
    counts = F.pad(upper - lower, (0, n_kb - n_kc))  # [b, N, B, KB]
    tile_lo = torch.arange(n_kb, device=device, dtype=torch.int32) * FLEX_BLOCK
    slot = torch.arange(block_size, device=device, dtype=torch.int32)
    own_lo = s + torch.arange(n, device=device, dtype=torch.int32).view(-1, 1) * block_size  # [N, 1]
    own_hi = own_lo + (slot + 1 if att.causal else torch.full_like(slot, block_size))  # [N, B]
    overlap = (torch.minimum(own_hi.unsqueeze(-1), tile_lo + FLEX_BLOCK)
               - torch.maximum(own_lo.unsqueeze(-1), tile_lo)).clamp(min=0)  # [N, B, KB]
    return (counts + overlap).reshape(b, n * block_size, n_kb)


def _flex_mask(anchors, anchor_valid, doc_ids, block_size, *, att: LayerAttention) -> BlockMask:
    b, n = anchors.shape
    s = doc_ids.shape[1]
    q_len, kv_len = n * block_size, s + n * block_size
    q_pad, kv_pad = _round_up(q_len, FLEX_BLOCK), _round_up(kv_len, FLEX_BLOCK)
    n_qb, n_kb = q_pad // FLEX_BLOCK, kv_pad // FLEX_BLOCK
    device = doc_ids.device
    anchor_eff, doc_a = _query_lookups(anchors, anchor_valid, doc_ids)

    # Allowed keys per (query row, key tile); padding queries (>= Q) allow nothing. Counting (not
    # any/all on the grid) gives both "partial" (count > 0) and "full" (count == tile size).
    row_counts = torch.zeros(b, q_pad, n_kb, dtype=torch.int32, device=device)
    row_counts[:, :q_len] = _tile_counts(anchor_eff, doc_a, doc_ids, block_size, att=att, n_kb=n_kb)
    row_counts = row_counts.view(b, n_qb, FLEX_BLOCK, n_kb)
    any_allowed = (row_counts > 0).any(2)  # [b, QB, KB]
    full = (row_counts == FLEX_BLOCK).all(2)
    partial = any_allowed & ~full

    def _indices(flags):
        num = flags.sum(-1, dtype=torch.int32)
        # Stable sort puts the flagged tiles first, in increasing tile order.
        idx = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num.unsqueeze(1).contiguous(), idx.unsqueeze(1).contiguous()

    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)

    # Small per-row lookups read by the mask_mod (only on partial tiles).
    key_block = torch.full((kv_pad,), -2, dtype=torch.long, device=device)
    key_block[s:kv_len] = torch.arange(q_len, device=device) // block_size
    q_block = torch.full((q_pad,), -1, dtype=torch.long, device=device)
    q_block[:q_len] = torch.arange(q_len, device=device) // block_size
    q_anchor = torch.zeros(b, q_pad, dtype=torch.long, device=device)
    q_anchor[:, :q_len] = anchor_eff.repeat_interleave(block_size, dim=1)
    q_doc = torch.full((b, q_pad), -1, dtype=torch.long, device=device)
    q_doc[:, :q_len] = doc_a.repeat_interleave(block_size, dim=1)
    kv_doc = torch.full((b, kv_pad), -2, dtype=torch.long, device=device)
    kv_doc[:, :s] = doc_ids.long()
    mask_mod = _mask_mod(att, block_size, s, (key_block, q_block, q_anchor, q_doc, kv_doc))
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(q_pad, kv_pad)
    )


def _mask_mod(att: LayerAttention, block_size: int, s: int, lookups):
    """The element rule on partial tiles; each layer attention gets its own code, so a full
    bidirectional layer reads nothing a window or causality would need."""
    key_block, q_block, q_anchor, q_doc, kv_doc = lookups
    window = att.window

    def in_context(bi, qi, ki):
        return (ki < q_anchor[bi, qi]) & (kv_doc[bi, ki] == q_doc[bi, qi])

    def mask_mod(bi, hi, qi, ki):
        return in_context(bi, qi, ki) | (key_block[ki] == q_block[qi])

    def window_mod(bi, hi, qi, ki):
        # Slot qi % B sits at anchor + slot; a context key is kept while (anchor + slot) - ki < W.
        near = ki > q_anchor[bi, qi] + qi % block_size - window
        return (in_context(bi, qi, ki) & near) | (key_block[ki] == q_block[qi])

    def causal_mod(bi, hi, qi, ki):
        # Inside the own block, key S + m is slot m % B of the same block, so m <= qi is slot order.
        return in_context(bi, qi, ki) | ((key_block[ki] == q_block[qi]) & (ki - s <= qi))

    def window_causal_mod(bi, hi, qi, ki):
        near = ki > q_anchor[bi, qi] + qi % block_size - window
        return (in_context(bi, qi, ki) & near) | ((key_block[ki] == q_block[qi]) & (ki - s <= qi))

    return {(False, False): mask_mod, (True, False): window_mod, (False, True): causal_mod,
            (True, True): window_causal_mod}[(window is not None, att.causal)]


def _check_inputs(anchors, anchor_valid, doc_ids, block_size) -> None:
    assert block_size >= 2, block_size  # DrafterShape refuses smaller blocks; this is a caller's bug
    if anchors.dim() != 2 or anchor_valid.shape != anchors.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} must be [b, N]")
    if doc_ids.dim() != 2 or doc_ids.shape[0] != anchors.shape[0]:
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [b, S] with the anchors' b")


def build_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    *, kind: str = "dense",
    attention: LayerAttention = FULL,
) -> DFlashMask:
    """The DFlash mask for `anchors[b, N]` (sorted or not), `anchor_valid[b, N]`, `doc_ids[b, S]`
    under one layer attention (default: full context, bidirectional block)."""
    _check_inputs(anchors, anchor_valid, doc_ids, block_size)
    # DrafterShape refuses a window shorter than the block (the recipe's message); here it is a caller's bug.
    assert attention.window is None or attention.window >= block_size, (attention.window, block_size)
    q_len = anchors.shape[1] * block_size
    kv_len = doc_ids.shape[1] + q_len
    anchor_valid = anchor_valid.bool()
    if kind == "dense":
        dense = _dense_mask(anchors, anchor_valid, doc_ids, block_size, att=attention)
        return DFlashMask(q_len, kv_len, dense=dense, attention=attention)
    if kind == "flex":
        block_mask = _flex_mask(anchors, anchor_valid, doc_ids, block_size, att=attention)
        return DFlashMask(q_len, kv_len, block_mask=block_mask, attention=attention)
    raise ValueError(f"mask kind must be 'dense' or 'flex', got {kind!r}")


def build_layer_masks(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    *, attentions: Sequence[LayerAttention],
    kind: str = "dense",
) -> tuple[DFlashMask, ...]:
    """One mask per layer for the layers' `attentions`; layers with the same attention share one
    mask object (built once)."""
    built: dict[LayerAttention, DFlashMask] = {}
    for att in attentions:
        if att not in built:
            built[att] = build_mask(anchors, anchor_valid, doc_ids, block_size, kind=kind, attention=att)
    return tuple(built[att] for att in attentions)


def _flex_fn(device: torch.device):
    # Uncompiled flex_attention materialises the full score matrix (dense fallback), which at
    # real sizes is ruinous; so GPUs always use one compiled instance per process (shapes are
    # static, new mask_mod closures of the same code do not recompile). CPU flex is only used by
    # tests at tiny sizes, where compiling costs more than it saves (and CPU flex has no backward).
    if device.type == "cpu":
        return flex_attention
    return compile_once(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DFlashMask, *, scale: float) -> torch.Tensor:
    """q `[b, h, Q, d]`, k/v `[b, hk, S+Q, d]` -> `[b, h, Q, d]` under the DFlash mask."""
    gqa = q.shape[1] != k.shape[1]
    if mask.dense is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa)
    if mask.block_mask is None:
        raise ValueError("DFlashMask holds neither a dense mask nor a BlockMask")
    q_pad, kv_pad = mask.block_mask.seq_lengths
    q_len, kv_len = q.shape[2], k.shape[2]
    assert (q_len, kv_len) == (mask.query_len, mask.kv_len), "mask built for other lengths"
    if q_pad != q_len:
        q = F.pad(q, (0, 0, 0, q_pad - q_len))
    if kv_pad != kv_len:
        k = F.pad(k, (0, 0, 0, kv_pad - kv_len))
        v = F.pad(v, (0, 0, 0, kv_pad - kv_len))
    with warnings.catch_warnings():
        # Eager flex on CPU warns that it is not compiled; that is intended there.
        warnings.filterwarnings("ignore", message=".*flex_attention.*compile.*")
        out = _flex_fn(q.device)(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    return out[:, :, :q_len] if q_pad != q_len else out
