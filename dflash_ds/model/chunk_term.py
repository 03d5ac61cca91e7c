"""An architecture's own term inside the fused loss (model/loss.py).

A `ChunkTerm` says what an architecture adds to each chunk's logits and loss while that chunk's
logits exist: a bias (e.g. DSpark's Markov head) and a per-row value computed over the vocabulary
from the drafter's and the target's distributions (e.g. DSpark's ||q - p||_1). The value and its
gradient run inside the loss's one compiled elementwise pass over the chunk, beside the CE, so
the term costs no extra pass over `[c, V]` logits; the bias is a small graph of its own (a matmul
to `[c, V]`) that `TermRunner` runs under autograd per chunk and differentiates with the chunk's
logit gradient. Terms of a row's own (e.g. a head trained toward that value) are not here: they
read the per-row values the loss returns (`LinearCE.term_rows`) after it.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class ChunkTerm(NamedTuple):
    """What an architecture adds inside the fused loss.

    `bias(rows, params) -> [c, V]` is added to the drafter's raw logits before the target's transform
    (the CE, the KL, the argmax hit and `vocab` all see the biased logits; the top-k candidates are
    the unbiased ones); it runs under autograd on one chunk, so only one chunk's bias exists.

    `vocab(q, target_z, grad) -> (values [c], d values / d z [c, V] or None)`: a per-row value of
    the drafter's distribution q = softmax(z) (z its transformed, biased logits) and the target's
    transformed logits `target_z` of the same rows, with its gradient w.r.t. z when `grad`. It is
    traced into the loss's compiled pass, so it must be a module-level function of tensors (one
    compiled graph per function) and elementwise or row-reducing only. The loss adds
    `vocab_weight * sum(w * values)` and returns the values per row and their weighted sum."""

    rows: tuple[torch.Tensor, ...] = ()
    """Per-row tensors `[n, ...]` for `bias`, in the loss's row order (`blocks.slot_rows`)."""
    params: tuple[torch.Tensor, ...] = ()
    """Tensors `bias` reads whole in every chunk (e.g. a head's weights)."""
    bias: Callable | None = None
    vocab: Callable | None = None
    vocab_weight: float = 0.0


class TermRunner:
    """A ChunkTerm's bias on each chunk: computed under autograd on that chunk's rows alone and
    differentiated with the chunk's logit gradient (already scaled by 1 / normaliser); the gradients
    of its tensors accumulate here."""

    def __init__(self, term: ChunkTerm, tensors, size: int):
        self.term, self.size = term, size
        k = len(term.rows)
        self.rows, self.params = tuple(tensors[:k]), tuple(tensors[k:])
        # Summed over the chunks in at least float32 (a bf16 sum of 16 chunks' shares loses digits).
        self.row_grads = [_accumulator(t) for t in self.rows]
        self.param_grads = [_accumulator(t) for t in self.params]
        self.graph = None

    def _leaves(self, lo: int, hi: int):
        pad = self.size - (hi - lo)
        rows = []
        for t in self.rows:
            c = t[lo:hi].detach()
            if pad:
                c = torch.cat([c, c.new_zeros(pad, *c.shape[1:])])
            rows.append(c.requires_grad_(t.requires_grad))
        params = [t.detach().requires_grad_(t.requires_grad) for t in self.params]
        return rows, params

    def bias(self, lo: int, hi: int) -> torch.Tensor | None:
        """The chunk's bias `[size, V]` (detached; its graph is kept for `backward`), None without one."""
        if self.term.bias is None:
            return None
        self.lo, self.hi = lo, hi
        self.leaves = self._leaves(lo, hi)
        with torch.enable_grad():
            self.graph = self.term.bias(*map(tuple, self.leaves))
        return self.graph.detach()

    def backward(self, g_logits: torch.Tensor | None) -> None:
        """The bias's tensors' gradients from the chunk's logit gradient (None: no gradient wanted)."""
        graph, self.graph = self.graph, None
        if graph is None or g_logits is None:
            return
        rows, params = self.leaves
        wanted = [t for t in rows + params if t.requires_grad]
        if not wanted:
            return
        got = iter(torch.autograd.grad(graph, wanted, g_logits.to(graph.dtype), allow_unused=True))
        n = self.hi - self.lo
        for acc, t in zip(self.row_grads, rows):
            g = next(got) if t.requires_grad else None
            if g is not None:
                acc[self.lo:self.hi] += g[:n].to(acc.dtype)
        for acc, t in zip(self.param_grads, params):
            g = next(got) if t.requires_grad else None
            if g is not None:
                acc += g.to(acc.dtype)

    def grads(self) -> tuple:
        """One per term tensor (rows, then params): the accumulated gradient in that tensor's dtype,
        None where none is wanted."""
        return tuple(g.to(t.dtype) if g is not None else None
                     for g, t in zip(self.row_grads + self.param_grads, self.rows + self.params))


def _accumulator(t: torch.Tensor) -> torch.Tensor | None:
    if not t.requires_grad:
        return None
    return torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32))
