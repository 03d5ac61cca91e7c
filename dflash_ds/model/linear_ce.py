"""Weighted cross-entropy of `hidden @ weight.T` with the gradients computed in the forward pass.

The lm_head of a 248K-token vocabulary is the drafter's most expensive matmul. Checkpointed
chunks (objective.chunked_loss) run it three times per chunk (forward, recompute, input
gradient) and walk each chunk's logits several times in fp32 (upcast, log_softmax, gather,
argmax, softmax backward). Here the loss is a sum over rows, so each chunk's gradient is known
as soon as its logits are: the forward computes logits, then one fused elementwise pass gives
the CE, the argmax hit and the logits' gradient, then one matmul turns that into the input
gradient. The backward only scales the saved gradients by the incoming one. Two lm_head matmuls
per chunk, and only one chunk's logits ever exist.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from dflash_ds.model.compile import compile_once
from dflash_ds.model.logit_transform import IDENTITY, LogitTransform, logit_slope, scale_logits
from dflash_ds.model.top_k import block_top_k

__all__ = ["ChunkPlan", "HeadGemms", "KLTerm", "linear_cross_entropy", "linear_cross_entropy_kl", "linear_cross_entropy_top_k"]


class KLTerm(NamedTuple):
    """The optional distillation term: every row adds weight * T^2 * KL(p_T || q_T), p_T the target's
    and q_T the drafter's distribution softened by the temperature T (T^2 keeps the gradient's size
    independent of T). The target's distribution comes from `target_hidden` (its final-norm states
    for the same rows, projected with the same lm_head weight) or, in objective.chunked_loss's
    unfused path only, from `target_logits_fn(index) -> logits`. Off when `weight` is 0."""

    weight: float
    temperature: float = 1.0
    target_hidden: torch.Tensor | None = None
    target_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None


class HeadGemms(Protocol):
    """The two lm_head matmuls of a chunk computed some other way than `torch.mm` with the weight
    (target_model/fp8_head.Fp8Head: FP8), for a frozen weight W [V, D]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] -> hidden @ W.T [n, V]."""

    def input_grad(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """[n, V] -> grad_logits @ W [n, D]."""


class ChunkPlan(NamedTuple):
    """How `linear_cross_entropy_top_k` projects the rows (a plain `(num_chunks, top_k)` tuple works too)."""

    num_chunks: int
    """At most this many chunks of rows; only one chunk's logits ever exist."""
    top_k: int = 0
    """> 0: also return each row's top-k token ids and raw logits."""
    transform: LogitTransform = IDENTITY
    """The target's logit scaling / softcap (model/logit_transform.py), applied before the softmax."""
    head: HeadGemms | None = None
    """The drafter's logits and their input gradient through these instead of `torch.mm` with the
    weight (which then gets no gradient); the KL term's target logits stay `torch.mm`."""


class _Settings(NamedTuple):
    # Everything but the rows: one argument for the autograd Function. `kl` is None when the term
    # is off, else it holds the target's states, detached and in the drafter's dtype: a constant of
    # the loss, so autograd need not see that tensor.
    num_chunks: int
    grad_hidden: bool
    grad_weight: bool
    kl: KLTerm | None
    top_k: int = 0  # > 0: also return each row's top_k token ids and raw logits, taken from the chunk's logits
    transform: LogitTransform = IDENTITY  # the target's logit scaling / softcap (model/logit_transform.py)
    head: HeadGemms | None = None  # ChunkPlan.head


def _ce_stats(logits, labels, weights, transform):
    # fp32 (or wider) statistics of bf16 logits; under torch.compile these fuse into one pass.
    # x: the logits the target's distribution is made of (scaled / capped as the target does).
    x = scale_logits(logits.to(weights.dtype), *transform)
    m = x.amax(-1, keepdim=True)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True)
    target = x.gather(1, labels.unsqueeze(1))
    ce = (m + s.log() - target).squeeze(1)
    hit = (x.argmax(-1) == labels) & (weights > 0)
    return (ce * weights).sum(), hit, e, s, x


def _ce_forward(logits, labels, weights, transform):
    ce_sum, hit, _, _, _ = _ce_stats(logits, labels, weights, transform)
    return ce_sum, hit


