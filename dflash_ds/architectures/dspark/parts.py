"""DSpark's additions to the DFlash drafter: a Markov head, a confidence head, their walks and loss.

DSpark (DeepSeek's DeepSpec) keeps the DFlash backbone and changes three things:

1. The block is anchor-first: the block of anchor `a` is `[token at a, MASK x (B-1)]` at positions
   `a .. a+B-1` as in DFlash, but slot k predicts the token at `a + k + 1`, so every one of the B
   slots is a drafting slot (B drafts per cycle; the engines call this `sample_from_anchor`): its spec's
   `label_offset` 1, labelled by objective/blocks.py `anchor_first_targets`.
2. `MarkovHead`: the logits of a drafting slot get a low-rank bias from the token just before the
   one it predicts, `logits = base + markov_w2(markov_w1[prev])` (rank r). In training `prev` is the
   gold token (teacher forcing); when drafting, slot 0's `prev` is the anchor and slot k's the token
   chosen at slot k - 1 (`greedy_walk`): the block becomes semi-autoregressive.
3. `ConfidenceHead`: `sigmoid(proj([h ; markov_w1[prev]]))` per slot, trained (BCE) toward the
   acceptance probability `1 - TV(drafter, target)` of that slot; the engines use it to cut the
   verified prefix.

The loss of a slot is `ce * CE + l1 * ||q - p||_1 + confidence * BCE(c, 1 - TV)` with q the
drafter's distribution (Markov bias included), p the target's, TV = ||q - p||_1 / 2; its weight w is
the usual decay times mask. `l1_to_target` is the L1 term and its gradient in the fused loss's one
pass over the vocabulary (objective/loss_terms.py RowTerm); the CE is the loss's own, and the confidence BCE
is computed after it from each slot's 1 - TV (architectures/dspark/__init__.py).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.network.gather import take_rows

# DeepSpec initialises both heads through transformers' `_init_weights` (initializer_range 0.02).
_INIT_STD = 0.02


class MarkovHead(nn.Module):
    """The vanilla Markov head, the only type the engines load: `bias(prev) = markov_w2 @ markov_w1[prev]`.

    Parameters (the exported names): `markov_w1.weight` `[V, r]` (an embedding of the previous token)
    and `markov_w2.weight` `[V, r]` (a bias-free `r -> V` projection)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        if rank < 1:
            raise ValueError(f"the Markov head's rank must be >= 1, got {rank}")
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.markov_w1.weight.normal_(0.0, _INIT_STD)
        self.markov_w2.weight.normal_(0.0, _INIT_STD)

    def embed(self, prev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`markov_w1[prev]` `[..., r]`; the gradient is `take_rows`' deterministic segmented sum (the
        same few tokens are the predecessors of most slots)."""
        return take_rows(self.markov_w1.weight, prev, dtype)

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """`[..., r]` -> `[..., V]`, in the embedding's dtype."""
        return F.linear(embedding, self.markov_w2.weight.to(embedding.dtype))

    def forward(self, base_logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits: `base_logits` `[..., V]` plus the bias of the predecessors `prev` `[...]`."""
        return base_logits + self.bias(self.embed(prev, base_logits.dtype))


class Projection(nn.Module):
    """`nn.Linear(width, 1)` whose bias is the first element of an 8-element parameter.

    Why: ZeRO-2 copies the gradients back to back into one buffer, in the order they arrive, and the
    bias's arrives first in the backward; one element would shift every later gradient 2 bytes off the
    16-byte alignment that the copies, the flatten and the optimizer's vectorised loads need (its cost:
    docs/performance.md, "Figures behind the code"). The padding's gradient is always zero, so AdamW keeps it
    at zero. The state dict holds `weight` `[1, width]` and `bias` `[1]`: the names and shapes that
    the engines, the export and `init_from` read."""

    SLOTS = 8

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, width))
        self.bias_slots = nn.Parameter(torch.zeros(self.SLOTS))

    @property
    def bias(self) -> torch.Tensor:
        return self.bias_slots[:1]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, value in (("weight", self.weight), ("bias", self.bias)):
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *reports):
        # The stored `bias` [1] becomes `bias_slots` (zero padded); torch's own loader does the rest
        # (copy or assignment, shapes, missing and unexpected keys).
        missing_keys, _, error_msgs = reports  # torch's lists, filled in place
        key, slots = prefix + "bias", prefix + "bias_slots"
        wrong_shape = False
        if key in state_dict:
            state_dict = dict(state_dict)
            value = state_dict.pop(key)
            if tuple(value.shape) == (1,):
                state_dict[slots] = torch.cat([value, value.new_zeros(self.SLOTS - 1)])
            else:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is torch.Size([1]).")
                wrong_shape = True
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *reports)
        missing_keys[:] = [key if k == slots else k for k in missing_keys if not (wrong_shape and k == slots)]


class ConfidenceHead(nn.Module):
    """`proj([h ; markov_w1[prev]])`, a raw logit per slot (the engines apply the sigmoid).

    Parameters: `proj.weight` `[1, D + r]` (`[1, D]` without the Markov embedding) and `proj.bias` `[1]`.
    Computed in at least float32, as vLLM and SGLang load and run it."""

    def __init__(self, hidden_size: int, rank: int = 0):
        super().__init__()
        self.with_markov = rank > 0
        self.proj = Projection(hidden_size + rank)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.proj.weight.normal_(0.0, _INIT_STD)
        self.proj.bias_slots.zero_()

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor | None = None) -> torch.Tensor:
        """hidden `[..., D]` (the drafter's final-norm state of the slot), embedding `[..., r]` (the
        Markov embedding of its predecessor) -> `[...]`."""
        if self.with_markov and embedding is None:
            raise ValueError("this confidence head reads the Markov embedding of the previous token")
        return confidence_logits(hidden, embedding if self.with_markov else None, self.proj.weight, self.proj.bias)


def confidence_logits(hidden: torch.Tensor, embedding: torch.Tensor | None, weight: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    """`ConfidenceHead`'s computation on its parameters `weight` `[1, D (+ r)]`, `bias` `[1]`, in at
    least float32: `[..., D]` states (and `[..., r]` embeddings, or None) -> `[...]` raw logits."""
    work = torch.promote_types(hidden.dtype, torch.float32)
    features = hidden.to(work)
    if embedding is not None:
        features = torch.cat([features, embedding.to(work)], dim=-1)
    return F.linear(features, weight.to(work), bias.to(work)).squeeze(-1)


def shift_in(first: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The predecessors of a block's slots `[..., L]`: `first` `[...]` (the anchor) for slot 0, then
    `tokens[..., :-1]`: with the labels, teacher forcing; with the drafted tokens, the walk's."""
    return torch.cat([first.unsqueeze(-1).to(tokens.dtype), tokens[..., :-1]], dim=-1)


