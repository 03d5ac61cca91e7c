"""Recipes that derive: a recipe may name a `base:` recipe and hold only what differs from it.

`base: tiny.yaml` is a path relative to the folder of the file that names it. The base is read first
(its own base before it), and the file is laid over it section by section: a mapping merges key by
key, at every depth; a value, a list or null replaces the base's; a section left empty (`eval:` with
nothing under it) changes nothing, since an empty section and a missing one read alike in any recipe.
The result is one whole mapping: typed, checked and recorded in the run directory exactly as a recipe
written out in full (the record names no base), so a derived recipe and the whole file it stands for
cannot be told apart after loading."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from dflash_ds.config.errors import RecipeError

BASE_KEY = "base"


def with_bases(path: Path, read: Callable[[Path], dict]) -> dict:
    """The recipe at `path` as one whole mapping: `read(file)` (a file's own mapping) for it and every
    base below it, each file laid over its base. A missing base, a base that is not a path and a cycle
    of bases stop with one line naming the file and the fix."""
    return _derived(Path(path), read, ())


def merged(base: dict, over: dict) -> dict:
    """`over` laid over `base`: mappings merge key by key, anything else replaces; an empty section
    (null where the base has a mapping) keeps the base's."""
    out = dict(base)
    for key, value in over.items():
        below = base.get(key)
        if isinstance(below, dict) and (value is None or isinstance(value, dict)):
            out[key] = merged(below, value or {})
        else:
            out[key] = value
    return out


def _shown(path: Path) -> str:
    return os.path.normpath(path)


def _derived(path: Path, read: Callable[[Path], dict], below: tuple[Path, ...]) -> dict:
    raw = read(path)
    if BASE_KEY not in raw:
        return raw
    name = raw.pop(BASE_KEY)
    here = _shown(path)
    folder = _shown(path.parent)
    if not isinstance(name, str) or not name.strip():
        raise RecipeError(f"{here}: base: {name!r} is not a recipe file; set base: to one recipe's path, "
                          f"relative to {folder}/ (e.g. base: tiny.yaml), or remove the key")
    base = path.parent / name
    chain = (*below, path)
    if any(base.resolve() == p.resolve() for p in chain):
        loop = " -> ".join(_shown(p) for p in (*chain, base))
        raise RecipeError(f"{here}: base: {name} closes a cycle of bases ({loop}); remove one of these base: keys")
    if not base.is_file():
        raise RecipeError(f"{here}: base: {name} not found (looked for {_shown(base)}); "
                          f"name a recipe file relative to {folder}/, the folder of the recipe that names it")
    return merged(_derived(base, read, chain), raw)
