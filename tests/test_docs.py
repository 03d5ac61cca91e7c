"""The documentation against the code it describes: the README's front door (its commands, the package
tree, the "to change X, open Y" table), the layer picture of docs/architecture.md against the package's
import graph, every passage of shared prose that lists the architectures against the registry, the
walk-through of the toy architecture against tests/toy_variant.py, and every relative link.

A failure names the file and the place to edit: the prose follows the code, not the other way round."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_structure import LAYERS, ROOT, folder_graph, import_graph, upward_arrows

REPO = ROOT.parent
README = REPO / "README.md"
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"
MAX_README_LINES = 250
FIRST_SCREEN = 70  # lines before the first "## " section


def section(text: str, heading: str) -> str:
    """The body of the markdown section `heading` (up to the next heading of the same or a higher level)."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.split("\n")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"^ *```{lang}\n(.*?)^ *```", text, flags=re.M | re.S)


def named(text: str, word: str) -> bool:
    """`word` appears whole in `text` (DFlash is not named by DFlash2, dflash not by dflash_ds)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


# ---------------------------------------------------------------------------------------------- the README

def test_the_readme_is_a_front_door():
    text = README.read_text()
    lines = text.split("\n")
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move a section to docs/ (at most {MAX_README_LINES})"
    first = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert first <= FIRST_SCREEN, f"README.md's first section starts at line {first + 1}; keep the first screen short"
    screen = "\n".join(lines[:first])
    blocks = [b.strip() for b in code_blocks(screen)]
    # The one command that runs the tiny recipe and the one that runs the tests, each a code block of its own,
    # and the tests' command is the one CI runs.
    assert "bash launch.sh recipes/tiny.yaml" in blocks and "bash scripts/test.sh" in blocks
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text(), ".ci/run must run README's test command"


def readme_tree() -> list[str]:
    """The entries of the README's package tree, in its order: `name/` for a folder, `name.py` for a module."""
    block = next(b for b in code_blocks(README.read_text()) if b.startswith("dflash_ds/\n"))
    entries = []
    for line in block.split("\n")[1:]:
        if not line.startswith("  "):
            break  # the repository's other folders
        for token in line.split():
            if not re.fullmatch(r"\w+(/|\.py)", token):
                break  # the comment
            entries.append(token)
    return entries


