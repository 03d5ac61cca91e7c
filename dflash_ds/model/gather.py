"""Row gathers whose gradients a large, hot table can afford.

DFlash2's selector reads rows of two `[V, r]` codebooks (V = 248,320) at every candidate of every
slot: 16 rows per slot, tens of thousands of slots per step, and the same few tokens (punctuation,
common words) among the candidates of most slots. Autograd's gradient of `table[index]` is a
sorted `index_put_` that adds the rows of one token one after another, so a token that appears
thousands of times is a long serial loop; on an H200 those kernels took ~0.6 ms per call.
`take_rows` gathers the same rows and computes the same gradient as a segmented sum:

  sort the indices (stable), prefix-sum the incoming rows in that order in float64, and write each
  token's total (the prefix sum at the end of its run minus the one just before its start) to its
  row of the gradient.

Every step is a parallel primitive (sort, scan, gather, one write per token), the result does not
depend on the order of floating-point additions across threads (the same bits every run, as the
sorted `index_put_` gives), and the float64 prefix sum keeps a rare token's total exact next to a
large running sum. Memory: `[m, r]` float64 for m gathered rows, transient.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch


def segment_sum_rows(index: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`out[t] = sum of rows[i] over i with index[i] == t`, `out` `[num_rows, r]` float64.

    index `[m]` int64 in [0, num_rows), rows `[m, r]`. Deterministic, no host synchronisation."""
    m = index.numel()
    out = rows.new_zeros(num_rows + 1, rows.shape[-1], dtype=torch.float64)
    if m == 0:
        return out[:num_rows]
    order_index, order = torch.sort(index, stable=True)
    sums = rows.index_select(0, order).to(torch.float64).cumsum(0)
    position = torch.arange(m, device=index.device)
    first = torch.ones(m, dtype=torch.bool, device=index.device)
    first[1:] = order_index[1:] != order_index[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    # For every position, where its run started; the prefix sum just before that start.
    start = torch.cummax(torch.where(first, position, 0), dim=0).values
    before = torch.where((start > 0).unsqueeze(1), sums[(start - 1).clamp(min=0)], 0.0)
    # One write per token: the last position of its run; every other position writes the spare
    # row `num_rows`, dropped below (its value is whichever write lands last, never read).
    target = torch.where(last, order_index, num_rows)
    out.index_put_((target,), sums - before)
    return out[:num_rows]


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, index):
        ctx.save_for_backward(index)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return table[index]

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        v, r = ctx.table_shape[0], ctx.table_shape[-1]
        total = segment_sum_rows(index.reshape(-1), grad.reshape(-1, r), v)
        return total.to(ctx.table_dtype).view(ctx.table_shape), None


def take_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for a 2-D table and an integer index of any shape; the table's gradient is the
    float64 segmented sum of `segment_sum_rows`, cast to the table's dtype."""
    if table.dim() != 2:
        raise ValueError(f"take_rows needs a [rows, width] table, got {tuple(table.shape)}")
    if not (torch.is_grad_enabled() and table.requires_grad):
        return table[index]
    return _TakeRows.apply(table, index.long())
