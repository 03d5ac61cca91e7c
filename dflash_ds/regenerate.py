"""`python -m dflash_ds.regenerate RECIPE` (or under `deepspeed --module`): see dflash_ds/data/regenerate.py."""
import sys

from dflash_ds.data.regenerate import main

if __name__ == "__main__":
    sys.exit(main())
