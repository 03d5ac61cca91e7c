"""`python -m dflash_ds.eval`: see dflash_ds/eval/cli.py for the flags."""
import sys

from dflash_ds.eval.cli import main

sys.exit(main())
