"""`python -m dflash_ds.bench`: see dflash_ds/bench/cli.py for the flags."""

import sys

from .cli import main

# Guarded: spawned transport workers re-import this module under another name and must not rerun main.
if __name__ == "__main__":
    sys.exit(main())
