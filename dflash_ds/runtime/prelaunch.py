"""Checks `bash launch.sh` runs on the launching host before the DeepSpeed launcher starts.

Everything a user can get wrong that would otherwise surface 30-50 s into the distributed job, in
a traceback per rank: the recipe, the run lock, wandb credentials, the tokenizer and chat
template, and the data (prepared here once, so the ranks then read the cache). Each problem is one
line naming the setting, file or line, and launch.sh exits 2.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError, ranks_per_node


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


WANDB_TIMEOUT_S = 5.0


def _wandb_reachable(timeout: float) -> str | None:
    """None when wandb's service answers (any HTTP status) within `timeout` seconds, else why not."""
    import urllib.error
    import urllib.request

    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(base + "/healthz", method="GET"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{base} did not answer within {timeout:g} s ({reason})"
    return None


def check_wandb_service(recipe: Recipe, timeout: float = WANDB_TIMEOUT_S) -> dict[str, str]:
    """Online wandb needs its service: unreachable, the run stops with one line offering offline mode,
    or (log.wandb.offline_fallback) runs offline; returns the environment the ranks then need."""
    w = recipe.log.wandb
    if not w.enabled or os.environ.get("WANDB_MODE", w.mode) != "online":
        return {}
    why = _wandb_reachable(timeout)
    if why is None:
        return {}
    if w.offline_fallback:
        print(f"[dflash] warning: wandb is unreachable ({why}); logging offline (wandb sync RUN_DIR/wandb later)",
              flush=True)
        return {"WANDB_MODE": "offline"}
    raise RecipeError(f"log.wandb: {why}; set log.wandb.mode=offline (sync later with `wandb sync`), "
                      "log.wandb.offline_fallback=true, or log.wandb.enabled=false")


def _writable_dir(path: Path, setting: str) -> None:
    """`path` is, or can be created as, a directory this process can write to (probed with a file)."""
    import tempfile

    if path.exists() and not path.is_dir():
        raise RecipeError(f"{setting}: {path} is a file, not a directory; move it away or point {setting} elsewhere")
    probe_in = path
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise RecipeError(f"{setting}: {path} cannot be created ({probe_in} is a file); point {setting} elsewhere")
    try:
        fd, name = tempfile.mkstemp(prefix=".dflash-write-test-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise RecipeError(f"{setting}: {path} is not writable ({probe_in}: {exc.strerror or exc}); "
                          f"point {setting} at a writable directory") from None


def check_locations(recipe: Recipe) -> None:
    """The run directory and what the run writes in it (checkpoints, the export), and the data cache:
    directories (or creatable ones) this process can write to."""
    out = Path(recipe.run.output_dir)
    _writable_dir(out, "run.output_dir")
    for sub in ("checkpoints", "export"):
        _writable_dir(out / sub, f"run.output_dir ({sub})")
    _writable_dir(Path(recipe.data.cache_dir), "data.cache_dir")


def check_lock(recipe: Recipe) -> None:
    from dflash_ds.runtime.lock import LockError, check

    try:
        check(recipe.run.output_dir)
    except LockError as exc:
        raise RecipeError(str(exc)) from None


def check_resume(recipe: Recipe) -> None:
    from dflash_ds.runtime.checkpoint import CheckpointError, resolve

    from dflash_ds.spec import contract

    try:
        start = resolve(recipe.run.output_dir, recipe.checkpoint.resume)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    if start is not None:  # the run's lead lists the settings that may change when it starts
        contract.check_resume(recipe, start["step"])


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
    from dflash_ds.spec.run import check_recipe

    check_recipe(recipe, ranks_per_node(recipe))
    load_training_data(recipe)
    return env
