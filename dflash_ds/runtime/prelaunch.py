"""Checks `bash launch.sh` runs on the launching host before the DeepSpeed launcher starts.

Everything a user can get wrong that would otherwise surface 30-50 s into the distributed job, in
a traceback per rank: the recipe, the run lock, wandb credentials, the tokenizer and chat
template, and the data (prepared here once, so the ranks then read the cache). Each problem is one
line naming the setting, file or line, and launch.sh exits with safety.Exit.USER (2).
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError, ranks_per_node
from dflash_ds.runtime.preflight import check_locations, check_wandb_service
from dflash_ds.safety import CheckpointError, LockError


def check_wandb(recipe: Recipe) -> None:
    w = recipe.log.wandb
    mode = os.environ.get("WANDB_MODE", w.mode)
    if not w.enabled or mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        auth = None
    if not auth:
        raise RecipeError("log.wandb.enabled is true with log.wandb.mode online but WANDB_API_KEY is not set; export "
                          "WANDB_API_KEY, or set log.wandb.mode=offline (sync later) or log.wandb.enabled=false")


def check_lock(recipe: Recipe) -> None:
    from dflash_ds.runtime.lock import check

    try:
        check(recipe.run.output_dir)
    except LockError as exc:
        raise RecipeError(str(exc)) from None


def check_resume(recipe: Recipe) -> None:
    from dflash_ds.runtime.control import decide_start

    try:
        # The same decision the run's lead makes at start-up, the recipe's contract included (a resume
        # that changes it raises RecipeError; the lead lists the settings that may change).
        decide_start(recipe)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None


def prelaunch(recipe: Recipe) -> dict[str, str]:
    """Raise ValueError (one line) for the first problem; prepares and caches the data on success.
    Returns environment variables the ranks need (wandb's offline fallback)."""
    check_locations(recipe)
    check_lock(recipe)  # first and cheap: a second run on a directory stops in a second
    check_wandb(recipe)
    env = check_wandb_service(recipe)
    if Path(recipe.run.output_dir).exists():
        check_resume(recipe)
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.resolve.run import resolve_run

    resolve_run(recipe, ranks_per_node(recipe))
    load_training_data(recipe)
    check_benchmarks(recipe)
    return env


def check_benchmarks(recipe: Recipe) -> None:
    """Every set of eval.benchmarks loads now, not after the training it would follow."""
    from dflash_ds.eval.benchmarks import HELDOUT, load_conversations

    for name in recipe.eval.benchmarks if recipe.eval.at_end else ():
        if name != HELDOUT:
            load_conversations(name, recipe.eval.bench_dir, 1, setting="eval.bench_dir")
