"""The loss: the target's frozen lm_head on the drafter's states and a sum of named terms (objective/loss_terms.py),
the gradients computed in the forward.

The lm_head of a 248K-token vocabulary is the drafter's most expensive matmul. The loss is a sum over
rows, so each chunk's gradient is known as soon as its logits are: the forward computes a chunk's
logits, one fused elementwise pass (`loss_terms.chunk_math`) gives every vocabulary term's values
(the CE, the KL, an architecture's per-row term), the argmax hit and the logits' gradient, and one
matmul turns that into the input gradient; the backward only scales the saved gradients by the
incoming one. Two lm_head matmuls per chunk, and only one chunk's logits ever exist: with the
target's rows, they are stacked under the drafter's in the same matmul, and a logit bias is folded
into it (objective/head_matmuls.py). An autograd version with checkpointed chunks would run the lm_head
three times per chunk and walk the logits several times in fp32 (docs/performance.md; the bench's
`--loss-impl autograd` runs one). After the chunk loop, the output terms (loss_terms.OutputTerm)
add theirs from what it returned.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.network.logit_transform import IDENTITY, LogitTransform
from dflash_ds.objective.blocks import slot_rows
from dflash_ds.objective.head_matmuls import ChunkRows, DenseHead
from dflash_ds.objective.loss_terms import (CrossEntropy, LogitBias, OutputTerm, Pass, Rounds, TargetRows, VocabTerm,
                                        chunk_pass)
from dflash_ds.objective.rounds import RoundLoop, RoundsOutput
from dflash_ds.objective.top_k import block_top_k


class LossOutput(NamedTuple):
    loss: torch.Tensor  # sum over terms of weight * scale * sum(w * values), / normaliser (+ the output terms')
    sums: dict  # name -> sum(w * values), detached, fp32 or wider: every term's, and the output terms' logs
    correct: torch.Tensor  # bool: argmax == label on rows of weight > 0 ([n] rows; [b, Q] for blocks)
    candidates: torch.Tensor | None  # int64 [n, top_k] each row's top-k token ids, best first; None without
    candidate_logits: torch.Tensor | None  # [n, top_k] their raw logits (before the transform), detached
    rows: dict  # name -> [n] a vocabulary term's values per row (those that keep them), detached
    expected: torch.Tensor | None = None
    """[n, D] q @ W per row of weight > 0 (an output term's reads_expected), detached; a row of weight 0 may
    read 0 (`_Call.derives_expected`)."""
    rounds: RoundsOutput | None = None
    """A logit bias's rounds (loss_terms.Rounds), or None without."""


class ChunkedLoss:
    """The loss over rows `[n, D]` through the lm_head `weight` `[V, D]` (the target's, frozen; a weight
    that requires grad gets its gradient too), a loop over chunks of rows in which every vocabulary
    term runs on the chunk's logits, then over the output terms.

    `terms`: the CrossEntropy first (always there: its sum is the logs' loss), then the others in
    the order their gradients are summed. `chunks`: at most this many chunks of ceil(n / chunks)
    rows, the last padded with zero-weight rows, so every chunk has one shape. `transform`: the
    target's logit scaling / softcap, applied before the softmax (the candidates' logits are the raw
    ones). `head`: the matmul strategy (objective/head_matmuls.py; default `DenseHead`). `first_slot`:
    for `blocks`, the first slot of every block that is a row (DrafterShape.first_draft_slot). The
    candidates (token ids and raw logits) returned per row are as many as the output terms read,
    taken from the chunks' logits."""

    def __init__(self, terms, weight: torch.Tensor, *, chunks: int, transform: LogitTransform = IDENTITY, head=None,
                 first_slot: int = 1):
        self.vocab_terms = tuple(t for t in terms if isinstance(t, VocabTerm))
        self.output_terms = tuple(t for t in terms if isinstance(t, OutputTerm))
        if len(self.vocab_terms) + len(self.output_terms) != len(terms):
            raise ValueError(f"a loss term is a VocabTerm or an OutputTerm, got {terms}")
        if not self.vocab_terms or not isinstance(self.vocab_terms[0], CrossEntropy):
            raise ValueError("the loss's first term must be the CrossEntropy")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"two loss terms share a name: {names}")
        for t in self.vocab_terms:
            if not t.weight >= 0 or not getattr(t, "temperature", 1.0) > 0:
                raise ValueError(f"the {t.name} term's weight must be >= 0 (and its temperature > 0), got {t}")
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.weight, self.chunks, self.transform, self.first_slot = weight, chunks, transform, first_slot
        self.head = head if head is not None else DenseHead()
        self.top_k = max((t.top_k for t in self.output_terms), default=0)
        self.expected = any(t.reads_expected for t in self.output_terms)
        self.reads_target = any(t.reads_target for t in self.vocab_terms)

    def rows(self, hidden, labels, weights, normaliser, *, bias: LogitBias | None = None,
             target: TargetRows | None = None) -> LossOutput:
        """The loss of rows: hidden `[n, D]` (the weight's dtype; logits in that dtype, the terms in
        fp32, or float64 for float64 inputs), labels `[n]` int, weights `[n]`, normaliser a
        float or a 0-dim tensor (a constant). Rows of weight 0 add exactly 0 whatever their label.
        `loss` is differentiable w.r.t. `hidden`, the weight when it requires grad, and the bias's
        tensors; with gradients enabled the forward also computes them (saved until backward, which
        only scales them). Static shapes and no host synchronisation, except one with
        `target.index` (each chunk's count of distinct target states). Differentiable once only."""
        n, weight = hidden.shape[0], self.weight
        if not 0 <= self.top_k <= weight.shape[0]:
            raise ValueError(f"top_k must be in [0, {weight.shape[0]}] (the vocabulary), got {self.top_k}")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"need hidden [n, D] and weight [V, D], got {tuple(hidden.shape)} and "
                             f"{tuple(weight.shape)}")
        if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
            raise ValueError(f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)} must be [{n}]")
        if self.reads_target and target is None:
            raise ValueError("a loss term reads the target's logits, but the target's states (TargetRows) are missing")
        target = _target_rows(target, hidden) if self.reads_target else None
        if bias is not None:
            bias.check(n, weight.shape[0])
        if isinstance(normaliser, torch.Tensor):
            normaliser = normaliser.detach()
        grad_on = torch.is_grad_enabled()
        grad_weight = grad_on and weight.requires_grad
        if grad_weight and not isinstance(self.head, DenseHead):
            raise ValueError("the loss's lm_head strategy computes the matmuls of a frozen weight, but the weight "
                             "requires grad")
        tensors = (bias.features, bias.table) if bias is not None else ()
        call = _Call(loss=self, normaliser=normaliser, target=target, grad_hidden=grad_on and hidden.requires_grad,
                     grad_weight=grad_weight, rounds=bias.rounds if bias is not None else None)
        if not (call.grad_hidden or grad_weight or (grad_on and any(t.requires_grad for t in tensors))):
            out, _ = call.run(hidden.detach(), weight.detach(), labels, weights,
                              bias_tensors=tuple(t.detach() for t in tensors))
        else:
            loss, correct, top, top_logits, sum_values, kept_values, expected, *rounds = _Fused.apply(
                hidden, weight, labels, weights, call, *tensors)
            sums = dict(zip(call.sum_names(), sum_values.unbind()))
            kept = dict(zip((t.name for t in self.vocab_terms if t.keep_rows), kept_values.unbind(1)))
            out = LossOutput(loss=loss, sums=sums, correct=correct, candidates=top, candidate_logits=top_logits,
                             rows=kept, expected=expected if self.expected else None,
                             rounds=RoundsOutput(*rounds) if call.rounds is not None else None)
        if not self.top_k:
            out = out._replace(candidates=None, candidate_logits=None)
        return self._output_terms(out, normaliser)

    def _output_terms(self, out: LossOutput, normaliser) -> LossOutput:
        loss, sums = out.loss, dict(out.sums)
        for term in self.output_terms:
            extra, logs = term.contribute(out, normaliser)
            loss = loss + extra
            sums.update(logs)
        return out._replace(loss=loss, sums=sums)

    def blocks(self, hidden, labels, weights, normaliser, *, bias: LogitBias | None = None,
               target: TargetRows | None = None) -> LossOutput:
        """The loss of a micro-batch's blocks: hidden `[b, N*B, D]`, labels and weights `[b, N, B]`
        (the block size is their last dimension), target states `[b, N*B, D]`, or with an index
        `[b, N*B]` a table `[P, D]`; a bias's features are already in row order. The slots before
        `first_slot` are skipped by shape (block_targets makes their weight 0): the drafting slots
        are copied into rows, in `blocks.slot_rows` order, the order of the candidates and kept rows.
        `correct` comes back `[b, Q]` (False on the skipped slots)."""
        b, n, block_size = labels.shape
        q, first = n * block_size, self.first_slot
        if hidden.shape[:2] != (b, q):
            raise ValueError(f"hidden {tuple(hidden.shape)} must be [{b}, {q}, D] for labels {tuple(labels.shape)}")
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if target is not None and target.index is not None:
            target = target._replace(index=slot_rows(target.index.view(b, q), block_size, first))
        elif target is not None:
            target = target._replace(states=slot_rows(target.states, block_size, first))
        out = self.rows(slot_rows(hidden, block_size, first), slot_rows(labels.view(b, q), block_size, first),
                        slot_rows(weights.view(b, q).to(acc_dtype), block_size, first), normaliser, bias=bias,
                        target=target)
        correct = out.correct.view(b * n, block_size - first)
        correct = torch.cat([correct.new_zeros(b * n, first), correct], dim=1).view(b, q)
        return out._replace(correct=correct)


