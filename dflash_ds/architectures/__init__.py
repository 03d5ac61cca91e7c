"""The drafter architectures, one package each, by the name the recipe's `drafter.architecture` gives.

Each package (dflash/, dflash2/, dspark/, lilicorr/, xpress/) registers its `Architecture` (network/contract.py:
its spec, modules, objective and walk) with `register` (network/registry.py); DFlash's (v1) parts are
the ones the others extend. The architectures sit above both the network (network/: the modules they
extend, the contract, the registry) and the objective (objective/: the loss their terms join), and
nothing below imports them. This module is the one place that lists them: importing it registers every
architecture. The entry points import it; otherwise the first look-up in the registry, or the recipe
reader's first need of their sections, does (config/architectures.py). Adding one is its package plus
one name below (docs/architecture.md, "How to add a drafter architecture"). Nothing outside this folder
asks which architecture a drafter is: it asks the drafter shape's spec.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from dflash_ds.architectures import dflash, dflash2, dspark, lilicorr, xpress  # noqa: F401  (each registers itself)
from dflash_ds.network.registry import DEFAULT_NAME, VARIANTS, class_names, names, register, spec_of, variant

DEFAULT = VARIANTS[DEFAULT_NAME]  # a recipe or config.json that names no architecture

__all__ = ["DEFAULT", "VARIANTS", "class_names", "names", "register", "spec_of", "variant"]
