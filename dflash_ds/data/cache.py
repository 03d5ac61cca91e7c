"""The prepared-data cache's layout on disk and its self-check.

An entry `data.cache_dir/<fingerprint>/` holds the rows (`<field>.npy` for each of ROW_FIELDS),
`eval.json`, `report.json`, `report.txt`, `lengths.json` and, written last, `manifest.json`: every file
with its size. `cache_damage` compares an entry with its manifest (the same check checkpoints make,
`io.size_mismatch`); a damaged entry is `discard`ed and rebuilt by `data.prepare`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dflash_ds.io import file_sizes, size_mismatch

FORMAT_VERSION = 3  # 2: lengths.json beside the audit; 3: rows of data.row_length, manifest.json
ROW_FIELDS = ("input_ids", "loss_mask", "doc_ids")
LENGTHS_FILE = "lengths.json"
MANIFEST_FILE = "manifest.json"


def write_manifest(folder: Path) -> None:
    """Every file of a finished entry with its size, written last: an entry without it was never finished."""
    files = file_sizes(folder)
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1))


def cache_damage(folder: Path) -> str | None:
    """Why a cache entry cannot be used (a file missing, of another size than written, an unreadable
    manifest), or None when every file matches its manifest."""
    try:
        files = json.loads((folder / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (the entry was never finished, or damaged)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({type(exc).__name__})"
    for name in (*(f"{k}.npy" for k in ROW_FIELDS), "eval.json", "report.json"):
        if name not in files:
            return f"{MANIFEST_FILE} does not list {name}"
    return size_mismatch(folder, files)


def discard(folder: Path) -> None:
    """Move a damaged entry aside and delete it (a reader holding it open keeps its files)."""
    aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(aside, ignore_errors=True)
