"""The drafter architecture contract: an architecture is four typed parts (docs/architecture.md, "How to add
a drafter architecture").

- `Spec`, frozen data: its names, its recipe sections, how its blocks are labelled, what its payloads
  carry, how its logs are shown, its card and its remote code. Nothing to override.
- `Modules`: what it adds to the backbone (wrappers around every layer's sublayers, heads beside the
  layers), their tensor inventory, the FLOPs no tensor accounts for, the memory their activations add,
  and whether an export of another architecture can start its backbone.
- `Objective`: ONE method, `terms`, that takes the micro-batch, its blocks and the drafter's states and
  returns its part of the loss (`StepTerms`: the cross-entropy's weight, its named terms, a logit bias);
  the terms' sums by name are its named logs. A training step of the architecture reads on one screen.
- `Walk`: how the engines draft with it (the greedy proposal, the sampled draft, a text's probabilities).

The registry beside it (network/registry.py) holds one `Architecture` per name; the packages of
architectures/, one layer up, fill it. The objective's types (the micro-batch, the blocks, the loss's
terms) are objective/'s, a layer above this one: the protocol names them in words, not by import.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from dflash_ds.network.arch_types import (Card, LogView, NoFields, Proposal, RemoteCode, SampledDraft, StepSizes,
                                          Wrappers)

if TYPE_CHECKING:
    from torch import nn

    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape, Tensor


@dataclass(frozen=True)
class Spec:
    """What an architecture is, as data."""

    name: str
    """The recipe's `drafter.architecture` and the registry key."""
    class_name: str
    """config.json's `architectures` entry, the class SGLang and vLLM dispatch on."""
    title: str
    """The model card's name for it."""
    card: Callable[[DrafterShape], Card]
    """The model card's rows, the engines' method names and draft counts, the serving note, of a shape."""
    fields: type = NoFields
    """Its recipe section `drafter.<name>:` and shape fields (`DrafterShape.arch_fields`): a frozen
    dataclass extending `arch_types.Fields`, a docstring per field."""
    objective_keys: type | None = None
    """Its recipe section `objective.<name>:` (its loss settings, what `Objective.terms` reads as `keys`):
    a frozen dataclass extending `arch_types.Keys`; None: none."""
    label_offset: int = 0
    """Slot k of the block at anchor a is trained on, and drafts, the token at a + k + label_offset.
    0 (DFlash): slot 0 is the anchor itself and drafts nothing, B - 1 drafts a block. 1 (anchor-first,
    the engines' `sample_from_anchor`): every slot drafts, B drafts a block, supervised up to the first
    slot that is not (objective/blocks.py `block_targets` / `anchor_first_targets`)."""
    needs_target_logits: bool = False
    """Payloads carry the target's final-norm states, so its terms see the target's logits."""
    walk_reads_anchor_slot: bool = False
    """Its walk reads the anchor slot's state too (XPress's refiner mixes it into every slot): the walk gets
    every slot's states [n, B, D], slot 0 first, in place of the drafting slots' [n, L, D]."""
    logs: LogView = LogView()
    """What its named logs become in metrics.jsonl, the progress line and the report."""
    remote_code: RemoteCode | None = None
    """The transformers remote code its exports carry; None: none."""
    tap_presets: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    """Published taps that differ from the default spread: (target layers, drafter layers) -> layer ids."""
    small: Mapping[str, Any] = field(default_factory=dict)
    """Its fields for the tests' small drafters (a 32-wide target, a vocabulary of 64 tokens or more: the
    conformance suite's); the fields it does not name keep their defaults."""


