"""The loss: the target's frozen lm_head on the drafter's states and a weighted cross-entropy, with
the optional distillation term and an architecture's own terms, the gradients computed in the forward.

The lm_head of a 248K-token vocabulary is the drafter's most expensive matmul. The loss is a sum over
rows, so each chunk's gradient is known as soon as its logits are: the forward computes a chunk's
logits, one fused elementwise pass (model/vocab_pass.py) gives the CE (and the KL, and an
architecture's per-row term over the vocabulary), the argmax hit and the logits' gradient, and one matmul turns that into the input
gradient; the backward only scales the saved gradients by
the incoming one. Two lm_head matmuls per chunk, and only one chunk's logits ever exist: with the
target's logits (the KL term, an architecture's term), the target's rows of the chunk are stacked
under the drafter's in the same matmul, and an architecture's low-rank bias is folded into it
(`[h | features] @ [W | table].T`, model/chunk_term.py). An autograd version with checkpointed chunks would run the lm_head three
times per chunk and walk the logits several times in fp32 (docs/performance.md).

`linear_cross_entropy` works on rows `[n, D]`; `block_loss` on the blocks of a micro-batch (it
drops slot 0 of every block by shape and returns the per-slot results in block layout).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from dflash_ds.model.blocks import slot_rows
from dflash_ds.model.chunk_matmuls import ChunkMatmuls
from dflash_ds.model.chunk_term import ChunkTerm
from dflash_ds.model.logit_transform import IDENTITY, LogitTransform
from dflash_ds.model.top_k import block_top_k
from dflash_ds.model.vocab_pass import Pass, Scales, chunk_pass


class KLTerm(NamedTuple):
    """The distillation term and the target's states: every row adds weight * T^2 * KL(p_T || q_T),
    p_T the target's and q_T the drafter's distribution softened by the temperature T (T^2 keeps the
    gradient's size independent of T). The target's logits are `target_hidden` (its final-norm states
    for the same rows) through the same lm_head, chunk by chunk. With weight 0 there is no KL, but a
    ChunkTerm still sees the target's logits.

    With `target_index`, `target_hidden` is a table `[P, D]` and row i's state is
    `target_hidden[target_index[i]]`: the target's logits depend on the position only, and the
    blocks of nearby anchors cover the same positions (at the recipes' anchor density about 38% of a
    chunk's rows repeat one), so each chunk multiplies its distinct states once and the pass reads
    each row's logits by index."""

    weight: float
    temperature: float = 1.0
    target_hidden: torch.Tensor | None = None
    target_index: torch.Tensor | None = None


class HeadGemms(Protocol):
    """The two lm_head matmuls of a chunk computed some other way than `torch.mm` with the weight
    (target_model/fp8_head.Fp8Head: FP8), for a frozen weight W [V, D]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] -> hidden @ W.T [n, V]."""

    def input_grad(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """[n, V] -> grad_logits @ W [n, D]."""


class LossOptions(NamedTuple):
    """How the rows are projected, and what else the loss returns."""

    num_chunks: int
    """At most this many chunks of rows; only one chunk's logits ever exist."""
    top_k: int = 0
    """> 0: also return each row's top-k token ids and raw logits (DFlash2's selector candidates)."""
    transform: LogitTransform = IDENTITY
    """The target's logit scaling / softcap (model/logit_transform.py), applied to the drafter's
    logits (and the target's) before the softmax; the top-k logits are the raw ones."""
    term: ChunkTerm | None = None
    """An architecture's term on each chunk's logits (ChunkTerm)."""
    head: HeadGemms | None = None
    """The drafter's logits and their input gradient through these instead of `torch.mm` with the
    weight (which must then be frozen); the target's logits of the same rows stay `torch.mm`."""
    first_slot: int = 1
    """`block_loss`: the first slot of every block that is a row (DrafterShape.first_draft_slot)."""
    ce_weight: float = 1.0
    """The cross-entropy's coefficient in the loss (`ce_sum` stays the unweighted sum(w * CE))."""


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
    term: ChunkTerm | None = None  # an architecture's term (its tensors travel as the Function's inputs)
    target: torch.Tensor | None = None  # the target's final-norm states [n, D] for `term` (detached), KL off
    target_index: torch.Tensor | None = None  # KLTerm.target_index of `target`
    head: HeadGemms | None = None  # LossOptions.head
    ce_weight: float = 1.0  # the CE's coefficient in the loss


class TermResult(NamedTuple):
    loss: torch.Tensor | float  # vocab_weight * sum(w * values), before the normaliser
    sums: torch.Tensor  # [1]: sum(w * values), detached ([0] without a vocab term)
    grads: tuple  # one per term tensor (None where it needs none)
    rows: torch.Tensor  # [n, 1] the values per row, detached ([n, 0] without)


def _run(hidden, weight, labels, weights, normaliser, settings: _Settings, term_tensors=()):
    """The whole computation; the gradients are those of loss = (sum(w * (ce_weight * CE + kl_weight *
    T^2 * KL + vocab_weight * the chunk term's values))) / normaliser, the KL term's target states
    [n, D] being those of the same rows. `term_tensors`: the chunk term's features and table (their
    gradients come back last)."""
    num_chunks, grad_hidden, grad_weight, kl_term, top_k, transform, chunk_term, _, _, head, ce_coef = settings
    temperature = kl_term.temperature if kl_term is not None else None
    n, d = hidden.shape
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = weights.to(acc_dtype)
    # Zero-weight rows add exactly 0; a fixed in-vocabulary label keeps their CE finite and
    # lets their labels be anything (padding, out-of-vocabulary ids).
    lab = torch.where(w > 0, labels, torch.zeros_like(labels))
    want_grad = grad_hidden or grad_weight or any(t.requires_grad for t in term_tensors)
    vocab = chunk_term.vocab if chunk_term is not None else None
    if want_grad:
        scale = w / normaliser
        scales = Scales(scale * ce_coef, scale * (kl_term.weight * kl_term.temperature) if kl_term is not None else None,
                         scale * chunk_term.vocab_weight if vocab is not None else None)
    size = max(1, -(-n // num_chunks))
    chunks = -(-n // size)
    ce_total = hidden.new_zeros((), dtype=acc_dtype)
    kl_total = hidden.new_zeros((), dtype=acc_dtype)
    vocab_total = hidden.new_zeros((), dtype=acc_dtype)
    hits = []
    g_weight = torch.zeros_like(weight) if grad_weight else None
    # DFlash2's selector rescores these: taken here, from logits that exist anyway.
    top = hidden.new_empty(chunks * size, top_k, dtype=torch.long) if top_k else None
    top_logits = hidden.new_empty(chunks * size, top_k) if top_k else None
    values = hidden.new_empty(chunks * size, dtype=acc_dtype) if vocab is not None else None
    project = ChunkMatmuls(hidden, weight, settings, term_tensors, size, chunks)
    how = Pass(temperature, transform, vocab, chunk_term.kernel if chunk_term is not None else None)
    fn = chunk_pass(hidden.device, how)
    for i in range(chunks):
        lo, hi = i * size, min(n, (i + 1) * size)
        lc, wc = lab[lo:hi], w[lo:hi]
        sc = Scales(*(t[lo:hi] if t is not None else None for t in scales)) if want_grad else None
        pad = size - (hi - lo)
        if pad:
            lc, wc = F.pad(lc, (0, pad)), F.pad(wc, (0, pad))
            sc = Scales(*(F.pad(t, (0, pad)) if t is not None else None for t in sc)) if want_grad else None
        # The target is frozen, so its logits are a constant of the loss; only this chunk's exist.
        logits, t_logits = project.logits(i, lo, hi)
        if top_k:
            top_logits[i * size:(i + 1) * size], top[i * size:(i + 1) * size] = block_top_k(logits, top_k)
        ce, hit, kl_c, v, v_sum, g_logits = fn(logits, t_logits, lc, wc, sc, how)
        del logits, t_logits
        ce_total = ce_total + ce
        hits.append(hit)
        if kl_c is not None:
            kl_total = kl_total + kl_c
        if v is not None:
            values[i * size:(i + 1) * size] = v
            vocab_total = vocab_total + v_sum
        if g_logits is not None:
            project.backward(g_logits, i, lo, hi)
        if grad_weight:
            # Accumulates in the weight's dtype, as autograd would across chunks.
            g_weight.addmm_(g_logits.t(), project.rows(hidden, lo, hi))
        del g_logits
    correct = torch.cat(hits)[:n] if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
    if top_k:
        top, top_logits = top[:n], top_logits[:n]
    else:
        top, top_logits = hidden.new_zeros(n, 0, dtype=torch.long), hidden.new_zeros(n, 0)
    g_hidden, term_grads = project.grads(n)
    if vocab is None:
        extra = TermResult(0.0, ce_total.new_zeros(0), term_grads, ce_total.new_zeros(n, 0))
    else:
        extra = TermResult(chunk_term.vocab_weight * vocab_total, vocab_total.reshape(1), term_grads,
                           values[:n].unsqueeze(1))
    return ce_total, correct, g_hidden if grad_hidden else None, g_weight, kl_total, (top, top_logits), extra


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, call: tuple, *term_tensors):
        normaliser, settings = call  # one argument: the normaliser and the settings are constants here
        ce_total, correct, g_hidden, g_weight, kl_total, top, extra = _run(hidden, weight, labels, weights,
                                                                           normaliser, settings, term_tensors)
        ctx.save_for_backward(g_hidden, g_weight, *(g if g is not None else torch.zeros(0) for g in extra.grads))
        ctx.term_grads = tuple(g is not None for g in extra.grads)
        loss = (_total(ce_total, kl_total, settings) + extra.loss) / normaliser
        ctx.mark_non_differentiable(ce_total, correct, kl_total, *top, extra.sums, extra.rows)
        return loss, ce_total, correct, kl_total, *top, extra.sums, extra.rows

    @staticmethod
    def backward(ctx, g_loss, *_non_differentiable):
        if torch.is_grad_enabled():
            # create_graph=True: the saved gradients are constants here, so a second derivative
            # would silently come out as zero.
            raise RuntimeError("linear_cross_entropy cannot be differentiated twice (backward with create_graph=True)")
        # loss is linear in the saved gradients' scale: only the upstream factor is left to apply.
        g_hidden, g_weight, *g_term = ctx.saved_tensors
        gh = g_hidden * g_loss if g_hidden is not None else None
        gw = g_weight * g_loss if g_weight is not None else None
        gt = tuple(g * g_loss if kept else None for g, kept in zip(g_term, ctx.term_grads))
        return gh, gw, None, None, None, *gt


def _total(ce_total, kl_total, settings: _Settings):
    kl = settings.kl
    ce = settings.ce_weight * ce_total
    return ce + (kl.weight * kl.temperature ** 2) * kl_total if kl is not None else ce


class LinearCE(NamedTuple):
    loss: torch.Tensor  # (ce_weight * sum(w * CE) + kl.weight * T^2 * sum(w * KL) + the term's loss) / normaliser
    ce_sum: torch.Tensor  # sum(w * CE), detached, fp32 or wider
    correct: torch.Tensor  # bool [n]: argmax == label on rows of weight > 0
    kl_sum: torch.Tensor  # sum(w * KL), detached (0 without the term)
    top_ids: torch.Tensor  # int64 [n, top_k], best first ([n, 0] without)
    top_logits: torch.Tensor  # [n, top_k] raw logits of those ids (the logits' dtype), detached
    term_sums: torch.Tensor  # [1] sum(w * the chunk term's values), detached ([0] without its vocab term)
    term_rows: torch.Tensor  # [n, 1] the chunk term's values per row, detached ([n, 0] without)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    options: LossOptions,
    kl: KLTerm | None = None,
) -> LinearCE:
    """sum(w * CE(t(hidden @ weight.T), labels)) / normaliser (t the target's logit transform), plus
    the KL term and the chunk term of `options`, without materialising all logits.

    hidden `[n, D]`, weight `[V, D]` (same dtype; logits in that dtype, CE in fp32, or float64 for
    float64 inputs), labels `[n]` int, weights `[n]`, normaliser a float or a 0-dim tensor (a
    constant: it gets no gradient). Rows are cut into at most `options.num_chunks` chunks of
    ceil(n / num_chunks) rows, the last padded with zero-weight rows, so every chunk has the same
    shape. Rows of weight 0 add exactly 0 and their labels may be anything. `loss` is
    differentiable w.r.t. `hidden`, `weight` when it requires grad, and the chunk term's tensors;
    with gradients enabled the forward also computes them (saved until backward, which only scales
    them); under no_grad it computes the loss only. Static shapes and no host synchronisation, except
    one with `kl.target_index` (each chunk's count of distinct target states). Differentiable once only.
    """
    num_chunks, top_k, transform, term, head, _, ce_weight = options
    if not 0 <= top_k <= weight.shape[0]:
        raise ValueError(f"top_k must be in [0, {weight.shape[0]}] (the vocabulary), got {top_k}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [n, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)} must be [{hidden.shape[0]}]")
    kl_weight, temperature = (kl.weight, kl.temperature) if kl is not None else (0.0, 1.0)
    if not kl_weight >= 0 or not temperature > 0:
        raise ValueError(f"the KL weight must be >= 0 and its temperature > 0, got {kl_weight}, {temperature}")
    target = kl.target_hidden if kl is not None else None
    index = kl.target_index if kl is not None and target is not None else None
    if index is not None:
        if index.shape != hidden.shape[:1] or target.dim() != 2 or target.shape[1] != hidden.shape[1]:
            raise ValueError(f"target_index {tuple(index.shape)} must be [{hidden.shape[0]}] into target_hidden "
                             f"[P, {hidden.shape[1]}], got target_hidden {tuple(target.shape)}")
        index = index.detach().long()
    elif target is not None and target.shape != hidden.shape:
        raise ValueError(f"target_hidden {tuple(target.shape)} must match hidden {tuple(hidden.shape)}")
    if kl_weight > 0 and target is None:
        raise ValueError("a KL weight > 0 needs the target's states (KLTerm.target_hidden)")
    target = target.detach().to(hidden.dtype) if target is not None and (kl_weight > 0 or term is not None) else None
    kl_on = KLTerm(kl_weight, temperature, target, index) if kl_weight > 0 else None
    if isinstance(normaliser, torch.Tensor):
        normaliser = normaliser.detach()
    grad_on = torch.is_grad_enabled()
    grad_hidden = grad_on and hidden.requires_grad
    grad_weight = grad_on and weight.requires_grad
    if head is not None and grad_weight:
        raise ValueError("LossOptions.head computes the lm_head matmuls of a frozen weight, but the weight requires grad")
    tensors = term.tensors if term is not None else ()
    if term is not None:
        term.check(hidden.shape[0], weight.shape[0])
    settings = _Settings(num_chunks, grad_hidden, grad_weight, kl_on, top_k, transform, term,
                         target if kl_on is None else None, index if kl_on is None else None, head, ce_weight)
    if not (grad_hidden or grad_weight or (grad_on and any(t.requires_grad for t in tensors))):
        ce_total, correct, _, _, kl_total, top, extra = _run(hidden.detach(), weight.detach(), labels, weights,
                                                             normaliser, settings, tuple(t.detach() for t in tensors))
        loss = (_total(ce_total, kl_total, settings) + extra.loss) / normaliser
        return LinearCE(loss, ce_total, correct, kl_total, *top, extra.sums, extra.rows)
    return LinearCE(*_LinearCrossEntropy.apply(hidden, weight, labels, weights, (normaliser, settings), *tensors))


class LossOutput(NamedTuple):
    loss: torch.Tensor  # (ce_weight * sum(w * CE) + kl.weight * T^2 * sum(w * KL) + the architecture's terms) / normaliser
    ce_sum: torch.Tensor  # sum(w * CE), detached, fp32 or wider (for logs and step-wide sums)
    correct: torch.Tensor  # bool [b, Q]: argmax == label on supervised slots, False elsewhere
    kl_sum: torch.Tensor  # sum(w * KL(p_target || p_drafter)), detached; 0 when the KL term is off
    # LossOptions.top_k > 0: int64 [rows, k] top-k token ids of every supervised slot, best first, in
    # `blocks.slot_rows` order (taken from the loss's own logits), and their raw lm_head logits [rows, k]
    # (before the target's transform; the lm_head's dtype, detached); None otherwise.
    candidates: torch.Tensor | None = None
    candidate_logits: torch.Tensor | None = None
    # The architecture's detached sums, in its `log_names` order (the chunk term's, then its extra loss's).
    extra: tuple = ()
    # The chunk term's values per row [rows, 1] in `slot_rows` order (None without its vocab term).
    term_rows: torch.Tensor | None = None


def block_loss(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normaliser: float | torch.Tensor,
    options: LossOptions,
    kl: KLTerm | None = None,
) -> LossOutput:
    """`linear_cross_entropy` of a micro-batch's blocks: hidden `[b, N*B, D]`, labels and weights
    `[b, N, B]` (the block size is their last dimension), `kl.target_hidden` `[b, N*B, D]`, or with
    `kl.target_index` `[b, N*B]` a table `[P, D]` that index reads.

    The slots before `options.first_slot` (slot 0, the anchor, unless the layout is anchor-first) are
    skipped by shape, so their weight is ignored (block_targets always makes it 0): the drafting
    slots of every block are copied into rows (cheap next to the lm_head), in `slot_rows` order; the
    chunk term's rows are in that order too. Every drafting slot is projected whatever its weight
    (zero-weight slots add exactly 0).
    """
    b, n, block_size = labels.shape
    q, d = n * block_size, hidden.shape[-1]
    if hidden.shape[:2] != (b, q):
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [{b}, {q}, D] for labels {tuple(labels.shape)}")
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    rows_kl = None
    first = options.first_slot
    if kl is not None:
        target, index = kl.target_hidden, kl.target_index
        if index is not None:
            rows_kl = kl._replace(target_index=slot_rows(index.view(b, q), block_size, first))
        else:
            rows_kl = kl._replace(target_hidden=slot_rows(target, block_size, first) if target is not None else None)
    out = linear_cross_entropy(slot_rows(hidden, block_size, first), lm_head,
                               slot_rows(labels.view(b, q), block_size, first),
                               slot_rows(weights.view(b, q).to(acc_dtype), block_size, first), normaliser, options,
                               rows_kl)
    correct = out.correct.view(b * n, block_size - first)
    correct = torch.cat([correct.new_zeros(b * n, first), correct], dim=1).view(b, q)
    top = options.top_k > 0
    return LossOutput(out.loss, out.ce_sum, correct, out.kl_sum.to(acc_dtype), out.top_ids if top else None,
                      out.top_logits if top else None, tuple(out.term_sums.unbind()) if options.term is not None else (),
                      out.term_rows if options.term is not None and options.term.vocab is not None else None)
