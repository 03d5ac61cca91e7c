"""DFlash2 (docs/algorithm.md section 8): the backbone with a block convolution around every sublayer
and a candidate selector that rescores the unary top-k; the engines walk the selector's greedy path.

The modules and their math are in parts.py; this module holds its recipe sections (`drafter.dflash2:`,
`objective.dflash2:`) and says where the modules go, what they hold, how they are trained and
logged, and how an export names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_ds.architectures.base import Card, LogView, Proposal, Wrappers
from dflash_ds.architectures.dflash import DFlash
from dflash_ds.architectures.dflash2.parts import (BlockConv, CandidateSelector, SelectorRows, SelectorTerm,
                                                    greedy_path, selector_alpha, selector_loss)
from dflash_ds.config import ObjectiveConfig
from dflash_ds.config.architectures import section_of
from dflash_ds.network.registry import register
from dflash_ds.network.shape import FieldError, Tensor
from dflash_ds.objective.blocks import MicroBatch, slot_rows
from dflash_ds.objective.loss_terms import OutputTerm

if TYPE_CHECKING:  # both read the architectures (architectures/__init__.py)
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape


@dataclass(frozen=True)
class DFlash2Fields:
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


@dataclass(frozen=True)
class DFlash2Objective:
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


@dataclass(frozen=True)
class SelectorSchedule:
    """The selector loss's settings (the recipe's objective.dflash2.selector_*)."""

    alpha: float = 1.0
    inject_gold: bool = False
    detach: bool = False
    warmup_ratio: float = 0.0
    ramp_ratio: float = 0.0


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


@register
class DFlash2(DFlash):
    name = "dflash2"
    class_name = "DFlash2DraftModel"
    title = "DFlash2"
    remote_code = DFlash.remote_code._replace(auto_map={"AutoConfig": "modeling_dflash.DFlash2Config",
                                                        "AutoModel": "modeling_dflash.DFlash2DraftModel"})
    fields = DFlash2Fields
    objective_keys = DFlash2Objective
    # z-lab's DFlash2 drafters of the 64-layer Qwen 27B geometry read these (v1 reads [1, 16, 31, 46, 61]).
    tap_presets = {(64, 5): (5, 19, 33, 47, 61)}
    logs = LogView(progress=("selector {selector_loss:.4f} (top-k recall {selector_recall:.2f})",))

    def check(self, shape: DrafterShape, serving: bool = False) -> None:
        f = shape.arch_fields
        for name, value in dataclasses.asdict(f).items():
            if value < 1:
                raise FieldError(name, f"= {value} must be >= 1 (DFlash2 publishes 2, 16, 256, 16)")
        if f.conv_kernel_size > shape.block_size:
            raise FieldError("conv_kernel_size", f"= {f.conv_kernel_size} must not exceed the block size "
                             f"{shape.block_size}: the convolution runs inside one block")
        if shape.hidden_size % f.conv_group_size:
            raise FieldError("conv_group_size", f"= {f.conv_group_size} must divide the hidden size {shape.hidden_size}")
        if f.selector_top_k > shape.vocab_size:
            raise FieldError("selector_top_k", f"= {f.selector_top_k} exceeds the vocabulary ({shape.vocab_size})")
        if not serving:
            return
        # llama.cpp returns each position's top-k candidates and their k x k transition scores in one
        # hidden-width row, and refuses a drafter whose row is too narrow for them.
        k, width = shape.arch_fields.selector_top_k, shape.hidden_size
        if k * (k + 1) > width:
            largest = max(j for j in range(1, k) if j * (j + 1) <= width) if width >= 2 else 0
            raise FieldError("selector_top_k", f"= {k} needs a hidden size of at least k(k+1) = {k * (k + 1)} for "
                             f"llama.cpp to serve the export; the target's is {width}: set it to {largest} or less")

    def config_entries(self, shape: DrafterShape) -> dict:
        # DFlash2 readers take the block size from dflash_config; v1 readers from the top level.
        return {"block_size": shape.block_size, **super().config_entries(shape)}

    # ---------------------------------------------------------------------------------- modules

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

    # --------------------------------------------------------------------------------- the walk

    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0) -> Proposal:
        if p_min > 0:
            raise ValueError("llama.cpp's --spec-draft-p-min cut of a DFlash2 draft is not modelled; predict its "
                             "rounds with p_min 0")
        tokens = greedy_path(model.drafter.candidate_selector, hidden, model.lm_head, anchors.to(hidden.device),
                             transform=model.config.logit_transform)
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))

    # --------------------------------------------------------------------------------- the loss

    def loss_settings(self, objective: ObjectiveConfig) -> SelectorSchedule:
        o = section_of(objective, self.name, DFlash2Objective)
        return SelectorSchedule(o.selector_alpha, o.selector_inject_gold, o.selector_detach, o.selector_warmup_ratio,
                                o.selector_ramp_ratio)

    def step_term(self, settings: SelectorSchedule | None, step: int | None = None,
                  total_steps: int = 0) -> SelectorTerm:
        """The selector term at optimizer step `step` of `total_steps` (warm-up, then ramp); step None:
        the full weight."""
        s = settings or SelectorSchedule()
        alpha = s.alpha if step is None else selector_alpha(step, total_steps, s.alpha, s.warmup_ratio,
                                                            ramp_ratio=s.ramp_ratio)
        return SelectorTerm(alpha, s.inject_gold, s.detach)

    def term_weights(self, shape: DrafterShape, term: SelectorTerm) -> dict[str, float]:
        return {**super().term_weights(shape, term), "selector_alpha": float(term.alpha)}

    def loss_terms(self, model: DraftModel, blocks, term: SelectorTerm, hidden: torch.Tensor, *, ctx: torch.Tensor,
                   mb: MicroBatch) -> tuple:
        return (SelectorLoss(model, blocks, hidden, term),)

    def log_names(self, shape: DrafterShape) -> tuple[str, ...]:
        return ("selector_loss_sum", "selector_covered", "selector_correct")

    def log_record(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        # Weighted over the slots like "loss": sum(w * selector CE) / sum(w), the share of the weight
        # whose gold is among the unary top-k, and how often the selector ranks it first there.
        ce, covered, correct = sums["selector_loss_sum"], sums["selector_covered"], sums["selector_correct"]
        return {"selector_loss": ce / weight, "selector_recall": covered / weight,
                "selector_accuracy": correct / max(covered, 1e-9)}

    # --------------------------------------------------------------------------------- the card

    def card(self, shape: DrafterShape) -> Card:
        f = shape.arch_fields
        rows = (f"| block convolution | {f.conv_kernel_size} taps, groups of {f.conv_group_size} channels |",
                f"| candidate selector | top {f.selector_top_k} unary candidates, pair scores at rank "
                f"{f.selector_rank} |")
        card = super().card(shape)
        return card._replace(rows=rows, serving=card.serving._replace(vllm_v2_only="the DFlash2 candidate head"), note=(
            "Both engines serve it with their DFlash method and select DFlash2 (the convolutions and the",
            "candidate selector) from `architectures: [\"DFlash2DraftModel\"]` and the four DFlash2 fields of",
            "`dflash_config`: SGLang from PR #35371 on, vLLM from PR #52816 on. Older releases would",
            "silently run the backbone alone.",
            "",
        ))