def _ce_forward_and_grad(logits, labels, weights, scale, transform):
    # d(sum(scale * CE)) / d(logits) = (softmax - onehot(label)) * scale * dz/dx (the transform's
    # slope; 1 without one), in the logits' dtype (what autograd would hand the lm_head matmul's backward).
    ce_sum, hit, e, s, x = _ce_stats(logits, labels, weights, transform)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = vocab == labels.unsqueeze(1)
    grad = (e / s - onehot.to(e.dtype)) * logit_slope(x, *transform) * scale.unsqueeze(1)
    return ce_sum, hit, grad.to(logits.dtype)


def _ce_kl_stats(logits, t_logits, labels, weights, temperature, transform):
    # KL(p || q) of the temperature-softened target (p) and drafter (q) distributions, per row; both
    # through the target's logit transform (the target's distribution is made of it).
    ce_sum, hit, e, s, z = _ce_stats(logits, labels, weights, transform)
    x = z / temperature
    log_q = x - x.amax(-1, keepdim=True)
    log_q = log_q - log_q.exp().sum(-1, keepdim=True).log()
    log_p = torch.log_softmax(scale_logits(t_logits.to(weights.dtype), *transform) / temperature, dim=-1)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1)
    return ce_sum, hit, e, s, (kl * weights).sum(), log_q, p, z


def _ce_kl_forward(logits, t_logits, labels, weights, kl, transform):
    # kl: (kl_coef, temperature)
    ce_sum, hit, _, _, kl_sum, _, _, _ = _ce_kl_stats(logits, t_logits, labels, weights, kl[1], transform)
    return ce_sum, hit, kl_sum


def _ce_kl_forward_and_grad(logits, t_logits, labels, weights, scale, kl, transform):
    # loss = sum(scale * (CE + kl_coef * T^2 * KL)), kl = (kl_coef, T): d/d(logits) = scale * dz/dx *
    # ((softmax - onehot) + kl_coef * T * (q_T - p_T)), the T^2 keeping the KL gradient's size independent of T.
    kl_coef, temperature = kl
    ce_sum, hit, e, s, kl_sum, log_q, p, z = _ce_kl_stats(logits, t_logits, labels, weights, temperature, transform)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = vocab == labels.unsqueeze(1)
    g = e / s - onehot.to(e.dtype) + (kl_coef * temperature) * (log_q.exp() - p)
    return ce_sum, hit, kl_sum, (g * logit_slope(z, *transform) * scale.unsqueeze(1)).to(logits.dtype)


def _elementwise(fn, device: torch.device):
    """`fn` compiled (once per process) on CUDA, where fusing it saves several passes over the
    logits; plain on CPU and meta (tests, no compiler needed)."""
    if device.type != "cuda":
        return fn
    return compile_once(fn, dynamic=False, fullgraph=True)


