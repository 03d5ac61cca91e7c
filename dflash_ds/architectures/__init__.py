"""The drafter architectures, one package each, by the name the recipe's `drafter.architecture` gives.

Each package (dflash/, dflash2/, dspark/, lilicorr/) defines its class with `@register`
(network/registry.py); DFlash (v1) is the class the others extend. The architectures sit above both
the network (network/: the modules they extend, the registry) and the objective (objective/: the loss
their terms join), and nothing below imports them. This module is the one place that lists them:
importing it registers every architecture. The entry points import it; otherwise the first look-up in
the registry, or the recipe reader's first need of their sections, does (config/architectures.py).
Adding one is its package plus one name below (docs/architecture.md, "How to add a drafter
architecture"). Nothing outside this folder asks which architecture a drafter is: it asks the drafter
shape's variant.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from dflash_ds.architectures import dflash, dflash2, dspark, lilicorr  # noqa: F401  (each registers itself)
from dflash_ds.architectures.dflash import DFlash
from dflash_ds.network.registry import DEFAULT_NAME, VARIANTS, class_names, register, variant, variant_of_classes

DEFAULT = VARIANTS[DEFAULT_NAME]  # a recipe or config.json that names no architecture
DrafterVariant = DFlash
"""The type of every architecture (each is a DFlash), for code outside this folder to name."""

__all__ = ["DEFAULT", "DrafterVariant", "VARIANTS", "class_names", "register", "variant", "variant_of_classes"]
