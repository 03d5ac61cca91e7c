"""Package structure rules, checked on the source with `ast` (nothing is imported):

- (the boundary rule, which replaced the parameter cap, is tests/test_boundary_rule.py's: arguments
  past the fourth keyword-only, no positional unpacking of NamedTuples, a type earns its place);
- no import cycle among dflash_ds modules, counting module-level, function-level and type-only imports
  (under `if TYPE_CHECKING:`: they run nothing, but a reader follows them like any other);
- no import cycle among its folders either (a folder is a subpackage, a top-level module is its own
  node), and every arrow between them points down the declared LAYERS: a reader following an
  import never climbs back up (the resolve step in resolve/ never reaches into runtime/);
- no code outside architectures/ asks which drafter architecture it has: no comparison with an
  architecture's name or class name, no attribute named after an architecture or one of its modules
  (`drafter.candidate_selector`), no import of
  one architecture's module (`isinstance(m, BlockConv)` needs one; `from dflash_ds.architectures import
  dspark` and `import dflash_ds.architectures.dspark` too), no read of its own values
  (`shape.arch_fields.<field>`, `recipe.drafter.sections[...]`, getattr of a field's name), and no
  string naming one of its log fields (`"selector_loss" in record`: metrics and the report read the
  architecture's `logs` view instead);
- the contract (network/contract.py: an architecture's spec, modules, objective and walk) is reached
  from at most 5 files outside architectures/: the ones that hold an architecture (`shape.variant`,
  the registry's `variant`, `VARIANTS`, `known`, `variant_of_classes`) to call its parts; the rest read
  its spec, the data the shape hands out (`shape.spec`, `registry.spec_of`);
- the entry points (train, eval's CLI, the bench's, the export's loader, the report) import
  dflash_ds.architectures, the list whose import registers every architecture; network/ and
  objective/ import none (the registry they ask is filled from above);
- network/, objective/, architectures/, target_model/ and quantization/ speak no recipe vocabulary: no
  message (a string that is not documentation) names a recipe key; the boundary that turns recipe
  values into a shape or a target names the setting.
- one output channel: messages to the user go through `safety.say` (one `[dflash] ...` line on
  stderr, flushed, never raising on a closed terminal); `print` and writes to sys.stdout / sys.stderr
  appear only in `say` itself, the progress line (`metrics.print_progress`, which rewrites one
  terminal line) and the command-line entry points (`main` functions, the CLI modules), whose output
  is the program's result (a table, a plan, launch.sh's shell variables).

Each rule is first run on a small made-up package that breaks it, so a checker that finds
nothing cannot pass unnoticed.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = "dflash_ds"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
CLI_MODULES = {"cli.py", "__main__.py"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """Module name -> (path, parsed tree) for every .py file of the package under `root`."""
    files = sorted(root.rglob("*.py"))
    return {module_name(p, root): (p, _parsed(p, p.stat().st_mtime_ns, p.stat().st_size)) for p in files}


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module:
    # Every check walks the whole package: parse each file once per session (a file written since is
    # parsed again, its modification time and size being part of the key). The checks only read the trees.
    return ast.parse(path.read_text(), filename=str(path))


def _is_package(name: str, modules: dict) -> bool:
    return modules[name][0].name == "__init__.py"


def _imported(name: str, node: ast.Import | ast.ImportFrom, modules: dict) -> set[str]:
    """The package's modules an import statement of module `name` loads (itself excluded)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            # Relative: from the module's package (a package's own __init__ is its package).
            pkg = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        # `from pkg import sub` loads the submodule when there is one, else names from pkg itself.
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    out = set()
    for target in targets:
        # `import a.b.c` of a name that is not a module (an attribute): the longest module prefix.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = sources(root)
    graph = {}
    for name, (_, tree) in modules.items():
        graph[name] = set()
        for node in ast.walk(tree):  # function-level and type-only (`if TYPE_CHECKING:`) imports included
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _imported(name, node, modules)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component with more than one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(_cycle_in(sorted(component), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    # Shortest way back to the first module, by breadth-first search inside the component.
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def folder_of(module: str) -> str:
    """`pkg.sub.mod` -> `pkg.sub`; a top-level module `pkg.mod` is its own node; `pkg` stays `pkg`."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed onto folders; imports inside one folder are left out."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        node = folders.setdefault(folder_of(module), set())
        node |= {folder_of(t) for t in targets} - {folder_of(module)}
    return folders


def upward_arrows(folders: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """`a -> b` for every folder arrow that does not point to a strictly lower layer, and `a: no layer`
    for a folder missing from `layers` (a new folder must be placed)."""
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    found = [f"{a}: no layer (add it to LAYERS)" for a in sorted(folders) if a not in level]
    found += [f"{a} -> {b}" for a in sorted(folders) if a in level for b in sorted(folders[a])
              if b in level and level[b] >= level[a]]
    return found


# Bottom to top: a folder imports only from layers below its own. The order follows the data flow
# (recipe -> rows and the FP8 mechanism -> the drafter network -> its training objective -> the architectures, which
# extend both -> target -> export -> eval -> run spec -> distributed run -> how it starts and stops -> entry points).
# The network asks its registry for an architecture; the architectures fill it from above (`register`).
LAYERS = [
    ("dflash_ds", "dflash_ds.config", "dflash_ds.io", "dflash_ds.safety", "dflash_ds.libraries", "dflash_ds.compile"),
    ("dflash_ds.arguments",),  # the command lines' checked arguments, on safety's one-line message
    ("dflash_ds.data", "dflash_ds.metrics", "dflash_ds.quantization"),
    ("dflash_ds.network",),
    ("dflash_ds.objective",),
    ("dflash_ds.architectures",),
    ("dflash_ds.target_model",),
    ("dflash_ds.export",),
    ("dflash_ds.eval", "dflash_ds.report"),
    ("dflash_ds.resolve",),
    ("dflash_ds.runtime",),
    ("dflash_ds.guard",),
    ("dflash_ds.train", "dflash_ds.regenerate"),
    ("dflash_ds.bench",),
]


VARIANTS_DIR = "architectures"
# Where a shape and a recipe section hold an architecture's own values (`shape.arch_fields.markov_rank`,
# `recipe.drafter.sections["dspark"]`): read by name only by the architecture itself (config/ reads every
# section alike, by its `check()` and dataclass fields).
OWN_VALUES = ("arch_fields", "sections")


def _constants(node: ast.AST) -> list[str]:
    """String constants of an operand: itself, or the elements of a literal tuple / list / set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _architecture_import(node: ast.Import | ast.ImportFrom, prefix: str, names: set[str]) -> str | None:
    """The module of one architecture an import loads, or None: `from P.two import X`, `from P import two`
    and `import P.two` load one; P itself (the list, the registry's names) and P.base (the types every
    architecture hands out) do not."""
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    elif node.level == 0 and node.module == prefix:
        modules = [f"{prefix}.{alias.name}" for alias in node.names if alias.name in names]
    else:
        modules = [node.module or ""]
    own = [m for m in modules if m.startswith(prefix + ".") and m != prefix + ".base"]
    return own[0] if own else None


def architecture_tests(root: Path, names: set[str], attributes: set[str], fields: set[str] = frozenset(),
                       logs: set[str] = frozenset()) -> list[str]:
    """`module:line what` for every place outside `architectures/` that tells architectures apart:
    `names` are the architectures' names and class names, `attributes` their names and module names,
    `fields` their own recipe and shape fields (read only through OWN_VALUES, which only the
    architecture reads: a field's name elsewhere, the target's `conv_kernel_size`, is not one), `logs`
    the names of their metrics fields and sums (a string key naming one: `r["selector_loss"]`)."""
    found = []
    package = root.name
    for name, (path, tree) in sources(root).items():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(VARIANTS_DIR + "/"):
            continue
        docs = _documentation(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Constant) and node.value in logs and id(node) not in docs:
                what = f"names the log field {node.value!r}"
            elif isinstance(node, ast.Compare):
                hits = [c for operand in [node.left, *node.comparators] for c in _constants(operand) if c in names]
                what = f"compares with {hits[0]!r}" if hits else None
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr in OWN_VALUES and node.attr in fields:
                what = f"reads .{node.value.attr}.{node.attr}"
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr in OWN_VALUES and any(c in names for c in _constants(node.slice)):
                what = f"reads .{node.value.attr}[{_constants(node.slice)[0]!r}]"
            elif isinstance(node, ast.Attribute) and node.attr in attributes:
                what = f"reads .{node.attr}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                hits = [c for a in node.args[1:2] for c in _constants(a) if c in attributes | fields]
                what = f"{node.func.id}(..., {hits[0]!r})" if hits else None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                own = _architecture_import(node, f"{package}.{VARIANTS_DIR}", names)
                what = f"imports {own}" if own else None
            if what:
                found.append((name, node.lineno, what))
    return [f"{m}:{line} {what}" for m, line, what in sorted(found)]


CONTRACT_HOME = ("network/contract.py", "network/registry.py")
# The registry's look-ups that hand out an architecture (its parts), not its spec's data.
LOOKUPS = {"variant", "VARIANTS", "known", "variant_of_classes"}


def contract_callers(root: Path) -> dict[str, list[str]]:
    """`module -> [what]` for every module outside `architectures/` (and the contract's own home) that
    holds an architecture: reads an attribute `.variant` (the shape's architecture) or imports one of
    the registry's LOOKUPS (from the registry or the architectures' list)."""
    package = root.name
    found: dict[str, list[str]] = {}
    for name, (path, tree) in sources(root).items():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(VARIANTS_DIR + "/") or rel in CONTRACT_HOME:
            continue
        what = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "variant":
                what.add(".variant")
            elif isinstance(node, ast.ImportFrom) and node.module in (f"{package}.network.registry",
                                                                       f"{package}.{VARIANTS_DIR}"):
                what |= {f"imports {a.name}" for a in node.names if a.name in LOOKUPS}
        if what:
            found[name] = sorted(what)
    return found


def architecture_vocabulary() -> tuple[set[str], set[str], set[str], set[str]]:
    """The registered architectures' names and class names, the attribute names that belong to one of
    them (its name and its modules, from its tensor inventory on a small shape), its own fields (both
    recipe sections) and its log fields (the sums it names and the record fields its view shows)."""
    import dataclasses
    import string

    from dflash_ds.architectures import VARIANTS
    from dflash_ds.network.shape import DrafterShape
    from tests.test_conformance_steps import named_logs

    names, attributes, fields, logs = set(), set(), set(), set()
    for arch in VARIANTS.values():
        v = arch.spec
        names |= {v.name, v.class_name}
        attributes.add(v.name)
        for section in (v.fields, v.objective_keys):
            fields |= {f.name for f in dataclasses.fields(section)} if section is not None else set()
        shape = DrafterShape(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                             max_position_embeddings=64, vocab_size=64, num_target_layers=2, target_layer_ids=(0,),
                             block_size=4, mask_token_id=1, tie_word_embeddings=False, architecture=v.name)
        for tensor in arch.modules.tensors(shape):
            parts = tensor.split(".")
            attributes.add(parts[2] if parts[0] == "layers" else parts[0])
        templates = [*v.logs.progress, *(t for _, t in v.logs.summary)]
        logs |= {f for t in templates for _, f, _, _ in string.Formatter().parse(t) if f}
        logs |= {key for _, key, _ in v.logs.series} | named_logs(v.name)
    return names, attributes, fields, logs


MECHANISM_FOLDERS = ("network", "objective", "architectures", "target_model", "quantization")


def recipe_keys() -> set[str]:
    """Every dotted key of the recipe (drafter.block_size, data.regenerate.urls, ...), the architectures'
    sections' included (drafter.dspark.markov_rank)."""
    import dataclasses
    import typing

    from dflash_ds.config.architectures import registered
    from dflash_ds.config.recipe import Recipe

    keys = set()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif prefix and f.name != "sections":
                keys.add(f"{prefix}{f.name}")
    walk(Recipe, "")
    for name, sections in registered().items():
        for kind, cls in sections._asdict().items():
            if cls is not None:
                walk(cls, f"{kind}.{name}.")
    return keys


def _documentation(tree: ast.AST) -> set[int]:
    """ids of the string statements of a module: docstrings and attribute docstrings (documentation may
    name a recipe key; a message may not)."""
    return {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}


def recipe_vocabulary(root: Path, folders: tuple[str, ...], keys: set[str]) -> list[str]:
    """`module:line key` for every string in `folders` of the package (documentation aside) that names a recipe key."""
    import re

    pattern = re.compile("|".join(rf"(?<![\w.]){re.escape(k)}(?!\w)" for k in sorted(keys, key=len, reverse=True)))
    found = []
    for name, (path, tree) in sources(root).items():
        if path.relative_to(root).parts[0] not in folders:
            continue
        docs = _documentation(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                hit = pattern.search(node.value)
                if hit:
                    found.append((name, node.lineno, hit.group(0)))
    return [f"{m}:{line} {key}" for m, line, key in sorted(found)]
# The functions besides the entry points that may write to the terminal themselves (module:function).
OUTPUT_CHANNELS = {"dflash_ds.safety:say", "dflash_ds.metrics:print_progress"}


def _writes_output(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id == "print"
    return (isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute)
            and f.value.attr in ("stdout", "stderr") and isinstance(f.value.value, ast.Name)
            and f.value.value.id == "sys")


def stray_output(root: Path, allowed: set[str]) -> list[str]:
    """`module:line in function` for every print / sys.stdout|stderr.write outside the entry points
    (`main`, the CLI modules) and the `allowed` module:function channels."""
    found = []
    for name, (path, tree) in sources(root).items():
        if path.name in CLI_MODULES:
            continue

        def visit(node, owner: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else owner
                if inner == "main" or f"{name}:{inner}" in allowed:
                    continue
                if isinstance(child, ast.Call) and _writes_output(child):
                    found.append(f"{name}:{child.lineno} in {inner or 'module level'}")
                visit(child, inner)

        visit(tree, "")
    return found


# ---------------------------------------------------------------------------------- the rules on a made-up package

def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_import_checkers_find_cycles(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n",
        "pkg/b.py": "def g():\n    from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/t.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.u import U\n",
        "pkg/u.py": "from pkg.t import T\n",
        "pkg/sub/__init__.py": "from .d import x\n",
        "pkg/sub/d.py": "from pkg.sub import e\nx = 1\n",
        "pkg/sub/e.py": "import os\nimport pkg.sub.d.x\n",  # an attribute path: the module is pkg.sub.d
    })
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.sub"] == {"pkg.sub.d"} and graph["pkg.sub.e"] == {"pkg.sub.d"}
    assert graph["pkg.t"] == {"pkg.u"} and graph["pkg.u"] == {"pkg.t"}  # a type-only import is an edge too
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.sub.d", "pkg.sub.e", "pkg.sub.d"],
                                    ["pkg.t", "pkg.u", "pkg.t"]]


def test_output_check_finds_a_stray_print(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": ("import sys\n\ndef say(m):\n    print(m, file=sys.stderr)\n\n"
                     "def work():\n    print('done')\n\nclass K:\n    def m(self):\n        sys.stderr.write('x')\n\n"
                     "def main():\n    print('result')\n"),
        "pkg/cli.py": "print('usage')\n",
    })
    assert stray_output(root, {"pkg.a:say"}) == ["pkg.a:7 in work", "pkg.a:11 in m"]
    assert stray_output(root, set()) == ["pkg.a:4 in say", "pkg.a:7 in work", "pkg.a:11 in m"]


def test_folder_checks_find_a_folder_cycle_and_an_arrow_up(tmp_path):
    # No module cycle, but the folders x and y import each other: x.a -> y.b -> x.c.
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x/__init__.py": "",
        "pkg/x/a.py": "from pkg.y import b\n",
        "pkg/x/c.py": "",
        "pkg/y/__init__.py": "",
        "pkg/y/b.py": "def f():\n    from pkg.x import c\n",
        "pkg/top.py": "import pkg.x.c\n",
    })
    graph = import_graph(root)
    assert import_cycles(graph) == []
    folders = folder_graph(graph)
    assert folders["pkg.x"] == {"pkg.y"} and folders["pkg.top"] == {"pkg.x"}
    assert import_cycles(folders) == [["pkg.x", "pkg.y", "pkg.x"]]
    assert upward_arrows(folders, [("pkg",), ("pkg.y",), ("pkg.x", "pkg.top")]) == ["pkg.top -> pkg.x", "pkg.y -> pkg.x"]
    assert upward_arrows(folders, [("pkg",), ("pkg.x",)]) == ["pkg.top: no layer (add it to LAYERS)",
                                                                "pkg.y: no layer (add it to LAYERS)"]


