"""The boundary rule, checked on the source with `ast` (nothing is imported), in place of a cap on
the number of parameters:

- arguments past the fourth are keyword-only, for every function and method of dflash_ds (`self` /
  `cls` not counted). Exempt: Triton kernels (`@triton.jit`: flat pointer and size arguments are their
  launch interface), torch.autograd.Function's methods (`apply` passes arguments by position only)
  and FIXED_SIGNATURES, the signatures transformers or the published remote code fix;
- no positional unpacking of a NamedTuple the package defines: `a, b = x` or `f(*x)` where x is a call
  of the type, a call of a function annotated to return it, or a name annotated with it. What the
  source cannot tell (an element of a list of them, an attribute) is not checked;
- a dataclass / NamedTuple earns its place by crossing a module boundary (its name used by another
  module of the package, or its values leaving through a public function annotated to return it, a
  public table of them, or the class object itself handed out) or by carrying behaviour (a method or
  property of its own);
- string keys are held to the same rule: no call hands another module's function a dict literal with
  fixed string keys that the function reads back by key (a type without a name, or a way around the
  keyword-only rule). Dicts returned as records (JSON results, metrics, reports) are data for their
  readers and are not checked.

Each rule is first run on a small made-up package that breaks it, so a checker that finds nothing
cannot pass unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_structure import ROOT, _constants, _write, sources

MAX_POSITIONAL = 4
_LOSS_BRANCH_FILES: set = set()


# Signatures another party fixes: transformers calls these with its arguments by position (an
# experts module's forward, a Gated DeltaNet layer's forward, a registered attention function), and
# the published architectures' remote code keeps the interface AutoModel's users call.
FIXED_SIGNATURES = {
    "target_model/expert_parallel.py:sharded_experts_forward", "target_model/packed.py:packed_gdn_forward",
    "target_model/packed.py:varlen_attention", "architectures/dflash/modeling_dflash.py",
    "architectures/dflash2/modeling_dflash2.py", "architectures/dspark/modeling_dspark.py",
    "data/static_decode.py:_attention",  # transformers' AttentionInterface calls it by position
}


def _methods(tree: ast.AST) -> set[int]:
    """ids of the functions defined directly in a class body that take the instance or the class first."""
    out = set()
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        not any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list):
                    out.add(id(fn))
    return out


def _by_position_only(tree: ast.AST) -> set[int]:
    """ids of the methods of torch.autograd.Function classes: `apply` hands them its arguments by
    position only, so their signatures cannot take keywords."""
    return {id(fn) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            and any(ast.unparse(b).endswith("Function") for b in cls.bases)
            for fn in cls.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    # A GPU kernel (`@triton.jit`): its flat pointer and size arguments are its launch interface.
    return any(ast.unparse(d).endswith("jit") for d in fn.decorator_list)


def _exempt(path: Path, root: Path, fn_name: str | None = None) -> bool:
    rel = path.relative_to(root).as_posix()
    return rel in _LOSS_BRANCH_FILES or (fn_name is not None and f"{rel}:{fn_name}" in _LOSS_BRANCH_FILES)


def _fixed(path: Path, root: Path, fn_name: str) -> bool:
    rel = path.relative_to(root).as_posix()
    return rel in FIXED_SIGNATURES or f"{rel}:{fn_name}" in FIXED_SIGNATURES


def positional_overflow(root: Path) -> list[str]:
    """`module:line name (n positional)` for every function or method that takes more than
    MAX_POSITIONAL arguments by position (`self` / `cls` not counted; `*args` and keyword-only ones
    are not positional parameters), the Triton kernels aside."""
    found = []
    for name, (path, tree) in sources(root).items():
        methods, autograd = _methods(tree), _by_position_only(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_kernel(node) \
                    or id(node) in autograd or _exempt(path, root, node.name) or _fixed(path, root, node.name):
                continue
            positional = node.args.posonlyargs + node.args.args
            n = len(positional) - (id(node) in methods and bool(positional))
            if n > MAX_POSITIONAL:
                found.append(f"{name}:{node.lineno} {node.name} ({n} positional)")
    return found


def _decorator_names(node: ast.ClassDef) -> set[str]:
    return {ast.unparse(d.func if isinstance(d, ast.Call) else d).rpartition(".")[2] for d in node.decorator_list}


def record_types(root: Path) -> list[tuple[str, ast.ClassDef]]:
    """Every dataclass and NamedTuple class of the package, as (module, class node)."""
    out = []
    for name, (_, tree) in sources(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
                if "dataclass" in _decorator_names(node) or "NamedTuple" in bases:
                    out.append((name, node))
    return out


def named_tuples(root: Path) -> set[str]:
    return {node.name for _, node in record_types(root)
            if "NamedTuple" in {ast.unparse(b).rpartition(".")[2] for b in node.bases}}


def _annotation_names(node: ast.AST | None) -> set[str]:
    """The bare names an annotation mentions (`Foo`, `"Foo"`, `Foo | None`, `tuple[Foo, int]`); an
    attribute (`torch.Tensor`) is another module's name, not one of these."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    skip = {id(a.value) for a in ast.walk(node) if isinstance(a, ast.Attribute)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in skip}


