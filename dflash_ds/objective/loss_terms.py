"""The loss's terms and what they read besides the drafter's rows (objective/loss.py loops over them).

A term has a name (its sum's key in `LossOutput.sums`, and the logs'), a weight (its coefficient in
the loss) and says what it reads. Two places a term can add to the loss:

- inside the pass over a chunk's vocabulary (`VocabTerm`: the cross-entropy, the distillation KL,
  an architecture's per-row term such as DSpark's ||q - p||_1): while the chunk's logits exist, it
  gives each row's value and the value's gradient w.r.t. the logits, which the loss sums into the
  chunk's one logits gradient (one matmul turns it into the input gradient);
- after the chunk loop (`OutputTerm`: DFlash2's selector, DSpark's confidence head): it reads what
  the loop returned (the candidates, a vocabulary term's per-row values) and adds an autograd loss.

The target's states (`TargetRows`) and an architecture's low-rank logit bias (`LogitBias`) are
inputs of the loss, not of a term: the matmuls fold them into the chunk's lm_head matmul
(objective/head_matmuls.py), and any term may read the target's logits they give.

`chunk_math` is the pass: one elementwise function over a chunk's logits (compiled on CUDA, so the
`[c, V]` intermediates never exist in memory) that loops over the vocabulary terms.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from dflash_ds.compile import compile_once
from dflash_ds.network.logit_transform import IDENTITY, LogitTransform, logit_slope, scale_logits


class TargetRows(NamedTuple):
    """The target's final-norm states of the loss's rows: `states` `[n, D]`, or with `index` `[n]` a
    table `[P, D]` that row i reads at index[i] (the target's logits depend on the position only, and
    nearby blocks cover the same positions: each chunk multiplies its distinct states once)."""

    states: torch.Tensor
    index: torch.Tensor | None = None


class Rounds(NamedTuple):
    """Rounds of a logit bias that re-read the argmax of the round before them (XPress's Jacobi rounds),
    computed inside the loss's chunk loop from the logits it already has. Round 0 is the unbiased logits
    (`h @ W.T`); round j >= 1 adds `features(j, previous, lo, hi) @ table.T` to them, `previous` [n] being
    round j - 1's argmax of every row, filled for the rows before `hi` (chunks run in row order, so a row's
    features may read its own and earlier rows' only). Each round runs the loss's vocabulary terms on its
    logits at `base_weight` (round 0) or `weight` (each later round); their sums are named
    `<term>_base` and `<term>_round<j>`. The loss calls `features` with gradients off and hands back the
    gradient of its loss w.r.t. them (`loss.RoundsOutput.feature_grads`) for the caller to apply."""

    count: int
    weight: float
    base_weight: float
    features: Callable


class LogitBias(NamedTuple):
    """A low-rank bias of the drafter's raw logits: row i gets `table @ features[i]` (`features`
    `[n, r]` in the loss's row order, `table` `[V, r]`; both may require grad). Written so, the loss
    folds it into the lm_head matmul (`[h | features] @ [W | table].T`): no `[c, V]` bias exists.
    `rounds`: the same table's rounds beside it (`Rounds`), or None."""

    features: torch.Tensor
    table: torch.Tensor
    rounds: Rounds | None = None

    def check(self, rows: int, vocab_size: int) -> None:
        f, t = self.features, self.table
        if f.dim() != 2 or t.dim() != 2 or f.shape[0] != rows or t.shape[0] != vocab_size or f.shape[1] != t.shape[1]:
            raise ValueError(f"a logit bias needs features [{rows}, r] and a table [{vocab_size}, r], got "
                             f"{tuple(f.shape)} and {tuple(t.shape)}")


class Softmax(NamedTuple):
    # What every vocabulary term may read of a chunk, computed once: the drafter's transformed logits
    # z, their row maxima m and exp-sums s, q = softmax(z), the labels and the target's transformed
    # logits tz (None when no term reads them).
    z: torch.Tensor
    m: torch.Tensor
    s: torch.Tensor
    q: torch.Tensor
    labels: torch.Tensor
    tz: torch.Tensor | None

    def label_nll(self) -> torch.Tensor:
        """-log q[label] per row, from the logits' maxima and exp-sums (no log of q itself)."""
        return (self.m + self.s.log() - self.z.gather(1, self.labels.unsqueeze(1))).squeeze(1)


class VocabTerm:
    """A term computed in the pass over a chunk's vocabulary. `rows(sm, grad)` -> (values [c], the
    direction of their gradient w.r.t. z [c, V] or None): the loss adds `weight * loss_scale *
    sum(w * values)` and `weight * grad_scale * w / normaliser * direction` to the logits' gradient
    (the two scales differ when the direction is not the exact derivative, e.g. the KL's 1 / T).
    Instances are constants of the compiled pass: frozen, of Python numbers and module-level
    functions only (one compiled graph per distinct set)."""

    name: str
    weight: float
    reads_target: bool = False
    keep_rows: bool = False  # the per-row values are returned (`LossOutput.rows[name]`)
    loss_scale: float = 1.0
    grad_scale: float = 1.0

    def rows(self, sm: Softmax, grad: bool):
        raise NotImplementedError


@dataclass(frozen=True)
class CrossEntropy(VocabTerm):
    """-log q[label]: the drafter's next-token loss. Always in the loss, even at weight 0 (its sum is
    the logs' "loss")."""

    weight: float = 1.0
    name: str = "ce"

    def rows(self, sm: Softmax, grad: bool):
        ce = sm.label_nll()
        if not grad:
            return ce, None
        onehot = torch.arange(sm.z.shape[-1], device=sm.z.device) == sm.labels.unsqueeze(1)
        return ce, sm.q - onehot.to(sm.q.dtype)


@dataclass(frozen=True)
class Distillation(VocabTerm):
    """KL(p_T || q_T) of the target's and the drafter's distributions softened by `temperature` T,
    weighted by T^2 (so the gradient's size does not depend on T); reads the target's logits."""

    weight: float
    temperature: float = 1.0
    name: str = "kl"
    reads_target: bool = True

    @property
    def loss_scale(self) -> float:
        return self.temperature ** 2

    @property
    def grad_scale(self) -> float:
        # T^2 of the loss over the 1 / T of the softened softmax: the direction is q_T - p_T.
        return self.temperature

    def rows(self, sm: Softmax, grad: bool):
        xt = sm.z / self.temperature
        log_q = xt - xt.amax(-1, keepdim=True)
        log_q = log_q - log_q.exp().sum(-1, keepdim=True).log()
        log_p = torch.log_softmax(sm.tz / self.temperature, dim=-1)
        p = log_p.exp()
        return (p * (log_p - log_q)).sum(-1), (log_q.exp() - p) if grad else None


@dataclass(frozen=True)
class RowTerm(VocabTerm):
    """An architecture's per-row term over the vocabulary: `values(q, tz, grad) -> (values [c],
    d values / d z or None)` of the drafter's distribution q and the target's transformed logits tz.
    Traced into the compiled pass: a module-level function of tensors, elementwise or row-reducing.
    `kernel`: the whole pass (`chunk_math`'s signature and results) written by hand for CUDA for the
    terms (CrossEntropy, this) without a logit transform; `chunk_math` is its reference."""

    name: str
    weight: float
    values: Callable
    kernel: Callable | None = None
    reads_target: bool = True
    keep_rows: bool = True

    def rows(self, sm: Softmax, grad: bool):
        return self.values(sm.q, sm.tz, grad)


class OutputTerm:
    """A term computed after the chunk loop from its output (objective.loss.LossOutput: the candidates,
    a vocabulary term's per-row values). `top_k`: candidates per row it reads (0: none).
    `reads_expected`: it reads each row's q @ W (`LossOutput.expected`), the lm_head row expected under
    the drafter's distribution, the gradient of a candidate's log-prob besides its own row.
    `contribute(out, normaliser)` -> (its differentiable loss, already divided by the normaliser,
    and its detached sums by name)."""

    name: str
    weight: float
    top_k: int = 0
    reads_expected: bool = False

    def contribute(self, out: Any, normaliser) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class Pass(NamedTuple):
    # A chunk's pass: its vocabulary terms and the target's logit transform (constants of its
    # compiled graph, one per run).
    terms: tuple[VocabTerm, ...]
    transform: LogitTransform = IDENTITY


class TargetLogits(NamedTuple):
    # The target's logits of a chunk's rows: `logits` [c, V], or with `rows` [c] a table that row i
    # reads at rows[i] (read by index inside the pass, so the rows are never copied out).
    logits: torch.Tensor
    rows: torch.Tensor | None = None


def chunk_math(logits, target: TargetLogits | None, labels, weights, *, scales: tuple | None, how: Pass):
    """One chunk's terms over the vocabulary and, with `scales` (one `[c]` tensor per term: the row
    weight over the normaliser times the term's weight and grad_scale; tensors, not numbers, so a
    weight that changes between steps compiles nothing anew), the gradient of their weighted sum
    w.r.t. the raw logits, in one pass.

    Returns (each term's sum(w * values), the argmax hit, each term's values [c] where it keeps them
    else None, the gradient dz/dx * sum_t scale_t * direction_t in the logits' dtype, or None)."""
    terms, cap, multiplier = how.terms, how.transform.softcap, how.transform.multiplier
    z = scale_logits(logits.to(weights.dtype), multiplier, cap)  # the logits the target's distribution is made of
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp()
    s = e.sum(-1, keepdim=True)
    tz = None
    if target is not None:
        t_logits = target.logits if target.rows is None else target.logits[target.rows]
        tz = scale_logits(t_logits.to(weights.dtype), multiplier, cap)
    sm = Softmax(z, m, s, e / s, labels, tz)
    hit = (z.argmax(-1) == labels) & (weights > 0)
    grad = scales is not None
    sums, kept, g = [], [], None
    for i, term in enumerate(terms):
        values, direction = term.rows(sm, grad)
        sums.append((values * weights).sum())
        kept.append(values if term.keep_rows else None)
        if grad:
            step = scales[i].unsqueeze(1) * direction
            g = step if g is None else g + step
    if grad:
        g = (g * logit_slope(z, multiplier, cap)).to(logits.dtype)
    return tuple(sums), hit, tuple(kept), g


def chunk_pass(device: torch.device, how: Pass):
    """The pass a chunk runs: on CUDA a term's own kernel where it applies (the cross-entropy and that
    term alone, no logit transform), else `chunk_math` compiled (once per process), where fusing it
    saves several passes over the logits; plain on CPU and meta (tests, no compiler needed)."""
    if device.type != "cuda":
        return chunk_math
    kernel = getattr(how.terms[-1], "kernel", None)
    if kernel is not None and len(how.terms) == 2 and isinstance(how.terms[0], CrossEntropy) \
            and how.transform == IDENTITY:
        return kernel
    return compile_once(chunk_math, dynamic=False, fullgraph=True)
