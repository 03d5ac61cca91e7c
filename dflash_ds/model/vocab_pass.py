"""One chunk's pass over the vocabulary inside the fused loss (model/loss.py), and what it reads.

`chunk_math` computes, from a chunk's logits, everything the loss needs over the vocabulary in one
elementwise function: the CE, the argmax hit, the KL term, an architecture's per-row term
(`ChunkTerm.vocab`) and the gradient of their weighted sum w.r.t. the logits. On CUDA it is compiled
once (`chunk_pass`), so the `[c, V]` intermediates never exist in memory. `TargetLogits` carries the
target's logits of the chunk's rows, directly or as a table of distinct positions that each row reads
by index (`distinct_rows` finds them).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from dflash_ds.compile import compile_once
from dflash_ds.model.logit_transform import IDENTITY, LogitTransform, logit_slope, scale_logits


class Scales(NamedTuple):
    # Per-row factors [c] of the logits' gradient: the slot weight over the normaliser times each
    # term's coefficient. Tensors, not numbers in the compiled graph, so a coefficient that changes
    # between steps compiles nothing anew.
    ce: torch.Tensor
    kl: torch.Tensor | None  # kl_weight * T (the T^2 of the loss over the 1 / T of the softened softmax)
    vocab: torch.Tensor | None


class Pass(NamedTuple):
    # What a chunk's pass computes besides the CE: constants of its compiled graph (one per run).
    temperature: float | None  # the KL term's; None without it
    transform: LogitTransform
    vocab: Callable | None  # ChunkTerm.vocab
    kernel: Callable | None = None  # ChunkTerm.kernel: this pass written by hand (CUDA), or None


class TargetLogits(NamedTuple):
    # The target's logits of a chunk's rows: `logits` [c, V], or with `rows` [c] a table that row i
    # reads at rows[i] (read by index inside the pass, so the rows are never copied out).
    logits: torch.Tensor
    rows: torch.Tensor | None = None


def chunk_math(logits, target: TargetLogits | None, labels, weights, scales: Scales | None, how: Pass):
    """One chunk's statistics over the vocabulary and, with `scales`, the gradient of its loss w.r.t.
    the raw logits, in one pass (compiled on CUDA: the `[c, V]` intermediates never exist in memory).

    z = t(logits) the drafter's transformed logits (an architecture's bias already in them), q = softmax(z): the CE sum(w * CE), the
    argmax hit, with `temperature` (not None) the KL sum(w * KL(p_T || q_T)) of the softened target
    and drafter distributions, with `vocab` (ChunkTerm.vocab) its per-row values and their weighted
    sum. The gradient: dz/dx * (s_ce (q - onehot) + s_kl (q_T - p_T) + s_vocab d values / d z), in
    the logits' dtype (what autograd would hand the lm_head matmul's backward)."""
    temperature, transform, vocab, _ = how
    z = scale_logits(logits.to(weights.dtype), *transform)  # the logits the target's distribution is made of
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp()
    s = e.sum(-1, keepdim=True)
    ce = (m + s.log() - z.gather(1, labels.unsqueeze(1))).squeeze(1)
    hit = (z.argmax(-1) == labels) & (weights > 0)
    q = e / s
    grad = scales is not None
    g = None
    if grad:
        onehot = torch.arange(z.shape[-1], device=z.device) == labels.unsqueeze(1)
        g = scales.ce.unsqueeze(1) * (q - onehot.to(q.dtype))
    tz = None
    if target is not None:
        t_logits = target.logits if target.rows is None else target.logits[target.rows]
        tz = scale_logits(t_logits.to(weights.dtype), *transform)
    kl_sum = None
    if temperature is not None:
        xt = z / temperature
        log_q = xt - xt.amax(-1, keepdim=True)
        log_q = log_q - log_q.exp().sum(-1, keepdim=True).log()
        log_p = torch.log_softmax(tz / temperature, dim=-1)
        p = log_p.exp()
        kl_sum = ((p * (log_p - log_q)).sum(-1) * weights).sum()
        if grad:
            g = g + scales.kl.unsqueeze(1) * (log_q.exp() - p)
    values = vocab_sum = None
    if vocab is not None:
        values, d_values = vocab(q, tz, grad)
        vocab_sum = (values * weights).sum()
        if grad:
            g = g + scales.vocab.unsqueeze(1) * d_values
    if grad:
        g = (g * logit_slope(z, *transform)).to(logits.dtype)
    return (ce * weights).sum(), hit, kl_sum, values, vocab_sum, g


def chunk_pass(device: torch.device, how: Pass):
    """The pass a chunk runs: on CUDA a term's own kernel where it applies (no KL term, no logit
    transform), else `chunk_math` compiled (once per process), where fusing it saves several passes
    over the logits; plain on CPU and meta (tests, no compiler needed)."""
    if device.type != "cuda":
        return chunk_math
    if how.kernel is not None and how.temperature is None and how.transform == IDENTITY:
        return how.kernel
    return compile_once(chunk_math, dynamic=False, fullgraph=True)


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
