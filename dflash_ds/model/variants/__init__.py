"""The drafter architectures, by the name the recipe's `drafter.architecture` gives.

One module per architecture defines a `DrafterVariant` (base.py: the hooks and the v1 defaults);
adding one is its module plus one line in `_VARIANTS` (docs/architecture.md, "How to add a drafter
architecture"). Nothing outside this folder asks which architecture a drafter is: it asks the
drafter shape's variant.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from dflash_ds.model.variants import dflash2, dspark, v1
from dflash_ds.model.variants.base import DrafterVariant

_VARIANTS = (v1.VARIANT, dflash2.VARIANT, dspark.VARIANT)

VARIANTS: dict[str, DrafterVariant] = {v.name: v for v in _VARIANTS}
DEFAULT = v1.VARIANT  # a recipe or config.json that names no architecture


def variant(name: str) -> DrafterVariant:
    """The architecture called `name`; ValueError naming the known ones otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown drafter architecture {name!r}; known: {', '.join(sorted(VARIANTS))}") from None


def variant_of_classes(class_names) -> DrafterVariant | None:
    """The architecture a config.json's `architectures` list names, or None."""
    for v in VARIANTS.values():
        if v.class_name in (class_names or ()):
            return v
    return None


def class_names() -> tuple[str, ...]:
    """config.json `architectures` entries an export may carry."""
    return tuple(v.class_name for v in VARIANTS.values())
