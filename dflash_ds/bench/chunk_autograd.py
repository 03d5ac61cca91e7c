"""The loss the way torchtitan's chunked loss computes it (torchtitan/components/loss.py, ChunkedLossWrapper):
autograd over each chunk, backward per chunk, for the bench to time against objective/loss.py's
hand-written gradients (`python -m dflash_ds.bench --role drafter --loss-impl autograd`).

Each chunk of rows is cut from the graph (a detached leaf), its lm_head matmul, logit transform and
terms are written plainly (torch's cross-entropy, log_softmax for the KL, an architecture's row term by
its value function) and `backward()` runs right away, so only one chunk's logits and autograd
intermediates exist at a time; the chunk's input gradient is copied into one float32 buffer. After the
loop one autograd node hands that buffer (times the incoming gradient) to the drafter. Against the
fused loss: the same two lm_head matmuls per chunk, but autograd keeps the fp32 logits and the
softmax of each term for its backward, and walks them again there. The target's logits are one
matmul per chunk of their own, over every row (no distinct positions), and a logit bias its own
matmul. Equal in value to ChunkedLoss to float summation order (tests/test_bench.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_ds.objective.loss import ChunkedLoss, LossOutput
from dflash_ds.objective.rounds import RoundsOutput
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, RowTerm
from dflash_ds.objective.top_k import block_top_k


class PerChunkBackwardLoss(ChunkedLoss):
    """ChunkedLoss's interface; `rows` by autograd per chunk (module docstring). The lm_head is frozen
    and multiplied with `torch.mm` (no FP8 strategy)."""

    def rows(self, hidden, labels, weights, normaliser, *, bias=None, target=None) -> LossOutput:
        weight = self.weight.detach()
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise ValueError("the per-chunk autograd loss trains no lm_head: freeze the weight")
        if self.reads_target and target is None:
            raise ValueError("a loss term reads the target's logits, but the target's states (TargetRows) are missing")
        n, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        w = weights.to(acc)
        lab = torch.where(w > 0, labels, torch.zeros_like(labels))
        if isinstance(normaliser, torch.Tensor):
            normaliser = normaliser.detach()
        leaves = (hidden, bias.features, bias.table) if bias is not None else (hidden,)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
        # The bias's table is one leaf for every chunk (its .grad accumulates over them); its features,
        # like the states, are cut per chunk.
        table = bias.table.detach().requires_grad_(bias.table.requires_grad) if bias is not None else None
        g_hidden = torch.zeros(n, hidden.shape[1], dtype=acc, device=hidden.device) \
            if grad and hidden.requires_grad else None
        g_features = torch.zeros(n, table.shape[1], dtype=acc, device=hidden.device) \
            if grad and bias is not None and bias.features.requires_grad else None
        size = max(1, -(-n // self.chunks))
        totals = {t.name: hidden.new_zeros((), dtype=acc) for t in self.vocab_terms}
        kept = {t.name: [] for t in self.vocab_terms if t.keep_rows}
        loss_value, hits, tops, expected = hidden.new_zeros((), dtype=acc), [], [], []
        rounds = _PlainRounds(bias.rounds, n, self.vocab_terms, acc=acc, grad=grad, device=hidden.device) \
            if bias is not None and bias.rounds is not None else None
        for lo in range(0, n, size):
            hi = min(n, lo + size)
            h = hidden[lo:hi].detach().requires_grad_(g_hidden is not None)
            base = h @ weight.T
            logits, f = base, None
            if bias is not None:
                f = bias.features[lo:hi].detach().requires_grad_(g_features is not None)
                logits = base + f.to(logits.dtype) @ table.to(logits.dtype).T
            if self.top_k:
                tops.append(block_top_k(logits.detach(), self.top_k))
            z = self.transform.apply(logits.to(acc))
            if self.expected:  # q @ W per row (an output term's reads_expected)
                expected.append(z.detach().softmax(-1).to(weight.dtype) @ weight)
            tz = None
            if self.reads_target:
                states = target.states if target.index is None else target.states[target.index]
                with torch.no_grad():
                    tz = self.transform.apply((states[lo:hi].to(hidden.dtype) @ weight.T).to(acc))
            hits.append((z.detach().argmax(-1) == lab[lo:hi]) & (w[lo:hi] > 0))
            chunk_loss = None
            for term in self.vocab_terms:
                values = _values(term, z, tz, lab[lo:hi])
                part = (values * w[lo:hi]).sum()
                totals[term.name] = totals[term.name] + part.detach()
                if term.keep_rows:
                    kept[term.name].append(values.detach())
                part = (term.weight * term.loss_scale) * part
                chunk_loss = part if chunk_loss is None else chunk_loss + part
            if rounds is not None:
                chunk_loss = chunk_loss + rounds.chunk(self, base, table, tz=tz, at=(lo, hi), labels=lab[lo:hi],
                                                       w=w[lo:hi], totals=totals)
            chunk_loss = chunk_loss / normaliser
            loss_value = loss_value + chunk_loss.detach()
            if grad:
                chunk_loss.backward()
                if g_hidden is not None:
                    g_hidden[lo:hi] = h.grad
                if g_features is not None:
                    g_features[lo:hi] = f.grad
                if rounds is not None:
                    rounds.take_grads()
        grads = (g_hidden, g_features, table.grad if table is not None else None)
        loss = _HandBack.apply(loss_value, grads, *leaves) if grad else loss_value
        correct = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
        out = LossOutput(loss=loss, sums=totals, correct=correct,
                         candidates=torch.cat([t[1] for t in tops]) if tops else None,
                         candidate_logits=torch.cat([t[0] for t in tops]) if tops else None,
                         rows={k: torch.cat(v) for k, v in kept.items()},
                         expected=torch.cat(expected) if expected else None,
                         rounds=rounds.output() if rounds is not None else None)
        return self._output_terms(out, normaliser)


class _PlainRounds:
    """A logit bias's rounds (objective/loss_terms.py `Rounds`) written plainly inside the per-chunk loop:
    round 0 the unbiased logits, round k >= 1 those plus `features(k, round k - 1's argmax) @ table.T`,
    each round's vocabulary terms at its weight, summed as `<term>_base` / `<term>_round<k>`; each later
    round's features are an autograd leaf, so its gradient (the loss's RoundsOutput.feature_grads) is
    theirs after the chunk's backward."""

    def __init__(self, spec, n: int, terms, *, acc, grad: bool, device):
        self.spec, self.terms = spec, terms
        self.argmax = torch.zeros(spec.count + 1, n, dtype=torch.long, device=device)
        self.correct = torch.zeros(spec.count + 1, n, dtype=torch.bool, device=device)
        self.grads = [] if grad else None
        self.leaves: list[torch.Tensor] = []
        self.acc = acc

    def chunk(self, owner, base, table, *, tz, at, labels, w, totals):
        """Rows [lo, hi)'s rounds from their unbiased logits `base`: their weighted loss (not yet over
        the normaliser), their sums added to `totals`, argmax and hits recorded."""
        lo, hi = at
        loss, self.leaves = None, []
        for k in range(self.spec.count + 1):
            raw = base
            if k:
                f = self.spec.features(k, self.argmax[k - 1], lo, hi).detach()
                f.requires_grad_(self.grads is not None)
                self.leaves.append(f)
                raw = base + f.to(base.dtype) @ table.to(base.dtype).T
            z = owner.transform.apply(raw.to(self.acc))
            w_k = self.spec.base_weight if k == 0 else self.spec.weight
            name = "base" if k == 0 else f"round{k}"
            for term in self.terms:
                part = (_values(term, z, tz, labels) * w).sum()
                key = f"{term.name}_{name}"
                totals[key] = totals.get(key, 0.0) + part.detach()
                part = (w_k * term.weight * term.loss_scale) * part
                loss = part if loss is None else loss + part
            self.argmax[k, lo:hi] = raw.detach().argmax(-1)
            self.correct[k, lo:hi] = (self.argmax[k, lo:hi] == labels) & (w > 0)
        return loss

    def take_grads(self) -> None:
        """After the chunk's backward: its later rounds' feature gradients."""
        self.grads.append(torch.stack([f.grad for f in self.leaves]) if self.leaves else None)

    def output(self) -> RoundsOutput:
        grads = None
        if self.grads and self.grads[0] is not None:
            grads = torch.cat(self.grads, dim=1).detach()
        return RoundsOutput(self.argmax, self.correct, grads)


def _values(term, z, tz, labels):
    """A vocabulary term's per-row values written plainly, for autograd to differentiate."""
    if isinstance(term, CrossEntropy):
        return F.cross_entropy(z, labels, reduction="none")
    if isinstance(term, Distillation):
        log_q, log_p = F.log_softmax(z / term.temperature, -1), F.log_softmax(tz / term.temperature, -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if isinstance(term, RowTerm):
        return term.values(z.softmax(-1), tz, False)[0]
    raise ValueError(f"the per-chunk autograd loss has no plain form of the {term.name} term")


class _HandBack(torch.autograd.Function):
    """The loss's value, whose backward hands the gradients gathered chunk by chunk to the leaves
    (hidden, then the bias's features and table), times the incoming gradient."""

    @staticmethod
    def forward(ctx, loss_value, grads, *leaves):
        ctx.grads = grads
        ctx.dtypes = tuple(t.dtype for t in leaves)
        return loss_value.clone()

    @staticmethod
    def backward(ctx, g_loss):
        out = tuple(g * g_loss if g is not None else None for g in ctx.grads)
        return None, None, *(g.to(d) if g is not None else None for g, d in zip(out, ctx.dtypes))
