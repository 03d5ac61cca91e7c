"""XPress's terms in the fused loss (speculators 0.9's objective, on the project's backbone loss):

    loss = L(base + bias_tf) + consistency_weight * mean_j L(base + bias_j) + base_anchor_weight * L(base)

L is the backbone's loss (the cross-entropy, and the KL term when the recipe sets one) with its decay
weights; bias_tf is the refiner's bias with the teacher's tokens as each slot's previous token; bias_j,
j = 1..J, with round j - 1's argmax there (round 0: the base logits' argmax, the Jacobi seed), exactly
the recurrence of the engines' Jacobi passes, no gradient through the argmax. The base term holds the
backbone's own logits to the data, so the seed of the passes does not decay while the refiner trains.

All of it is one pass of the fused loss: the teacher-forced bias is the loss's logit bias (folded into
the lm_head matmul), and the rounds are its `Rounds` (objective/loss_terms.py): each chunk's base and
round logits are its logits plus rank-r products, their gradients join its one logits gradient. The
rounds' features are computed inside the loop without autograd, so the loss hands back their
gradients and `JacobiTerm` applies them through the head (a term of value 0 whose gradient is theirs).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch

from dflash_ds.architectures.xpress.head import XPressHead, refined_bias
from dflash_ds.objective.drafter_loss import acceptance_proxy
from dflash_ds.objective.loss_terms import OutputTerm


class RoundFeatures:
    """A `Rounds.features`: the latents of rows [lo, hi) with round j - 1's argmax `previous` [n] (rows
    in the loss's order: B - 1 drafting slots a block) as the block's tokens."""

    def __init__(self, head: XPressHead, cache: torch.Tensor, anchors: torch.Tensor):
        self.head, self.cache, self.anchors = head, cache, anchors
        self.slots = cache.shape[1] - 1

    def __call__(self, round_index: int, previous: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        s = self.slots
        first, last = lo // s, (hi - 1) // s + 1  # the blocks the rows touch, whole
        tokens = previous[first * s:last * s].view(-1, s)
        z = refined_bias(self.head, self.cache[first:last], self.anchors[first:last], tokens)
        return z.reshape(-1, z.shape[-1])[lo - first * s:hi - first * s]


class JacobiTerm(OutputTerm):
    """After the chunk loop: the rounds' feature gradients through the head (value 0), and the logs:
    each pass's acceptance proxy (pass 0 the base draft, pass j after round j; `tf` the teacher-forced
    refined draft) and the refiner's bias size, the RMS over the vocabulary of the teacher-forced bias
    sqrt(f (w2^T w2) f^T / V) a row (no [rows, V] product)."""

    name = "xpress"
    weight = 1.0

    def __init__(self, rounds: RoundFeatures, features: torch.Tensor, weights: torch.Tensor):
        self.rounds, self.features, self.weights = rounds, features, weights

    def contribute(self, out, normaliser):
        head, s = self.rounds.head, self.rounds.slots
        w = self.weights.reshape(-1, s + 1)
        rows_w = w[:, 1:].reshape(-1).to(self.features.dtype)
        loss = self.features.new_zeros(())
        found = out.rounds
        if found.feature_grads is not None:
            for j in range(found.feature_grads.shape[0]):
                f = self.rounds(j + 1, found.argmax[j], 0, found.argmax.shape[1])
                loss = loss + ((f - f.detach()) * found.feature_grads[j].to(f.dtype)).sum()
        logs = {}
        with torch.no_grad():
            gram = head.w2.weight.T.float() @ head.w2.weight.float()
            f = self.features.detach().float()
            rms = ((f @ gram * f).sum(-1).clamp(min=0) / head.w2.weight.shape[0]).sqrt()
            logs["xpress_bias_rms_sum"] = (rows_w.float() * rms).sum()
            passes = [("tf", _with_anchor(out.correct, s))]
            passes += [(str(p), _with_anchor(c, s)) for p, c in enumerate(found.correct)]
            for label, correct in passes:
                total, count = acceptance_proxy(correct, w, reduce=False)
                logs[f"xpress_accept_pass{label}_sum"] = total
            logs["xpress_accept_blocks"] = count
        return loss, logs


def _with_anchor(correct: torch.Tensor, slots: int) -> torch.Tensor:
    """[rows] drafting slots' hits -> [blocks, B], slot 0 (the anchor, never a row) False."""
    c = correct.reshape(-1, slots)
    return torch.cat([torch.zeros_like(c[:, :1]), c], dim=1)


def log_record(sums: dict[str, float], weight: float) -> dict:
    """metrics.jsonl's XPress fields: the base and rounds' cross-entropies (weighted as "loss"), each pass's
    acceptance proxy (a list, pass 0 first, and the teacher-forced one apart), the bias's RMS."""
    rec = {"xpress_base_ce": sums["ce_base"] / weight, "xpress_bias_rms": sums["xpress_bias_rms_sum"] / weight}
    rounds = sorted(int(k[len("ce_round"):]) for k in sums if k.startswith("ce_round"))
    if rounds:
        rec["xpress_consistency_ce"] = sum(sums[f"ce_round{j}"] for j in rounds) / len(rounds) / weight
    blocks = max(sums["xpress_accept_blocks"], 1e-9)
    rec["xpress_accept_tf"] = sums["xpress_accept_passtf_sum"] / blocks
    per_pass = [sums[f"xpress_accept_pass{p}_sum"] / blocks for p in range(len(rounds) + 1)]
    rec["xpress_accept_pass"] = per_pass
    rec["xpress_accept_base"], rec["xpress_accept_last"] = per_pass[0], per_pass[-1]
    return rec
