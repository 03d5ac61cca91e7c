"""An architecture's own term inside the fused loss (model/loss.py).

A `ChunkTerm` says what an architecture adds to each chunk's logits and loss while that chunk's
logits exist: a low-rank bias of the logits (e.g. DSpark's Markov head) and a per-row value computed
over the vocabulary from the drafter's and the target's distributions (e.g. DSpark's ||q - p||_1).

The bias is `features @ table.T`: each row's features `[r]` (e.g. the Markov embedding of the token
before the one it predicts) times a `[V, r]` table. Written so, the loss folds it into the lm_head
matmul itself (`[states | features] @ [lm_head | table].T`, K = D + r): no `[c, V]` bias is ever
written or read, the sum is formed in the matmul's float32 accumulator, and the input gradient
`[d states | d features]` is one matmul too. The value and its gradient run inside the loss's one
pass over the chunk's vocabulary, beside the CE. Terms of a row's own (e.g. a head trained toward
that value) are not here: they read the per-row values the loss returns (`LinearCE.term_rows`).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class ChunkTerm(NamedTuple):
    """What an architecture adds inside the fused loss.

    `features` `[n, r]` (in the loss's row order, `blocks.slot_rows`) and `table` `[V, r]`: row i's
    raw logits get `table @ features[i]` added before the target's transform (the CE, the KL, the
    argmax hit and `vocab` all see the biased logits; the top-k candidates are the biased ones too).
    Both may require grad; the loss returns their gradients. Both None: no bias.

    `vocab(q, target_z, grad) -> (values [c], d values / d z [c, V] or None)`: a per-row value of
    the drafter's distribution q = softmax(z) (z its transformed, biased logits) and the target's
    transformed logits `target_z` of the same rows, with its gradient w.r.t. z when `grad`. It is
    traced into the loss's compiled pass, so it must be a module-level function of tensors (one
    compiled graph per function) and elementwise or row-reducing only. The loss adds
    `vocab_weight * sum(w * values)` and returns the values per row and their weighted sum.

    `kernel`: the same pass (model/vocab_pass.chunk_math's signature and results, with `vocab` this
    term's) written by hand for CUDA, e.g. one Triton kernel that sweeps each row three times where
    the compiled graph needs four; the loss uses it on CUDA without the KL term and logit transform,
    and the generic compiled pass is its reference (a GPU test holds them equal)."""

    features: torch.Tensor | None = None
    table: torch.Tensor | None = None
    vocab: Callable | None = None
    vocab_weight: float = 0.0
    kernel: Callable | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The term's tensors the loss differentiates (features then table), those that exist."""
        return tuple(t for t in (self.features, self.table) if t is not None)

    def check(self, rows: int, vocab_size: int) -> None:
        """Shapes against the loss's rows and vocabulary (ValueError naming the mismatch)."""
        if (self.features is None) != (self.table is None):
            raise ValueError("a ChunkTerm's bias needs both features [n, r] and a table [V, r]")
        if self.table is None:
            return
        f, t = self.features, self.table
        if f.dim() != 2 or t.dim() != 2 or f.shape[0] != rows or t.shape[0] != vocab_size or f.shape[1] != t.shape[1]:
            raise ValueError(f"a ChunkTerm's bias needs features [{rows}, r] and a table [{vocab_size}, r], got "
                             f"{tuple(f.shape)} and {tuple(t.shape)}")
