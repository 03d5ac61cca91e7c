"""A throwaway drafter architecture, defined outside the package: what adding one takes.

`ToyMarkov` adds a low-rank Markov head (a per-slot logit bias from the previous token: `E[prev] @ P.T`,
E `[V, r]`, P `[V, r]`), trains it inside the fused loss (the biased logits' CE, plus a total-variation
term between the drafter's and the target's distributions, which needs the target's logits chunk by
chunk), drafts with the Markov chain (slot k's bias comes from the token chosen at slot k - 1) and
exports its field and tensors. Registered by the tests alone (`register`): the package is not edited.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.model import variants
from dflash_ds.model.blocks import slot_rows
from dflash_ds.model.chunk_term import ChunkTerm
from dflash_ds.model.variants.base import DrafterVariant, FieldError, Tensor


@dataclass(frozen=True)
class ToyFields:
    toy_rank: int = 3


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(vocab, rank))
        self.projection = nn.Parameter(torch.empty(vocab, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.embedding.normal_(0.0, 0.5)
        self.projection.normal_(0.0, 0.5)


def markov_bias(prev: torch.Tensor, embedding: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """[n] previous tokens -> [n, V] logit bias."""
    return F.embedding(prev, embedding) @ projection.T


def total_variation(q: torch.Tensor, target_z: torch.Tensor, grad: bool):
    """TV(q, softmax(target_z)) per row and, with `grad`, its gradient w.r.t. the logits of q (a
    ChunkTerm's `vocab`: module level, traced into the fused loss)."""
    gap = q - target_z.softmax(-1)
    tv = 0.5 * gap.abs().sum(-1)
    if not grad:
        return tv, None
    s = 0.5 * torch.sign(gap)
    return tv, q * (s - (s * q).sum(-1, keepdim=True))


def markov_term(prev: torch.Tensor, embedding: torch.Tensor, projection: torch.Tensor, tv_weight: float) -> ChunkTerm:
    """The bias from each row's previous token `prev` [n] (its embedding row times the projection),
    and tv_weight * sum(w * TV(drafter, target))."""
    return ChunkTerm(F.embedding(prev, embedding), projection, total_variation, tv_weight)


def predecessors(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher forcing: slot k's previous token is the gold token at slot k - 1 (slot 0's label is the anchor)."""
    blocks = labels.view(labels.shape[0], -1, block_size)
    return torch.cat([blocks[..., :1], blocks[..., :-1]], dim=-1).flatten(1)


class ToyMarkov(DrafterVariant):
    name = "toy_markov"
    class_name = "ToyMarkovDraftModel"
    title = "Toy Markov"
    fields = ToyFields
    needs_target_logits = True
    log_sums = ("tv_sum",)

    def check(self, shape) -> None:
        if shape.arch_fields.toy_rank < 1:
            raise FieldError("toy_rank", f"= {shape.arch_fields.toy_rank} must be >= 1")

    def heads(self, shape) -> dict:
        return {"markov_head": MarkovHead(shape.vocab_size, shape.arch_fields.toy_rank)}

    def tensors(self, shape) -> dict:
        v, r = shape.vocab_size, shape.arch_fields.toy_rank
        return {"markov_head.embedding": Tensor((v, r), "table"), "markov_head.projection": Tensor((v, r), "block")}

    def draft(self, model, hidden, anchors):
        head = model.drafter.markov_head
        prev, path = anchors.to(hidden.device).long(), []
        for slot in range(hidden.shape[1]):
            logits = hidden[:, slot] @ model.lm_head.T.to(hidden.dtype)
            prev = (logits + markov_bias(prev, head.embedding, head.projection).to(logits.dtype)).argmax(-1)
            path.append(prev)
        return torch.stack(path, dim=1)

    def loss_settings(self, objective) -> float:
        return 0.5  # the TV term's weight (a real architecture reads its recipe keys here)

    def chunk_term(self, model, blocks, term, hidden) -> ChunkTerm:
        head, b = model.drafter.markov_head, model.config.block_size
        return markov_term(slot_rows(predecessors(blocks.labels, b), b), head.embedding, head.projection, term)

    def log_record(self, sums, weight):
        return {"tv": sums[0] / weight}

    def card_rows(self, shape) -> list[str]:
        return [f"| Markov head | rank {shape.arch_fields.toy_rank} |"]


TOY = ToyMarkov()


def register(monkeypatch) -> ToyMarkov:
    """The one registry line, made by a test: the architecture is known for the test's duration."""
    monkeypatch.setitem(variants.VARIANTS, TOY.name, TOY)
    return TOY
