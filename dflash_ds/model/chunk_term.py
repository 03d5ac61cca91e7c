"""An architecture's own term inside the fused loss (model/loss.py): `ChunkTerm` says what it adds to
each chunk's logits and loss, `TermRunner` evaluates it on one chunk at a time under autograd, while
that chunk's logits exist, and gathers its gradients and logged sums over the chunks.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from dflash_ds.model.logit_transform import LogitTransform


class ChunkView(NamedTuple):
    """One chunk's rows as a `ChunkTerm` sees them."""

    z: torch.Tensor
    """[c, V] the drafter's logits, biased and through the target's transform, in fp32 or wider (differentiable)."""
    target_z: torch.Tensor | None
    """[c, V] the target's logits of the same rows through its transform (a constant), when the
    target's final-norm states are given; None otherwise."""
    labels: torch.Tensor  # [c] (0 where the weight is 0)
    weights: torch.Tensor  # [c] slot weights, fp32 or wider (0 on the padding rows)
    rows: tuple[torch.Tensor, ...]  # the chunk's slices of `ChunkTerm.rows` (differentiable where they were)
    params: tuple[torch.Tensor, ...]  # `ChunkTerm.params` (differentiable where they were)


class ChunkTerm(NamedTuple):
    """A term an architecture evaluates inside the fused loss, on each chunk's logits while they exist.

    `bias(rows, params) -> [c, V]` is added to the drafter's raw logits before the target's transform
    (the CE, the KL, the argmax hit and `loss` all see the biased logits; the top-k candidates are the
    unbiased ones). `loss(view) -> (loss_sum, sums)`: a differentiable scalar added to the chunk's
    sum(w * CE) (so it is divided by the same normaliser) and `num_sums` detached values summed over
    the chunks for the logs. Gradients reach the drafter's states through the logits and the
    tensors of `rows` and `params` that require them; both functions run under autograd on the
    chunk alone, so only one chunk's graph ever exists. Padding rows have weight 0, rows of zeros
    (a term must weight what it adds by `view.weights`)."""

    rows: tuple[torch.Tensor, ...] = ()
    """Per-row tensors `[n, ...]` in the loss's row order (`blocks.slot_rows`)."""
    params: tuple[torch.Tensor, ...] = ()
    """Tensors read whole by every chunk (e.g. a head's weights)."""
    bias: Callable | None = None
    loss: Callable | None = None
    num_sums: int = 0
    num_row_values: int = 0
    """> 0: `loss` returns a third value, `[c, num_row_values]` detached per-row values (e.g. a
    slot's acceptance probability) that the loss returns for all rows (`LinearCE.term_rows`)."""


class TermResult(NamedTuple):
    loss: torch.Tensor | float  # the term's loss summed over the chunks (detached), before the normaliser
    sums: torch.Tensor  # [num_sums] detached
    grads: tuple  # one per term tensor (None where it needs none)
    rows: torch.Tensor  # [n, num_row_values] detached



class TermRunner:
    """A ChunkTerm on each chunk: its bias and loss under autograd on that chunk alone; the gradients
    of its tensors accumulate here (scaled by 1 / normaliser like the rest of the loss)."""

    def __init__(self, term: ChunkTerm, tensors, n: int, size: int, normaliser):
        self.term, self.n, self.size, self.normaliser = term, n, size, normaliser
        k = len(term.rows)
        self.rows, self.params = tuple(tensors[:k]), tuple(tensors[k:])
        self.row_grads = [torch.zeros_like(t) if t.requires_grad else None for t in self.rows]
        self.param_grads = [torch.zeros_like(t) if t.requires_grad else None for t in self.params]
        self.sums = None
        self.row_values = None  # [chunks x size, num_row_values], made where the first chunk's values are
        self.loss = 0.0
        self.bias_graph = None

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

    def biased(self, logits, lo: int, hi: int, dtype):
        """The chunk's raw logits plus the term's bias, in `dtype` (the bias's graph kept for `chunk`)."""
        self.lo, self.hi = lo, hi
        self.chunk_rows, self.chunk_params = self._leaves(lo, hi)
        if self.term.bias is None:
            self.bias_graph = None
            return logits
        with torch.enable_grad():
            bias = self.term.bias(tuple(self.chunk_rows), tuple(self.chunk_params))
        self.bias_graph = bias
        return logits.to(dtype) + bias.detach().to(dtype)

    def chunk(self, logits, t_logits, view: ChunkView, transform: LogitTransform, g_logits):
        """The logits' gradient with the term's part added; the term's loss, its sums and its tensors'
        gradients are accumulated."""
        grad = g_logits is not None
        g = g_logits.to(view.weights.dtype) if grad else None
        if self.term.loss is not None:
            with torch.enable_grad():
                x = logits.detach().to(view.weights.dtype).requires_grad_(grad)
                z = transform.apply(x)
                tz = transform.apply(t_logits.to(view.weights.dtype)) if t_logits is not None else None
                loss_sum, sums, *values = self.term.loss(view._replace(z=z, target_z=tz, rows=tuple(self.chunk_rows),
                                                                       params=tuple(self.chunk_params)))
                if values:
                    v = values[0].detach()
                    if self.row_values is None:  # on the values' device: no host-to-device copy per micro-batch
                        self.row_values = v.new_zeros(-(-self.n // self.size) * self.size, self.term.num_row_values)
                    self.row_values[self.lo:self.lo + self.size] = v
                sums = sums.detach().to(view.weights.dtype)
                self.sums = sums if self.sums is None else self.sums + sums
                if grad:
                    wanted = [x] + [t for t in self.chunk_rows + self.chunk_params if t.requires_grad]
                    got = torch.autograd.grad(loss_sum / self.normaliser, wanted, allow_unused=True)
                    g = g + got[0]
                    self._collect(got[1:])
            self.loss = self.loss + loss_sum.detach()
        if grad and self.bias_graph is not None:
            wanted = [t for t in self.chunk_rows + self.chunk_params if t.requires_grad]
            if wanted:
                self._collect(torch.autograd.grad(self.bias_graph, wanted, g.to(self.bias_graph.dtype),
                                                  allow_unused=True))
        self.bias_graph = None
        return g

    def _collect(self, grads) -> None:
        it = iter(grads)
        lo, hi = self.lo, self.hi
        for i, t in enumerate(self.chunk_rows):
            if t.requires_grad:
                got = next(it)
                if got is not None:
                    self.row_grads[i][lo:hi] += got[:hi - lo].to(self.row_grads[i].dtype)
        for i, t in enumerate(self.chunk_params):
            if t.requires_grad:
                got = next(it)
                if got is not None:
                    self.param_grads[i] += got.to(self.param_grads[i].dtype)

    def result(self, like: torch.Tensor) -> TermResult:
        sums = self.sums if self.sums is not None else like.new_zeros(self.term.num_sums)
        return TermResult(self.loss, sums, tuple(self.row_grads) + tuple(self.param_grads),
                           like.new_zeros(self.n, self.term.num_row_values) if self.row_values is None
                           else self.row_values[:self.n].to(like.device))
