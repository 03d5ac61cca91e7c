"""DFlash2's two additions to the DFlash drafter (docs/algorithm.md section 8).

1. `BlockConv`: a grouped dynamic depthwise convolution along each draft block, applied before and
   after the attention and the MLP sublayer of every layer. Tap t of output slot k reads input slot
   k - t of the SAME block (zero before slot 0; slot 0 is the anchor token, so slot 1 mixes with the
   anchor); it never reaches across a block boundary and never touches the context features. The
   weight of tap t on channel c is `base_kernel[side, t, c] + dynamic[t, c // group_size]`, the
   dynamic part one projection of the (normalised) sublayer input at the output slot; that one
   projection gives both the input-side (side 0) and the output-side (side 1) coefficients. With
   the identity base kernel (tap 0 = 1, others 0) and a zero projection it is an exact no-op.
2. `CandidateSelector`: the unary logits (target lm_head on the drafter's final states) keep their
   top-k candidates per slot; a candidate c at a slot whose predecessor token is p scores
   `unary[c] + <predecessor_codebook[p] * hidden_projection(h), successor_codebook[c]>` (rank r),
   and the path is walked greedily from the anchor: each slot takes its best candidate given the
   token chosen at the slot before (`greedy_path`). A zero successor codebook (the initial value)
   leaves the unary argmax path unchanged.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.network.gather import take_rows
from dflash_ds.network.logit_transform import IDENTITY, LogitTransform

_INIT_STD = 0.02


def block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """One side of the convolution: x `[b, Q, D]` (Q = N blocks x block_size, blocks contiguous),
    dynamic `[b, Q, K, G]` (G = D / group_size groups), base `[K, D]` -> `[b, Q, D]`.

    out[slot k] = sum_t (base[t] + dynamic[k, t] per group) * x[slot k - t], x of slots before the
    block's slot 0 taken as zero.
    """
    b, q, d = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    assert q % block_size == 0 and d % groups == 0 and base.shape == (taps, d)
    xs = x.view(b, q // block_size, block_size, groups, d // groups)
    coeff = base.to(x.dtype).view(taps, groups, d // groups) + dynamic.view(
        b, q // block_size, block_size, taps, groups, 1)
    out = coeff[..., 0, :, :] * xs
    for tap in range(1, taps):
        # Shift along the block's own slot axis: slot k reads slot k - tap, zeros enter at slot 0.
        shifted = F.pad(xs[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        out = out + coeff[..., tap, :, :] * shifted
    return out.view(b, q, d)


class BlockConv(nn.Module):
    """The convolution wrapping one sublayer: `prepare` convolves its input and returns the
    output-side coefficients, `finish` convolves its output with them."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"kernel_size ({kernel_size}) must be >= 1 and group_size ({group_size}) must divide "
                             f"the hidden size {hidden_size}")
        self.kernel_size, self.groups, self.block_size = kernel_size, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The exact no-op: identity base kernel on both sides, zero dynamic projection."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return block_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.block_size), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return block_conv(x, dynamic, self.base_kernel[1], self.block_size)


def conv_activation_bytes(hidden_size: int, num_layers: int, queries: int) -> int:
    """Bytes the two `BlockConv`s of each of `num_layers` layers keep for the backward over `queries` block
    queries: a wrapper puts a [Q, D] state between the norm and its sublayer (the sublayer's input, read
    by its projections' backward) and keeps the sublayer's output before the output-side convolution
    (its coefficients' gradient reads it), two bf16 [Q, D] a wrapper; the shifted copies are recomputed
    inside the compiled layer."""
    return 2 * 2 * queries * hidden_size * 2 * num_layers


