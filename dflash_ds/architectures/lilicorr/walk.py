"""LiLiCorr's serving walk: the backbone's top-k candidates of every drafted slot (full-vocabulary
log-probs through the target's raw lm_head), the head's log-factors, and the greedy left-to-right walk
the engines run over them (vLLM's selector walk at temperature 0, SGLang's one-hot rows and inverse-CDF
walk): slot 1 takes the best start factor, slot s the best factor leaving the candidate slot s - 1 took,
the lowest candidate index (the backbone's best-ranked) winning a tie. Every slot emits one of its k
candidates; nothing past rank k - 1 is ever proposed.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from dflash_ds.architectures.lilicorr.head import Factors

if TYPE_CHECKING:
    from dflash_ds.network.draft_model import DraftModel


class Candidates(NamedTuple):
    """The top-k of every drafted slot: `ids` [n, S, k] (descending logit, rank 0 the argmax) and their
    `log_probs` [n, S, k] normalised over the whole vocabulary, fp32 (or the states' wider dtype)."""

    ids: torch.Tensor
    log_probs: torch.Tensor


class Path(NamedTuple):
    """A walk: the candidate index `index` [n, S] each slot took and the `rows` [n, S, k] of log-factors it
    chose from (the start factors at slot 1, then the row leaving the previous choice): what a sampled
    walk samples from and the engines' rejection sampling reads."""

    index: torch.Tensor
    rows: torch.Tensor


def candidates(hidden: torch.Tensor, lm_head: torch.Tensor, top_k: int, *, chunk: int = 1024) -> Candidates:
    """The top `top_k` candidates of drafted states `hidden` [n, S, D] through the target's lm_head
    [V, D] (raw logits in the states' dtype, as the engines multiply; log-softmax in fp32), in chunks of
    rows so the [rows, V] logits of a large vocabulary stay small."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head.to(device=flat.device, dtype=flat.dtype)
    ids = torch.empty(flat.shape[0], top_k, dtype=torch.long, device=flat.device)
    # fp32 log-probs as both engines compute them; float64 states (reference checks) stay float64.
    dtype = torch.promote_types(flat.dtype, torch.float32)
    log_probs = torch.empty(flat.shape[0], top_k, dtype=dtype, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        z = (flat[i:i + chunk] @ w.T).to(dtype)
        top = z.topk(top_k, dim=-1)
        ids[i:i + chunk] = top.indices
        log_probs[i:i + chunk] = top.values - z.logsumexp(-1, keepdim=True)
    shape = (*hidden.shape[:-1], top_k)
    return Candidates(ids.view(shape), log_probs.view(shape))


def greedy_path(factors: Factors) -> Path:
    """The engines' walk at temperature 0 over log-factors of n blocks (torch's argmax takes the first
    maximum: the lowest candidate index wins a tie, as vLLM's kernel and SGLang's one-hot rows do)."""
    row = factors.start
    index, rows = [], []
    for s in range(factors.pair.shape[1] + 1):
        if s > 0:
            k = row.shape[-1]
            row = factors.pair[:, s - 1].gather(1, index[-1][:, None, None].expand(-1, 1, k)).squeeze(1)
        rows.append(row)
        index.append(row.argmax(-1))
    return Path(torch.stack(index, dim=1), torch.stack(rows, dim=1))


def sampled_path(factors: Factors, temperature: float, uniforms: torch.Tensor) -> Path:
    """The walk at temperature `temperature` > 0 with one uniform a slot (`uniforms` [n, S] in [0, 1)), as
    SGLang draws it: each slot's proposal is q = softmax(row / T) over its k candidates (row: the start
    factors, then the row leaving the previous choice), the index the number of cumulative q at or below
    the uniform, capped at the last candidate with q > 0. `rows` holds the q rows (the proposal
    distributions min(1, p / q) is checked against)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampled walk, got {temperature}; use greedy_path for 0")
    row = factors.start
    index, rows = [], []
    k = row.shape[-1]
    positions = torch.arange(k, device=row.device)
    for s in range(factors.pair.shape[1] + 1):
        if s > 0:
            row = factors.pair[:, s - 1].gather(1, index[-1][:, None, None].expand(-1, 1, k)).squeeze(1)
        q = torch.softmax(row / temperature, dim=-1)
        count = (uniforms[:, s, None] >= q.cumsum(-1)).sum(-1)
        last = torch.where(q > 0, positions, torch.zeros_like(positions)).amax(-1)
        rows.append(q)
        index.append(torch.minimum(count, last))
    return Path(torch.stack(index, dim=1), torch.stack(rows, dim=1))


def text_probabilities(found: Candidates, factors: Factors, following: torch.Tensor, temperature: float
                       ) -> torch.Tensor:
    """q_s(x_s) [n, S]: the probability that the sampled walk at `temperature` proposes the text's token
    `following` [n, S] at slot s, given that it proposed the text's tokens at slots 1 .. s - 1 (what
    sampled verification needs once those were accepted: a slot is accepted with probability
    min(1, q / p) of the token it proposed). Slot 1 reads the start factors, slot s the row leaving the
    text's token at slot s - 1. A token outside its slot's candidates has q 0, and so has every slot
    after it (no walk reaches them through it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for the sampled walk's probabilities, got {temperature}")
    hit = found.ids == following[..., None].to(found.ids.device)  # [n, S, k], at most one per slot
    among = hit.any(-1)
    index = hit.to(torch.long).argmax(-1)  # the text's candidate index (0 where it is none)
    k = found.ids.shape[-1]
    out, row, reached = [], factors.start, torch.ones_like(among[:, 0])
    for s in range(following.shape[1]):
        if s > 0:
            row = factors.pair[:, s - 1].gather(1, index[:, s - 1, None, None].expand(-1, 1, k)).squeeze(1)
            reached = reached & among[:, s - 1]
        q = torch.softmax(row / temperature, dim=-1).gather(1, index[:, s, None]).squeeze(1)
        out.append(torch.where(reached & among[:, s], q, torch.zeros_like(q)))
    return torch.stack(out, dim=1)


def score(model: DraftModel, hidden: torch.Tensor, context: torch.Tensor, context_valid: torch.Tensor
          ) -> tuple[Candidates, Factors]:
    """The candidates and the head's log-factors of n blocks from the drafted slots' states `hidden`
    [n, S, D], the anchors' context rows `context` [n, D] (hidden_norm(fc(taps)) at the position before
    each anchor) and whether each exists `context_valid` [n]."""
    head = model.drafter.lilicorr
    found = candidates(hidden, model.lm_head, head.geometry.top_k)
    # The candidates' rows of the target's own input embedding, never trained through.
    embeddings = F.embedding(found.ids.to(model.embed.device), model.embed).to(device=hidden.device)
    return found, head(embeddings, found.log_probs, hidden, context, valid=context_valid)


def chosen(found: Candidates, path: Path) -> torch.Tensor:
    """The tokens [n, S] a walk emits."""
    return found.ids.gather(-1, path.index[..., None]).squeeze(-1)
