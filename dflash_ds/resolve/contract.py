"""The run's recipe as a contract: what a run started with is recorded, and a resume may change only
what does not change the drafter's shape, the data stream or the taps.

`run.output_dir/recipe.yaml` is the recipe of the run's first start, written by the lead drafter once the
drafter is built and its checkpoint loaded (a start that fails before that, e.g. a resume of another shape
without a record, must not become the contract the correct command is refused against), and is never
overwritten; a later
start whose recipe differs is recorded beside it (`recipe.resume-<step>.yaml`; after
`checkpoint.resume=restart` the previous run's record moves to `recipe.before-restart-<n>.yaml` and the
new run's becomes recipe.yaml). Before a resume, `compare` puts the recipe against the record:
- the drafter's shape must be equal, every field of it: the `DrafterShape` each recipe resolves to
  (with the target's config) is compared field by field, nested dataclasses included, so a field an
  architecture adds is compared without being listed here. `selector_top_k` is one: it changes no
  weight, but the export's dflash_config carries it (the engines rescore that many candidates), so a
  selector trained with one top-k would be exported with another;
- CONTRACT keys (the rows and their order, the anchors' seed, what the target taps) must be equal;
- a difference in either stops in one line naming each setting with both values; every other setting
  (learning rate and schedule, steps, checkpoints, evaluation, logging, timeouts...) may change and is
  listed in one line.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from dflash_ds.config import DrafterConfig, ObjectiveConfig, Recipe, RecipeError, build_recipe, dump_yaml
from dflash_ds.config.architectures import owners
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import RECIPE_KEYS, drafter_shape as resolve_shape, is_architecture_field, setting_of

RECORD = "recipe.yaml"

# The rows, their order on every drafter rank, the anchors drawn from them.
DATA_KEYS = ("data.path", "data.split", "data.max_samples", "data.max_length", "data.row_length", "data.pack",
             "data.truncation", "data.thinking", "data.seed", "data.eval_path", "data.eval_split", "data.num_eval",
             "data.regenerate.enabled", "data.regenerate.output_dir", "run.seed", "optim.rows_per_micro_batch",
             "optim.grad_accum", "topology.drafters_per_node")
# What the target sends: its weights and the hidden states it taps.
TAP_KEYS = ("target.path", "target.adapter", "target.dtype", "objective.kl_weight")
CONTRACT = tuple(dict.fromkeys(DATA_KEYS + TAP_KEYS))
# Changing the number of drafter ranks is what a universal checkpoint is for.
UNIVERSAL_MAY_CHANGE = ("topology.drafters_per_node",)


def flat(recipe: Recipe) -> dict[str, object]:
    """Every setting by its dotted key (tuples as lists), `source` left out."""
    out: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            elif f.name == "sections":  # an architecture's own section: drafter.<name>.<key>
                for name, section in value.items():
                    walk(section, f"{prefix}{name}.")
            elif key not in ("source", "notes"):
                out[key] = list(value) if isinstance(value, tuple) else value
    walk(recipe, "")
    return out


def _known(raw, cls) -> dict:
    """`raw` without the keys `cls` does not have (a record written by an older version); the drafter
    and objective sections keep every key, read by build_recipe (an architecture's section, or an
    older record's flat architecture key at its section)."""
    if not isinstance(raw, dict):
        return {}
    hints = typing.get_type_hints(cls)
    kept = {k: _known(v, hints[k]) if dataclasses.is_dataclass(hints[k]) else v
            for k, v in raw.items() if k in hints and k not in ("source", "notes")}
    if "sections" in hints:
        kind = {DrafterConfig: "drafter", ObjectiveConfig: "objective"}[cls]
        kept.update({k: v for k, v in raw.items() if k not in hints and (isinstance(v, dict) or owners(kind, k))})
    return kept


def recorded(run_dir: str | Path) -> Recipe | None:
    """The recipe the run in `run_dir` started with, or None when there is none. Settings an older
    version wrote and this one lacks are ignored; settings it lacks take their defaults."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        return build_recipe(_known(raw, Recipe))
    except (yaml.YAMLError, RecipeError, TypeError, ValueError) as exc:
        raise RecipeError(f"{path}: the run's recorded recipe cannot be read ({str(exc).splitlines()[0]}); restore it, "
                          "or start a new run (checkpoint.resume=restart or another run.output_dir)") from None


def _show(value) -> str:
    """A value as the recipe would write it (null, true, [1,2])."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(list(value) if isinstance(value, tuple) else value).replace(" ", "")


def shape_differences(then: DrafterShape, now: DrafterShape) -> list[tuple[str, object, object]]:
    """(field, recorded value, value now) for every field of two shapes that differs (`DrafterShape.flat`:
    an architecture's own fields by their names; a field only one shape has counts as a difference)."""
    a, b = then.flat(), now.flat()
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*b, *a]) if a.get(k) != b.get(k)]