def test_architecture_check_finds_each_kind_of_test(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/architectures/__init__.py": "from pkg.architectures import two\n",
        "pkg/architectures/base.py": "",
        "pkg/architectures/two.py": "def f(shape):\n    return shape.rank > 0 and shape.architecture == 'two'\n",
        "pkg/loss.py": ("from pkg.architectures.base import X\nfrom pkg.architectures.two import Head\n\n"
                        "def f(shape, m, r):\n    if shape.architecture in ('one', 'two'):\n"
                        "        return shape.arch_fields.rank > 0 or r.drafter.sections['two']\n"
                        "    return isinstance(m, Head) or hasattr(m, 'head') or m.head is None or getattr(m, 'rank')\n"),
        "pkg/clean.py": ("def f(shape, layer):\n    return shape.variant.draft(shape) if shape.architecture else 'two words'\n"
                         "\ndef g(layer):\n    return layer.rank  # another object's attribute of a field's name\n"
                         "\ndef h(r):\n    \"\"\"Reads two_loss (documentation).\"\"\"\n    return r.get('two_loss')\n"),
        "pkg/top.py": ("import pkg.architectures\nfrom pkg.architectures import VARIANTS, base\n"
                       "from pkg.architectures import two\nimport pkg.architectures.two\n"),
    })
    assert architecture_tests(root, {"one", "two", "TwoModel"}, {"two", "head"}, {"rank"}, {"two_loss"}) == [
        "pkg.clean:9 names the log field 'two_loss'",
        "pkg.loss:2 imports pkg.architectures.two", "pkg.loss:5 compares with 'one'", "pkg.loss:6 reads .arch_fields.rank",
        "pkg.loss:6 reads .sections['two']", "pkg.loss:7 getattr(..., 'rank')", "pkg.loss:7 hasattr(..., 'head')",
        "pkg.loss:7 reads .head", "pkg.top:3 imports pkg.architectures.two", "pkg.top:4 imports pkg.architectures.two"]


