"""Each loss chunk's lm_head matmuls (objective/loss.py): the drafter's logits, the target's, an
architecture's folded bias, and their input gradient. Two strategies, each an object the loss is
handed (`DraftModel.loss_head`):

- `DenseHead` (the default): `torch.mm` with the weight. With a logit bias or the target's rows, one
  matmul per chunk computes all of them: its rows are the chunk's states with the bias features
  beside them (`[h | f] @ [W | table].T`, the bias folded in) and, below them, the target's states of
  the chunk (its distinct positions, with zero features): fewer, larger matmuls than three, and no
  `[c, V]` bias. It keeps the folded weight `[W | table]` between calls.
- `GemmHead`: a head with `logits(h)` and `input_grad(g)` of a frozen weight (quantization/fp8_head.Fp8Head:
  FP8), through `SeparateMatmuls`: the drafter's logits through it, the bias and the target's
  logits matmuls of their own (the target's stay `torch.mm` with the weight).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.objective.loss_terms import LogitBias, TargetLogits, TargetRows


class ChunkRows(NamedTuple):
    """What the matmuls multiply: the drafter's rows `hidden` [n, D] and the frozen `weight` [V, D],
    the optional bias and target rows (detached, in hidden's dtype), the chunking (`chunks` of `size`
    rows) and whether the rows' input gradient is wanted."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: LogitBias | None
    target: TargetRows | None
    size: int
    chunks: int
    grad_hidden: bool


def distinct_rows(index: torch.Tensor, chunks: int, size: int):
    """Per chunk of `size` rows of `index` [n] (padded with its last entry): the distinct entries
    first [chunks, size] (the first `count` of a row are valid), each row's place among them
    [chunks, size], and the counts (one host synchronisation, for the matmuls' shapes)."""
    pad = chunks * size - index.shape[0]
    idx = torch.cat([index, index[-1:].expand(pad)]) if pad else index
    srt, order = idx.view(chunks, size).sort(dim=1)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    rank = new.cumsum(1) - 1
    place = torch.empty_like(rank).scatter_(1, order, rank)
    distinct = torch.zeros_like(srt).scatter_(1, rank, srt)  # equal entries write equal values
    return distinct, place, new.sum(1).tolist()


class _Matmuls:
    """What both strategies share: the padded rows, the distinct target positions, the gradients'
    buffers and how they come back."""

    def __init__(self, rows: ChunkRows, folded: bool):
        self.hidden, self.weight, self.size = rows.hidden, rows.weight, rows.size
        target, bias = rows.target, rows.bias
        self.target = target.states if target is not None else None
        self.features, self.table = (bias.features, bias.table) if bias is not None else (None, None)
        self.distinct = distinct_rows(target.index, rows.chunks, rows.size) \
            if target is not None and target.index is not None else None
        d, r = self.hidden.shape[1], self.table.shape[1] if self.table is not None else 0
        wants = rows.grad_hidden or (self.features is not None and self.features.requires_grad)
        # The folded matmul's input gradient is [d states | d features] in one buffer.
        self.g_rows = self.hidden.new_empty(rows.chunks * rows.size, d + (r if folded else 0)) if wants else None
        self.g_features = self.hidden.new_zeros(rows.chunks * rows.size, r) if wants and not folded and r else None
        table_grad = self.table is not None and self.table.requires_grad
        self.g_table = torch.zeros_like(self.table, dtype=torch.promote_types(self.table.dtype, torch.float32)) \
            if table_grad else None

    def rows(self, t, lo, hi):
        # Equal chunk shapes (one compiled graph, one GEMM shape): zero rows of weight 0 pad the last.
        c = t[lo:hi]
        pad = self.size - (hi - lo)
        return F.pad(c, (0, 0, 0, pad)) if pad else c

    def _table_grad(self, g_logits, lo, hi):
        if self.g_table is not None:
            self.add_table_grad(g_logits, self.rows(self.features, lo, hi))

    def add_table_grad(self, g_logits, features) -> None:
        """The table's gradient from the logits' gradient `g_logits` [size, V] of rows `features` [size, r] biased."""
        if self.g_table is not None:
            _add_product(self.g_table, g_logits.t(), features.to(g_logits.dtype))

    def grads(self, n: int):
        """(d hidden [n, D] or None, the bias's gradients (features, table), None where none is wanted)."""
        d = self.hidden.shape[1]
        g_hidden = self.g_rows[:n, :d] if self.g_rows is not None else None
        if self.features is None:
            return g_hidden, (None, None)
        g_f = None
        if self.features.requires_grad:
            g_f = (self.g_rows[:n, d:] if self.g_features is None else self.g_features[:n]).to(self.features.dtype)
        g_t = self.g_table.to(self.table.dtype) if self.g_table is not None else None
        return g_hidden, (g_f, g_t)


