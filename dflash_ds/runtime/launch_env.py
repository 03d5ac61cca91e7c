"""Shell variables for launch.sh: how many processes the recipe needs here, and a free port.

Printed as `NAME=value` lines for `eval`; a bad recipe fails here, before the launcher starts.
"""

from __future__ import annotations

import socket
import sys

from dflash_ds.config import RecipeError, load_recipe, ranks_per_node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    try:
        recipe = load_recipe(args[0], args[1:])
    except RecipeError as exc:
        print(f"echo 'recipe error: {str(exc).replace(chr(39), chr(34))}' >&2; exit 2")
        return 0
    lines = [f"DFLASH_PROCS={ranks_per_node(recipe)}", f"DFLASH_PORT={free_port()}"]
    import torch

    if recipe.run.device == "cpu" or not torch.cuda.is_available():
        # One thread per rank: several ranks share few cores, and the CPU comm backend is gloo.
        lines += ["export DS_ACCELERATOR=cpu", "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
