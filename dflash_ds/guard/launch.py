"""How a run is launched: the checks before the first rank starts, and where the run starts.

`python -m dflash_ds.guard.launch RECIPE [key=value ...]` is launch.sh's pre-launch step. It runs every
check that needs no GPU (`prelaunch`): the recipe, the run lock, the locations the run writes, wandb,
the hub, the checkpoint state and the recipe's contract, the files the recipe names, the tokenizer
and chat template, the data (prepared here once, so the ranks then read the cache) and the benchmark
sets. A problem is one line naming the
setting, file or line, and launch.sh exits with safety.Exit.USER (2) before the launcher starts a
single rank. On success it prints `NAME=value` lines for the shell's `eval`: how many processes the
recipe needs on this host, a free port, the stop grace time.

The run's lead makes the checks that do not depend on this host's launch again at start-up
(`lead_checks`, `decide_start`), for runs the deepspeed launcher starts alone.
"""

from __future__ import annotations

import json
import netrc
import os
import shlex
import signal
import socket
import sys
import tempfile
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError, load_recipe, ranks_per_node
from dflash_ds.libraries import quiet_libraries
from dflash_ds.safety import INTERRUPTED, CheckpointError, Exit, LockError, interrupt_in_this_process, say

WANDB_TIMEOUT_S = 5.0
HUB_TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- locations

def _writable_dir(path: Path, setting: str) -> None:
    """`path` is, or can be created as, a directory this process can write to (probed with a file)."""
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
    export = out / "export"
    held = sorted(p.name for p in export.iterdir()) if export.is_dir() else []
    if held:
        from dflash_ds.export import is_export

        if not is_export(export):
            # The first checkpoint would refuse to replace it, after the training that led there.
            raise RecipeError(f"run.output_dir (export): {export} holds files that are not a DFlash drafter export "
                              f"({', '.join(held[:3])}{' ...' if len(held) > 3 else ''}); move them away or set "
                              "another run.output_dir")


# ----------------------------------------------------------------------------- wandb

def _wandb_key() -> str | None:
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        auth = None
    return auth[2] if auth else None


def _answers(url: str, timeout: float) -> str | None:
    """None when `url` answers (any HTTP status) within `timeout` seconds, else why not."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{url} did not answer within {timeout:g} s ({getattr(exc, 'reason', exc)})"
    return None


def _wandb_probe(key: str, timeout: float) -> tuple[str, str] | None:
    """Ask wandb's service who `key` belongs to, as wandb itself authenticates (GraphQL, basic auth
    "api:KEY"). None when it accepts the key or answers in a way that says nothing about it (wandb.init
    is guarded for the rest); else ("unreachable" | "rejected", why)."""
    import base64
    import urllib.error
    import urllib.request

    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")
    auth = base64.b64encode(f"api:{key}".encode()).decode()
    request = urllib.request.Request(base + "/graphql", data=json.dumps({"query": "query { viewer { id } }"}).encode(),
                                     headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        return ("rejected", f"{base} rejected the API key (HTTP {exc.code})") if exc.code in (401, 403) else None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return "unreachable", f"{base} did not answer within {timeout:g} s ({getattr(exc, 'reason', exc)})"
    try:
        viewer = (json.loads(body).get("data") or {}).get("viewer")
    except (ValueError, AttributeError):
        return None
    return None if viewer else ("rejected", f"{base} does not know the API key (no viewer for it)")


def check_wandb(recipe: Recipe, timeout: float = WANDB_TIMEOUT_S) -> dict[str, str]:
    """Online wandb needs credentials its service accepts. No credentials: one line. The service out of
    reach or rejecting the key: one line offering offline mode or, with log.wandb.offline_fallback,
    offline logging; returns the environment the ranks then need."""
    w = recipe.log.wandb
    if not w.enabled or os.environ.get("WANDB_MODE", w.mode) != "online":
        return {}
    key = _wandb_key()
    if key is None:
        raise RecipeError("log.wandb.enabled is true with log.wandb.mode online but WANDB_API_KEY is not set; export "
                          "WANDB_API_KEY, or set log.wandb.mode=offline (sync later) or log.wandb.enabled=false")
    found = _wandb_probe(key, timeout)
    if found is None:
        return {}
    kind, why = found
    if w.offline_fallback:
        say(f"warning: wandb is {kind} ({why}); logging offline (wandb sync RUN_DIR/wandb later)")
        return {"WANDB_MODE": "offline"}
    fix = "check WANDB_API_KEY (and WANDB_BASE_URL), or " if kind == "rejected" else ""
    raise RecipeError(f"log.wandb: {why}; {fix}set log.wandb.mode=offline (sync later with `wandb sync`), "
                      "log.wandb.offline_fallback=true, or log.wandb.enabled=false")


def lead_checks(recipe: Recipe) -> dict[str, str]:
    """What both launch.sh and the run's lead check: the locations and wandb. Returns the environment
    wandb then needs."""
    check_locations(recipe)
    return check_wandb(recipe)


# ----------------------------------------------------------------------------- the hub

def _hub_ids(recipe: Recipe) -> list[str]:
    """The recipe's paths that are hub ids (not local, not local-looking), benchmark sets included."""
    from dflash_ds.data.sources import local_path_problem
    from dflash_ds.eval.benchmarks import BENCHMARKS

    paths = [recipe.target.path, recipe.target.adapter, recipe.data.path, recipe.data.eval_path]
    ids = [p for p in paths if p and not Path(p).expanduser().exists() and local_path_problem(p, "") is None]
    if recipe.eval.at_end and not recipe.eval.bench_dir:
        ids += [BENCHMARKS[n].hub_id for n in recipe.eval.benchmarks if n in BENCHMARKS]
    return ids


