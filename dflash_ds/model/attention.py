"""The DFlash attention mask (docs/algorithm.md section 3), dense for CPU/tests, a flex BlockMask for GPUs.

Queries are the `Q = N*B` block tokens (block n = queries n*B .. n*B+B-1); keys are the `S`
context features followed by the same `Q` block tokens. Query of block n (anchor a_n) sees:
  - context j  iff  the block is valid, j < a_n  and  doc_ids[j] == doc_ids[a_n];
  - block key S + m  iff  m // B == n  (its own block, bidirectionally).
Invalid (padding) blocks see their own block only, so no query row is fully masked.

The BlockMask is built from the anchors with tensor ops (no `create_block_mask`, whose per
element mask_mod evaluation over the full Q x KV grid is slow at real sizes). Its sparsity
must be exact: a tile marked "full" skips the mask_mod, so it is only marked when every
element in it is allowed.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_ds.model.compile import compile_once

FLEX_BLOCK = 128

@dataclass
class DFlashMask:
    """Either `dense` (bool `[b, 1, Q, S+Q]`, True = attend) or `block_mask` (flex BlockMask).

    `query_len` / `kv_len` are the real lengths Q and S+Q. The BlockMask covers lengths padded
    up to multiples of `FLEX_BLOCK`; `attend` pads q/k/v to match (no copy at the real sizes,
    S=3072 and Q=8192, which are multiples already).
    """

    query_len: int
    kv_len: int
    dense: torch.Tensor | None = None
    block_mask: BlockMask | None = None


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


def _dense_mask(anchors, anchor_valid, doc_ids, block_size) -> torch.Tensor:
    b, n = anchors.shape
    q_len = n * block_size
    device = doc_ids.device
    anchor_eff, doc_a = _query_lookups(anchors, anchor_valid, doc_ids)
    ctx = _visible_context(anchor_eff, doc_a, doc_ids).repeat_interleave(block_size, dim=1)  # [b, Q, S]
    blk = torch.arange(q_len, device=device) // block_size
    own = (blk.view(-1, 1) == blk.view(1, -1)).expand(b, q_len, q_len)
    return torch.cat([ctx, own], dim=2).unsqueeze(1)


def _flex_mask(anchors, anchor_valid, doc_ids, block_size) -> BlockMask:
    b, n = anchors.shape
    s = doc_ids.shape[1]
    q_len, kv_len = n * block_size, s + n * block_size
    q_pad, kv_pad = _round_up(q_len, FLEX_BLOCK), _round_up(kv_len, FLEX_BLOCK)
    n_qb, n_kb = q_pad // FLEX_BLOCK, kv_pad // FLEX_BLOCK
    device = doc_ids.device
    anchor_eff, doc_a = _query_lookups(anchors, anchor_valid, doc_ids)

    # Allowed keys per (block n, key tile): context part [b, N, S] summed per tile, plus the
    # block part, which is the same for every row. Counting (not any/all on the grid) gives
    # both "partial" (count > 0) and "full" (count == tile size) in one pass.
    allowed_keys = torch.zeros(b, n, kv_pad, dtype=torch.int32, device=device)
    allowed_keys[:, :, :s] = _visible_context(anchor_eff, doc_a, doc_ids).to(torch.int32)
    key_block = torch.full((kv_pad,), -2, dtype=torch.long, device=device)
    key_block[s:kv_len] = torch.arange(q_len, device=device) // block_size
    allowed_keys += (key_block.view(1, -1) == torch.arange(n, device=device).view(-1, 1)).to(torch.int32)
    counts = allowed_keys.view(b, n, n_kb, FLEX_BLOCK).sum(-1)  # [b, N, KB]

    # Spread to query rows; padding queries (>= Q) allow nothing.
    q_block = torch.full((q_pad,), -1, dtype=torch.long, device=device)
    q_block[:q_len] = torch.arange(q_len, device=device) // block_size
    row_counts = torch.zeros(b, q_pad, n_kb, dtype=torch.int32, device=device)
    row_counts[:, :q_len] = counts.repeat_interleave(block_size, dim=1)
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
    q_anchor = torch.zeros(b, q_pad, dtype=torch.long, device=device)
    q_anchor[:, :q_len] = anchor_eff.repeat_interleave(block_size, dim=1)
    q_doc = torch.full((b, q_pad), -1, dtype=torch.long, device=device)
    q_doc[:, :q_len] = doc_a.repeat_interleave(block_size, dim=1)
    kv_doc = torch.full((b, kv_pad), -2, dtype=torch.long, device=device)
    kv_doc[:, :s] = doc_ids.long()

    def mask_mod(bi, hi, qi, ki):
        in_ctx = (ki < q_anchor[bi, qi]) & (kv_doc[bi, ki] == q_doc[bi, qi])
        own = key_block[ki] == q_block[qi]
        return in_ctx | own

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(q_pad, kv_pad)
    )


def _check_inputs(anchors, anchor_valid, doc_ids, block_size) -> None:
    if block_size < 2:
        raise ValueError(f"drafter.block_size must be >= 2, got {block_size}")
    if anchors.dim() != 2 or anchor_valid.shape != anchors.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} must be [b, N]")
    if doc_ids.dim() != 2 or doc_ids.shape[0] != anchors.shape[0]:
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [b, S] with the anchors' b")


def build_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    kind: str = "dense",
) -> DFlashMask:
    """The DFlash mask for `anchors[b, N]` (sorted or not), `anchor_valid[b, N]`, `doc_ids[b, S]`."""
    _check_inputs(anchors, anchor_valid, doc_ids, block_size)
    q_len = anchors.shape[1] * block_size
    kv_len = doc_ids.shape[1] + q_len
    anchor_valid = anchor_valid.bool()
    if kind == "dense":
        return DFlashMask(q_len, kv_len, dense=_dense_mask(anchors, anchor_valid, doc_ids, block_size))
    if kind == "flex":
        return DFlashMask(q_len, kv_len, block_mask=_flex_mask(anchors, anchor_valid, doc_ids, block_size))
    raise ValueError(f"mask kind must be 'dense' or 'flex', got {kind!r}")


def _flex_fn(device: torch.device):
    # Uncompiled flex_attention materialises the full score matrix (dense fallback), which at
    # real sizes is ruinous; so GPUs always use one compiled instance per process (shapes are
    # static, new mask_mod closures of the same code do not recompile). CPU flex is only used by
    # tests at tiny sizes, where compiling costs more than it saves (and CPU flex has no backward).
    if device.type == "cpu":
        return flex_attention
    return compile_once(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DFlashMask, scale: float) -> torch.Tensor:
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