def _visible(tree: ast.Module, package: str, types: set[str]) -> set[str]:
    """The package's NamedTuple names a module can mean by a bare name: its own and those it imports."""
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} & types
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.level or (n.module or "").split(".")[0] == package) for a in n.names if a.name in types}
    return own | imported


def _returns_of(modules: dict, package: str, types: set[str]) -> dict[str, str]:
    """Function name -> the NamedTuple it is annotated to return, for functions whose every
    definition of that name in the package returns one (a name shared with others is left out)."""
    seen: dict[str, set] = {}
    for _, (_, tree) in modules.items():
        visible = _visible(tree, package, types)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                hit = _annotation_names(node.returns) & visible
                seen.setdefault(node.name, set()).add(next(iter(hit)) if len(hit) == 1 else None)
    return {f: next(iter(r)) for f, r in seen.items() if len(r) == 1 and None not in r}


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def positional_unpacking(root: Path) -> list[str]:
    """`module:line what` for every positional unpacking of a NamedTuple the package defines:
    `a, b = x` or `f(*x)` where x is a call of the type, a call of a function annotated to return it,
    or a name annotated with it (a parameter or an annotated assignment in the same function)."""
    modules = sources(root)
    types = named_tuples(root)
    returns = _returns_of(modules, root.name, types)
    found = []
    for name, (path, tree) in modules.items():
        if _exempt(path, root):
            continue
        visible = _visible(tree, root.name, types)
        for scope in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            typed = {}
            for a in scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs:
                hit = _annotation_names(a.annotation) & visible
                if hit:
                    typed[a.arg] = next(iter(hit))
            for n in ast.walk(scope):
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    hit = _annotation_names(n.annotation) & visible
                    if hit:
                        typed[n.target.id] = next(iter(hit))

            def what(value: ast.AST) -> str | None:
                f = _called(value)
                if f in visible and isinstance(value.func, ast.Name):
                    return f
                if f in returns:
                    return returns[f]
                return typed.get(value.id) if isinstance(value, ast.Name) else None

            for n in ast.walk(scope):
                pairs = []
                if isinstance(n, ast.Assign):
                    pairs = [(t, n.value) for t in n.targets if isinstance(t, (ast.Tuple, ast.List))]
                elif isinstance(n, ast.Starred) and isinstance(n.ctx, ast.Load):
                    pairs = [(n, n.value)]
                for target, value in pairs:
                    t = what(value)
                    if t:
                        kind = "star-unpacks" if isinstance(target, ast.Starred) else "unpacks"
                        found.append((name, n.lineno, f"{kind} {t} by position"))
    return [f"{m}:{line} {w}" for m, line, w in sorted(set(found))]


