"""Inputs and calls shared by the tests that hold an export's remote code (`AutoModel` with
trust_remote_code) against the drafter it was exported from: two rows of packed blocks (the
training call, with a mask) and one block after the whole context (the serving call, no mask)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_ds.network.attention import DFlashMask


class BlockCase(NamedTuple):
    taps: torch.Tensor  # [2, S, 3 * D]
    anchors: torch.Tensor  # [2, 3]
    valid: torch.Tensor  # [2, 3]
    doc_ids: torch.Tensor  # [2, S]
    ctx_pos: torch.Tensor  # [2, S]
    block_pos: torch.Tensor  # [2, 3 * B]
    embeds: torch.Tensor  # [2, 3 * B, D]


def block_case(width: int, block_size: int, *, seq: int = 24, two_docs: bool = True, all_valid: bool = False,
               generator: torch.Generator | None = None) -> BlockCase:
    """Two rows of `seq` context tokens and three blocks each, taps of 3 target layers. With `two_docs`
    the second row holds a second document from token 12 (positions restart there); unless
    `all_valid`, the second row's last block is padding (anchor 0, invalid)."""
    b, n = 2, 3
    taps = torch.randn(b, seq, 3 * width, generator=generator)
    anchors = torch.tensor([[3, 9, 15], [2, 14, 20 if all_valid else 0]])
    valid = torch.ones(b, n, dtype=torch.bool)
    if not all_valid:
        valid[1, 2] = False
    doc_ids = torch.zeros(b, seq, dtype=torch.int32)
    ctx_pos = torch.arange(seq)[None].expand(b, -1)
    if two_docs:
        doc_ids[1, 12:] = 1
        ctx_pos = torch.where(doc_ids == 1, ctx_pos - 12, ctx_pos)
    block_pos = (torch.gather(ctx_pos, 1, anchors)[..., None] + torch.arange(block_size)).reshape(b, n * block_size)
    embeds = torch.randn(b, n * block_size, width, generator=generator)
    return BlockCase(taps, anchors, valid, doc_ids, ctx_pos, block_pos, embeds)


@torch.no_grad()
def training_call(remote, ours, case: BlockCase, ours_masks, remote_mask: torch.Tensor):
    """(remote output, drafter output) of the packed rows: the drafter under `ours_masks` (a mask or
    per-layer masks), the remote code under the dense `remote_mask`, which it narrows per layer itself."""
    want = ours(case.embeds, ours.fuse(case.taps), case.block_pos, case.ctx_pos, mask=ours_masks)
    got = remote(case.embeds, case.taps, torch.cat([case.ctx_pos, case.block_pos], 1), attention_mask=remote_mask)
    return got, want


@torch.no_grad()
def serving_call(remote, ours, case: BlockCase, block_size: int, ours_masks=None):
    """(remote output, drafter output) of one block after row 0's whole context, the remote code
    called without a mask as the engines call it; `ours_masks` defaults to everything visible."""
    seq = case.taps.shape[1]
    bp = torch.arange(seq, seq + block_size)[None]
    if ours_masks is None:
        ours_masks = DFlashMask(query_len=block_size, kv_len=seq + block_size,
                                dense=torch.ones(1, 1, block_size, seq + block_size, dtype=torch.bool))
    embeds = case.embeds[:1, :block_size]
    want = ours(embeds, ours.fuse(case.taps[:1]), bp, torch.arange(seq)[None], mask=ours_masks)
    got = remote(embeds, case.taps[:1], torch.cat([torch.arange(seq)[None], bp], 1))
    return got, want