def test_the_readme_tree_is_the_package_top_layer_first():
    entries = readme_tree()
    package = {p.name + "/" for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | \
        {p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(entries) == sorted(package), (
        f"README.md's package tree: missing {sorted(package - set(entries))}, gone {sorted(set(entries) - package)}")
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    levels = [level[f"dflash_ds.{e.rstrip('/').removesuffix('.py')}"] for e in entries]
    assert levels == sorted(levels, reverse=True), "README.md's package tree lists the top layer first (tests/test_structure.py LAYERS)"


def test_every_path_the_readme_table_names_exists():
    from dflash_ds.architectures import VARIANTS

    table = section(README.read_text(), "# dflash-ds").split("| to change | open |", 1)[1].split("\n\n", 1)[0]
    paths = [p for p in re.findall(r"`([^`]+)`", table) if "/" in p or p.endswith((".py", ".md"))]
    assert len(paths) >= 10
    for path in paths:
        for name in (VARIANTS if "<name>" in path else [None]):
            real = path.replace("<name>", name) if name else path
            assert (REPO / real).exists(), f"README.md's 'to change' table names {real}, which does not exist"


# ------------------------------------------------------------------------------------- the layer picture

def picture_layers() -> list[tuple[str, ...]]:
    """docs/architecture.md's layer picture, bottom layer first, as test_structure's LAYERS names them."""
    block = code_blocks(section(ARCHITECTURE_DOC.read_text(), "## The layers"), "text")[0]
    boxes = [re.match(r"\|(.*?)\|", line).group(1).split() for line in block.split("\n") if line.startswith("|")]
    return [tuple(f"dflash_ds.{name.rstrip('/')}" for name in box) for box in reversed(boxes)]


def test_the_layer_picture_is_the_import_layering():
    picture = picture_layers()
    # The root package (`dflash_ds/__init__.py`, a version string) sits below every layer.
    declared = [tuple(n for n in layer if n != "dflash_ds") for layer in LAYERS]
    assert [set(layer) for layer in picture] == [set(layer) for layer in declared], (
        "docs/architecture.md's layer picture differs from tests/test_structure.py LAYERS; draw "
        + " | ".join("  ".join(n.split(".", 1)[1] for n in layer) for layer in reversed(declared)) + " (top first)")
    # Derived from the package itself: every folder has its box, every import between folders points down.
    folders = folder_graph(import_graph(ROOT))
    assert upward_arrows(folders, [("dflash_ds",), *picture]) == []
    assert {n for layer in picture for n in layer} <= set(folders), "a box of the picture names no folder of the package"


# --------------------------------------------------------------------- prose that lists the architectures

def drafter_architecture_reference() -> str:
    """The docstring of DrafterConfig.architecture, the recipe reference of `drafter.architecture`."""
    tree = ast.parse((ROOT / "config" / "sections.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DrafterConfig")
    for field, doc in zip(cls.body, cls.body[1:]):
        if isinstance(field, ast.AnnAssign) and field.target.id == "architecture":
            return doc.value.value
    raise AssertionError("DrafterConfig.architecture has no docstring")


def _readme_intro() -> str:
    return README.read_text().split("\n\n")[1]


def _readme_table() -> str:
    rows = section(README.read_text(), "## The drafter architectures").split("\n")
    return "\n".join(row.split("|")[1] for row in rows if row.startswith("| `"))


def _readme_tree_line() -> str:
    return next(line for line in README.read_text().split("\n") if line.startswith("  architectures/ "))


def _drafters_doc() -> str:
    return re.search(r"Each drafter architecture \(([^)]*)\)", (REPO / "docs" / "drafters.md").read_text()).group(1)


def _architecture_doc_tree() -> str:
    block = next(b for b in code_blocks(section(ARCHITECTURE_DOC.read_text(), "## The package")) if b.startswith("dflash_ds/"))
    return "\n".join(re.findall(r"^    (\w+)/ ", block, flags=re.M))


# (where, what it lists by: the architecture's recipe name or its title, the passage)
LISTS = [
    ("dflash_ds/config/sections.py DrafterConfig.architecture", "name", drafter_architecture_reference),
    ("README.md, its first paragraph", "title", _readme_intro),
    ("README.md, 'The drafter architectures'", "name", _readme_table),
    ("README.md, the package tree's architectures/ line", "name", _readme_tree_line),
    ("docs/drafters.md, 'Each drafter architecture (...)'", "title", _drafters_doc),
    ("docs/architecture.md, the package tree under architectures/", "name", _architecture_doc_tree),
]


@pytest.mark.parametrize("where, by, passage", LISTS, ids=[w for w, _, _ in LISTS])
def test_shared_prose_lists_every_registered_architecture(where, by, passage):
    from dflash_ds.architectures import VARIANTS

    text = passage()
    missing = [getattr(v.spec, by) for v in VARIANTS.values() if not named(text, getattr(v.spec, by))]
    assert not missing, f"{where} leaves out {', '.join(missing)}: list every registered architecture there"


# --------------------------------------------------------------------- the toy architecture, file by file

def walkthrough() -> str:
    return section(ARCHITECTURE_DOC.read_text(), "## Adding the toy architecture, file by file")


def test_the_walkthrough_names_every_member_of_the_toy():
    import dataclasses

    from dflash_ds.network.contract import Spec
    from tests.toy_variant import SPEC, TOY

    rows = [line.split("|")[1] for line in walkthrough().split("\n") if line.strip().startswith("| `")]
    named_members = {m for row in rows for m in re.findall(r"`(\w+)`", row)}
    # The toy's members: what its spec sets beyond a spec of the four required fields, and what each of
    # its classes (its parts and its two sections) defines itself.
    bare = Spec(name=SPEC.name, class_name=SPEC.class_name, title=SPEC.title, card=SPEC.card)
    members = {"name", "class_name", "title", "card"} | {
        f.name for f in dataclasses.fields(Spec) if getattr(SPEC, f.name) != getattr(bare, f.name)}
    classes = [type(TOY.modules), type(TOY.objective), type(TOY.walk), SPEC.fields, SPEC.objective_keys]
    members |= {k for cls in classes for k in vars(cls) if not k.startswith("_")}
    assert named_members == members, (f"docs/architecture.md's walk-through of the toy: members it lacks "
                                      f"{sorted(members - named_members)}, names the toy no longer has {sorted(named_members - members)}")
    for path in re.findall(r"\*\*`(tests/[\w/.]+)`\*\*", walkthrough()):
        assert (REPO / path).is_file(), f"docs/architecture.md's walk-through names {path}, which does not exist"


def test_the_walkthroughs_recipe_loads_and_resolves(monkeypatch, tmp_path):
    from transformers import AutoConfig

    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.drafter import drafter_shape
    from tests.toy_variant import register

    toy = register(monkeypatch)
    text = code_blocks(walkthrough(), "yaml")[0]
    assert text.lstrip().startswith("base: tiny.yaml\n")
    path = tmp_path / "tiny-toy_markov.yaml"  # beside a copy's base: the recipe as it would sit in recipes/
    path.write_text(text.replace("base: tiny.yaml", f"base: {REPO / 'recipes' / 'tiny.yaml'}"))
    recipe = load_recipe(path, [f"run.output_dir={tmp_path / 'run'}"])
    assert recipe.notes == () and recipe.drafter.architecture == toy.spec.name
    shape = drafter_shape(AutoConfig.from_pretrained(REPO / recipe.target.path), recipe.drafter)
    assert shape.variant is toy and shape.arch_fields.toy_rank == 3


# ------------------------------------------------------------------------------------------------- links

def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for doc in [README, *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = doc.parent / path if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(REPO)}: {link} (no such file)")
            elif anchor and target.suffix == ".md":
                body = re.sub(r"```.*?```", "", target.read_text(), flags=re.S)
                if anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", body, flags=re.M)}:
                    broken.append(f"{doc.relative_to(REPO)}: {link} (no such heading)")
    assert not broken, "links to fix:\n  " + "\n  ".join(broken)
