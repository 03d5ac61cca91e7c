"""Every shipped recipe (recipes/*.yaml, recipes/lab/*.yaml) resolves to the settings pinned in
tests/fixtures/resolved_recipes.json: each setting the recipe leaves at another value than the
sections' default, by its dotted key. A recipe that derives from another (`base:`) and holds only what
differs must resolve exactly as the whole file did, and a change to a base shows here for every recipe
built on it. Defaults are compared as defaults, so a change of a default in config/sections.py does not
touch the record; a change of a shipped recipe that is meant regenerates it:

    PYTHONPATH=. python -m tests.test_recipes_resolved --update
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash_ds.config import Recipe, load_recipe
from dflash_ds.resolve.contract import flat

REPO = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("fixtures") / "resolved_recipes.json"
UPDATE = "PYTHONPATH=. python -m tests.test_recipes_resolved --update"


def shipped() -> list[str]:
    root = REPO / "recipes"
    return sorted(p.relative_to(REPO).as_posix() for p in [*root.glob("*.yaml"), *root.glob("lab/*.yaml")])


def resolved(path: str) -> dict[str, object]:
    """The recipe's settings that differ from the defaults (a round trip through JSON: lists, not tuples)."""
    defaults = flat(Recipe())
    recipe = load_recipe(REPO / path)
    assert recipe.notes == (), f"{path} reads with notes: {recipe.notes}"
    settings = json.loads(json.dumps(flat(recipe)))
    return {k: v for k, v in settings.items() if k not in defaults or v != json.loads(json.dumps(defaults[k]))}


def pinned() -> dict[str, dict[str, object]]:
    return json.loads(RECORD.read_text())["recipes"] if RECORD.is_file() else {}


def test_the_record_holds_every_shipped_recipe():
    assert sorted(pinned()) == shipped(), f"the shipped recipes changed; if that is meant: {UPDATE}"


@pytest.mark.parametrize("path", shipped())
def test_shipped_recipe_resolves_as_pinned(path):
    record = pinned().get(path)
    assert record is not None, f"{path} is not in {RECORD.name}; add it: {UPDATE}"
    now = resolved(path)
    changed = {k: (record.get(k, "(default)"), now.get(k, "(default)")) for k in sorted(set(record) | set(now))
               if record.get(k, "(default)") != now.get(k, "(default)")}
    assert not changed, f"{path} resolves differently (pinned -> now): {changed}; if that is meant: {UPDATE}"


def update() -> None:
    records = {path: resolved(path) for path in shipped()}
    # One setting a line, so that a regenerated record reads as a diff of the settings that changed.
    about = json.dumps(f"tests/test_recipes_resolved.py; regenerate with `{UPDATE}`")
    body = ",\n".join(f"  {json.dumps(path)}: {{\n" + ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}"
                                                            for k, v in settings.items()) + "\n  }"
                      for path, settings in records.items())
    RECORD.write_text(f'{{\n "about": {about},\n "recipes": {{\n{body}\n }}\n}}\n')
    print(f"{RECORD}: {len(records)} recipes")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {UPDATE}")
    update()
