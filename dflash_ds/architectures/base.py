"""The types a drafter architecture hands the rest of the package, shared by every architecture package.

The architectures themselves are classes: DFlash (v1, dflash/) with every hook, and the others
extending it (docs/architecture.md, "How to add a drafter architecture", is the contract). What
their hooks return is declared here, where code outside architectures/ may import it; the two the
drafter's shape itself uses (`FieldError`, `Tensor`) are the network's (network/shape.py).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class NoFields:
    """The shape fields of an architecture that has none of its own."""


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

    sglang_algorithm: str
    sglang_draft_tokens: int
    vllm_method: str
    vllm_tokens: int
    llama_cpp_type: str | None  # None: llama.cpp does not load this drafter
    llama_cpp_draft_max: int
    vllm_v2_only: str | None = None
    """What vLLM's V1 model runner (its CPU build's only one) refuses in this drafter, in words; None: the
    V1 runner serves it. Model Runner V2 (GPU) serves every architecture."""


class Proposal(NamedTuple):
    """What the engines propose from n blocks at temperature 0 (`DFlash.propose`)."""

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


class LogView(NamedTuple):
    """How an architecture's own metrics.jsonl fields are shown (metrics.py and report.py read this,
    never a field's name): `progress` entries of the progress line and `summary` rows of the report,
    each a format string over the step record shown when every field it names is in the record (a
    field the step did not log, e.g. a head the drafter lacks, hides it); `series` the report's step
    panels it is drawn in, as (panel stem, field, legend label)."""

    progress: tuple[str, ...] = ()
    series: tuple[tuple[str, str, str], ...] = ()
    summary: tuple[tuple[str, str], ...] = ()


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


def argmax_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Greedy tokens of drafter states [..., D] through the target lm_head, in chunks of rows so
    the [rows, vocab] logits of a 248K vocabulary stay small."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head.to(device=flat.device, dtype=flat.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = (flat[i:i + chunk] @ w.T).argmax(-1)
    return out.view(hidden.shape[:-1])
