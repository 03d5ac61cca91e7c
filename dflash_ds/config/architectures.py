"""The drafter architectures' own recipe sections: `drafter.<name>:` and `objective.<name>:`.

An architecture declares its recipe keys in its package (dflash_ds/architectures/<name>/): one frozen
dataclass per section, a docstring per field (the key reference) and, where a value can be checked
on its own, a `check()` that raises ValueError beginning with the field's name. The architecture
registry's decorator (network/registry.py) registers them here. This module imports no architecture:
the first recipe that needs the sections, or the registry's first look-up, imports the one module
that lists the architectures (`DISCOVERY`, through `registered`), the way a plugin registry loads its
entry points, so config/ stays the bottom layer and reading a plain DFlash recipe imports no model
code.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, NamedTuple

KINDS = ("drafter", "objective")
"""The recipe sections an architecture may add a section of its own to."""
DISCOVERY = "dflash_ds.architectures"
"""The module that imports every architecture package (each registers itself on import)."""


class Sections(NamedTuple):
    """One architecture's recipe sections: the dataclass of `drafter.<name>:` and of `objective.<name>:`
    (None: the architecture has no key there)."""

    drafter: type | None = None
    objective: type | None = None


SECTIONS: dict[str, Sections] = {}
"""Architecture name -> its recipe sections (filled by network.registry.register)."""
_discovered: list[bool] = []


def register_sections(name: str, sections: Sections) -> None:
    SECTIONS[name] = sections


def registered() -> dict[str, Sections]:
    """Every architecture's sections, discovering the architectures on the first call."""
    if not _discovered:
        _discovered.append(True)
        importlib.import_module(DISCOVERY)
    return SECTIONS


def section_type(kind: str, name: str) -> type | None:
    """The dataclass of `<kind>.<name>:`, or None when architecture `name` has no such section."""
    found = registered().get(name)
    return getattr(found, kind) if found is not None else None


def owners(kind: str, key: str) -> list[str]:
    """The architectures whose `<kind>.<name>:` section has `key` (where a flat key of an older recipe moved)."""
    return sorted(name for name, s in registered().items()
                  if getattr(s, kind) is not None and key in {f.name for f in dataclasses.fields(getattr(s, kind))})


def section_of(config: Any, name: str, cls: type) -> Any:
    """Architecture `name`'s section of a drafter or objective section (`config.sections`), or its
    defaults (`cls()`) when the recipe has none; anything else (a section of a test) is read by
    attribute name, fields it lacks keeping their defaults."""
    own = getattr(config, "sections", {}).get(name)
    if own is not None:
        return own
    hints = typing.get_type_hints(cls)  # JSON and YAML give 2.0 or "2" as readily as 2
    return cls(**{f.name: hints[f.name](getattr(config, f.name)) if hints[f.name] in (int, float, bool)
                  else getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)})


def other_sections(architecture: str, drafter: Any, objective: Any) -> list[str]:
    """One line per architecture other than `architecture` whose sections the recipe sets: this drafter
    trains without them. Not an error: switching drafter.architecture on a recipe of another
    architecture (its plain backbone, say) is a use; a mistaken one is not, and the line names the keys."""
    lines = []
    names = dict.fromkeys([*drafter.sections, *objective.sections])
    for name in names:
        if name == architecture:
            continue
        keys = []
        for kind, section in (("drafter", drafter), ("objective", objective)):
            own = section.sections.get(name)
            if own is not None:  # the keys set away from their defaults, or the section itself
                keys += [f"{kind}.{name}.{k}" for k, v in dataclasses.asdict(own).items()
                         if v != dataclasses.asdict(type(own)())[k]] or [f"{kind}.{name}"]
        lines.append(f"{', '.join(keys)}: {name} settings; this drafter is drafter.architecture: {architecture} and "
                     f"trains without them (remove the {name} sections, or set drafter.architecture: {name})")
    return lines
