"""The registry of drafter architectures: `register`, the decorator every architecture package puts on
its class, and the look-ups by the recipe's `drafter.architecture` and by config.json's `architectures`.

This module imports no architecture: model/variants/__init__.py is the one place that lists the
packages (importing each registers it), and a test registers its own (tests/toy_variant.py). The
decorator also registers the architecture's recipe sections with the recipe reader
(config/architectures.py), so a package declares its keys once.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

from dflash_ds.config.architectures import SECTIONS, Sections

if TYPE_CHECKING:
    from dflash_ds.model.variants.dflash import DFlash

VARIANTS: dict[str, "DFlash"] = {}
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


def variant(name: str) -> "DFlash":
    """The architecture called `name`; ValueError naming the known ones otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown drafter architecture {name!r}; known: {', '.join(sorted(VARIANTS))}") from None


def variant_of_classes(class_names) -> "DFlash | None":
    """The architecture a config.json's `architectures` list names, or None."""
    for v in VARIANTS.values():
        if v.class_name in (class_names or ()):
            return v
    return None


def class_names() -> tuple[str, ...]:
    """config.json `architectures` entries an export may carry."""
    return tuple(v.class_name for v in VARIANTS.values())
