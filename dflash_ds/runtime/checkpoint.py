"""Checkpoints: the drafter engine + run position, written so that a crash never loses one.

DeepSpeed writes each checkpoint into its own tag directory. Once every drafter rank finished,
the lead writes `<tag>/complete.json` (every file with its size), the last file of the checkpoint,
and then replaces `latest.json` (ours, not DeepSpeed's `latest`) atomically. A checkpoint is
complete when its complete.json exists and every file it lists has its size, and only then: a
truncated file is found by its size before torch reads it, and a write cut short before the end
leaves no complete.json. The run position is
the step number: the data order and the anchors are functions of (seed, micro-batch id), so
nothing else needs saving for an identical stream.

Where to start is decided once, on the lead (global rank 0), by `checkpoint.resume`:
  auto      latest.json's checkpoint; a missing, unreadable or incomplete one stops the run
  fallback  the same, but falls back to the newest complete earlier checkpoint with a warning
  restart   step 0: the previous run's checkpoints are moved aside into
            `checkpoints/previous-<time>/` (`set_aside`), so none of them is pruned into, or resumed
            by, the new run
A directory with checkpoints but no latest.json never restarts silently under auto. Pruning keeps
the newest `checkpoint.keep_last` checkpoints up to the one just written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.io import file_sizes, size_mismatch, write_json_atomic
from dflash_ds.runtime.deepspeed_patches import barriers_on
from dflash_ds.runtime.watchdog import waiting_on
from dflash_ds.safety import CheckpointError, say

LATEST = "latest.json"
MANIFEST = "complete.json"
MODES = ("auto", "fallback", "restart")
ASIDE = "previous-"  # checkpoints/previous-<time>/: a run's checkpoints moved aside by a restart


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    return int(tag[len("step"):])


def tags(ck: Path) -> list[str]:
    """Checkpoint tags present, oldest first (universal conversions are not separate checkpoints)."""
    if not ck.is_dir():
        return []
    return sorted(p.name for p in ck.iterdir() if p.is_dir() and p.name.startswith("step")
                  and p.name[4:].isdigit())


def verify(tag_dir: Path) -> str | None:
    """None when `tag_dir` is a complete checkpoint, else what is wrong with it (naming the file)."""
    if not tag_dir.is_dir():
        return f"checkpoint directory {tag_dir} does not exist"
    manifest = tag_dir / MANIFEST
    if not manifest.is_file():
        return f"{tag_dir} is incomplete (no {MANIFEST}: its write did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({type(exc).__name__}: {exc})"
    return size_mismatch(tag_dir, files)


def latest(run_dir: str | Path) -> dict | None:
    """latest.json's content when it names a complete checkpoint, else None (no error raised)."""
    try:
        info = json.loads((checkpoint_dir(run_dir) / LATEST).read_text())
        return info if verify(checkpoint_dir(run_dir) / info["tag"]) is None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve(run_dir: str | Path, mode: str) -> dict | None:
    """Where this run starts: {"tag", "step"} (plus "warning" after a fallback) or None for step 0.

    Runs on the lead only; raises CheckpointError with one line naming the file at fault.
    """
    if mode not in MODES:
        raise CheckpointError(f"checkpoint.resume must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "restart":
        return None
    ck = checkpoint_dir(run_dir)
    path = ck / LATEST
    present = tags(ck)
    bad = None
    if path.is_file():
        try:
            info = json.loads(path.read_text())
            tag, step = str(info["tag"]), int(info["step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"{path} is unreadable ({type(exc).__name__}: {exc})"
        else:
            problem = verify(ck / tag)
            if problem is None:
                return {"tag": tag, "step": step}
            problem, bad = f"{path} names {tag}, but {problem}", tag
    elif present:
        problem = f"{ck} holds checkpoints ({', '.join(present[-3:])}) but no {LATEST}"
    else:
        return None
    if mode == "fallback":
        for tag in reversed(present):
            if tag != bad and verify(ck / tag) is None:
                return {"tag": tag, "step": step_of(tag),
                        "warning": f"{problem}; falling back to the newest complete checkpoint {ck / tag}"}
        raise CheckpointError(f"{problem}, and no complete earlier checkpoint exists; set checkpoint.resume=restart "
                              "to start over from step 0")
    raise CheckpointError(f"{problem}; {_earlier(run_dir, bad)}")


def set_aside(run_dir: str | Path) -> Path | None:
    """Move everything of the previous run in `checkpoints/` (its tags, latest.json) into
    `checkpoints/previous-<time>/`; returns that directory, None when there was nothing to move.
    Called by the lead under the run lock when `checkpoint.resume=restart` starts a run over a directory."""
    ck = checkpoint_dir(run_dir)
    old = [p for p in ck.iterdir() if not p.name.startswith(ASIDE)] if ck.is_dir() else []
    if not old:
        return None
    aside = ck / f"{ASIDE}{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while aside.exists():
        n += 1
        aside = ck / f"{ASIDE}{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    aside.mkdir()
    for p in old:
        os.rename(p, aside / p.name)
    return aside


def mismatch(text: str) -> str | None:
    """The parameters a model and a state dict disagree on, in one line, from torch's load_state_dict
    error (missing keys, unexpected keys, shapes); None when `text` is not such an error."""
    if "Error(s) in loading state_dict" not in text and "size mismatch for" not in text:
        return None

    def keys(label: str) -> list[str]:
        m = re.search(label + r" key\(s\) in state_dict: (.*?)\.\s*(?:\n|$)", text)
        return re.findall(r'"([^"]+)"', m.group(1)) if m else []

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")

    parts = []
    if missing := keys("Missing"):
        parts.append(f"{len(missing)} missing from the checkpoint: {some(missing)}")
    if unexpected := keys("Unexpected"):
        parts.append(f"{len(unexpected)} unexpected: {some(unexpected)}")
    shapes = re.findall(r"size mismatch for ([^:]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                        r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)", text)
    if shapes:
        shown = "; ".join(f"{n} {a} in the checkpoint, {b} now" for n, a, b in shapes[:3])
        parts.append(f"{len(shapes)} of another shape: {shown}" + (f" (+{len(shapes) - 3} more)" if len(shapes) > 3 else ""))
    return "; ".join(parts) or text.strip().splitlines()[0]


def _earlier(run_dir: str | Path, tag: str | None) -> str:
    """The way out after `tag` would not load: fallback when another complete checkpoint exists, else restart."""
    ck = checkpoint_dir(run_dir)
    other = next((t for t in reversed(tags(ck)) if t != tag and verify(ck / t) is None), None)
    if other is not None:
        return (f"set checkpoint.resume=fallback to continue from the newest complete checkpoint ({other}), or "
                "checkpoint.resume=restart to start over from step 0")
    return "no complete checkpoint exists to fall back to; set checkpoint.resume=restart to start over from step 0"


def load_failure(exc: BaseException, run_dir: str | Path, tag: str) -> str:
    """One line for a checkpoint that did not load. A drafter of another shape than the one that wrote
    it (missing / unexpected parameters, other shapes) is a recipe change, which no earlier checkpoint
    of the run can help with; a damaged file is, when an earlier complete checkpoint exists."""
    where = checkpoint_dir(run_dir) / tag
    why = mismatch(str(exc))
    if why is not None:
        recorded = Path(run_dir) / "recipe.yaml"
        # Advise the record only where there is one (a run directory copied without it has none).
        settings = (f"the settings recorded in {recorded}" if recorded.is_file() else
                    f"the drafter settings that wrote it (no {recorded} records them)")
        return (f"checkpoint {where} does not fit the drafter this recipe builds ({why}): the recipe changed the "
                f"drafter since the run started; resume with {settings}, "
                "or start a new run (checkpoint.resume=restart or another run.output_dir)")
    return f"could not load checkpoint {where}: {describe_error(exc)}; {_earlier(run_dir, tag)}"


def describe_error(exc: BaseException, folder: Path | None = None) -> str:
    """The cause of a failed write in words: errno text and file when known (disk full, read-only...);
    a permission error says that `folder` (where the write went) is not writable."""
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and folder is not None:
        return f"{folder} is not writable ({os.strerror(exc.errno)}: {exc.filename})"
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{os.strerror(exc.errno)}{where}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    rust = re.search(r"Os \{ code: (\d+)", text)  # safetensors (Rust) reports the errno inside its text
    if rust:
        return f"{os.strerror(int(rust.group(1)))} ({type(exc).__name__}: {text})"
    if any(k in text for k in ("inline_container", "iostream", "file write failed", "PytorchStreamWriter")):
        # torch's writer reports a short write without errno; name the likely causes instead.
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        why = (f"the file-size limit (ulimit -f) is {soft} bytes" if soft != resource.RLIM_INFINITY
               else "disk full, quota or I/O error")
        return f"a write was cut short ({why}; torch: {text})"
    return f"{type(exc).__name__}: {text}"


def _space_note(path: Path) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; {free / 2**20:.0f} MiB free there" if free < 2**30 else ""


def _any(flag: bool, group, device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    with waiting_on("the checkpoint vote", dist.get_process_group_ranks(group)):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def save(engine, run_dir: str | Path, step: int, group, *, is_lead: bool, keep_last: int) -> str:
    """Collective over the drafter group. Returns the tag written.

    A failed write on any drafter rank (disk full, permissions, I/O error) removes the partial tag
    directory and raises CheckpointError on every drafter rank; latest.json, the older checkpoints
    and the export are untouched, because they are only replaced after a complete write.
    """
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    ck = checkpoint_dir(run_dir)
    tag = tag_of(step)
    state = {"step": step, "rng_cpu": torch.get_rng_state(), UNIVERSAL_CHECKPOINT_INFO: {}}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state()
    error = None
    try:
        # DeepSpeed logs and swallows a failed makedirs, and torch then reports a "parent directory
        # that does not exist": creating it here first keeps the real cause (permissions, a read-only disk).
        (ck / tag).mkdir(parents=True, exist_ok=True)
        with barriers_on(group):
            engine.save_checkpoint(str(ck), tag=tag, client_state=state, save_latest=False)
    except (OSError, RuntimeError) as exc:  # torch reports a full disk as RuntimeError
        error = exc
    failed = _any(error is not None, group, engine.device)
    if not failed and is_lead:
        try:
            files = file_sizes(ck / tag, leave_out=MANIFEST)
            write_json_atomic(ck / tag / MANIFEST, {"step": step, "files": files}, indent=1)
            write_json_atomic(ck / LATEST, {"tag": tag, "step": step}, indent=1)
        except OSError as exc:
            error = exc
    failed = _any(error is not None, group, engine.device)
    if failed:
        if is_lead:
            shutil.rmtree(ck / tag, ignore_errors=True)
        cause = describe_error(error, ck) + _space_note(ck) if error is not None else "it failed on another drafter rank"
        prev = next((t for t in reversed(tags(ck)) if t != tag and verify(ck / t) is None), None)
        kept = f"the previous checkpoint {ck / prev} is untouched" if prev else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint {ck / tag}: {cause}; the partial directory was removed and "
                              f"{kept}")
    if is_lead:
        prune(ck, keep_last, step)
    with waiting_on("the checkpoint barrier", dist.get_process_group_ranks(group)):
        dist.barrier(group=group)
    return tag


def prune(ck: Path, keep_last: int, step: int) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `step` (the one just written)."""
    upto = [t for t in tags(ck) if step_of(t) <= step]
    for old in upto[:-keep_last]:
        shutil.rmtree(ck / old, ignore_errors=True)


def load(engine, run_dir: str | Path, group, info: dict | None, *, universal: bool = False,
         is_lead: bool = False) -> int:
    """Restore the checkpoint `info` chose (resolve() on the lead, shared with every rank).

    Returns the step to continue from (0 when `info` is None).
    """
    if info is None:
        return 0
    ck = checkpoint_dir(run_dir)
    tag = info["tag"]
    if universal:
        if not (ck / f"{tag}_universal").is_dir():
            raise CheckpointError(f"checkpoint.universal is true but {ck / (tag + '_universal')} does not exist; run "
                                  f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {ck / tag} "
                                  f"--output_folder {ck / (tag + '_universal')}")
        tag = f"{tag}_universal"
    try:
        with barriers_on(group):
            _, state = engine.load_checkpoint(str(ck), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except Exception as exc:  # noqa: BLE001  torch/pickle errors from a damaged file name no path
        raise CheckpointError(load_failure(exc, run_dir, tag)) from None
    if state is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {ck / tag}; {_earlier(run_dir, tag)}")
    torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng_cuda"])
    if is_lead:
        say(f"resumed from step {int(state['step'])} (checkpoint {ck / tag})")
    return int(state["step"])
