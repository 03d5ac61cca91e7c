"""Atomic writes: a reader (a resumed run, another rank, a serving engine) sees the old content or
the new one, never a torn file or a half-filled directory, even after a crash or power loss.

Everything is written under a temporary name in the destination's own directory (a rename is only
atomic within one filesystem), flushed to disk, and renamed into place; the directory entry is
flushed too, so the rename itself survives a crash.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's data (for a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; the run directory is read by other users too
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_json_atomic(path: str | os.PathLike, data: Any, indent: int | None = None) -> None:
    write_text_atomic(path, json.dumps(data, indent=indent) + ("\n" if indent is not None else ""))


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        fsync_path(p)
    fsync_path(root)


@contextmanager
def replace_dir_atomic(final: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory next to `final`; when the block ends without an error, its
    contents are flushed and it becomes `final`. On an error it is removed and `final` is untouched.

    `keep_existing=True`: when `final` exists by then (another process published the same content
    first), the staged copy is dropped and theirs is kept. Otherwise an existing `final` is replaced:
    directories cannot be swapped in one rename, so the old one is moved aside first and deleted
    only after the new one is in place (a crash in between leaves it next to `final`, not in it).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    old = None
    try:
        yield tmp
        _fsync_tree(tmp)
        if keep_existing:
            try:
                os.rename(tmp, final)
            except OSError:  # published by another process meanwhile: keep theirs
                if not final.exists():
                    raise
        else:
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
                os.rename(final, old / final.name)
            os.rename(tmp, final)
        fsync_path(final.parent)
    except BaseException:
        if old is not None and not final.exists():
            os.rename(old / final.name, final)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def file_sizes(folder: str | os.PathLike, leave_out: str = "") -> dict[str, int]:
    """Every file under `folder` (relative path -> size in bytes), except those named `leave_out`:
    what a manifest records so that a later reader can tell a complete folder from a damaged one."""
    root = Path(folder)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != leave_out}


def size_mismatch(folder: str | os.PathLike, files: dict[str, int]) -> str | None:
    """The first file of a manifest's `files` that is missing under `folder` or has another size than
    recorded (a truncated write, a disk that filled up), said in words naming it; None when all match."""
    root = Path(folder)
    for name, size in sorted(files.items()):
        p = root / name
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} is truncated or damaged ({p.stat().st_size} bytes, {size} written)"
    return None