class Modules(Protocol):
    """What an architecture adds to the DFlash backbone (network/drafter.py builds them)."""

    def wrappers(self, shape: DrafterShape) -> Wrappers | None:
        """Fresh modules around one layer's sublayers (called once per layer), or None."""

    def heads(self, shape: DrafterShape) -> dict[str, nn.Module]:
        """Fresh modules on the drafter beside the layers, by export name (read by the objective and the
        walk, not by the forward). Each has `reset_parameters`; one with `compile_units()` names the
        modules `drafter.compile` compiles besides the layers."""

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        """Every tensor the wrappers and heads hold, by export name (the layers' under `layers.{i}.`)."""

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        """Matmul FLOPs of a step no tensor of `tensors` accounts for, `draft_tokens` being the drafting
        slots' rows of the loss."""

    def extra_activation_bytes(self, shape: DrafterShape, step: StepSizes) -> int:
        """Bytes its wrappers and heads hold at the step's memory peak beyond the backbone's (what their
        backward keeps, their own temporaries beside a loss chunk's), for one micro-batch of `step`'s
        sizes: the memory plan (resolve/plan.py) adds them to the backbone's activations."""

    def backbone_from(self, shape: DrafterShape, exported: DrafterShape) -> str | None:
        """Why an export of another architecture cannot start the backbone of a drafter of `shape`, its
        heads fresh (`drafter.init_from`); None when it can."""


class StepTerms(NamedTuple):
    """An architecture's part of one micro-batch's loss (objective/drafter_loss.py adds the KL term)."""

    ce_weight: float = 1.0
    """The cross-entropy's weight (objective.loss_terms.CrossEntropy)."""
    terms: tuple = ()
    """Its terms after the cross-entropy and the KL, each named (objective.loss_terms: a VocabTerm runs on
    each chunk's logits, an OutputTerm after the chunk loop); their sums by name are its named logs."""
    bias: Any = None
    """A low-rank bias of every row's logits (objective.loss_terms.LogitBias), or None."""


class Objective(Protocol):
    """How an architecture trains: its part of every micro-batch's loss."""

    def terms(self, model: DraftModel, mb: Any, blocks: Any, hidden: torch.Tensor, *, ctx: torch.Tensor, keys: Any,
              step: int | None = None, total_steps: int = 0) -> StepTerms:
        """Its terms of micro-batch `mb` (objective.blocks.MicroBatch) whose blocks are `blocks`
        (objective.blocks.Blocks: their labels and weights are the spec's `label_offset`'s), from the
        drafter's final states `hidden` [R, N*B, D] and the context rows `ctx` [R, S, D]; `keys`: its
        `objective.<name>:` section (None without one); at optimizer step `step` of `total_steps` (a
        weight's warm-up; None: after it)."""


class Walk(Protocol):
    """How the engines draft with an architecture, from the drafting slots' final states [n, L, D]
    (L = `DrafterShape.num_drafts`; every slot's [n, B, D] with `Spec.walk_reads_anchor_slot`). `context` [n, D]: each anchor's context row, the fused state before
    it (drafter.fuse), for a walk that reads it."""

    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None) -> Proposal:
        """The tokens the engines propose at temperature 0 from blocks whose anchors are `anchors` [n], and
        how many of each llama.cpp verifies under `--spec-draft-p-min p_min`."""

    def sampled_draft(self, model: DraftModel, hidden: torch.Tensor, temperature: float, generator: torch.Generator,
                      *, context: torch.Tensor | None = None) -> SampledDraft | None:
        """The draft the engines draw at `temperature`, drawing from `generator`; None (drawing nothing):
        they verify the greedy draft."""

    def text_probabilities(self, model: DraftModel, hidden: torch.Tensor, following: torch.Tensor, temperature: float,
                           *, context: torch.Tensor | None = None) -> torch.Tensor | None:
        """q_s(x_s) [n, L]: the probability that the draft at `temperature` proposes the text's token
        `following` at slot s once it proposed the text's tokens before it; None: the draft is the greedy
        one at every temperature."""


@dataclass(frozen=True)
class Architecture:
    """One drafter architecture: its four parts."""

    spec: Spec
    modules: Modules
    objective: Objective
    walk: Walk
