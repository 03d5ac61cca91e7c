"""Checkpoints: the drafter engine + run position, written so that a crash never loses one.

DeepSpeed writes each checkpoint into its own tag directory; `latest.json` (ours, not DeepSpeed's
`latest`) is replaced atomically only after every drafter rank finished writing, so resume always
finds a complete checkpoint. The run position is the step number: the data order and the anchors
are functions of (seed, micro-batch id), so nothing else needs saving for an identical stream.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.io import write_json_atomic
from dflash_ds.runtime.deepspeed_patches import barriers_on

LATEST = "latest.json"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> dict | None:
    p = checkpoint_dir(run_dir) / LATEST
    if not p.is_file():
        return None
    info = json.loads(p.read_text())
    return info if (checkpoint_dir(run_dir) / info["tag"]).is_dir() else None


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def save(engine, run_dir: str | Path, step: int, group, is_lead: bool, keep_last: int, extra: dict | None = None) -> str:
    """Collective over the drafter group. Returns the tag written."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    ck = checkpoint_dir(run_dir)
    tag = tag_of(step)
    state = {"step": step, "rng_cpu": torch.get_rng_state(), UNIVERSAL_CHECKPOINT_INFO: {}}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state()
    state.update(extra or {})
    with barriers_on(group):
        engine.save_checkpoint(str(ck), tag=tag, client_state=state, save_latest=False)
    dist.barrier(group=group)
    if is_lead:
        write_json_atomic(ck / LATEST, {"tag": tag, "step": step}, indent=1)
        prune(ck, keep_last)
    dist.barrier(group=group)
    return tag


def prune(ck: Path, keep_last: int) -> None:
    tags = sorted(p for p in ck.iterdir() if p.is_dir() and p.name.startswith("step") and not p.name.endswith("_universal"))
    for old in tags[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load(engine, run_dir: str | Path, group, universal: bool = False) -> int:
    """Restore the newest complete checkpoint; returns the step to continue from (0 if none)."""
    info = latest(run_dir)
    if info is None:
        return 0
    ck = checkpoint_dir(run_dir)
    tag = info["tag"]
    if universal:
        if not (ck / f"{tag}_universal").is_dir():
            raise ValueError(f"checkpoint.universal is true but {ck / (tag + '_universal')} does not exist; run "
                             f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {ck / tag} "
                             f"--output_folder {ck / (tag + '_universal')}")
        tag = f"{tag}_universal"
    with barriers_on(group):
        _, state = engine.load_checkpoint(str(ck), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if state is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ck / tag}")
    torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng_cuda"])
    return int(state["step"])
