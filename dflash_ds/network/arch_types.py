"""The values a drafter architecture's parts hand the rest of the package (network/contract.py is the
contract itself): its recipe sections' base types (`Fields`, `Keys`), the modules around a layer
(`Wrappers`), what its walk proposes (`Proposal`, `SampledDraft`), how its logs are shown (`LogView`,
`ReportFigure`), what the card says of it (`Card`, `Serving`) and the remote code its exports carry
(`RemoteCode`). Code outside architectures/ imports them from here; the two the drafter's shape itself
uses (`FieldError`, `Tensor`) are the shape's (network/shape.py).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dflash_ds.config.architectures import section_of

if TYPE_CHECKING:
    from dflash_ds.network.shape import DrafterShape

CE_ALWAYS_ON = "the cross-entropy (always on)"
"""How the pre-launch check names the cross-entropy of an architecture whose recipe does not weigh it."""


class Fields:
    """The base of an architecture's `fields`: its recipe section `drafter.<name>:`, which is also its
    shape fields (`DrafterShape.arch_fields`, written to config.json's `dflash_config`). A subclass is
    a frozen dataclass with a docstring per field; it overrides what it reads or writes otherwise."""

    @classmethod
    def from_recipe(cls, section: Any, name: str) -> Any:
        """The fields from the recipe's drafter section: its `drafter.<name>:` section, or, for a section
        without one, its attributes of the fields' names (a key it lacks keeps its default)."""
        return section_of(section, name, cls)

    def check_shape(self, shape: DrafterShape, serving: bool = False) -> None:
        """Raise FieldError when a field does not fit the rest of the shape; with `serving`, also when an
        engine would refuse the export of this shape (docs/algorithm.md section 6, "What the engines
        refuse"): checked before a run, not on loading an export."""

    def config_entries(self, shape: DrafterShape) -> dict:
        """Its `dflash_config` entries of config.json (default: every field by its name)."""
        return dataclasses.asdict(self)

    def top_level_entries(self, shape: DrafterShape) -> dict:
        """config.json entries beside `dflash_config` that the architecture's readers look for there."""
        return {}

    @classmethod
    def from_config(cls, dflash_config: dict, *, class_name: str) -> Any:
        """Inverse of `config_entries`: every field must be present (`class_name` names the export's kind)."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in dflash_config]
        if missing:
            raise ValueError(f"a {class_name} config.json needs dflash_config.{', '.join(missing)}")
        return typed(cls, {n: dflash_config[n] for n in names})


@dataclass(frozen=True)
class NoFields(Fields):
    """The shape fields of an architecture that has none of its own."""


class Keys:
    """The base of an architecture's `objective_keys`: its recipe section `objective.<name>:` (its loss
    settings), a frozen dataclass with a docstring per field."""

    def check(self) -> None:
        """Raise ValueError (beginning with the field's name) for a value that is wrong on its own."""

    def weights(self, shape: DrafterShape) -> dict[str, float]:
        """The weight of each of its loss terms that reaches a parameter of a drafter of `shape` (after any
        warm-up), by the field that sets it, or in words for a term no field weighs: the pre-launch check
        that some term trains the drafter reads this. The default: the cross-entropy, always on."""
        return {CE_ALWAYS_ON: 1.0}

    def trained_parts(self, shape: DrafterShape) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The parts of a drafter of `shape` that only some of its terms train, each with those terms' names
        (keys of `weights`); the other terms (the KL among them) train the drafts. The pre-launch check
        refuses a part whose every term weighs 0: it would be exported untrained. The default: none."""
        return ()


class Wrappers(NamedTuple):
    """The modules a variant puts around a layer's two sublayers, each under its export name. A wrapper
    has `prepare(x) -> (h, state)` (h goes into the sublayer) and `finish(y, state) -> out` (added to
    the residual)."""

    attention: tuple[str, nn.Module]
    mlp: tuple[str, nn.Module]


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

    sglang_algorithm: str | None  # None: SGLang does not serve this drafter
    sglang_draft_tokens: int
    vllm_method: str
    vllm_tokens: int
    llama_cpp_type: str | None  # None: llama.cpp does not load this drafter
    llama_cpp_draft_max: int
    vllm_v2_only: str | None = None
    """What vLLM's V1 model runner (its CPU build's only one) refuses in this drafter, in words; None: the
    V1 runner serves it. Model Runner V2 (GPU) serves every architecture."""


class Proposal(NamedTuple):
    """What the engines propose from n blocks at temperature 0 (`Walk.propose`)."""

    tokens: torch.Tensor  # [n, L] the greedy drafts (what `DraftModel.draft` returns)
    served: torch.Tensor  # [n] how many of them it verifies under its confidence cut (L without one)
    confidence: torch.Tensor | None = None  # [n, L] what the cut compares with the threshold; None: no cut
    text_q: torch.Tensor | None = None  # [n, L] q of the text's tokens under the sampled draft (eval.tau), or None


class SampledDraft(NamedTuple):
    """A draft drawn at a sampling temperature, as the engines draw an architecture's whose drafts they
    sample (LiLiCorr): the tokens, each slot's proposal distribution over the vocabulary (what the
    verifier's min(1, p / q) and residual max(0, p - q) read) and `text_q`, q of a text's tokens
    [n, L] along the same walk (what offline sampled tau reads)."""

    tokens: torch.Tensor  # [n, L]
    q: torch.Tensor  # [n, L, V]
    text_q: Callable[[torch.Tensor], torch.Tensor]


def _no_fields(sums: dict[str, float], weight: float) -> dict:
    return {}


def _no_figures(steps: list[dict]) -> list:
    return []


class LogView(NamedTuple):
    """What an architecture's logs become (metrics.py, report.py and the trainer read this, never a
    field's name): `record` makes the metrics.jsonl fields from the step's sums by name (its terms'
    named logs, summed over micro-batches and ranks) and the step's slot weight: numbers, or lists of
    numbers (metrics.jsonl only; wandb gets the numbers), a field the drafter has nothing for (a head it
    lacks) left out so that nothing shows it. `progress` entries of the progress line and `summary`
    rows of the report are format strings over the step record, shown when every field they name is
    in it; `series` the report's step panels a field is drawn in, as (panel stem, field, legend label);
    `figures` panels of its own from the step records (metrics.jsonl, step order)."""

    record: Callable[[dict[str, float], float], dict] = _no_fields
    progress: tuple[str, ...] = ()
    series: tuple[tuple[str, str, str], ...] = ()
    summary: tuple[tuple[str, str], ...] = ()
    figures: Callable[[list[dict]], list] = _no_figures


class RemoteCode(NamedTuple):
    """The transformers remote code an export carries: `source`, the file copied into it as `name`,
    config.json's `auto_map` (the classes of that file AutoConfig / AutoModel load), and `beside`, files
    copied next to it under their own names that it imports relatively (transformers' remote-code loader
    copies a local directory's relative imports along)."""

    source: Path
    name: str
    auto_map: dict[str, str]
    beside: tuple[Path, ...] = ()


class Card(NamedTuple):
    """What the model card says of an architecture's drafter of one shape: its table rows (markdown
    `| name | value |`), how the engines serve it, and the lines of the serving section before the
    commands."""

    rows: tuple[str, ...]
    serving: Serving
    note: tuple[str, ...] = ()


def typed(fields: type, values: dict) -> Any:
    """`fields(**values)` with each int, float or bool field converted to its declared type (JSON and
    YAML give 2.0 or "2" as readily as 2)."""
    hints = typing.get_type_hints(fields)
    return fields(**{k: hints[k](v) if hints.get(k) in (int, float, bool) else v for k, v in values.items()})


class StepSizes(NamedTuple):
    """The sizes of one micro-batch's drafter step that memory follows (`Modules.extra_activation_bytes`):
    the planner (resolve/plan.py) fills them from the recipe before any tensor exists."""

    rows: int
    """Rows of the micro-batch (optim.rows_per_micro_batch)."""
    row_length: int
    """Tokens of a row: the context the blocks attend to (data.row_length)."""
    blocks: int
    """Blocks of the micro-batch, over all its rows (objective.num_anchors a row)."""
    block_size: int
    drafts: int
    """Drafting slots a block (`DrafterShape.num_drafts`): the loss's rows a block."""
    loss_chunks: int

    @property
    def queries(self) -> int:
        """Block queries the layers run: every slot of every block."""
        return self.blocks * self.block_size

    @property
    def draft_rows(self) -> int:
        """Rows of the loss: the drafting slots of every block."""
        return self.blocks * self.drafts

    @property
    def chunk_rows(self) -> int:
        """Rows of one loss chunk, whose [rows, vocab] logits the loss holds at a time."""
        return -(-self.draft_rows // self.loss_chunks)
