"""A throwaway drafter architecture, defined outside the package: what adding one takes.

`ToyMarkov` adds a low-rank Markov head (a per-slot logit bias from the previous token: `E[prev] @ P.T`,
E `[V, r]`, P `[V, r]`), trains it inside the fused loss (the biased logits' CE, plus a total-variation
term between the drafter's and the target's distributions, which needs the target's logits chunk by
chunk), drafts with the Markov chain (slot k's bias comes from the token chosen at slot k - 1) and
exports its field and tensors. Its recipe sections are `drafter.toy_markov:` (toy_rank) and
`objective.toy_markov:` (tv_weight); it logs `tv`, shown in the progress line, the report's loss
panel and summary; its exports carry its own remote code (tests/toy_modeling.py). Registered by the
tests alone (`register`): the package is not edited. It is the four parts of network/contract.py: its
spec (data), its modules (a head and its two tensors), its objective (one method) and its walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.architectures import DEFAULT
from dflash_ds.architectures.dflash import DFlashModules, DFlashObjective, DFlashWalk
from dflash_ds.network.arch_types import Card, Fields, Keys, LogView, RemoteCode
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.registry import entries
from dflash_ds.network.shape import FieldError, Tensor
from dflash_ds.objective.blocks import slot_rows
from dflash_ds.objective.loss_terms import LogitBias, RowTerm


@dataclass(frozen=True)
class ToyFields(Fields):
    """`drafter.toy_markov:`, and the shape's fields."""

    toy_rank: int = 3
    """Rank of the Markov head's two tables."""

    def check_shape(self, shape, serving: bool = False) -> None:
        if self.toy_rank < 1:
            raise FieldError("toy_rank", f"= {self.toy_rank} must be >= 1")


@dataclass(frozen=True)
class ToyKeys(Keys):
    """`objective.toy_markov:`."""

    tv_weight: float = 0.5
    """Weight of the total-variation term."""

    def check(self) -> None:
        if not self.tv_weight >= 0:
            raise ValueError(f"tv_weight must be >= 0, got {self.tv_weight}")


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
    RowTerm's `values`: module level, traced into the fused loss)."""
    gap = q - target_z.softmax(-1)
    tv = 0.5 * gap.abs().sum(-1)
    if not grad:
        return tv, None
    s = 0.5 * torch.sign(gap)
    return tv, q * (s - (s * q).sum(-1, keepdim=True))


def markov_term(prev: torch.Tensor, embedding: torch.Tensor, projection: torch.Tensor,
                tv_weight: float) -> tuple[LogitBias, RowTerm]:
    """The bias from each row's previous token `prev` [n] (its embedding row times the projection),
    and the term tv_weight * sum(w * TV(drafter, target))."""
    return LogitBias(F.embedding(prev, embedding), projection), RowTerm("tv_sum", tv_weight, total_variation)


def predecessors(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher forcing: slot k's previous token is the gold token at slot k - 1 (slot 0's label is the anchor)."""
    blocks = labels.view(labels.shape[0], -1, block_size)
    return torch.cat([blocks[..., :1], blocks[..., :-1]], dim=-1).flatten(1)


class ToyModules(DFlashModules):
    def heads(self, shape) -> dict:
        return {"markov_head": MarkovHead(shape.vocab_size, shape.arch_fields.toy_rank)}

    def tensors(self, shape) -> dict:
        v, r = shape.vocab_size, shape.arch_fields.toy_rank
        return {"markov_head.embedding": Tensor((v, r), "table"), "markov_head.projection": Tensor((v, r), "block")}


class ToyObjective(DFlashObjective):
    def terms(self, model, mb, blocks, hidden, *, ctx, keys, step=None, total_steps=0) -> StepTerms:
        head, b = model.drafter.markov_head, model.config.block_size
        bias = LogitBias(F.embedding(slot_rows(predecessors(blocks.labels, b), b), head.embedding), head.projection)
        return StepTerms(terms=(RowTerm("tv_sum", keys.tv_weight, total_variation),), bias=bias)


class ToyWalk(DFlashWalk):
    def propose(self, model, hidden, anchors, p_min: float = 0.0, *, context=None):
        head = model.drafter.markov_head
        prev, path = anchors.to(hidden.device).long(), []
        for slot in range(hidden.shape[1]):
            logits = hidden[:, slot] @ model.lm_head.T.to(hidden.dtype)
            prev = (logits + markov_bias(prev, head.embedding, head.projection).to(logits.dtype)).argmax(-1)
            path.append(prev)
        tokens = torch.stack(path, dim=1)
        return super().propose(model, hidden, anchors, p_min)._replace(tokens=tokens)


def card(shape) -> Card:
    return DEFAULT.spec.card(shape)._replace(rows=(f"| Markov head | rank {shape.arch_fields.toy_rank} |",))


SPEC = Spec(name="toy_markov", class_name="ToyMarkovDraftModel", title="Toy Markov", card=card, fields=ToyFields,
            objective_keys=ToyKeys, needs_target_logits=True,
            remote_code=RemoteCode(Path(__file__).with_name("toy_modeling.py"), "toy_modeling.py",
                                   {"AutoModel": "toy_modeling.ToyMarkovWalk"}),
            logs=LogView(lambda sums, weight: {"tv": sums["tv_sum"] / weight}, progress=("tv {tv:.4f}",),
                         series=(("loss", "tv", "TV term"),), summary=(("final TV", "{tv:.3f}"),)))
TOY = Architecture(SPEC, ToyModules(), ToyObjective(), ToyWalk())


def register(monkeypatch) -> Architecture:
    """What `register` does, undone after the test: the architecture and its recipe sections are known
    for the test's duration."""
    for registry, key, value in entries(TOY):
        monkeypatch.setitem(registry, key, value)
    return TOY