def _target_rows(target: TargetRows, hidden) -> TargetRows:
    states, index = target.states, target.index
    if index is not None:
        if index.shape != hidden.shape[:1] or states.dim() != 2 or states.shape[1] != hidden.shape[1]:
            raise ValueError(f"the target's index {tuple(index.shape)} must be [{hidden.shape[0]}] into its states "
                             f"[P, {hidden.shape[1]}], got states {tuple(states.shape)}")
        index = index.detach().long()
    elif states.shape != hidden.shape:
        raise ValueError(f"the target's states {tuple(states.shape)} must match hidden {tuple(hidden.shape)}")
    # A constant of the loss (the target is frozen), in the drafter's dtype: autograd need not see it.
    return TargetRows(states.detach().to(hidden.dtype), index)


class _Call(NamedTuple):
    # One loss call's constants: the autograd Function's one non-tensor argument.
    loss: ChunkedLoss
    normaliser: float | torch.Tensor
    target: TargetRows | None
    grad_hidden: bool
    grad_weight: bool
    rounds: Rounds | None = None

    def sum_names(self) -> list[str]:
        """The names of the vocabulary terms' sums: each term's, then each round's (loss_terms.Rounds)."""
        names = [t.name for t in self.loss.vocab_terms]
        if self.rounds is None:
            return names
        return names + [f"{n}_{r}" for r in ["base"] + [f"round{j}" for j in range(1, self.rounds.count + 1)]
                        for n in names]

    def run(self, hidden, weight, labels, weights, *, bias_tensors=()):
        """The chunk loop: (the output of the vocabulary terms, whose loss is sum_t weight_t * loss_scale_t *
        sum(w * values_t) / normaliser, and its gradients (d hidden, d weight, the bias's), those the
        terms' directions give; None where not wanted)."""
        owner, normaliser = self.loss, self.normaliser
        terms, top_k = owner.vocab_terms, owner.top_k
        n = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        w = weights.to(acc_dtype)
        # Zero-weight rows add exactly 0; a fixed in-vocabulary label keeps their values finite and lets
        # their labels be anything (padding, out-of-vocabulary ids).
        lab = torch.where(w > 0, labels, torch.zeros_like(labels))
        bias = LogitBias(features=bias_tensors[0], table=bias_tensors[1]) if bias_tensors else None
        want_grad = self.grad_hidden or self.grad_weight or any(t.requires_grad for t in bias_tensors)
        if want_grad:
            scale = w / normaliser
            scales = tuple(scale * (t.weight * t.grad_scale) for t in terms)
        size = max(1, -(-n // owner.chunks))
        chunks = -(-n // size)
        totals = [hidden.new_zeros((), dtype=acc_dtype) for _ in terms]
        hits = []
        g_weight = torch.zeros_like(weight) if self.grad_weight else None
        # DFlash2's selector rescores these: taken here, from logits that exist anyway.
        top = hidden.new_empty(chunks * size, top_k, dtype=torch.long)
        top_logits = hidden.new_empty(chunks * size, top_k)
        kept = {t.name: hidden.new_empty(chunks * size, dtype=acc_dtype) for t in terms if t.keep_rows}
        # q @ W per row: the expected lm_head row under the drafter's distribution (LiLiCorr's soft value
        # differentiates its candidates' log-probs through it). Read off the input gradient where that is
        # the cross-entropy's alone (after the loop); else one more GEMM a chunk, from logits that exist anyway.
        derive = owner.expected and self.derives_expected()
        explicit = owner.expected and not derive
        expected = hidden.new_empty(chunks * size if explicit else 0, weight.shape[1])
        project = owner.head.matmuls(ChunkRows(hidden=hidden, weight=weight, bias=bias, target=self.target, size=size,
                                               chunks=chunks, grad_hidden=self.grad_hidden))
        how = Pass(terms, owner.transform)
        fn = chunk_pass(hidden.device, how)
        rounds = RoundLoop(self.rounds, bias, n=n, size=size, chunks=chunks, terms=len(terms),
                           grads=want_grad) if self.rounds is not None else None
        for i in range(chunks):
            lo, hi = i * size, min(n, (i + 1) * size)
            lc, wc = lab[lo:hi], w[lo:hi]
            sc = tuple(t[lo:hi] for t in scales) if want_grad else None
            pad = size - (hi - lo)
            if pad:
                lc, wc = F.pad(lc, (0, pad)), F.pad(wc, (0, pad))
                sc = tuple(F.pad(t, (0, pad)) for t in sc) if want_grad else None
            # The target is frozen, so its logits are a constant of the loss; only this chunk's exist.
            logits, t_logits = project.logits(i, lo, hi)
            if top_k:
                top_logits[i * size:(i + 1) * size], top[i * size:(i + 1) * size] = block_top_k(logits, top_k)
            if explicit:
                q = torch.softmax(owner.transform.apply(logits.to(acc_dtype)), dim=-1)
                expected[i * size:(i + 1) * size] = q.to(weight.dtype) @ weight  # [V, D] never copied
                del q
            sums, hit, values, g_logits = fn(logits, t_logits, lc, wc, scales=sc, how=how)
            g_biased = g_logits
            if rounds is not None:
                g_rest = rounds.chunk(project, logits, t_logits, (i, lo, hi), labels=lc, weights=wc, scales=sc, fn=fn, how=how)
                if g_rest is not None:
                    g_logits = g_logits + g_rest
            del logits, t_logits
            totals = [a + b for a, b in zip(totals, sums)]
            hits.append(hit)
            for term, v in zip(terms, values):
                if term.keep_rows:
                    kept[term.name][i * size:(i + 1) * size] = v
            if g_logits is not None:
                project.backward(g_logits, i, lo, hi, g_biased=g_biased if rounds is not None else None)
            if self.grad_weight:
                # Accumulates in the weight's dtype, as autograd would across chunks.
                g_weight.addmm_(g_logits.t(), project.rows(hidden, lo, hi))
            del g_logits
        correct = torch.cat(hits)[:n] if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
        if rounds is not None:
            totals = totals + rounds.totals
        g_hidden, g_bias = project.grads(n)
        if derive:
            expected = _expected_from_gradient(g_hidden, scales[0], weight, lab)
        weights_of = [t.weight * t.loss_scale for t in terms]
        if rounds is not None:  # each round's terms at the round's weight
            weights_of += [rounds.weight_of(k) * w_t for k in range(self.rounds.count + 1) for w_t in weights_of[:len(terms)]]
        loss = None
        for w_t, total in zip(weights_of, totals):
            loss = w_t * total if loss is None else loss + w_t * total
        out = LossOutput(loss=loss / normaliser, sums=dict(zip(self.sum_names(), totals)), correct=correct,
                         candidates=top[:n], candidate_logits=top_logits[:n], rows={k: v[:n] for k, v in kept.items()},
                         expected=expected[:n] if owner.expected else None,
                         rounds=rounds.output(n) if rounds is not None else None)
        return out, (g_hidden if self.grad_hidden else None, g_weight, g_bias)

    def derives_expected(self) -> bool:
        """Whether q @ W is read off the input gradient: with the cross-entropy the only term with a gradient,
        the untransformed logits and the dense lm_head, row t's gradient is s_t (q_t - e_y) @ W (s_t its
        scale), so q_t @ W = g_t / s_t + W[y_t] for every row of weight > 0, and the GEMM of a [rows, V]
        softmax with W (as large as the lm_head's forward) is saved. A row of weight 0 reads 0 there: the
        soft value's gradient on it is zero (LiLiCorr's lattice terms read only blocks whose every slot
        weighs > 0)."""
        owner = self.loss
        ce, others = owner.vocab_terms[0], owner.vocab_terms[1:]
        return (self.grad_hidden and owner.transform.identity and isinstance(owner.head, DenseHead)
                and ce.weight * ce.grad_scale > 0 and all(t.weight * t.grad_scale == 0 for t in others))


def _expected_from_gradient(g_hidden: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                            labels: torch.Tensor) -> torch.Tensor:
    """q @ W [n, D] from the cross-entropy's input gradient g = scale * (q - e_y) @ W [n, D] (`_Call.derives_expected`):
    g / scale + W[y] where scale > 0, else 0; in the weight's dtype, as the GEMM would give it."""
    on = scale > 0
    rows = g_hidden.to(scale.dtype) / torch.where(on, scale, 1.0)[:, None] + F.embedding(labels, weight).to(scale.dtype)
    return torch.where(on[:, None], rows, 0.0).to(weight.dtype)


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, call: _Call, *bias_tensors):
        out, (g_hidden, g_weight, g_bias) = call.run(hidden, weight, labels, weights, bias_tensors=bias_tensors)
        g_bias = g_bias[:len(bias_tensors)]
        ctx.save_for_backward(g_hidden, g_weight, *(g if g is not None else torch.zeros(0) for g in g_bias))
        ctx.bias_grads = tuple(g is not None for g in g_bias)
        # Tensors, not dicts, cross the Function; `rows` names them again.
        sum_values = torch.stack(list(out.sums.values()))
        kept = list(out.rows.values())
        kept_values = torch.stack(kept, dim=1) if kept else out.candidate_logits.new_zeros(out.correct.shape[0], 0)
        expected = out.expected if out.expected is not None else kept_values.new_zeros(0)
        rounds = () if out.rounds is None else (out.rounds.argmax, out.rounds.correct, out.rounds.feature_grads)
        ctx.mark_non_differentiable(out.correct, out.candidates, out.candidate_logits, sum_values, kept_values, expected,
                                    *rounds)
        return out.loss, out.correct, out.candidates, out.candidate_logits, sum_values, kept_values, expected, *rounds

    @staticmethod
    def backward(ctx, g_loss, *_non_differentiable):
        if torch.is_grad_enabled():
            # create_graph=True: the saved gradients are constants here, so a second derivative
            # would silently come out as zero.
            raise RuntimeError("the chunked loss cannot be differentiated twice (backward with create_graph=True)")
        # loss is linear in the saved gradients' scale: only the upstream factor is left to apply.
        g_hidden, g_weight, *g_bias = ctx.saved_tensors
        gh = g_hidden * g_loss if g_hidden is not None else None
        gw = g_weight * g_loss if g_weight is not None else None
        gb = tuple(g * g_loss if kept else None for g, kept in zip(g_bias, ctx.bias_grads))
        return gh, gw, None, None, None, *gb