class CandidateSelector(nn.Module):
    """Low-rank predecessor-conditioned rescoring of the unary top-k (module docstring, item 2).

    The codebooks are plain parameters (`candidate_selector.predecessor_codebook`, not
    `...codebook.weight`): those are the exported names the engines load.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"rank ({rank}) must be >= 1 and top_k ({top_k}) in [1, {vocab_size}] (the vocabulary)")
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Projection and predecessor codebook N(0, 0.02); successor codebook zero, so a fresh
        selector adds nothing to the unary scores (and still receives a gradient)."""
        self.hidden_projection.weight.normal_(0.0, _INIT_STD)
        self.predecessor_codebook.normal_(0.0, _INIT_STD)
        self.successor_codebook.zero_()

    def transition(self, projected: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """projected `[n, r]` (hidden_projection of the slot's state), predecessors `[n]`, candidates
        `[n, k]` -> pair scores `[n, k]`, in at least fp32. Gathers k + 1 codebook rows per slot
        (never a `[n, V, r]` tensor) through `take_rows`, whose gradient stays fast when a few tokens
        are the candidates of most slots. The k dot products are a multiply and a sum over r, not a
        batched matmul: a `[k, r] x [r, 1]` product per slot ran on badly aligned GEMM kernels."""
        work = torch.promote_types(projected.dtype, torch.float32)
        query = take_rows(self.predecessor_codebook, predecessors, work) * projected.to(work)
        keys = take_rows(self.successor_codebook, candidates, work)
        return (keys * query.unsqueeze(1)).sum(-1)


def unary_top_k(hidden: torch.Tensor, lm_head: torch.Tensor, top_k: int, *, chunk: int = 1024):
    """Top-k unary logits (at least fp32) and their token ids of states `[..., D]`, in row chunks so only
    `[chunk, V]` logits ever exist. Sorted best first, as the engines' top-k."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head.to(device=flat.device, dtype=flat.dtype)
    work = torch.promote_types(flat.dtype, torch.float32)
    values = torch.empty(flat.shape[0], top_k, dtype=work, device=flat.device)
    ids = torch.empty(flat.shape[0], top_k, dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        v, j = torch.topk(flat[i:i + chunk] @ w.T, top_k, dim=-1)
        values[i:i + chunk], ids[i:i + chunk] = v.to(work), j
    shape = hidden.shape[:-1] + (top_k,)
    return values.view(shape), ids.view(shape)


@torch.no_grad()
def greedy_path(selector: CandidateSelector, hidden: torch.Tensor, lm_head: torch.Tensor,
                anchors: torch.Tensor, *, transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """The drafted tokens `[n, L]` of blocks whose drafting slots have final states `[n, L, D]`
    (L = B - 1), each block following the token `anchors[n]`: the walk the engines run at
    temperature 0 (slot 1's predecessor is the anchor, slot k's the token chosen at slot k - 1).
    The unary scores are the target-transformed logits (`transform`, network/logit_transform.py)."""
    unary, candidates = unary_top_k(hidden, lm_head, selector.top_k)
    unary = transform.apply(unary)
    projected = selector.hidden_projection(hidden)
    predecessor = anchors.to(candidates.device).long()
    path = []
    for slot in range(hidden.shape[1]):
        scores = unary[:, slot] + selector.transition(projected[:, slot], predecessor, candidates[:, slot])
        pick = scores.argmax(-1, keepdim=True)
        predecessor = candidates[:, slot].gather(1, pick).squeeze(1)
        path.append(predecessor)
    return torch.stack(path, dim=1)


class SelectorTerm(NamedTuple):
    """The selector loss of one micro-batch (recipe keys objective.dflash2.selector_*)."""

    alpha: float
    """This step's weight of the term (after warm-up and ramp)."""
    inject_gold: bool = False
    """A gold token outside the unary top-k replaces the weakest candidate (speculators); False: such
    slots add no selector loss (SpecForge's strict top-k)."""
    detach: bool = False
    """The term trains the selector's own parameters only (no gradient into the drafter's states)."""
    chunk_bytes: int = 256 << 20
    """Only when the candidates' logits are not given (`SelectorRows.unary` None): they are computed
    in chunks of as many rows as keep a chunk's gathered `[rows, k, D]` lm_head rows under this size."""


class SelectorRows(NamedTuple):
    """Flat rows of the supervised slots: states `[n, D]`, unary candidates `[n, k]` (sorted best
    first), gold labels `[n]`, teacher-forced predecessors `[n]` (the gold token one slot before;
    the anchor for slot 1), loss weights `[n]`, and the candidates' raw lm_head logits `[n, k]` (before
    the target's transform) when the base loss kept them (`LossOutput.candidate_logits`; None: computed
    here from the lm_head rows)."""

    hidden: torch.Tensor
    candidates: torch.Tensor
    labels: torch.Tensor
    predecessors: torch.Tensor
    weights: torch.Tensor
    unary: torch.Tensor | None = None


class SelectorStats(NamedTuple):
    loss_sum: torch.Tensor  # sum(w * selector CE), differentiable
    covered: torch.Tensor  # sum(w) over rows whose gold is among the unary top-k (detached)
    correct: torch.Tensor  # sum(w) over covered rows whose best rescored candidate is the gold (detached)


class _CandidateLogits(torch.autograd.Function):
    """The unary scores `unary[n, j] = t(<lm_head[candidates[n, j]], hidden[n]>)` (t the target's logit
    transform), given the raw logits (the base loss computed them with the full-vocabulary logits):
    the forward only transforms them, the backward sends `sum_j grad[n, j] * t'[n, j] *
    lm_head[candidates[n, j]]` to the states through one `embedding_bag` (a gather and weighted sum
    per row: no `[n, k, D]` tensor, no recompute). `lm_head` is frozen: it gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, lm_head, candidates, raw, transform):
        z = transform.apply(raw)
        slope = transform.slope(z)
        ctx.save_for_backward(lm_head, candidates, slope if torch.is_tensor(slope) else None)
        ctx.hidden_dtype, ctx.slope = hidden.dtype, None if torch.is_tensor(slope) else slope
        return z if z is not raw else raw.clone()

    @staticmethod
    def backward(ctx, grad):
        lm_head, candidates, slope = ctx.saved_tensors
        grad = grad * (slope if slope is not None else ctx.slope)
        g = F.embedding_bag(candidates, lm_head, per_sample_weights=grad.to(lm_head.dtype), mode="sum")
        return g.to(ctx.hidden_dtype), None, None, None, None


@torch.no_grad()
def candidate_logits(hidden: torch.Tensor, lm_head: torch.Tensor, candidates: torch.Tensor,
                     chunk_bytes: int = 256 << 20) -> torch.Tensor:
    """`[n, k]` logits of the candidates `[n, k]` of states `[n, D]`, in at least fp32, from the k
    lm_head rows of each state, in chunks of at most `chunk_bytes` of gathered rows."""
    work = torch.promote_types(hidden.dtype, torch.float32)
    per_row = candidates.shape[1] * hidden.shape[1] * hidden.element_size()
    size = max(1, chunk_bytes // max(1, per_row))
    out = []
    for lo in range(0, hidden.shape[0], size):
        rows = lm_head[candidates[lo:lo + size]].to(work)
        out.append((rows * hidden[lo:lo + size].to(work).unsqueeze(1)).sum(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, candidates.shape[1], dtype=work)


def selector_loss(selector: CandidateSelector, lm_head: torch.Tensor, rows: SelectorRows,
                  term: SelectorTerm, *, transform: LogitTransform = IDENTITY) -> SelectorStats:
    """sum over rows of w * CE(selector scores over the k candidates, the gold's index).

    The candidates are those of the base loss (no second lm_head pass), and so, when
    `rows.unary` is given, are their unary logits. A row whose gold is not among them adds
    nothing (`term.inject_gold` False) or takes the place of the weakest one (its logit computed
    from its lm_head row). The whole micro-batch in one pass: besides the states, it keeps
    `[n, k, r]` codebook rows (r = selector rank) for the backward, 235 MB in fp32 at 14,336
    slots, k 16, r 256. `lm_head` is frozen (no gradient). The unary scores are the candidates'
    logits through the target's `transform` (network/logit_transform.py), as the engines score them.
    """
    hidden = rows.hidden.detach() if term.detach else rows.hidden
    head = lm_head.detach()
    work = torch.promote_types(hidden.dtype, torch.float32)
    candidates, labels = rows.candidates, rows.labels
    unary = rows.unary if rows.unary is not None else candidate_logits(hidden.detach(), head, candidates,
                                                                      term.chunk_bytes)
    gold_at = candidates == labels.unsqueeze(1)
    covered = gold_at.any(1)
    if term.inject_gold:
        # The weakest unary candidate (last, the candidates being sorted) makes room for the gold;
        # its logit rounded like the others' (the base loss's logits are in the lm_head's dtype).
        with torch.no_grad():
            gold = (head[labels].to(work) * hidden.detach().to(work)).sum(-1).to(unary.dtype)
        candidates = torch.cat([candidates[:, :-1], torch.where(covered, candidates[:, -1], labels).unsqueeze(1)], 1)
        unary = torch.cat([unary[:, :-1], torch.where(covered, unary[:, -1], gold).unsqueeze(1)], 1)
        gold_at = candidates == labels.unsqueeze(1)
    unary = _CandidateLogits.apply(hidden, head, candidates, unary.detach().to(work), transform)
    scores = unary + selector.transition(selector.hidden_projection(hidden), rows.predecessors, candidates)
    target = gold_at.to(torch.int64).argmax(1)
    ce = torch.logsumexp(scores, dim=1) - scores.gather(1, target.unsqueeze(1)).squeeze(1)
    w = rows.weights.to(work)
    use = w * gold_at.any(1).to(work)
    # Accuracy over the slots whose gold the unary top-k holds (an injected gold does not count).
    hit = (scores.argmax(1) == target) & covered
    return SelectorStats((ce * use).sum(), (w * covered.to(work)).sum().detach(), (w * hit.to(work)).sum().detach())


def selector_alpha(step: int, total_steps: int, alpha: float, warmup_ratio: float, *, ramp_ratio: float) -> float:
    """The selector weight at optimizer step `step` (0-based): 0 during the first warmup_ratio of
    the steps, then linear up to `alpha` over the next ramp_ratio, then `alpha` (SpecForge's schedule)."""
    warm, ramp = warmup_ratio * total_steps, ramp_ratio * total_steps
    if step < warm:
        return 0.0
    if ramp <= 0:
        return float(alpha)
    return float(alpha) * min(1.0, (step + 1 - warm) / ramp)