class MarkovWalk(NamedTuple):
    tokens: torch.Tensor  # [n, L] drafted tokens
    logits: torch.Tensor  # [n, L, V] the logits each was drawn from (base + Markov bias)
    predecessors: torch.Tensor  # [n, L] the token each slot's bias was conditioned on


@torch.no_grad()
def greedy_walk(head: MarkovHead, base_logits: torch.Tensor, first: torch.Tensor) -> MarkovWalk:
    """The engines' walk over the drafting slots' logits `[n, L, V]` of n blocks (greedy drafting,
    also under a sampling verifier): slot 0 is conditioned on `first` `[n]` (the anchor), slot k on
    the argmax chosen at slot k - 1."""
    prev = first.to(base_logits.device).long()
    tokens, logits, predecessors = [], [], []
    for slot in range(base_logits.shape[1]):
        step = head(base_logits[:, slot], prev)
        predecessors.append(prev)
        prev = step.argmax(-1)
        tokens.append(prev)
        logits.append(step)
    return MarkovWalk(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(predecessors, 1))


def l1_to_target(q: torch.Tensor, target_z: torch.Tensor, grad: bool):
    """DSpark's L1 term for the fused loss (a RowTerm's `values`): per row ||q - p||_1 (twice the
    total variation) of the drafter's distribution q `[c, V]` and the target's p = softmax(target_z),
    and its gradient w.r.t. the drafter's logits: with s = sign(q - p), d/dz ||q - p||_1 =
    q * (s - <s, q>) (the softmax's Jacobian applied to s)."""
    gap = q - torch.softmax(target_z, dim=-1)
    l1 = gap.abs().sum(-1)
    if not grad:
        return l1, None
    s = torch.sign(gap)
    return l1, q * (s - (s * q).sum(-1, keepdim=True))


def expected_tau(accept: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpec's `tau_probabilistic` as (sum, count) over blocks: per block `[..., B]`,
    `1 + sum_k prod_{j <= k} accept_j` over the supervised slots (weight > 0; the supervised slots
    are a prefix), counted for blocks with at least one supervised slot."""
    ok = weights > 0
    survive = torch.cumprod(accept * ok, dim=-1)
    has = ok.any(-1)
    return ((survive.sum(-1) + 1.0) * has).sum(), has.sum()


def confident_prefix(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Drafts to verify per block `[...]` from `[..., L]`: the slots before the first whose own
    sigmoid is below `threshold` (llama.cpp's `--spec-draft-p-min`, DeepSpec's confidence_threshold;
    per slot, not cumulative); threshold 0 keeps all L."""
    below = torch.sigmoid(confidence_logits.float()) < threshold
    return (~below).to(torch.int32).cumprod(-1).sum(-1)


class Calibration(NamedTuple):
    """Weighted sums (add them across chunks and ranks, then divide by `weight`)."""

    weight: torch.Tensor  # sum(w)
    abs_error: torch.Tensor  # sum(w * |pred - target|)
    bias: torch.Tensor  # sum(w * (pred - target))
    bin_weight: torch.Tensor  # [L, bins] sum(w) of predictions in each bin, per slot
    bin_pred: torch.Tensor  # [L, bins] sum(w * pred)
    bin_target: torch.Tensor  # [L, bins] sum(w * target)


def calibration(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, bins: int = 20) -> Calibration:
    """Calibration of probabilities `pred` `[..., L]` against `target` `[..., L]` (1 - TV in training;
    0/1 accepted-prefix outcomes when serving), weights `[..., L]`:
    mean absolute error, bias, and per-slot reliability bins of equal width on [0, 1] (DeepSpec
    reports 20), in float64."""
    length = pred.shape[-1]
    p = pred.detach().reshape(-1, length).double()
    t = target.detach().reshape(-1, length).double()
    w = weights.detach().reshape(-1, length).double()
    at = (p * bins).long().clamp(0, bins - 1) + torch.arange(length, device=p.device) * bins

    def binned(values):
        return torch.zeros(length * bins, dtype=torch.float64, device=p.device).index_add_(
            0, at.reshape(-1), values.reshape(-1)).view(length, bins)

    return Calibration(w.sum(), (w * (p - t).abs()).sum(), (w * (p - t)).sum(), binned(w), binned(w * p),
                       binned(w * t))