def _run(hidden, weight, labels, weights, normaliser, settings: _Settings):
    """The whole computation; the gradients are those of loss = sum(w * (CE + kl_weight * T^2 *
    KL)) / normaliser, the KL term's target states [n, D] being those of the same rows."""
    num_chunks, grad_hidden, grad_weight, kl_term, top_k, transform, head = settings
    target = kl_term.target_hidden if kl_term is not None else None
    kl_weight, temperature = (kl_term.weight, kl_term.temperature) if kl_term is not None else (0.0, 1.0)
    n, d = hidden.shape
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = weights.to(acc_dtype)
    # Zero-weight rows add exactly 0; a fixed in-vocabulary label keeps their CE finite and
    # lets their labels be anything (padding, out-of-vocabulary ids).
    lab = torch.where(w > 0, labels, torch.zeros_like(labels))
    want_grad = grad_hidden or grad_weight
    scale = w / normaliser if want_grad else None
    size = max(1, -(-n // num_chunks))
    chunks = -(-n // size)
    ce_total = hidden.new_zeros((), dtype=acc_dtype)
    hits = []
    # Sized for whole chunks, so every input-gradient matmul writes `size` rows in place.
    g_hidden = hidden.new_empty(chunks * size, d) if grad_hidden else None
    g_weight = torch.zeros_like(weight) if grad_weight else None
    # DFlash2's selector rescores these: taken here, from logits that exist anyway.
    top = hidden.new_empty(chunks * size, top_k, dtype=torch.long) if top_k else None
    top_logits = hidden.new_empty(chunks * size, top_k) if top_k else None
    kl = target is not None
    kl_total = hidden.new_zeros((), dtype=acc_dtype)
    if kl:
        fn = _elementwise(_ce_kl_forward_and_grad if want_grad else _ce_kl_forward, hidden.device)
    else:
        fn = _elementwise(_ce_forward_and_grad if want_grad else _ce_forward, hidden.device)
    for i in range(chunks):
        lo, hi = i * size, min(n, (i + 1) * size)
        hc, lc, wc = hidden[lo:hi], lab[lo:hi], w[lo:hi]
        sc = scale[lo:hi] if want_grad else None
        tc = target[lo:hi] if kl else None
        pad = size - (hi - lo)
        if pad:
            # Equal chunk shapes (one compiled graph, one GEMM shape): zero rows of weight 0.
            hc = F.pad(hc, (0, 0, 0, pad))
            lc, wc = F.pad(lc, (0, pad)), F.pad(wc, (0, pad))
            sc = F.pad(sc, (0, pad)) if want_grad else None
            tc = F.pad(tc, (0, 0, 0, pad)) if kl else None
        logits = torch.mm(hc, weight.t()) if head is None else head.logits(hc)
        if top_k:
            top_logits[i * size:(i + 1) * size], top[i * size:(i + 1) * size] = block_top_k(logits, top_k)
        if kl:
            # The target's logits of the same rows: one more lm_head matmul per chunk, and only
            # this chunk's ever exist. The target is frozen, so they are a constant of the loss.
            t_logits = torch.mm(tc, weight.t())
            if want_grad:
                ce, hit, kl_c, g_logits = fn(logits, t_logits, lc, wc, sc, (kl_weight, temperature), transform)
            else:
                ce, hit, kl_c = fn(logits, t_logits, lc, wc, (kl_weight, temperature), transform)
            del t_logits
            kl_total = kl_total + kl_c
        elif want_grad:
            ce, hit, g_logits = fn(logits, lc, wc, sc, transform)
        else:
            ce, hit = fn(logits, lc, wc, transform)
        del logits
        ce_total = ce_total + ce
        hits.append(hit)
        if grad_hidden and head is None:
            torch.mm(g_logits, weight, out=g_hidden[i * size:(i + 1) * size])
        elif grad_hidden:
            g_hidden[i * size:(i + 1) * size] = head.input_grad(g_logits)
        if grad_weight:
            # Accumulates in the weight's dtype, as autograd would across chunks.
            g_weight.addmm_(g_logits.t(), hc)
        if want_grad:
            del g_logits
    correct = torch.cat(hits)[:n] if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
    if top_k:
        top, top_logits = top[:n], top_logits[:n]
    else:
        top, top_logits = hidden.new_zeros(n, 0, dtype=torch.long), hidden.new_zeros(n, 0)
    return ce_total, correct, (g_hidden[:n] if grad_hidden else None), g_weight, kl_total, (top, top_logits)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, normaliser, settings: _Settings):
        ce_total, correct, g_hidden, g_weight, kl_total, top = _run(hidden, weight, labels, weights, normaliser,
                                                                    settings)
        ctx.save_for_backward(g_hidden, g_weight)
        loss = _total(ce_total, kl_total, settings.kl) / normaliser
        ctx.mark_non_differentiable(ce_total, correct, kl_total, *top)
        return loss, ce_total, correct, kl_total, *top

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_correct, _g_kl, _g_top, _g_top_logits):
        if torch.is_grad_enabled():
            # create_graph=True: the saved gradients are constants here, so a second derivative
            # would silently come out as zero.
            raise RuntimeError("linear_cross_entropy cannot be differentiated twice (backward with create_graph=True)")
        # loss is linear in the saved gradients' scale: only the upstream factor is left to apply.
        g_hidden, g_weight = ctx.saved_tensors
        gh = g_hidden * g_loss if g_hidden is not None else None
        gw = g_weight * g_loss if g_weight is not None else None
        return gh, gw, None, None, None, None


def _total(ce_total, kl_total, kl: KLTerm | None):
    return ce_total + (kl.weight * kl.temperature ** 2) * kl_total if kl is not None else ce_total


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    num_chunks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum(w * CE(hidden @ weight.T, labels)) / normaliser, two lm_head matmuls per chunk.

    hidden `[n, D]`, weight `[V, D]` (same dtype; logits in that dtype, CE in fp32, or float64
    for float64 inputs), labels `[n]` int, weights `[n]`, normaliser a float or a 0-dim tensor
    (a constant: it gets no gradient). Rows are cut into at most `num_chunks` chunks of
    ceil(n / num_chunks) rows, the last padded with zero-weight rows, so every chunk has the same
    shape. Rows of weight 0 add exactly 0 and their labels may be anything.

    Returns (loss, ce_sum, correct): `loss` differentiable w.r.t. `hidden`, and `weight` when it
    requires grad; `ce_sum` = sum(w * CE), detached; `correct` bool `[n]`, argmax == label on
    rows of weight > 0, False elsewhere. With gradients enabled the forward also computes them
    (saved until backward, which only scales them); under no_grad it computes the loss only.
    Static shapes and no host synchronisation. Differentiable once only.
    """
    return linear_cross_entropy_kl(hidden, weight, labels, weights, normaliser, num_chunks)[:3]


def linear_cross_entropy_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    num_chunks: int,
    kl: KLTerm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_cross_entropy` plus an optional distillation term; returns (loss, ce_sum, correct, kl_sum).

    With `kl.target_hidden` [n, D] (the target's final-norm hidden states predicting the same tokens)
    and `kl.weight` > 0: loss = sum(w * (CE + kl.weight * T^2 * KL(p_T || q_T))) / normaliser,
    p_T = softmax(target_hidden @ weight.T / T), q_T = softmax(hidden @ weight.T / T),
    T = `kl.temperature`. The target's logits are computed chunk by chunk with the same `weight`
    (three lm_head matmuls per chunk instead of two), never for more than one chunk at a time.
    `kl_sum` = sum(w * KL), detached (0 without the term).
    """
    return linear_cross_entropy_top_k(hidden, weight, labels, weights, normaliser, ChunkPlan(num_chunks), kl)[:4]


def linear_cross_entropy_top_k(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    plan: ChunkPlan | tuple,
    kl: KLTerm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_cross_entropy_kl` that also returns each row's top-k token ids `[n, k]` (int64, best
    first) and their raw logits `[n, k]` (the logits' dtype, detached), taken from the logits each
    chunk computes anyway (`model.top_k.block_top_k`): `plan` = ChunkPlan(num_chunks, k, transform, head),
    k = 0 for none (`[n, 0]` tensors). Returns (loss, ce_sum, correct, kl_sum, top_k_ids, top_k_logits).

    `plan.transform`: the target's logit scaling / softcap (model/logit_transform.py), applied to the
    drafter's logits (and the target's, for the KL term) before the softmax; the top-k logits are
    the raw ones (the transform is monotonic, so the ids are the same)."""
    num_chunks, top_k, transform, head = ChunkPlan(*plan)
    if not 0 <= top_k <= weight.shape[0]:
        raise ValueError(f"top_k must be in [0, {weight.shape[0]}] (the vocabulary), got {top_k}")
    if num_chunks < 1:
        raise ValueError(f"objective.loss_chunks must be >= 1, got {num_chunks}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [n, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)} must be [{hidden.shape[0]}]")
    kl_weight, temperature = (kl.weight, kl.temperature) if kl is not None else (0.0, 1.0)
    if not kl_weight >= 0 or not temperature > 0:
        raise ValueError(f"objective.kl_weight must be >= 0 and objective.kl_temperature > 0, got {kl_weight}, {temperature}")
    kl_on = None
    if kl is not None and kl.target_hidden is not None and kl_weight > 0:
        if kl.target_hidden.shape != hidden.shape:
            raise ValueError(f"target_hidden {tuple(kl.target_hidden.shape)} must match hidden {tuple(hidden.shape)}")
        kl_on = KLTerm(kl_weight, temperature, kl.target_hidden.detach().to(hidden.dtype))
    if isinstance(normaliser, torch.Tensor):
        normaliser = normaliser.detach()
    grad_on = torch.is_grad_enabled()
    grad_hidden = grad_on and hidden.requires_grad
    grad_weight = grad_on and weight.requires_grad
    if head is not None and grad_weight:
        raise ValueError("plan.head computes the lm_head matmuls of a frozen weight, but the weight requires grad")
    settings = _Settings(num_chunks, grad_hidden, grad_weight, kl_on, top_k, transform, head)
    if not (grad_hidden or grad_weight):
        ce_total, correct, _, _, kl_total, top = _run(hidden.detach(), weight.detach(), labels, weights, normaliser,
                                                      settings)
        return _total(ce_total, kl_total, kl_on) / normaliser, ce_total, correct, kl_total, *top
    return _LinearCrossEntropy.apply(hidden, weight, labels, weights, normaliser, settings)
