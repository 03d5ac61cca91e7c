"""Shell variables for launch.sh: how many processes the recipe needs here, and a free port.

Printed as `NAME=value` lines for `eval`. Before that, every check that needs no GPU runs here
(runtime/prelaunch.py): a bad recipe, a taken run directory, bad data or a missing tokenizer stop
with one line and exit 2 before the launcher starts a single rank.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

from dflash_ds.config import RecipeError, load_recipe, ranks_per_node
from dflash_ds.safety import Exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fail(msg: str) -> int:
    print(f"echo {shlex.quote('[dflash] error: ' + msg)} >&2; exit {int(Exit.USER)}")
    return Exit.OK


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    try:
        recipe = load_recipe(args[0], args[1:])
    except RecipeError as exc:
        return _fail(str(exc))
    # Whatever the checks print (data preparation reports, library warnings) must not reach the
    # shell's eval: fd 1 points at stderr until the variables are printed.
    saved = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        from dflash_ds.runtime.prelaunch import prelaunch

        env = prelaunch(recipe)
        error = None
    except ValueError as exc:  # RecipeError, data and tokenizer errors: the user's to fix
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if error is not None:
        return _fail(error)
    lines = [f"DFLASH_PROCS={ranks_per_node(recipe)}", f"DFLASH_PORT={free_port()}",
             f"DFLASH_STOP_GRACE={recipe.run.stop_grace_s:g}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    import torch

    if recipe.run.device == "cpu" or not torch.cuda.is_available():
        # One thread per rank: several ranks share few cores, and the CPU comm backend is gloo.
        lines += ["export DS_ACCELERATOR=cpu", "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    print("\n".join(lines))
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
