"""Checks both `bash launch.sh` (before the launcher) and the run's lead (at start-up, for runs the
deepspeed launcher starts alone) make: the locations the run writes, and wandb's service. Each
problem is one RecipeError line naming the setting."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.safety import say


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
        say(f"warning: wandb is unreachable ({why}); logging offline (wandb sync RUN_DIR/wandb later)")
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
