"""The rounds of a logit bias inside the loss's chunk loop (objective/loss_terms.py `Rounds`: XPress's Jacobi
rounds): from each chunk's logits, which exist anyway, the unbiased logits (round 0) and every later round's,
each round's features read from the argmax of the round before it, each round's vocabulary terms and their
gradient. No lm_head matmul is added: a round's logits are the chunk's plus a rank-r product, and its
gradient joins the chunk's one logits gradient, so the one input-gradient matmul carries every round
(objective/head_matmuls.py: the bias's own gradients take only the part of the logits it reached).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.objective.loss_terms import LogitBias, Rounds


class RoundsOutput(NamedTuple):
    """What a logit bias's rounds gave: each round's argmax and hit per row (round 0: the unbiased
    logits), and the loss's gradient w.r.t. each later round's features, which only the caller can take
    further (it computed them; None where the caller's autograd already holds them)."""

    argmax: torch.Tensor  # int64 [count + 1, n]
    correct: torch.Tensor  # bool [count + 1, n]: argmax == label on rows of weight > 0
    feature_grads: torch.Tensor | None  # [count, n, r], detached


class RoundLoop:
    """One loss call's rounds: its buffers, a chunk's rounds (`chunk`) and what they add up to."""

    def __init__(self, rounds: Rounds, bias: LogitBias, *, n: int, size: int, chunks: int, terms: int, grads: bool):
        if rounds.count < 0 or not (rounds.weight >= 0 and rounds.base_weight >= 0):
            raise ValueError(f"rounds need a count >= 0 and weights >= 0, got {rounds}")
        self.rounds, self.features, self.table, self.n, self.size = rounds, bias.features, bias.table, n, size
        rows, r = chunks * size, bias.table.shape[1]
        # Rows past n stay 0: an in-vocabulary id whatever the features read there.
        self.argmax = torch.zeros(rounds.count + 1, rows, dtype=torch.long, device=bias.table.device)
        self.correct = torch.zeros(rounds.count + 1, rows, dtype=torch.bool, device=bias.table.device)
        self.grads = bias.features.new_zeros(rounds.count, rows, r) if grads else None
        acc = torch.promote_types(bias.features.dtype, torch.float32)
        self.totals = [bias.features.new_zeros((), dtype=acc) for _ in range((rounds.count + 1) * terms)]
        self.terms = terms

    def weight_of(self, k: int) -> float:
        """Round k's weight (0: the unbiased logits)."""
        return self.rounds.base_weight if k == 0 else self.rounds.weight

    def chunk(self, project, logits, t_logits, at: tuple[int, int, int], *, labels, weights, scales, fn, how):
        """Every round of chunk `at` = (i, lo, hi) from its logits `logits` [size, V] (the bias folded
        in): the rounds' sums, hits and argmax recorded, their features' and the table's gradients
        added; returns the sum of the rounds' logits gradients (None without gradients)."""
        i, lo, hi = at
        table = self.table.detach().to(logits.dtype)
        pad = self.size - (hi - lo)
        own = F.pad(self.features.detach()[lo:hi], (0, 0, 0, pad)).to(logits.dtype)
        base = torch.addmm(logits, own, table.t(), alpha=-1.0)  # the chunk's logits without its bias
        g_rest, raw = None, base
        for k in range(self.rounds.count + 1):
            if k:
                f = self.rounds.features(k, self.argmax[k - 1], lo, hi).detach().to(logits.dtype)
                f = F.pad(f, (0, 0, 0, pad))
                raw = torch.addmm(base, f, table.t())
            w_k = self.weight_of(k)
            sc = tuple(s * w_k for s in scales) if scales is not None else None
            sums, hit, _, g = fn(raw, t_logits, labels, weights, scales=sc, how=how)
            for j, total in enumerate(sums):
                self.totals[k * self.terms + j] = self.totals[k * self.terms + j] + total
            self.correct[k, lo:hi] = hit[:hi - lo]
            self.argmax[k, lo:hi] = raw[:hi - lo].argmax(-1)
            if g is None:
                continue
            g_rest = g if g_rest is None else g_rest + g
            if k:
                self.grads[k - 1, lo:hi] = torch.mm(g[:hi - lo], table).to(self.grads.dtype)
                project.add_table_grad(g, f)
        return g_rest

    def output(self, n: int) -> RoundsOutput:
        grads = self.grads[:, :n] if self.grads is not None else None
        return RoundsOutput(self.argmax[:, :n], self.correct[:, :n], grads)
