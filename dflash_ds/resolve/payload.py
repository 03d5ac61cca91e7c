"""The payload's layout: one micro-batch on the wire, and how it is written and read back.

One micro-batch travels as ONE tensor `[R, S, T*D + M]` in the tap dtype: the tapped hidden states
followed by M columns that reinterpret an int32 `[R, S, 3]` block (input_ids, loss_mask, doc_ids),
zero-padded so that a row is a multiple of 16 bytes. The drafter's `fc` reads the taps as a strided
view of the payload, and cuBLAS takes its fast kernels only when the row stride is 16-byte aligned
(with 3 int32 columns, 12 bytes, the fc ran on a slow fallback kernel: docs/performance.md, "Figures
behind the code").
The target's tap hooks write straight into the payload, so nothing is concatenated or copied, and
one send per micro-batch keeps NCCL/gloo overheads to a minimum. The transport that moves it is
runtime/transport.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_ds.objective.blocks import MicroBatch

META_FIELDS = 3  # input_ids, loss_mask, doc_ids as int32
ROW_ALIGN = 16  # bytes: a payload row's stride, for cuBLAS's aligned kernels


@dataclass(frozen=True)
class PayloadLayout:
    rows: int
    seq_len: int
    num_taps: int
    hidden: int
    dtype: torch.dtype
    final_norm: bool = False
    """One more tap after the layer taps: the target's final-norm hidden state (KL term on)."""

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def meta_cols(self) -> int:
        taps = self.tap_cols * self.itemsize
        if taps % 4:  # the int32 block could not be whole: no alignment to keep (odd toy widths only)
            return META_FIELDS * 4 // self.itemsize
        return (-(-(taps + META_FIELDS * 4) // ROW_ALIGN) * ROW_ALIGN - taps) // self.itemsize

    @property
    def tap_cols(self) -> int:
        return (self.num_taps + int(self.final_norm)) * self.hidden

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.seq_len, self.tap_cols + self.meta_cols)

    @property
    def nbytes(self) -> int:
        r, s, c = self.shape
        return r * s * c * self.itemsize

    def empty(self, device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def taps_view(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    return payload[..., : layout.tap_cols]


def layer_taps(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """The tapped layers' states [..., T*D] (what the drafter fuses)."""
    return payload[..., : layout.num_taps * layout.hidden]


def final_hidden(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor | None:
    """The target's final-norm states [..., D] when the payload carries them, else None."""
    return payload[..., layout.num_taps * layout.hidden: layout.tap_cols] if layout.final_norm else None


def write_meta(payload: torch.Tensor, layout: PayloadLayout, input_ids, loss_mask, *, doc_ids) -> None:
    meta = torch.stack([input_ids.to(torch.int32), loss_mask.to(torch.int32), doc_ids.to(torch.int32)], dim=-1)
    meta = torch.nn.functional.pad(meta, (0, layout.meta_cols * layout.itemsize // 4 - META_FIELDS))  # the padding
    payload[..., layout.tap_cols:] = meta.view(layout.dtype).to(payload.device)


def read_meta(payload: torch.Tensor, layout: PayloadLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A last-dim slice cannot be reinterpreted in place, so the (tiny) metadata is copied out.
    meta = payload[..., layout.tap_cols:].contiguous().view(torch.int32)
    return meta[..., 0].long(), meta[..., 1].bool(), meta[..., 2]


def unpack(payload: torch.Tensor, layout: PayloadLayout, dtype: torch.dtype) -> MicroBatch:
    """A received payload as the drafter's micro-batch, taps cast to the compute dtype."""
    ids, loss_mask, doc_ids = read_meta(payload, layout)
    final = final_hidden(payload, layout)
    return MicroBatch(layer_taps(payload, layout).to(dtype), ids, loss_mask, doc_ids,
                      None if final is None else final.to(dtype))
