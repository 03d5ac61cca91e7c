"""The registry of drafter architectures: `register`, which every architecture package calls on its
`Architecture` (network/contract.py), and the look-ups by the recipe's `drafter.architecture` and by
config.json's `architectures`.

The network owns it and the architectures, one layer up, fill it: this module imports no
architecture. `dflash_ds/architectures/__init__.py` is the one place that lists the packages
(importing it registers each); the entry points import it, and a look-up here that comes first
imports it through the recipe reader's discovery (`config.architectures.registered`, once per
process), as a plugin registry loads its entry points. A test registers its own
(tests/toy_variant.py). Registering also hands the architecture's recipe sections to the recipe
reader (config/architectures.py), so a package declares its keys once.

Code outside architectures/ reaches an architecture's parts through the drafter's shape
(`DrafterShape.variant`); `spec_of` and `names` hand out its data alone.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_ds.config.architectures import SECTIONS, Sections, registered

VARIANTS: dict[str, Any] = {}
"""drafter.architecture -> its network.contract.Architecture (typed there: the contract names the shape,
which looks its architecture up here)."""
DEFAULT_NAME = "dflash"
"""The architecture of a recipe or config.json that names none."""


def entries(arch: Any) -> list[tuple[dict, str, object]]:
    """What registering `arch` adds, as (registry, key, value): the architecture by name and its recipe
    sections (a test registers one for its own duration with these, tests/toy_variant.py)."""
    spec = arch.spec
    keys = Sections(spec.fields if dataclasses.fields(spec.fields) else None, spec.objective_keys)
    return [(VARIANTS, spec.name, arch), (SECTIONS, spec.name, keys)]


def register(arch: Any) -> Any:
    """`arch` (a network.contract.Architecture) is known by its spec's name from now on; returns it."""
    found = VARIANTS.get(arch.spec.name)
    if found is not None and found.spec.class_name != arch.spec.class_name:
        raise ValueError(f"drafter architecture {arch.spec.name!r} is registered twice ({found.spec.class_name}, "
                         f"{arch.spec.class_name})")
    for registry, key, value in entries(arch):
        registry[key] = value
    return arch


def known() -> dict[str, Any]:
    """Every registered architecture by name, the listed packages imported first if nothing has yet."""
    registered()  # the discovery: imports dflash_ds.architectures the first time, nothing after
    return VARIANTS


def variant(name: str) -> Any:
    """The architecture called `name`; ValueError naming the known ones otherwise."""
    try:
        return known()[name]
    except KeyError:
        raise ValueError(f"unknown drafter architecture {name!r}; known: {', '.join(sorted(VARIANTS))}") from None


def spec_of(name: str) -> Any:
    """The spec (network.contract.Spec) of the architecture called `name`; ValueError naming the known ones."""
    return variant(name).spec


def names() -> tuple[str, ...]:
    """Every registered architecture's name, sorted."""
    return tuple(sorted(known()))


def variant_of_classes(class_names) -> Any:
    """The architecture a config.json's `architectures` list names, or None."""
    for v in known().values():
        if v.spec.class_name in (class_names or ()):
            return v
    return None


def class_names() -> tuple[str, ...]:
    """config.json `architectures` entries an export may carry."""
    return tuple(v.spec.class_name for v in known().values())
