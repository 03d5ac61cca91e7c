"""Each loss chunk's lm_head matmuls (model/loss.py): its logits, the target's, an architecture's folded
bias, and their input gradient.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dflash_ds.model.vocab_pass import TargetLogits, distinct_rows


class ChunkMatmuls:
    """Each chunk's logits and their input gradient.

    Plain rows (the CE alone): `hidden @ W.T`. With a chunk term's bias or the target's logits, one
    matmul per chunk computes both: its rows are the chunk's states with the term's features beside
    them (`[h | f] @ [W | table].T`, the bias folded in) and, below them, the target's states of the
    chunk (its distinct positions, with zero features): fewer, larger matmuls than three, and no
    `[c, V]` bias. With `head` (FP8) the drafter's logits go through it and the bias and the target's
    logits are matmuls of their own."""

    def __init__(self, hidden, weight, settings, term_tensors, size: int, chunks: int):
        # settings: the loss's _Settings (kl, term, head, target, target_index, grad_hidden read here).
        kl, term, head = settings.kl, settings.term, settings.head
        self.hidden, self.weight, self.head, self.size = hidden, weight, head, size
        self.target = kl.target_hidden if kl is not None else settings.target
        index = kl.target_index if kl is not None else settings.target_index
        self.features, self.table = (term_tensors[0], term_tensors[1]) if term is not None and term.table is not None \
            else (None, None)
        d = hidden.shape[1]
        r = self.table.shape[1] if self.table is not None else 0
        self.distinct = distinct_rows(index, chunks, size) if self.target is not None and index is not None else None
        self.fused = head is None and (self.table is not None or self.target is not None)
        if head is None and self.table is not None:
            self.w = _folded(weight, self.table)
        else:
            self.w = weight
        below = size if self.target is not None else 0
        if self.fused:
            self.x = hidden.new_zeros(size + below, d + r)
            self.out = hidden.new_empty(size + below, weight.shape[0])
        elif self.target is not None:
            self.out = hidden.new_empty(size, weight.shape[0])
        wants = settings.grad_hidden or (self.features is not None and self.features.requires_grad)
        self.g_rows = hidden.new_empty(chunks * size, d + (r if head is None else 0)) if wants else None
        self.g_features = hidden.new_zeros(chunks * size, r) if wants and head is not None and r else None
        table_grad = self.table is not None and self.table.requires_grad
        self.g_table = torch.zeros_like(self.table, dtype=torch.promote_types(self.table.dtype, torch.float32)) \
            if table_grad else None

    def rows(self, t, lo, hi):
        # Equal chunk shapes (one compiled graph, one GEMM shape): zero rows of weight 0 pad the last.
        c = t[lo:hi]
        pad = self.size - (hi - lo)
        return F.pad(c, (0, 0, 0, pad)) if pad else c

    def logits(self, i: int, lo: int, hi: int):
        """The chunk's logits `[size, V]` and the target's (TargetLogits, or None)."""
        if not self.fused and self.head is None:
            return torch.mm(self.rows(self.hidden, lo, hi), self.weight.t()), None
        if not self.fused:
            logits = self.head.logits(self.rows(self.hidden, lo, hi))
            if self.table is not None:
                logits.addmm_(self.rows(self.features, lo, hi).to(logits.dtype), self.table.t().to(logits.dtype))
            return logits, self._target_alone(i, lo, hi)
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

    def _target_alone(self, i, lo, hi):
        # With an FP8 head the target's logits stay a bf16 matmul of their own.
        if self.target is None:
            return None
        if self.distinct is None:
            return TargetLogits(torch.mm(self.rows(self.target, lo, hi), self.weight.t()))
        states, count = self.distinct[0][i], self.distinct[2][i]
        torch.mm(self.target[states[:count]], self.weight.t(), out=self.out[:count])
        return TargetLogits(self.out, self.distinct[1][i])

    def backward(self, g_logits, i: int, lo: int, hi: int) -> None:
        """The chunk's input gradients (states and features) and its share of the table's gradient."""
        at = slice(i * self.size, (i + 1) * self.size)
        if self.g_rows is not None and self.head is None:
            torch.mm(g_logits, self.w, out=self.g_rows[at])
        elif self.g_rows is not None:
            self.g_rows[at] = self.head.input_grad(g_logits)
            if self.g_features is not None:
                self.g_features[at] = torch.mm(g_logits, self.table.to(g_logits.dtype))
        if self.g_table is not None:
            _add_product(self.g_table, g_logits.t(), self.rows(self.features, lo, hi).to(g_logits.dtype))

    def grads(self, n: int):
        """(d hidden [n, D] or None, the term's gradients: features then table, None where none is wanted)."""
        d = self.hidden.shape[1]
        g_hidden = self.g_rows[:n, :d] if self.g_rows is not None else None
        if self.features is None:
            return g_hidden, ()
        g_f = None
        if self.features.requires_grad:
            g_f = (self.g_rows[:n, d:] if self.g_features is None else self.g_features[:n]).to(self.features.dtype)
        g_t = self.g_table.to(self.table.dtype) if self.g_table is not None else None
        return g_hidden, (g_f, g_t)


_FOLDED: dict = {}


def _folded(weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`[W | table]` `[V, D + r]`, so each chunk's bias is part of its lm_head matmul. The frozen W's
    columns are copied once and kept while W is the same tensor, unchanged (its version); the
    table's columns are copied every call (the table trains): 127 MB at the flagship's sizes, where
    the whole copy is 2.7 GB and a strided concatenation of it took 3.5 ms a step."""
    key = (table.shape[1], table.dtype, weight._version, weight.data_ptr())
    held = _FOLDED.get("entry")
    if held is not None and held[0]() is weight and held[1] == key:
        folded = held[2]
        folded[:, weight.shape[1]:].copy_(table.detach())
        return folded
    _FOLDED.clear()
    folded = torch.cat([weight, table.detach().to(weight.dtype)], dim=1)
    _FOLDED["entry"] = (weakref.ref(weight), key, folded)
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