def _identifiers(tree: ast.AST) -> set[str]:
    """The names a module's code uses: names, attributes, imported names and string annotations' names."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add(n.name.rpartition(".")[2])
        elif isinstance(n, (ast.arg, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef)):
            out |= _annotation_names(n.annotation if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                     else n.returns)
    return out


def _leaves(tname: str, tree: ast.Module) -> set[str]:
    """The names through which values of type `tname` leave its module besides its own: public
    functions annotated to return it, public module-level constants built from it (a table of them);
    and `tname` itself when the class object is handed out as a value (`fields = DFlash2Fields`)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_") \
                and tname in _annotation_names(n.returns):
            out.add(n.name)
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(_called(c) == tname for c in ast.walk(stmt.value)):
            out |= {t.id for t in stmt.targets if isinstance(t, ast.Name) and not t.id.startswith("_")}
    # Calling it and testing against it (`isinstance(x, T)`) keep it inside; naming it as a value gives it away.
    calls = {id(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call)}
    calls |= {id(a) for c in ast.walk(tree) if isinstance(c, ast.Call) and _called(c) in ("isinstance", "issubclass")
              for a in ast.walk(c)}
    notes = {id(x) for n in ast.walk(tree) for a in ("annotation", "returns") if getattr(n, a, None) is not None
             for x in ast.walk(getattr(n, a))}
    if any(isinstance(n, ast.Name) and n.id == tname and isinstance(n.ctx, ast.Load) and id(n) not in calls | notes
           for n in ast.walk(tree)):
        out.add(tname)
    return out


def unearned_types(root: Path) -> list[str]:
    """`module:line Name` for every dataclass / NamedTuple that neither carries behaviour (a method or
    property of its own) nor crosses a module boundary: its name used by another module of the
    package, or its values leaving through a public function, a public table or the class itself."""
    modules = sources(root)
    used = {m: _identifiers(tree) for m, (_, tree) in modules.items()}
    found = []
    for module, node in record_types(root):
        tname = node.name
        path, tree = modules[module]
        if _exempt(path, root) or any(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body):
            continue
        if _leaves(tname, tree) or any(tname in names for m, names in used.items() if m != module):
            continue
        found.append((module, node.lineno, tname))
    return [f"{m}:{line} {t}" for m, line, t in sorted(found)]


def _keys_read(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, set[str]]:
    """Parameter -> the constant string keys the function reads from it (`p["key"]`, `p.get("key")`)."""
    params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    out: dict[str, set[str]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in params:
            out.setdefault(n.value.id, set()).update(_constants(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and isinstance(n.func.value, ast.Name) and n.func.value.id in params and n.args:
            out.setdefault(n.func.value.id, set()).update(_constants(n.args[0]))
    return {p: keys for p, keys in out.items() if keys}


def string_key_carriers(root: Path) -> list[str]:
    """`module:line function(parameter)` for every call that hands another module's function a dict
    literal with fixed string keys which that function reads back by key: a type without a name (or a
    way around the keyword-only rule) crossing the boundary. Records written out as JSON, read by
    their consumers as data, are not arguments of this kind."""
    modules = sources(root)
    readers: dict[str, list[tuple[str, ast.FunctionDef, dict]]] = {}
    for name, (_, tree) in modules.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (keys := _keys_read(fn)):
                readers.setdefault(fn.name, []).append((name, fn, keys))
    found = []
    for name, (path, tree) in modules.items():
        if _exempt(path, root):
            continue
        for call in ast.walk(tree):
            for module, fn, keys in readers.get(_called(call), []) if isinstance(call, ast.Call) else []:
                if module == name:
                    continue
                params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                given = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords]
                for param, value in given:
                    if param in keys and isinstance(value, ast.Dict) and value.keys and \
                            all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
                        found.append(f"{name}:{call.lineno} {fn.name}({param})")
    return sorted(set(found))


# ---------------------------------------------------------------------------------- the rules on a made-up package

def test_positional_check_counts_positional_parameters_past_self(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": ("def f(a, b, c, d, e):\n    pass\n\ndef ok(a, b, c, d, *, e, f, g):\n    pass\n\n"
                     "def star(a, b, *rest, **kw):\n    pass\n"),
        "pkg/b.py": ("import torch\n\nclass K:\n    def m(self, a, b, c, d):\n        pass\n\n"
                     "    def n(self, a, b, c, d, e):\n        pass\n\n    @staticmethod\n    def s(a, b, c, d, e):\n"
                     "        pass\n\nclass G(torch.autograd.Function):\n    @staticmethod\n"
                     "    def forward(ctx, a, b, c, d, e):\n        pass\n\n@triton.jit\ndef kernel(a, b, c, d, e):\n    pass\n"),
    })
    assert positional_overflow(root) == ["pkg.a:1 f (5 positional)", "pkg.b:7 n (5 positional)",
                                         "pkg.b:11 s (5 positional)"]


