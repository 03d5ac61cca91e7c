"""`python -m dflash_ds.data prepare RECIPE`: see dflash_ds/data/prepare.py."""
import sys

from dflash_ds.data.prepare import main

sys.exit(main())
