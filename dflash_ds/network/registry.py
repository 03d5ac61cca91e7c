"""The registry of drafter architectures: `register`, the decorator every architecture package puts on
its class, and the look-ups by the recipe's `drafter.architecture` and by config.json's `architectures`.

The network owns it and the architectures, one layer up, fill it: this module imports no
architecture. `dflash_ds/architectures/__init__.py` is the one place that lists the packages
(importing it registers each); the entry points import it, and a look-up here that comes first
imports it through the recipe reader's discovery (`config.architectures.registered`, once per
process), as a plugin registry loads its entry points. A test registers its own
(tests/toy_variant.py). The decorator also registers the architecture's recipe sections with the
recipe reader (config/architectures.py), so a package declares its keys once.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

from dflash_ds.config.architectures import SECTIONS, Sections, registered

if TYPE_CHECKING:  # the type every architecture is (a DFlash), named by the list that holds them
    from dflash_ds.architectures import DrafterVariant

VARIANTS: dict[str, "DrafterVariant"] = {}
"""drafter.architecture -> the architecture (an instance of its class)."""
DEFAULT_NAME = "dflash"
"""The architecture of a recipe or config.json that names none."""

V = TypeVar("V", bound=type)


def entries(cls: type) -> list[tuple[dict, str, object]]:
    """What registering `cls` adds, as (registry, key, value): its instance by name and its recipe sections
    (a test registers an architecture for its own duration with these, tests/toy_variant.py)."""
    v = cls()
    keys = Sections(v.fields if dataclasses.fields(v.fields) else None, v.objective_keys)
    return [(VARIANTS, v.name, v), (SECTIONS, v.name, keys)]


def register(cls: V) -> V:
    """Class decorator: the architecture `cls` (DFlash or a subclass) is known by its `name` from now on."""
    found = VARIANTS.get(cls.name)
    if found is not None and type(found).__qualname__ != cls.__qualname__:
        raise ValueError(f"drafter architecture {cls.name!r} is registered twice ({type(found).__name__}, {cls.__name__})")
    for registry, key, value in entries(cls):
        registry[key] = value
    return cls


def known() -> dict[str, "DrafterVariant"]:
    """Every registered architecture by name, the listed packages imported first if nothing has yet."""
    registered()  # the discovery: imports dflash_ds.architectures the first time, nothing after
    return VARIANTS


def variant(name: str) -> "DrafterVariant":
    """The architecture called `name`; ValueError naming the known ones otherwise."""
    try:
        return known()[name]
    except KeyError:
        raise ValueError(f"unknown drafter architecture {name!r}; known: {', '.join(sorted(VARIANTS))}") from None


def variant_of_classes(class_names) -> "DrafterVariant | None":
    """The architecture a config.json's `architectures` list names, or None."""
    for v in known().values():
        if v.class_name in (class_names or ()):
            return v
    return None


def class_names() -> tuple[str, ...]:
    """config.json `architectures` entries an export may carry."""
    return tuple(v.class_name for v in known().values())
