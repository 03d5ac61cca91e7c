"""The files a recipe names, checked before launch: local paths that exist, weights that are whole.

A truncated or half-copied model.safetensors loads only when a rank reaches it, tens of seconds into
the job, and fails there with a traceback. Its header says how long it must be, so reading the first
bytes of each weight file finds it now, with one line naming the setting and the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.data.sources import local_path_problem

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file (missing, not one, shorter than its header says), or None.
    Reads the header only."""
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                return f"{path} is not a safetensors file ({size} bytes, no readable header)"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path} is not a safetensors file (its header cannot be read: {type(exc).__name__})"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is not a JSON object)"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{path} is not a safetensors file (its header lists no tensor offsets)"
    if size < 8 + n + end:
        return f"{path} is truncated ({size} bytes, its header says {8 + n + end})"
    return None


def weights_problem(folder: Path) -> str | None:
    """The first weight file of a model directory that is missing or damaged (a sharded checkpoint's
    index names its shards), None when all are whole. Directories with only .bin weights are left to
    their loader (no header to read)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            return problem
    return None


def check_files(recipe: Recipe) -> None:
    """Every local path the recipe's model settings name exists, and the weights in it are whole;
    RecipeError naming the setting and the file otherwise. Hub ids are left to their download."""
    t, d = recipe.target, recipe.drafter
    for setting, path in (("target.path", t.path), ("target.adapter", t.adapter), ("drafter.init_from", d.init_from),
                          ("data.path", recipe.data.path), ("data.eval_path", recipe.data.eval_path)):
        problem = local_path_problem(path, setting) if path else None
        if problem:
            raise RecipeError(problem)
    for setting, path in (("target.path", t.path), ("target.adapter", t.adapter), ("drafter.init_from", d.init_from)):
        if path and Path(path).is_dir():
            problem = weights_problem(Path(path))
            if problem:
                raise RecipeError(f"{setting}: {problem}; copy the model again (or point {setting} at a whole one)")
