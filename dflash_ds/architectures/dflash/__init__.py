"""DFlash (v1): the backbone alone, the argmax of every slot (docs/algorithm.md sections 1-7), and the class
every other architecture extends.

Every architecture shares the DFlash backbone (fused taps, KV injection, the block mask, the target's
embedding and lm_head). One that adds to it subclasses `DFlash`, registers itself with `@register`
and overrides only what it changes: its names (`drafter.architecture`, config.json's
`architectures`, the card's title), its recipe sections (`fields`: `drafter.<name>:`, which is also
its shape fields held by `DrafterShape.arch_fields` and written to `dflash_config`;
`objective_keys`: `objective.<name>:`), the modules it adds (sublayer wrappers in every layer,
heads on the drafter) and the tensors they hold, the draft walk, the loss terms it adds, their log
fields (`log_names`, `log_record`) and how they are shown (`logs`, `report_figures`), its card and
its transformers remote code. docs/architecture.md ("How to add a drafter architecture") is the contract.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_ds.architectures.base import (Card, LogView, NoFields, Proposal, RemoteCode, ReportFigure, SampledDraft,
                                          Serving, Wrappers, argmax_tokens, typed)
from dflash_ds.config.architectures import section_of
from dflash_ds.network.registry import register
from dflash_ds.network.shape import Tensor
from dflash_ds.objective import blocks

if TYPE_CHECKING:  # the model and the shape read the architectures (architectures/__init__.py); the rest
    from torch import nn  # are here for the annotations only

    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.objective.blocks import Blocks, MicroBatch
    from dflash_ds.objective.loss_terms import LogitBias

MODELING = Path(__file__).parent / "modeling_dflash.py"
"""transformers' remote code of the published architectures (DFlash, DFlash2, DSpark): torch and
transformers only, copied verbatim into their exports."""


@register
class DFlash:
    """Plain DFlash, and every hook's default (module docstring)."""

    name: str = "dflash"
    """The recipe's `drafter.architecture` and the registry key."""
    class_name: str = "DFlashDraftModel"
    """config.json's `architectures` entry, the class SGLang and vLLM dispatch on."""
    title: str = "DFlash"
    """The model card's name for it."""
    remote_code: RemoteCode | None = RemoteCode(MODELING, MODELING.name, {
        "AutoConfig": "modeling_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlashDraftModel"})
    """The remote code its exports carry (`remote`); None: none."""
    fields: type = NoFields
    """Frozen dataclass of its recipe section `drafter.<name>:`, which is also its shape fields
    (`DrafterShape.arch_fields`, written to `dflash_config`): a docstring per field."""
    objective_keys: type | None = None
    """Frozen dataclass of its recipe section `objective.<name>:` (its loss settings), or None; a
    `check()` method checks the values that need nothing else."""
    tap_presets: dict[tuple[int, int], tuple[int, ...]] = {}
    """Published taps that differ from build_target_layer_ids: (target layers, taps) -> layer ids."""
    needs_target_logits: bool = False
    """Payloads carry the target's final-norm states, so the chunk term sees the target's logits."""
    reads_context: bool = False
    """`propose` reads each anchor's context row (`context=`, the fused state before the anchor)."""
    label_offset: int = 0
    """Slot k of the block at anchor a is trained on, and drafts, the token at a + k + label_offset.
    0 (DFlash): slot 0 is the anchor itself and drafts nothing, B - 1 drafts per block. 1
    (anchor-first, the engines' `sample_from_anchor`): every slot drafts, B drafts per block."""
    logs: LogView = LogView()
    """How its own metrics.jsonl fields are shown in the progress line and the report."""

    def remote(self) -> RemoteCode | None:
        """The remote code of this architecture's exports: the `remote_code` its own class declares. An
        architecture that declares none carries none (the classes of another's would not load its tensors)."""
        return type(self).__dict__.get("remote_code")

    # ---------------------------------------------------------------------------------- the shape

    def fields_from_recipe(self, section: Any) -> Any:
        """The shape fields from the recipe's drafter section: its `drafter.<name>:` section (config.DrafterConfig
        `sections`), or, for a section without one, its attributes of the fields' names (a key it
        does not have keeps the field's default)."""
        return section_of(section, self.name, self.fields)

    def check(self, shape: DrafterShape, serving: bool = False) -> None:
        """Raise FieldError when a field does not fit the rest of the shape; with `serving`, also when an
        engine would refuse the export of this shape (docs/algorithm.md section 6, "What the engines
        refuse"): checked before a run, not on loading an export."""

    def config_entries(self, shape: DrafterShape) -> dict:
        """This architecture's `dflash_config` entries of config.json (default: every field by its name)."""
        return dataclasses.asdict(shape.arch_fields)

    def top_level_entries(self, shape: DrafterShape) -> dict:
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

    def wrappers(self, shape: DrafterShape) -> Wrappers | None:
        """Fresh modules around one layer's sublayers (called once per layer), or None."""
        return None

    def heads(self, shape: DrafterShape) -> dict[str, nn.Module]:
        """Fresh modules on the drafter beside the layers, by export name (read by the loss and the
        walk, not by the forward). Each module has `reset_parameters`."""
        return {}

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        """Every tensor the wrappers and heads hold, by export name (the layers' under `layers.{i}.`)."""
        return {}

    def backbone_from(self, shape: DrafterShape, exported: DrafterShape) -> str | None:
        """Why an export of another architecture, `exported`, cannot start the backbone (layers, fc,
        norms and wrappers) of a drafter of `shape`, its heads fresh (`drafter.init_from`); None when it
        can. By default none can."""
        return f"is a {exported.architecture} export and the drafter a {shape.architecture}"

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        """Matmul FLOPs of a step that no tensor of `tensors` accounts for (e.g. gathered lm_head rows),
        `draft_tokens` being the drafting slots' rows of the loss (DrafterShape.num_drafts a block)."""
        return 0

    # ------------------------------------------------------------------------------- the walk

    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0) -> Proposal:
        """What the engines propose at temperature 0 from the drafting slots' final states `[n, L, D]`
        (L = `DrafterShape.num_drafts`) of blocks whose anchors are `anchors` [n]: the tokens `[n, L]`
        (each slot's argmax: the target's logit transform is monotonic, so it does not change the
        argmax) and how many of each block llama.cpp verifies with `--spec-draft-p-min p_min`, which
        cuts a draft at its first slot whose confidence is below p_min. The confidence of a DFlash
        slot there is the draft sampler's probability of its top candidate among the top 10
        (DFlash2's: the selector's), which is not modelled: only p_min 0, no cut."""
        tokens = argmax_tokens(hidden, model.lm_head)
        if p_min > 0:
            raise ValueError(f"llama.cpp's --spec-draft-p-min cut of a {self.title or self.name} draft is not "
                             "modelled; predict its rounds with p_min 0")
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))

    def text_probabilities(self, model: DraftModel, hidden: torch.Tensor, following: torch.Tensor, temperature: float,
                           *, context: torch.Tensor | None = None) -> torch.Tensor | None:
        """q_s(x_s) [n, L]: the probability that this architecture's draft at `temperature` proposes the
        text's token `following` [n, L] at slot s once it proposed the text's tokens before it, from the
        drafting slots' states `hidden` [n, L, D] (sampled verification accepts a slot with min(1, q / p)).
        None (the default): the draft is the greedy one at every temperature, q a point mass on it."""
        return None

    def sampled_draft(self, model: DraftModel, hidden: torch.Tensor, temperature: float, generator: torch.Generator,
                      *, context: torch.Tensor | None = None) -> SampledDraft | None:
        """The draft the engines draw at `temperature` from the drafting slots' states [n, L, D], drawing
        from `generator`; None (the default, drawing nothing): they verify the greedy draft."""
        return None

    # ------------------------------------------------------------------------------- the loss

    def default_gamma(self, shape: DrafterShape) -> float:
        """The slot decay's gamma when the recipe sets none."""
        return blocks.default_gamma(shape.block_size)

    def block_targets(self, mb: MicroBatch, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                      *, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels and float32 weights `[b, N, B]` of micro-batch `mb`'s blocks (objective.blocks.block_targets:
        same-position labels, slot 0 weight 0)."""
        return blocks.block_targets(mb.input_ids, mb.loss_mask, mb.doc_ids, anchors, valid=valid, block_size=block_size,
                                    gamma=gamma)

    def loss_settings(self, objective: Any) -> Any:
        """Its loss settings from the recipe's objective section (config.ObjectiveConfig): its
        `objective.<name>:` section, turned into what `step_term` reads; None without one."""
        return None

    def step_term(self, settings: Any, step: int | None = None, total_steps: int = 0) -> Any:
        """The loss settings at optimizer step `step` (0-based) of `total_steps` (e.g. a weight's
        warm-up); step None: after any warm-up."""
        return settings

    def ce_weight(self, term: Any) -> float:
        """The cross-entropy's coefficient in the loss under this step's `step_term`."""
        return 1.0

    def term_weights(self, shape: DrafterShape, term: Any) -> dict[str, float]:
        """The weight of each of this architecture's loss terms under `term` (a `step_term`) that reach a
        parameter of a drafter of `shape`, by the field of `objective_keys` that sets it, or in words for
        a term no setting weighs (the pre-launch check that some term trains the drafter reads this).
        DFlash's cross-entropy is always on."""
        return {"the cross-entropy (always on)": self.ce_weight(term)}

    def trained_parts(self, shape: DrafterShape) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The parts of a drafter of `shape` that only some terms of the loss train, each with those terms'
        names (keys of `term_weights`); the other terms (the KL among them) train the drafter's drafts.
        The pre-launch check refuses a part whose every term weighs 0: it would be exported untrained.
        None here: every term reaches the drafts."""
        return ()

    def loss_terms(self, model: DraftModel, blocks: Blocks, term: Any, hidden: torch.Tensor, *, ctx: torch.Tensor,
                   mb: MicroBatch) -> tuple:
        """This architecture's terms of the loss under `term` (a `step_term`), after the cross-entropy and
        the KL (objective/loss_terms.py): `VocabTerm`s run on each chunk's logits (and the target's, when
        they read them; `needs_target_logits` then), `OutputTerm`s after the chunk loop on what it
        returned. Their sums' names are `log_names`. `hidden` `[R, N*B, D]`: the drafter's final states;
        `ctx` `[R, S, D]`: the context rows (drafter.fuse of the taps); `mb`: the micro-batch (its
        documents, the target's states)."""
        return ()

    def logit_bias(self, model: DraftModel, blocks: Blocks, hidden: torch.Tensor) -> LogitBias | None:
        """A low-rank bias of every row's logits (objective.loss_terms.LogitBias: features in the loss's row
        order, a table), folded into the loss's lm_head matmul; None for none."""
        return None

    def log_names(self, shape: DrafterShape) -> tuple[str, ...]:
        """The names of the detached sums this architecture's terms add to the loss's `sums` for a drafter
        of `shape`, summed over micro-batches and ranks."""
        return ()

    def log_record(self, sums: dict[str, float], weight: float) -> dict[str, float | list[float]]:
        """metrics.jsonl fields from the step's sums by name (`log_names`) and the step's total slot
        weight: numbers, or lists of numbers (metrics.jsonl only; wandb gets the numbers). A field
        the drafter has nothing for (a head it lacks) is left out, so that nothing shows it."""
        return {}

    def report_figures(self, steps: list[dict]) -> list[ReportFigure]:
        """The run report's panels of this architecture's own fields beyond `logs.series`, from the
        training step records (metrics.jsonl, step order); none by default."""
        return []

    # ------------------------------------------------------------------------------- the card

    def card(self, shape: DrafterShape) -> Card:
        """The model card's rows, the engines' method names and draft counts (DFlash: SGLang counts the
        anchor, vLLM and llama.cpp the drafts) and the serving note, for a drafter of `shape`."""
        b = shape.block_size
        return Card((), Serving("DFLASH", b, "dflash", b - 1, "draft-dflash", b - 1))