def test_unpacking_check_finds_positional_unpacking_of_a_named_tuple(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/t.py": ("from typing import NamedTuple\n\nclass Pair(NamedTuple):\n    a: int\n    b: int\n\n"
                     "def make() -> Pair:\n    return Pair(1, 2)\n\ndef plain() -> tuple[int, int]:\n    return 1, 2\n"),
        "pkg/u.py": ("from pkg.t import Pair, make, plain\n\ndef f(p: Pair, q):\n    a, b = make()\n    c, d = p\n"
                     "    e, g = plain()\n    h, i = q\n    print(*p)\n    j, k = Pair(1, 2)\n    return make().a\n"),
    })
    assert positional_unpacking(root) == ["pkg.u:4 unpacks Pair by position", "pkg.u:5 unpacks Pair by position",
                                          "pkg.u:8 star-unpacks Pair by position", "pkg.u:9 unpacks Pair by position"]


def test_type_check_finds_a_carrier_that_neither_crosses_nor_behaves(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": ("from dataclasses import dataclass\nfrom typing import NamedTuple\n\n"
                     "@dataclass\nclass Kept:\n    x: int\n\n"          # used by pkg.b
                     "@dataclass(frozen=True)\nclass Carrier:\n    x: int\n\n"  # only here: flagged
                     "class Behaves(NamedTuple):\n    x: int\n\n    def double(self):\n        return 2 * self.x\n\n"
                     "class Returned(NamedTuple):\n    x: int\n\n"
                     "class Row(NamedTuple):\n    x: int\n\n"
                     "class Private(NamedTuple):\n    x: int\n\n"
                     "TABLE = (Row(1), Row(2))\n\n"
                     "def public() -> Returned:\n    return Returned(Carrier(1).x)\n\n"
                     "def _private() -> Private:\n    return Private(1)\n"),
        "pkg/b.py": "from pkg.a import Kept\n",
    })
    assert unearned_types(root) == ["pkg.a:9 Carrier", "pkg.a:24 Private"]


def test_string_key_check_finds_a_dict_carrier_across_modules(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def run(x, opts):\n    return x * opts['scale'] + opts.get('shift', 0)\n",
        "pkg/b.py": ("from pkg.a import run\n\ndef f(x):\n    run(x, {'scale': 2, 'shift': 1})\n"
                     "    run(x, opts={'scale': 3})\n    run(x, {1: 2})\n    return run(x, dict(scale=2))\n"),
        "pkg/c.py": "def own(opts):\n    return opts['k']\n\ndef g():\n    return own({'k': 1})\n",  # one module
    })
    assert string_key_carriers(root) == ["pkg.b:4 run(opts)", "pkg.b:5 run(opts)"]


# ---------------------------------------------------------------------------------- the rules on dflash_ds

def test_arguments_past_the_fourth_are_keyword_only():
    found = positional_overflow(ROOT)
    assert not found, ("functions taking more than 4 arguments by position (make the rest keyword-only: "
                       "`def f(a, b, c, d, *, e)`):\n  " + "\n  ".join(found))


def test_no_named_tuple_is_unpacked_by_position():
    found = positional_unpacking(ROOT)
    assert not found, "NamedTuples unpacked by position (read their fields by name):\n  " + "\n  ".join(found)


def test_every_type_crosses_a_module_boundary_or_carries_behaviour():
    types = record_types(ROOT)
    assert len(types) > 50 and {"DrafterShape", "RunSpec", "LogitBias"} <= {node.name for _, node in types}  # seen
    found = unearned_types(ROOT)
    assert not found, ("dataclasses / NamedTuples used inside one module only and without a method (pass "
                       "the values themselves, or give the type its behaviour):\n  " + "\n  ".join(found))


def test_no_string_keyed_carrier_crosses_a_module_boundary():
    found = string_key_carriers(ROOT)
    assert not found, ("dict literals with fixed keys handed to another module's function that reads them "
                       "by key (use keyword arguments, or a type):\n  " + "\n  ".join(found))