def drafter_shape(recipe: Recipe, fallback_config=None) -> DrafterShape:
    """The shape a recipe's drafter resolves to with its target's config (`fallback_config` when the
    recorded run's target cannot be read any more: target.path itself is compared as a setting)."""
    from dflash_ds.target_model.model import load_config

    try:
        config = load_config(recipe.target.path)
    except ValueError:
        if fallback_config is None:
            raise
        config = fallback_config
    return resolve_shape(config, recipe.drafter)


def _setting_of(field: str, recipe: Recipe) -> str:
    """The recipe key that sets shape field `field`, or the field with what decides it."""
    if field in {f.name for f in dataclasses.fields(recipe.drafter)}:
        return f"drafter.{field}"
    hint = RECIPE_KEYS.get(field)
    if hint is None and is_architecture_field(field):  # a key of its architecture's section
        return setting_of(field, recipe.drafter.architecture)
    if hint and " " not in hint:
        return hint
    return f"the drafter's {field} (from {hint or 'the drafter section and the target'})"


def compare(recipe: Recipe, before: Recipe) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(contract differences, allowed differences) as (key, recorded value, value now): the drafter's
    shape field by field, the CONTRACT keys, then the settings that may change."""
    from dflash_ds.target_model.model import load_config

    shape_now = drafter_shape(recipe)
    try:
        shape_then = drafter_shape(before, fallback_config=load_config(recipe.target.path))
    except ValueError as exc:
        raise RecipeError(f"{Path(recipe.run.output_dir) / RECORD}: the recorded recipe's drafter cannot be "
                          f"resolved ({str(exc).splitlines()[0]}); resume with a version that reads it, or start a new "
                          "run (checkpoint.resume=restart or another run.output_dir)") from None
    refused = [(_setting_of(k, recipe), a, b) for k, a, b in shape_differences(shape_then, shape_now)]
    now, then = flat(recipe), flat(before)
    may_change = UNIVERSAL_MAY_CHANGE if recipe.checkpoint.universal else ()
    allowed = []
    for key in now:
        if now[key] == then.get(key):
            continue
        entry = (key, then.get(key), now[key])
        (refused if key in CONTRACT and key not in may_change else allowed).append(entry)
    # A drafter setting that changed the shape is named by its shape entry, not listed as allowed too.
    named = {k for k, _, _ in refused}
    return refused, [e for e in allowed if e[0] not in named]


def check_resume(recipe: Recipe, step: int) -> str | None:
    """Before resuming at `step`: RecipeError (one line, every differing contract key with both values)
    when the recipe changes the drafter's shape, the data stream or the taps; otherwise the one line
    listing the settings that changed (None when none did)."""
    before = recorded(recipe.run.output_dir)
    if before is None:
        return None
    refused, allowed = compare(recipe, before)
    if refused:
        diffs = "; ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in refused)
        raise RecipeError(
            f"resuming {recipe.run.output_dir} at step {step} with settings that change the drafter, its data or "
            f"its taps (recorded in {Path(recipe.run.output_dir) / RECORD} -> now): {diffs}; set them back to the "
            "recorded values, or start a new run (checkpoint.resume=restart or another run.output_dir)")
    if not allowed:
        return None
    return (f"resuming at step {step} with changed settings (allowed on resume): "
            + "; ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in allowed))


def record(recipe: Recipe, start_step: int) -> Path:
    """Write the recipe of this start into the run directory without overwriting an earlier record;
    returns the file it is in."""
    run_dir = Path(recipe.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    first = run_dir / RECORD
    text = dump_yaml(recipe)
    if first.is_file() and start_step == 0:  # a new run over the directory (restart): keep the old record
        taken = [int(m.group(1)) for p in run_dir.glob("recipe.before-restart-*.yaml")
                 if (m := re.fullmatch(r"recipe\.before-restart-(\d+)\.yaml", p.name))]
        first.rename(run_dir / f"recipe.before-restart-{max(taken, default=0) + 1}.yaml")
        # resumed records belong to the previous run too
        for p in run_dir.glob("recipe.resume-*.yaml"):
            p.rename(run_dir / f"recipe.before-restart-{max(taken, default=0) + 1}.{p.name}")
    if not first.is_file():
        first.write_text(text)
        return first
    if first.read_text() == text:
        return first
    later = run_dir / f"recipe.resume-{start_step}.yaml"
    if not later.is_file() or later.read_text() != text:
        later.write_text(text)
    return later
