"""Reading a recipe: YAML text and `key.sub=value` overrides into a typed, validated Recipe, and back.

Every value is coerced to its field's type as it is read, so a wrong type or an unknown key stops
with one line naming its dotted path (and, for a key, the keys known there); YAML syntax errors name
the file, line and column, and a key given twice both its lines (config/yaml_text.py). A recipe that
names a `base:` is read laid over it (config/derive.py). The value checks run last (config/checks.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from dflash_ds.config.architectures import KINDS, other_sections, owners, registered, section_type

from dflash_ds.config.checks import validate
from dflash_ds.config.derive import with_bases
from dflash_ds.config.errors import RecipeError
from dflash_ds.config.recipe import Recipe
from dflash_ds.config.yaml_text import read_yaml


def _coerce(value, tp, path: str, moves: list | None = None):
    """`value` read from YAML (or an override) as type `tp`; `path` is its dotted key for the error line.
    Strings are accepted for booleans and numbers because overrides may arrive as text."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            return tp()
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping of settings, got {value!r}")
        return _build(tp, value, path, moves)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}: expected a list, got {value!r}")
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
            return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecipeError(f"{path}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RecipeError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise RecipeError(f"{path}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise RecipeError(f"{path}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RecipeError(f"{path}: expected a number, got {value!r}") from None
        # nan or inf in any setting (a rate, a weight, a timeout) trains NaN or never ends, silently.
        if not math.isfinite(number):
            raise RecipeError(f"{path}: expected a finite number, got {value!r}; set a finite value")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise RecipeError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


# Keys a recipe may no longer set, and what to do instead: one line, never a silent default.
REMOVED = {
    "objective.fused_loss": "the fused lm_head loss is the only loss; delete the key",
}


class Moved(NamedTuple):
    """A flat key of an older recipe read at its architecture's section (`old` -> `new`)."""

    old: str
    new: str
    architecture: str

    def note(self, arch: str) -> str:
        """The line the launch says about it, for a recipe whose drafter is `arch`."""
        unread = "" if self.architecture == arch else (
            f", a {self.architecture} setting: this drafter is drafter.architecture: {arch} and trains without it "
            f"(remove it, or set drafter.architecture: {self.architecture})")
        return f"recipe key '{self.old}' moved to '{self.new}'{unread}; read there for now: move it in the recipe"


def _sections(kind: str, cls, raw: dict, moves: list[Moved]) -> dict:
    """`raw` (the drafter or objective section) with the architectures' sections typed into
    `sections`: `<kind>.<name>:` for a registered architecture `name`, and a flat key of an older
    recipe that one architecture's section now holds moved there (recorded in `moves`)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"sections"}
    out, given, moved = {}, {}, {}
    for key, value in raw.items():
        if key in names or not isinstance(key, str):
            out[key] = value
        elif section_type(kind, key) is not None:
            if value is not None and not isinstance(value, dict):
                raise RecipeError(f"{kind}.{key}: expected a mapping of {key} settings, got {value!r}")
            given[key] = dict(value or {})
        elif len(owner := owners(kind, key)) == 1:
            moved.setdefault(owner[0], {})[key] = value
            moves.append(Moved(f"{kind}.{key}", f"{kind}.{owner[0]}.{key}", owner[0]))
        else:
            out[key] = value  # unknown: _build names it with the known keys
    for name, values in moved.items():
        both = sorted(set(values) & set(given.get(name, {})))
        if both:
            raise RecipeError(f"{kind}.{both[0]} and {kind}.{name}.{both[0]} are both set; keep {kind}.{name}.{both[0]} "
                              "only (the flat key is an older recipe's)")
        given[name] = {**given.get(name, {}), **values}
    sections = {name: _build(section_type(kind, name), values, f"{kind}.{name}", moves)
                for name, values in given.items()}
    return {**out, "sections": sections} if sections else out


def _build(cls, raw: dict, prefix: str = "", moves: list[Moved] | None = None):
    """An instance of the dataclass `cls` from a mapping; a key it has no field for is refused, naming
    the keys it does have (the fields left out keep their defaults). The drafter and objective
    sections also take the architectures' own sections (config/architectures.py); a flat key an
    older recipe set there is read at its new place and recorded in `moves`."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    moves = [] if moves is None else moves
    if prefix in KINDS and any(k not in names or k == "sections" for k in raw):
        raw = _sections(prefix, cls, raw, moves)
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in REMOVED:
            raise RecipeError(f"recipe key '{path}' is gone: {REMOVED[path]}")
        if key == "sections" and prefix in KINDS and isinstance(value, dict) and \
                all(dataclasses.is_dataclass(v) for v in value.values()):
            kwargs[key] = value
            continue
        if key not in names or key in ("sections", "notes"):
            known = ", ".join(sorted(n for n in names if n not in ("source", "sections", "notes")))
            extra = "" if prefix not in KINDS else "; architecture sections: " + ", ".join(
                sorted(name for name, s in registered().items() if getattr(s, prefix) is not None))
            raise RecipeError(f"unknown recipe key '{path}'; known keys here: {known}{extra}")
        kwargs[key] = _coerce(value, hints[key], path, moves)
    return cls(**kwargs)


def build_recipe(raw: dict) -> Recipe:
    """A Recipe from a mapping of sections (types checked, unknown keys refused, an older recipe's flat
    architecture keys read at their sections; not validated)."""
    return _build(Recipe, raw)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    """Set `a.b.c` in a nested mapping, creating the sections on the way (an override may name a
    section the file leaves out)."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key.sub=value` strings as (dotted key, value) pairs, each value parsed as YAML."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override '{item}' is not of the form key.sub=value")
        key, text = item.split("=", 1)
        # YAML parses the value so that numbers, booleans, null and [lists] work as in the file.
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"override '{item}': the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                              "quote it, e.g. key='[a, b]'") from None
        out.append((key.strip(), value))
    return out


def _read_file(path: Path) -> dict:
    """One recipe file's own mapping (its `base:` still in it), read strictly (config/yaml_text.py): a
    file that is not YAML, or not a mapping, stops naming it."""
    raw = read_yaml(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: the recipe must be a mapping of sections (run, target, drafter, ...)")
    return raw


def recipe_mapping(path: str | os.PathLike) -> dict:
    """The recipe file as the one whole mapping it stands for, its bases laid under it (config/derive.py);
    neither typed nor checked. What reads a recipe's YAML without load_recipe reads it through this."""
    if not Path(path).is_file():
        raise RecipeError(f"recipe file {str(path)!r} not found; pass a path such as recipes/tiny.yaml")
    return with_bases(Path(path), _read_file)


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe (laid over its `base:` when it names one), apply `key.sub=value` overrides,
    validate and return it."""
    p = Path(path)
    raw = recipe_mapping(p)
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(raw, key, value)
    moves: list[Moved] = []
    recipe = _build(Recipe, raw, "", moves)
    recipe = dataclasses.replace(recipe, source=str(p), notes=tuple(_notes(recipe, moves)))
    # Recipes written when resume was a boolean keep working.
    legacy = {"true": "auto", "false": "restart"}.get(recipe.checkpoint.resume.lower())
    if legacy:
        recipe = dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, resume=legacy))
    validate(recipe)
    return recipe


def _notes(recipe: Recipe, moves: list[Moved]) -> list[str]:
    """One line per flat key an older recipe set (where it is read now) and per other architecture whose
    sections the recipe sets (this drafter trains without them); the launch prints them once."""
    arch = recipe.drafter.architecture
    lines = [m.note(arch) for m in moves]
    moved = {m.architecture for m in moves}
    drafter = dataclasses.replace(recipe.drafter, sections={k: v for k, v in recipe.drafter.sections.items()
                                                            if k not in moved})
    objective = dataclasses.replace(recipe.objective, sections={k: v for k, v in recipe.objective.sections.items()
                                                                if k not in moved})
    return lines + other_sections(arch, drafter, objective)


def dump_yaml(r: Recipe) -> str:
    """The recipe as YAML, sections and keys in declaration order (an architecture's own sections after
    the shared keys of theirs); load_recipe reads it back unchanged."""
    d = dataclasses.asdict(r)
    d.pop("source", None)
    d.pop("notes", None)
    for kind in KINDS:
        d[kind].update(d[kind].pop("sections", {}))
    # Tuples are written as lists so the dump loads back through load_recipe.
    return yaml.safe_dump(json.loads(json.dumps(d)), sort_keys=False)
