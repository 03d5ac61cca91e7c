"""What a drafter architecture is to the rest of the package: `DrafterVariant`, its hooks and their defaults.

Every architecture shares the DFlash backbone (docs/algorithm.md section 1: fused taps, KV
injection, the block mask, the target's embedding and lm_head). A variant adds to it, and owns
everything that differs: its names (`drafter.architecture`, config.json's `architectures`, the
export's `auto_map`), its shape fields (a frozen dataclass held by `DrafterShape.arch_fields`, with
their checks and their `dflash_config` entries), the modules it adds (sublayer wrappers in every
layer, heads on the drafter), the tensors those hold (the export's expected shapes, the parameter
count and the FLOP count derive from them), the draft walk, the loss terms it adds, their log
fields and report panels, and its model-card rows. The defaults here are plain DFlash (v1): a
variant overrides only what it changes. docs/architecture.md ("How to add a drafter architecture") is the contract.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from dflash_ds.model import blocks

# `shape` below is a model.shape.DrafterShape, which imports this module (so its name is not imported here).

class FieldError(ValueError):
    """A shape field whose value does not fit: `field` names it (the recipe's `drafter.<field>` sets an
    architecture's field), `problem` says why, in words that hold wherever the value came from."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class NoFields:
    """The shape fields of an architecture that has none of its own."""


class Tensor(NamedTuple):
    """One tensor of the drafter's inventory: its shape, and how a training step uses it (the FLOP rule)."""

    shape: tuple[int, ...]
    use: str = "elementwise"
    """"block": a weight multiplying every block token (6 x numel FLOPs per token, forward and backward);
    "context+block": the same over the context tokens too (the k and v projections); "context": a weight
    applied to the context tokens only, whose input needs no gradient (4 x numel, the tap fusion);
    "elementwise" or "table" (rows gathered, not multiplied): no matmul FLOPs."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Wrappers(NamedTuple):
    """The modules a variant puts around a layer's two sublayers, each under its export name. A wrapper
    has `prepare(x) -> (h, state)` (h goes into the sublayer) and `finish(y, state) -> out` (added to
    the residual)."""

    attention: tuple[str, nn.Module]
    mlp: tuple[str, nn.Module]


class LossContext(NamedTuple):
    """What a variant's loss term after the base loss sees (`DrafterVariant.extra_loss`)."""

    model: Any  # model.draft_model.DraftModel
    hidden: torch.Tensor  # [R, N*B, D] the drafter's final states
    blocks: Any  # model.blocks.Blocks
    base: Any  # model.loss.LossOutput of the base loss (its candidates, when `candidates` asked for them)
    normaliser: float | torch.Tensor
    term: Any  # this step's `step_term`


class ExtraLoss(NamedTuple):
    loss: torch.Tensor  # added to the base loss (already divided by the normaliser), differentiable
    sums: tuple[torch.Tensor, ...]  # detached, in `log_sums` order (after the chunk term's, if any)


class ReportFigure(NamedTuple):
    """A panel an architecture adds to the run report (dflash_ds/report.py): `draw(ax)` draws it on a
    matplotlib axes (the report imports matplotlib, the variant does not); `rows` are the summary
    table's (label, value) rows that go with it."""

    stem: str  # the PNG's file name without .png
    draw: Callable[[Any], None]
    rows: tuple[tuple[str, str], ...] = ()


class Serving(NamedTuple):
    """How the engines are told to serve a drafter: SGLang's `--speculative-algorithm` and
    `--speculative-num-draft-tokens`, vLLM's `method` and `num_speculative_tokens`, llama.cpp's
    speculative type (read from the converted drafter's metadata) and `--spec-draft-n-max`."""

    sglang_algorithm: str
    sglang_draft_tokens: int
    vllm_method: str
    vllm_tokens: int
    llama_cpp_type: str
    llama_cpp_draft_max: int


class Proposal(NamedTuple):
    """What llama.cpp proposes from n blocks at temperature 0 (`DrafterVariant.propose`)."""

    tokens: torch.Tensor  # [n, L] the greedy drafts (`DrafterVariant.draft`)
    served: torch.Tensor  # [n] how many of them it verifies under its confidence cut (L without one)
    confidence: torch.Tensor | None = None  # [n, L] what the cut compares with the threshold; None: no cut


class DrafterVariant:
    """One drafter architecture (module docstring). Subclass it, set the names, override the hooks that differ."""

    name: str = ""
    """The recipe's `drafter.architecture` and the registry key."""
    class_name: str = ""
    """config.json's `architectures` entry, the class SGLang and vLLM dispatch on."""
    title: str = ""
    """The model card's name for it."""
    auto_map: dict | None = None
    """config.json's `auto_map` (classes of export_modeling/modeling_dflash.py); None: no transformers remote code."""
    fields: type = NoFields
    """Frozen dataclass of the shape fields this architecture adds (`DrafterShape.arch_fields`)."""
    tap_presets: dict[tuple[int, int], tuple[int, ...]] = {}
    """Published taps that differ from build_target_layer_ids: (target layers, taps) -> layer ids."""
    needs_target_logits: bool = False
    """Payloads carry the target's final-norm states, so the chunk term sees the target's logits."""
    log_sums: tuple[str, ...] = ()
    """Names of the detached sums `LossOutput.extra` holds (chunk term's first, then `extra_loss`'s);
    `log_names` when their number depends on the shape."""
    label_offset: int = 0
    """Slot k of the block at anchor a is trained on, and drafts, the token at a + k + label_offset.
    0 (DFlash): slot 0 is the anchor itself and drafts nothing, B - 1 drafts per block. 1
    (anchor-first, the engines' `sample_from_anchor`): every slot drafts, B drafts per block."""

    # ---------------------------------------------------------------------------------- the shape

    def fields_from_recipe(self, section: Any) -> Any:
        """The shape fields from the recipe's drafter section, read by attribute name (a key the
        section does not have keeps the field's default)."""
        return typed(self.fields, {f.name: getattr(section, f.name) for f in dataclasses.fields(self.fields)
                                   if hasattr(section, f.name)})

    def check(self, shape: Any) -> None:
        """Raise FieldError when a field does not fit the rest of the shape."""

    def check_serving(self, shape: Any) -> None:
        """Raise FieldError when an engine would refuse the export of this shape (docs/algorithm.md
        section 6, "What the engines refuse"); called before a run, not on loading an export, whose
        rules are `check`'s."""

    def config_entries(self, shape: Any) -> dict:
        """This architecture's `dflash_config` entries of config.json (default: every field by its name)."""
        return dataclasses.asdict(shape.arch_fields)

    def top_level_entries(self, shape: Any) -> dict:
        """config.json entries beside `dflash_config` that this architecture's readers look for there."""
        return {}

    def fields_from_config(self, dflash_config: dict) -> Any:
        """Inverse of `config_entries`: every field must be present."""
        names = [f.name for f in dataclasses.fields(self.fields)]
        missing = [n for n in names if n not in dflash_config]
        if missing:
            raise ValueError(f"a {self.class_name} config.json needs dflash_config.{', '.join(missing)}")
        return typed(self.fields, {n: dflash_config[n] for n in names})

    # ------------------------------------------------------------------------------ the modules

    def wrappers(self, shape: Any) -> Wrappers | None:
        """Fresh modules around one layer's sublayers (called once per layer), or None."""
        return None

    def heads(self, shape: Any) -> dict[str, nn.Module]:
        """Fresh modules on the drafter beside the layers, by export name (read by the loss and the
        walk, not by the forward). Each module has `reset_parameters`."""
        return {}

    def tensors(self, shape: Any) -> dict[str, Tensor]:
        """Every tensor the wrappers and heads hold, by export name (the layers' under `layers.{i}.`)."""
        return {}

    def extra_flops(self, shape: Any, draft_tokens: int) -> int:
        """Matmul FLOPs of a step that no tensor of `tensors` accounts for (e.g. gathered lm_head rows),
        `draft_tokens` being the drafting slots' rows of the loss (DrafterShape.num_drafts a block)."""
        return 0

    # ------------------------------------------------------------------------------- the walk

    def draft(self, model: Any, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The tokens `[n, L]` the engines propose at temperature 0 from the drafting slots' final
        states `[n, L, D]` (L = `DrafterShape.num_drafts`) of blocks whose anchors are `anchors` [n]: each slot's argmax (the
        target's logit transform is monotonic, so it does not change the argmax)."""
        return argmax_tokens(hidden, model.lm_head)

    def propose(self, model: Any, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0) -> Proposal:
        """`draft`'s tokens and how many of each block's llama.cpp verifies with `--spec-draft-p-min
        p_min`, which cuts a draft at its first slot whose confidence is below p_min. The confidence
        of a DFlash slot there is the draft sampler's probability of its top candidate among the top
        10 (DFlash2's: the selector's), which is not modelled: only p_min 0, no cut."""
        tokens = self.draft(model, hidden, anchors)
        if p_min > 0:
            raise ValueError(f"llama.cpp's --spec-draft-p-min cut of a {self.title or self.name} draft is not "
                             "modelled; predict its rounds with p_min 0")
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))

    # ------------------------------------------------------------------------------- the loss

    def default_gamma(self, shape: Any) -> float:
        """The slot decay's gamma when the recipe sets none."""
        return blocks.default_gamma(shape.block_size)

    def block_targets(self, mb: Any, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                      gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels and float32 weights `[b, N, B]` of micro-batch `mb`'s blocks (model.blocks.block_targets:
        same-position labels, slot 0 weight 0)."""
        return blocks.block_targets(mb.input_ids, mb.loss_mask, mb.doc_ids, anchors, valid, block_size, gamma)

    def loss_settings(self, objective: Any) -> Any:
        """The variant's loss settings from the recipe's objective section (read by attribute name)."""
        return None

    def step_term(self, settings: Any, step: int | None = None, total_steps: int = 0) -> Any:
        """The loss settings at optimizer step `step` (0-based) of `total_steps` (e.g. a weight's
        warm-up); step None: after any warm-up."""
        return settings

    def ce_weight(self, term: Any) -> float:
        """The cross-entropy's coefficient in the loss under this step's `step_term`."""
        return 1.0

    def candidates(self, shape: Any) -> int:
        """Top-k token ids (and raw logits) per slot the base loss keeps for `extra_loss`; 0 for none."""
        return 0

    def chunk_term(self, model: Any, blocks: Any, term: Any, hidden: torch.Tensor) -> Any:
        """A model.chunk_term.ChunkTerm evaluated inside the fused loss, chunk by chunk, on each chunk's
        logits (and the target's, with `needs_target_logits`): a low-rank bias of the logits
        (features @ table.T, folded into the lm_head matmul) and/or a per-row term over the
        vocabulary; None for none. `hidden` `[R, N*B, D]`: the drafter's final states."""
        return None

    def extra_loss(self, ctx: LossContext) -> ExtraLoss | None:
        """A term computed after the base loss (e.g. from its candidates), or None."""
        return None

    def log_names(self, shape: Any) -> tuple[str, ...]:
        """The names of the step's detached sums for a drafter of `shape` (default: `log_sums`)."""
        return self.log_sums

    def log_record(self, sums: list[float], weight: float) -> dict[str, float | list[float]]:
        """metrics.jsonl fields from the step's `log_sums` (summed over micro-batches and ranks) and
        the step's total slot weight: numbers, or lists of numbers (metrics.jsonl only; wandb gets
        the numbers)."""
        return {}

    def report_figures(self, steps: list[dict]) -> list[ReportFigure]:
        """The run report's panels of this architecture's own fields, from the training step
        records (metrics.jsonl, step order); none by default."""
        return []

    # ------------------------------------------------------------------------------- the card

    def card_rows(self, shape: Any) -> list[str]:
        """Rows of the model card's table (markdown `| name | value |`)."""
        return []

    def serving(self, shape: Any) -> Serving:
        """The engines' method names and draft counts (DFlash: SGLang counts the anchor, vLLM and
        llama.cpp the drafts)."""
        return Serving("DFLASH", shape.block_size, "dflash", shape.block_size - 1, "draft-dflash", shape.block_size - 1)

    def serving_note(self) -> list[str]:
        """Lines of the model card's serving section before the commands."""
        return []


def typed(fields: type, values: dict) -> Any:
    """`fields(**values)` with each int, float or bool field converted to its declared type (JSON and
    YAML give 2.0 or "2" as readily as 2)."""
    hints = typing.get_type_hints(fields)
    return fields(**{k: hints[k](v) if hints.get(k) in (int, float, bool) else v for k, v in values.items()})


def argmax_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Greedy tokens of drafter states [..., D] through the target lm_head, in chunks of rows so
    the [rows, vocab] logits of a 248K vocabulary stay small."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head.to(device=flat.device, dtype=flat.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = (flat[i:i + chunk] @ w.T).argmax(-1)
    return out.view(hidden.shape[:-1])
