"""DFlash2 (docs/algorithm.md section 8): the backbone with a block convolution around every sublayer
and a candidate selector that rescores the unary top-k; the engines walk the selector's greedy path.

The modules and their math are in parts.py; this module holds its recipe sections (`drafter.dflash2:`,
`objective.dflash2:`) and says where the modules go, what they hold, how they are trained and
logged, and how an export names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_ds.architectures.dflash import MODELING as DFLASH_MODELING, SPEC as DFLASH_SPEC, DFlashModules, \
    DFlashObjective, DFlashWalk
from dflash_ds.architectures.dflash2.parts import (BlockConv, CandidateSelector, SelectorRows, SelectorTerm,
                                                    conv_activation_bytes, greedy_path, selector_alpha, selector_loss)
from dflash_ds.network.arch_types import (CE_ALWAYS_ON, Card, Fields, Keys, LogView, Proposal, RemoteCode, StepSizes,
                                         Wrappers)
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.registry import register
from dflash_ds.network.shape import FieldError, Tensor
from dflash_ds.objective.blocks import slot_rows
from dflash_ds.objective.loss_terms import OutputTerm

if TYPE_CHECKING:  # for the annotations only
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.objective.blocks import Blocks, MicroBatch


MODELING = Path(__file__).parent / "modeling_dflash2.py"
"""The export's remote code: DFlash2DraftModel on modeling_dflash.py's backbone, copied beside it."""


@dataclass(frozen=True)
class DFlash2Fields(Fields):
    """The recipe's `drafter.dflash2:` section and DFlash2's shape, in dflash_config order; the defaults
    are the published shape (z-lab's)."""

    conv_kernel_size: int = 2
    """Taps of the block convolution around every attention and MLP sublayer (slot k reads slots
    k .. k-taps+1 of its own block)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic convolution coefficient; must divide the hidden size."""
    selector_rank: int = 256
    """Rank of the candidate selector's pair scores (two [vocab, rank] codebooks: 127M parameters at a
    248K vocabulary)."""
    selector_top_k: int = 16
    """Unary candidates the selector rescores per slot."""

    def check_shape(self, shape: DrafterShape, serving: bool = False) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value < 1:
                raise FieldError(name, f"= {value} must be >= 1 (DFlash2 publishes 2, 16, 256, 16)")
        if self.conv_kernel_size > shape.block_size:
            raise FieldError("conv_kernel_size", f"= {self.conv_kernel_size} must not exceed the block size "
                             f"{shape.block_size}: the convolution runs inside one block")
        if shape.hidden_size % self.conv_group_size:
            raise FieldError("conv_group_size", f"= {self.conv_group_size} must divide the hidden size "
                             f"{shape.hidden_size}")
        if self.selector_top_k > shape.vocab_size:
            raise FieldError("selector_top_k", f"= {self.selector_top_k} exceeds the vocabulary ({shape.vocab_size})")
        if not serving:
            return
        # llama.cpp returns each position's top-k candidates and their k x k transition scores in one
        # hidden-width row, and refuses a drafter whose row is too narrow for them.
        k, width = self.selector_top_k, shape.hidden_size
        if k * (k + 1) > width:
            largest = max(j for j in range(1, k) if j * (j + 1) <= width) if width >= 2 else 0
            raise FieldError("selector_top_k", f"= {k} needs a hidden size of at least k(k+1) = {k * (k + 1)} for "
                             f"llama.cpp to serve the export; the target's is {width}: set it to {largest} or less")

    def config_entries(self, shape: DrafterShape) -> dict:
        # DFlash2 readers take the block size from dflash_config; v1 readers from the top level.
        return {"block_size": shape.block_size, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class DFlash2Keys(Keys):
    """The recipe's `objective.dflash2:` section: the selector loss."""

    selector_alpha: float = 1.0
    """Weight of the selector loss (a k-way cross-entropy over the unary top-k, teacher-forced
    predecessor, the same slot weights) added to the base loss. Peers: 1.0 in SpecForge, speculators
    and NeMo Automodel. 0 leaves the selector untrained (its successor codebook stays zero)."""
    selector_inject_gold: bool = False
    """A gold token outside the unary top-k replaces the weakest candidate (speculators' default:
    true); false = such slots add no selector loss, strict top-k (SpecForge's default, which it
    reports gives the best serving acceptance)."""
    selector_warmup_ratio: float = 0.0005
    """Fraction of the optimizer steps with selector weight 0 (SpecForge: 0.0005; speculators and
    Automodel: 0)."""
    selector_ramp_ratio: float = 0.0005
    """Fraction of the steps after the warm-up over which the weight rises linearly to selector_alpha
    (SpecForge: 0.0005; speculators and Automodel: 0)."""
    selector_detach: bool = False
    """The selector loss trains the selector's own parameters only, not the drafter's states
    (SpecForge's dflash2_selector_stop_gradient, default false; speculators and Automodel: false)."""

    def check(self) -> None:
        if self.selector_alpha < 0:
            raise ValueError(f"selector_alpha must be >= 0, got {self.selector_alpha}")
        for key in ("selector_warmup_ratio", "selector_ramp_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be in [0, 1], got {getattr(self, key)}")

    def weights(self, shape: DrafterShape) -> dict[str, float]:
        return {CE_ALWAYS_ON: 1.0, "selector_alpha": float(self.selector_alpha)}

    def at(self, step: int | None, total_steps: int) -> SelectorTerm:
        """The selector term at optimizer step `step` of `total_steps` (warm-up, then ramp); step None:
        the full weight."""
        alpha = self.selector_alpha if step is None else selector_alpha(
            step, total_steps, self.selector_alpha, self.selector_warmup_ratio, ramp_ratio=self.selector_ramp_ratio)
        return SelectorTerm(alpha, self.selector_inject_gold, self.selector_detach)


class SelectorLoss(OutputTerm):
    """alpha * sum(w * selector CE) / normaliser over the loss's top-k candidates (and their raw logits),
    teacher-forced: slot k's predecessor is the gold token at slot k - 1 (slot 0's label is the anchor)."""

    name = "selector_loss_sum"

    def __init__(self, model: DraftModel, blocks, hidden: torch.Tensor, term: SelectorTerm):
        self.model, self.blocks, self.hidden, self.term = model, blocks, hidden, term
        self.weight, self.top_k = term.alpha, model.config.arch_fields.selector_top_k

    def contribute(self, out, normaliser):
        model, blocks, term = self.model, self.blocks, self.term
        b = model.config.block_size
        labels = blocks.labels.view(blocks.labels.shape[0], -1, b)
        predecessors = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).flatten(1)
        rows = SelectorRows(slot_rows(self.hidden, b), out.candidates, slot_rows(blocks.labels, b),
                            slot_rows(predecessors, b), slot_rows(blocks.weights, b), out.candidate_logits)
        stats = selector_loss(model.drafter.candidate_selector, model.lm_head, rows, term, transform=model.config.logit_transform)
        return (term.alpha / normaliser) * stats.loss_sum, {
            "selector_loss_sum": stats.loss_sum.detach(), "selector_covered": stats.covered,
            "selector_correct": stats.correct}


class DFlash2Modules(DFlashModules):
    def wrappers(self, shape: DrafterShape) -> Wrappers:
        f = shape.arch_fields
        conv = (shape.hidden_size, f.conv_kernel_size, f.conv_group_size, shape.block_size)
        return Wrappers(("attention_conv", BlockConv(*conv)), ("mlp_conv", BlockConv(*conv)))

    def heads(self, shape: DrafterShape) -> dict:
        f = shape.arch_fields
        return {"candidate_selector": CandidateSelector(shape.hidden_size, shape.vocab_size, f.selector_rank,
                                                        f.selector_top_k)}

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        f, d, v = shape.arch_fields, shape.hidden_size, shape.vocab_size
        k, r = f.conv_kernel_size, f.selector_rank
        out = {}
        for i in range(shape.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                out[f"layers.{i}.{conv}.base_kernel"] = Tensor((2, k, d))
                out[f"layers.{i}.{conv}.kernel_projection.weight"] = Tensor((2 * k * d // f.conv_group_size, d), "block")
        out["candidate_selector.hidden_projection.weight"] = Tensor((r, d), "block")
        out["candidate_selector.predecessor_codebook"] = Tensor((v, r), "table")
        out["candidate_selector.successor_codebook"] = Tensor((v, r), "table")
        return out

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        # The unary scores from the gathered lm_head rows (forward + input gradient); the
        # elementwise convolutions and the rank-r pair scores are not matmuls.
        return 4 * shape.arch_fields.selector_top_k * shape.hidden_size * draft_tokens

    def extra_activation_bytes(self, shape: DrafterShape, step: StepSizes) -> int:
        # The block convolutions' states, and the selector's [slots, top_k, rank] fp32 codebook rows that
        # it keeps for the backward (it runs once a micro-batch, not per loss chunk).
        f = shape.arch_fields
        convs = conv_activation_bytes(shape.hidden_size, shape.num_hidden_layers, step.queries)
        return convs + step.draft_rows * f.selector_top_k * f.selector_rank * 4


class DFlash2Objective(DFlashObjective):
    """The cross-entropy and the selector's k-way cross-entropy over the loss's unary top-k."""

    def terms(self, model: DraftModel, mb: MicroBatch, blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor,
              keys: DFlash2Keys | None, step: int | None = None, total_steps: int = 0) -> StepTerms:
        return StepTerms(terms=(SelectorLoss(model, blocks, hidden, (keys or DFlash2Keys()).at(step, total_steps)),))


class DFlash2Walk(DFlashWalk):
    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None) -> Proposal:
        if p_min > 0:
            raise ValueError("llama.cpp's --spec-draft-p-min cut of a DFlash2 draft is not modelled; predict its "
                             "rounds with p_min 0")
        tokens = greedy_path(model.drafter.candidate_selector, hidden, model.lm_head, anchors.to(hidden.device),
                             transform=model.config.logit_transform)
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))


def log_record(sums: dict[str, float], weight: float) -> dict[str, float]:
    # Weighted over the slots like "loss": sum(w * selector CE) / sum(w), the share of the weight
    # whose gold is among the unary top-k, and how often the selector ranks it first there.
    ce, covered, correct = sums["selector_loss_sum"], sums["selector_covered"], sums["selector_correct"]
    return {"selector_loss": ce / weight, "selector_recall": covered / weight,
            "selector_accuracy": correct / max(covered, 1e-9)}


def card(shape: DrafterShape) -> Card:
    f = shape.arch_fields
    rows = (f"| block convolution | {f.conv_kernel_size} taps, groups of {f.conv_group_size} channels |",
            f"| candidate selector | top {f.selector_top_k} unary candidates, pair scores at rank "
            f"{f.selector_rank} |")
    base = DFLASH_SPEC.card(shape)
    return base._replace(rows=rows, serving=base.serving._replace(vllm_v2_only="the DFlash2 candidate head"), note=(
        "Both engines serve it with their DFlash method and select DFlash2 (the convolutions and the",
        "candidate selector) from `architectures: [\"DFlash2DraftModel\"]` and the four DFlash2 fields of",
        "`dflash_config`: SGLang from PR #35371 on, vLLM from PR #52816 on. Older releases would",
        "silently run the backbone alone.",
        "",
    ))


SPEC = Spec(
    name="dflash2", class_name="DFlash2DraftModel", title="DFlash2", card=card, fields=DFlash2Fields,
    objective_keys=DFlash2Keys,
    remote_code=RemoteCode(MODELING, MODELING.name, {"AutoConfig": "modeling_dflash2.DFlash2Config",
                                                      "AutoModel": "modeling_dflash2.DFlash2DraftModel"},
                           beside=(DFLASH_MODELING,)),
    logs=LogView(log_record, progress=("selector {selector_loss:.4f} (top-k recall {selector_recall:.2f})",)),
    # z-lab's DFlash2 drafters of the 64-layer Qwen 27B geometry read these (v1 reads [1, 16, 31, 46, 61]).
    tap_presets={(64, 5): (5, 19, 33, 47, 61)},
    small={"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4})
DFLASH2 = register(Architecture(SPEC, DFlash2Modules(), DFlash2Objective(), DFlash2Walk()))