def check_hub(recipe: Recipe, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """With hub ids to fetch and the hub out of reach, every lookup would retry for about 30 s before
    failing: this process and the ranks then use the local HF cache only (HF_HUB_OFFLINE=1, set here
    before huggingface_hub is imported). Returns why the hub is out of reach, None when it answers."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or not _hub_ids(recipe):
        return None
    why = _answers(os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"), timeout)
    if why is not None:
        os.environ["HF_HUB_OFFLINE"] = "1"
    return why


# ----------------------------------------------------------------------------- where the run starts

def decide_start(recipe) -> dict | None:
    """Where a run starts: the checkpoint `checkpoint.resume` picks in run.output_dir (latest.json's,
    or with `fallback` the newest complete one), None for step 0. Raises CheckpointError.

    A resume must keep the run's contract (resolve/contract.py): one that changes the drafter's shape,
    the data stream or the taps raises RecipeError naming each key; the settings it may change and
    does are in the result's "changed" line."""
    from dflash_ds.resolve import contract
    from dflash_ds.runtime import checkpoint

    start = checkpoint.resolve(recipe.run.output_dir, recipe.checkpoint.resume)
    if start is not None:
        changed = contract.check_resume(recipe, int(start["step"]))
        if changed:
            start = {**start, "changed": changed}
    return start


# ----------------------------------------------------------------------------- before launch

def check_lock(recipe: Recipe) -> None:
    from dflash_ds.guard.lock import check

    try:
        check(recipe.run.output_dir)
    except LockError as exc:
        raise RecipeError(str(exc)) from None


def check_resume(recipe: Recipe) -> None:
    try:
        # The same decision the run's lead makes at start-up, the recipe's contract included (a resume
        # that changes it raises RecipeError; the lead lists the settings that may change).
        decide_start(recipe)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None


def check_benchmarks(recipe: Recipe) -> None:
    """Every set of eval.benchmarks loads now, every record of it checked, not after the training it
    would follow."""
    from dflash_ds.eval.benchmarks import HELDOUT, load_conversations

    for name in recipe.eval.benchmarks if recipe.eval.at_end else ():
        if name != HELDOUT:
            load_conversations(name, recipe.eval.bench_dir, setting="eval.bench_dir")


def prelaunch(recipe: Recipe) -> dict[str, str]:
    """Raise ValueError (one line) for the first problem; prepares and caches the data on success.
    Returns environment variables the ranks need (wandb's offline fallback)."""
    check_locations(recipe)
    check_lock(recipe)  # first and cheap: a second run on a directory stops in a second
    env = check_wandb(recipe)
    offline = check_hub(recipe)
    # After the hub check: it may set HF_HUB_OFFLINE, which huggingface_hub reads as it is imported.
    quiet_libraries(torchao=recipe.drafter.fp8.layers != "none")
    try:
        if Path(recipe.run.output_dir).exists():
            check_resume(recipe)
        from dflash_ds.data.prepare import load_training_data
        from dflash_ds.resolve.run import resolve_run

        resolve_run(recipe, ranks_per_node(recipe))
        load_training_data(recipe)
        check_benchmarks(recipe)
    except ValueError as exc:
        if offline is None:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{first} (the hub is out of reach: {offline}; only the local HF cache was searched)") from None
    if offline is not None:
        say(f"note: the hub is out of reach ({offline}); the run uses the local HF cache only (HF_HUB_OFFLINE=1)")
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _fail(msg: str, code: int = Exit.USER) -> str:
    """Shell text that prints the one line and stops launch.sh with `code` (Exit.USER: the user's to fix)."""
    return f"echo {shlex.quote('[dflash] error: ' + msg)} >&2; exit {int(code)}"


def requested_port() -> str:
    """The caller's DFLASH_PORT (launch.sh passes it on as DFLASH_REQUESTED_PORT), "" when unset; a value
    that is not a port raises ValueError."""
    port = os.environ.get("DFLASH_REQUESTED_PORT", "").strip()
    if port and not (port.isdigit() and 1024 <= int(port) <= 65535):
        raise ValueError(f"DFLASH_PORT={port} is not a port: set a number in 1024-65535, or unset it for a free one")
    return port


def main(argv: list[str]) -> int:
    # launch.sh runs its one option, --dry-run, itself: any other is a mistyped one, and a run started
    # without it (`--dryrun`) would be a real run.
    flags = [a for a in argv if a.startswith("-")]
    args = [a for a in argv if not a.startswith("-")]
    if flags or not args:
        what = f"unknown option {flags[0]}" if flags else "no recipe given"
        print(_fail(f"launch.sh: {what}; usage: bash launch.sh RECIPE [key=value ...] [--dry-run]"))
        return Exit.OK
    try:
        port = requested_port()
    except ValueError as exc:
        print(_fail(str(exc)))
        return Exit.OK
    try:
        recipe = load_recipe(args[0], args[1:])
    except RecipeError as exc:
        print(_fail(str(exc)))
        return Exit.OK
    for note in recipe.notes:  # here once: the ranks read the recipe again and say nothing of it
        say(f"warning: {note}")
    # Whatever the checks print (data preparation reports, library warnings) must not reach the
    # shell's eval: fd 1 points at stderr until the variables are printed.
    saved = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    code = Exit.USER
    try:
        with interrupt_in_this_process():
            env = prelaunch(recipe)
        error = None
    except ValueError as exc:  # RecipeError, data and tokenizer errors: the user's to fix
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    except KeyboardInterrupt:  # Ctrl-C, most often during the data preparation: one line, the shell's status
        error, code = INTERRUPTED, Exit.of_signal(signal.SIGINT)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if error is not None:
        print(_fail(error, code))
        return Exit.OK
    lines = [f"DFLASH_PROCS={ranks_per_node(recipe)}", f"DFLASH_PORT={port or free_port()}",
             f"DFLASH_STOP_GRACE={recipe.run.stop_grace_s:g}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    import torch

    if recipe.run.device == "cpu" or not torch.cuda.is_available():
        # One thread per rank: several ranks share few cores, and the CPU comm backend is gloo.
        lines += ["export DS_ACCELERATOR=cpu", "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        return _caller_gone()
    return Exit.OK


def _caller_gone() -> int:
    """launch.sh, stopped (SIGTERM) during the checks, is gone and its end of the pipe with it: nothing
    will start, which one line says instead of a traceback."""
    # stdout to /dev/null so that the interpreter's own flush at exit does not raise again
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    say("launch.sh was stopped during the pre-launch checks; nothing was started")
    return Exit.of_signal(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