def test_contract_check_finds_every_holder_of_an_architecture(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/network/__init__.py": "",
        "pkg/network/registry.py": "VARIANTS = {}\n\ndef variant(name):\n    return VARIANTS[name]\n",
        "pkg/architectures/__init__.py": "from pkg.network.registry import VARIANTS, variant\n",
        "pkg/architectures/two.py": "def f(shape):\n    return shape.variant.walk\n",
        "pkg/loss.py": "def f(shape):\n    return shape.variant.objective.terms()\n",
        "pkg/look.py": "from pkg.architectures import VARIANTS, spec_of\n",
        "pkg/data.py": "from pkg.network.registry import spec_of\n\ndef f(shape):\n    return shape.spec.title\n",
    })
    assert contract_callers(root) == {"pkg.look": ["imports VARIANTS"], "pkg.loss": [".variant"]}


def test_vocabulary_check_finds_recipe_keys_in_messages_only(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/network/__init__.py": '"""Reads drafter.block_size (documentation)."""\n',
        "pkg/network/a.py": ('class S:\n    size: int = 2\n    """Set by drafter.block_size."""\n\n'
                           'def f(b):\n    """drafter.block_size: documented."""\n'
                           '    if b < 2:\n        raise ValueError(f"drafter.block_size must be >= 2, got {b}")\n'
                           '    return "block_size" + "drafter.block_sizes" + "my.drafter.block_size"\n'),
        "pkg/config/checks.py": 'MSG = "drafter.block_size must be >= 2"\n',
    })
    assert recipe_vocabulary(root, ("network",), {"drafter.block_size"}) == ["pkg.network.a:8 drafter.block_size"]


# ---------------------------------------------------------------------------------- the rules on dflash_ds

def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the walk really saw the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles among dflash_ds modules:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_folders_have_no_cycle_and_no_arrow_up():
    folders = folder_graph(import_graph(ROOT))
    assert {"dflash_ds.resolve", "dflash_ds.runtime", "dflash_ds.guard", "dflash_ds.network", "dflash_ds.objective",
            "dflash_ds.architectures"} <= set(folders)
    cycles = import_cycles(folders)
    assert not cycles, "import cycles among dflash_ds folders:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)
    up = upward_arrows(folders, LAYERS)
    assert not up, ("folder imports that do not point down LAYERS (tests/test_structure.py):\n  " + "\n  ".join(up))


# The entry points that build or load a drafter import the list of architectures themselves (each
# registers itself on import), rather than leaning on the registry's discovery on a first look-up.
ENTRY_POINTS = ("dflash_ds.train", "dflash_ds.eval.cli", "dflash_ds.bench.cli", "dflash_ds.export.drafter", "dflash_ds.report")


def test_entry_points_import_the_architectures():
    graph = import_graph(ROOT)
    missing = [m for m in ENTRY_POINTS if "dflash_ds.architectures" not in graph[m]]
    assert not missing, ("entry points that do not import dflash_ds.architectures (which registers every drafter "
                         "architecture):\n  " + "\n  ".join(missing))
    below = [m for m in graph if folder_of(m) in ("dflash_ds.network", "dflash_ds.objective")
             and any(folder_of(t) == "dflash_ds.architectures" for t in graph[m])]
    assert below == [], f"the network and the objective import an architecture: {below}"


# The files that call an architecture's parts: the shape (its fields' checks and entries, the modules'
# inventory), the drafter (the modules), the draft model (the walk) and the loss (the objective).
CONTRACT_CALLERS = {"dflash_ds.network.shape", "dflash_ds.network.drafter", "dflash_ds.network.draft_model",
                    "dflash_ds.objective.drafter_loss"}


def test_the_contract_is_called_from_at_most_five_files_outside_the_architectures():
    found = contract_callers(ROOT)
    assert len(found) <= 5 and set(found) <= CONTRACT_CALLERS, (
        "modules outside dflash_ds/architectures/ that hold an architecture (read its spec through "
        "`shape.spec` or `registry.spec_of`, and call its parts through the shape, the drafter, the draft model "
        "or the loss):\n  " + "\n  ".join(f"{m}: {', '.join(w)}" for m, w in sorted(found.items())))


def test_no_architecture_test_outside_the_architectures():
    names, attributes, fields, logs = architecture_vocabulary()
    assert {"dflash", "dflash2", "DFlash2DraftModel", "selector_rank", "candidate_selector", "attention_conv",
            "l1_weight", "selector_loss", "tau_probabilistic", "confidence_mae"} <= names | attributes | fields | logs
    found = architecture_tests(ROOT, names, attributes, fields, logs)
    assert not found, ("code outside dflash_ds/architectures/ that tells drafter architectures apart (ask the "
                       "shape's variant instead, docs/architecture.md):\n  " + "\n  ".join(found))


def test_model_code_names_no_recipe_key():
    keys = recipe_keys()
    assert {"drafter.block_size", "objective.kl_weight", "target.path", "data.regenerate.urls",
            "drafter.dspark.markov_rank", "objective.dflash2.selector_alpha"} <= keys
    found = recipe_vocabulary(ROOT, MECHANISM_FOLDERS, keys)
    assert not found, ("messages in dflash_ds/network/, objective/, architectures/, target_model/ or quantization/ that "
                       "name a recipe key (raise a "
                       "neutral error there and name the setting at the boundary, config/checks.py or "
                       "resolve/):\n  " + "\n  ".join(found))
def test_messages_go_through_one_channel():
    found = stray_output(ROOT, OUTPUT_CHANNELS)
    assert not found, ("print / sys.stdout|stderr.write outside the entry points; say it with dflash_ds.safety.say "
                       "(or, for a program's result, print it in its main):\n  " + "\n  ".join(found))


def test_the_lab_stands_beside_the_package():
    """The quality lab imports dflash_ds; the package never imports the lab, and installs without it."""
    here = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((here / "dflash_ds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(here)}: {n}" for n in names if n == "lab" or n.startswith("lab.")]
    assert not found, found
    assert (here / "lab" / "__main__.py").is_file() and not (here / "dflash_ds" / "lab").exists()
    assert 'include = ["dflash_ds*"]' in (here / "pyproject.toml").read_text()