class StackedMatmuls(_Matmuls):
    """DenseHead's matmuls of one loss call: one `torch.mm` a chunk (bias folded, target rows stacked)."""

    def __init__(self, rows: ChunkRows, w: torch.Tensor):
        super().__init__(rows, folded=True)
        self.w = w
        self.stacked = self.table is not None or self.target is not None
        d, r = self.hidden.shape[1], self.table.shape[1] if self.table is not None else 0
        below = self.size if self.target is not None else 0
        if self.stacked:
            self.x = self.hidden.new_zeros(self.size + below, d + r)
            self.out = self.hidden.new_empty(self.size + below, w.shape[0])

    def logits(self, i: int, lo: int, hi: int):
        """The chunk's logits `[size, V]` and the target's (TargetLogits, or None)."""
        if not self.stacked:
            return torch.mm(self.rows(self.hidden, lo, hi), self.w.t()), None
        x, size, d, m = self.x, self.size, self.hidden.shape[1], hi - lo
        x[:m, :d] = self.hidden[lo:hi]
        if self.features is not None:
            x[:m, d:] = self.features[lo:hi]
        x[m:size].zero_()
        rows, place = size, None
        if self.distinct is not None:
            states, count = self.distinct[0][i], self.distinct[2][i]
            x[size:size + count, :d] = self.target[states[:count]]
            rows, place = size + count, self.distinct[1][i]
        elif self.target is not None:
            x[size:size + m, :d] = self.target[lo:hi]
            x[size + m:, :d].zero_()
            rows = 2 * size
        torch.mm(x[:rows], self.w.t(), out=self.out[:rows])
        target = TargetLogits(self.out[size:], place) if self.target is not None else None
        return self.out[:size], target

    def backward(self, g_logits, i: int, lo: int, hi: int, *, g_biased=None) -> None:
        """The chunk's input gradients (states and features) and its share of the table's gradient.
        `g_biased`: the part of `g_logits` of logits the bias reached, where not all did (the rounds of
        a loss.Rounds start from the unbiased logits); None: all of it."""
        if self.g_rows is not None:
            at = self.g_rows[i * self.size:(i + 1) * self.size]
            if g_biased is None or self.table is None:
                torch.mm(g_logits, self.w, out=at)
            else:
                d = self.hidden.shape[1]
                torch.mm(g_logits, self.w[:, :d], out=at[:, :d])
                torch.mm(g_biased, self.w[:, d:], out=at[:, d:])
        self._table_grad(g_logits if g_biased is None else g_biased, lo, hi)


class SeparateMatmuls(_Matmuls):
    """The matmuls of one loss call through a head of the frozen weight (`logits`, `input_grad`): the
    drafter's logits through it, the bias and the target's logits matmuls of their own."""

    def __init__(self, rows: ChunkRows, head):
        super().__init__(rows, folded=False)
        self.head = head
        if self.target is not None:
            self.out = self.hidden.new_empty(self.size, self.weight.shape[0])

    def logits(self, i: int, lo: int, hi: int):
        logits = self.head.logits(self.rows(self.hidden, lo, hi))
        if self.table is not None:
            logits.addmm_(self.rows(self.features, lo, hi).to(logits.dtype), self.table.t().to(logits.dtype))
        if self.target is None:
            return logits, None
        if self.distinct is None:
            return logits, TargetLogits(torch.mm(self.rows(self.target, lo, hi), self.weight.t()))
        states, count = self.distinct[0][i], self.distinct[2][i]
        torch.mm(self.target[states[:count]], self.weight.t(), out=self.out[:count])
        return logits, TargetLogits(self.out, self.distinct[1][i])

    def backward(self, g_logits, i: int, lo: int, hi: int, *, g_biased=None) -> None:
        at = slice(i * self.size, (i + 1) * self.size)
        g_bias = g_logits if g_biased is None else g_biased
        if self.g_rows is not None:
            self.g_rows[at] = self.head.input_grad(g_logits)
            if self.g_features is not None:
                self.g_features[at] = torch.mm(g_bias, self.table.to(g_logits.dtype))
        self._table_grad(g_bias, lo, hi)


class GemmHead:
    """The strategy of a head of the frozen weight that computes the chunk's two lm_head matmuls its own
    way (`gemms.logits(h)`, `gemms.input_grad(g)`: quantization/fp8_head.Fp8Head in FP8), through
    `SeparateMatmuls`."""

    def __init__(self, gemms):
        self.gemms = gemms

    def matmuls(self, rows: ChunkRows) -> SeparateMatmuls:
        return SeparateMatmuls(rows, self.gemms)


class DenseHead:
    """The lm_head matmuls as `torch.mm` with the weight (the default strategy). It keeps `[W | table]`
    `[V, D + r]`, so each chunk's bias is part of its lm_head matmul: the frozen W's columns are copied
    once and kept while W is the same tensor, unchanged (its version); the table's columns are copied
    every call (the table trains): a fraction of the whole copy, which costs milliseconds a step at a
    248K vocabulary (docs/performance.md)."""

    def __init__(self):
        self._held = None  # (weakref to W, key, [W | table])

    def matmuls(self, rows: ChunkRows) -> StackedMatmuls:
        w = self._folded(rows.weight, rows.bias.table) if rows.bias is not None else rows.weight
        return StackedMatmuls(rows, w)

    def _folded(self, weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        key = (table.shape[1], table.dtype, weight._version)
        held = self._held
        if held is not None and held[0]() is weight and held[1] == key:
            held[2][:, weight.shape[1]:].copy_(table.detach())
            return held[2]
        self._held = None  # the old copy goes before the new one is made
        folded = torch.cat([weight, table.detach().to(weight.dtype)], dim=1)
        self._held = (weakref.ref(weight), key, folded)
        return folded


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in acc's precision: on CUDA the matmul accumulates into a wider acc directly;
    elsewhere a narrower product is rounded once, then added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(torch.mm(a, b))
