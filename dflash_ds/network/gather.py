"""Row gathers whose gradients a large, hot table can afford.

DFlash2's selector reads rows of two `[V, r]` codebooks (V = 248,320) at every candidate of every
slot: 16 rows per slot, tens of thousands of slots per step, and the same few tokens (punctuation,
common words) among the candidates of most slots. Autograd's gradient of `table[index]` is a
sorted `index_put_` in which one thread group adds the rows of a token one after another, each
add waiting for the previous one's store: a token among the candidates of thousands of slots is a
long chain of dependent memory round trips. `take_rows` gathers the same rows and computes the
gradient as a segmented sum instead: sort the indices (stable), count each token's rows (a binary
search of the sorted indices, no host synchronisation), and sum each token's run of rows with
`torch.segment_reduce`, whose loop over a run issues independent loads. Each token's total is
summed in one fixed order, so the result is the same bits every run (as the sorted `index_put_`
gives, and unlike atomic adds), in float32 (or wider), and cast to the table's dtype once.
The forward can return the rows in a wider dtype (`dtype`), so the incoming gradient is not
rounded to the table's dtype row by row before it is summed.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch


def segment_sum_rows(index: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`out[t] = sum of rows[i] over i with index[i] == t`, `out` `[num_rows, r]` in at least float32.

    index `[m]` int64 in [0, num_rows), rows `[m, r]`. Deterministic, no host synchronisation."""
    work = torch.promote_types(rows.dtype, torch.float32)
    if index.numel() == 0:
        return rows.new_zeros(num_rows, rows.shape[-1], dtype=work)
    ordered, order = torch.sort(index, stable=True)
    bounds = torch.searchsorted(ordered, torch.arange(num_rows + 1, device=index.device, dtype=ordered.dtype))
    lengths = bounds[1:] - bounds[:-1]
    # unsafe: the lengths sum to the rows by construction; the check would read them on the host.
    return torch.segment_reduce(rows.index_select(0, order).to(work), "sum", lengths=lengths, axis=0,
                                unsafe=True, initial=0)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, index, dtype):
        ctx.save_for_backward(index)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return table[index].to(dtype)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        v, r = ctx.table_shape[0], ctx.table_shape[-1]
        total = segment_sum_rows(index.reshape(-1), grad.reshape(-1, r), v)
        return total.to(ctx.table_dtype), None, None


def take_rows(table: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`table[index].to(dtype)` for a 2-D table and an integer index of any shape; the table's
    gradient is the segmented sum of `segment_sum_rows` (the incoming gradient in `dtype`, summed in
    at least float32), cast to the table's dtype once."""
    if table.dim() != 2:
        raise ValueError(f"take_rows needs a [rows, width] table, got {tuple(table.shape)}")
    dtype = dtype or table.dtype
    if not (torch.is_grad_enabled() and table.requires_grad):
        return table[index].to(dtype)
    return _TakeRows.apply(table, index.long(), dtype)
