"""A recipe's YAML text read strictly: a key given twice in one mapping, and a syntax error, each stop
with one line naming the file and the line(s) a user has to look at.

PyYAML keeps the last of two equal keys without a word (a second `optim:` section silently replaces
the first, its epochs, warm-up and rate falling back to defaults), so the document is composed into
nodes first, every mapping is checked for repeated keys, and only then turned into Python values."""

from __future__ import annotations

import yaml

from dflash_ds.config.errors import RecipeError

# The contexts PyYAML names while it reads one token: its mark is where that token began, which is
# the line at fault (a key missing its ':' is only noticed on the next line, a quote left open at the
# end of the file). The "while parsing a ..." contexts mark the enclosing block instead, often far above.
_TOKEN_CONTEXTS = ("while scanning a simple key", "while scanning a quoted scalar", "while scanning a block scalar",
                   "while scanning an anchor", "while scanning an alias", "while scanning a tag")


def _run_on(text: str, mark) -> int | None:
    """The line where the plain text that ends at `mark` began, when it began on an earlier line: a key
    missing its ':' (or a line indented too far) runs on into the next line, whose ':' PyYAML refuses."""
    start = None
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, yaml.ScalarToken):
                start = token.start_mark.line
    except yaml.YAMLError:
        pass
    return start + 1 if start is not None and start < mark.line else None


def syntax_error(name: str, text: str, exc: yaml.YAMLError) -> str:
    """One line for text that is not valid YAML: file, line and column the user should fix, and the problem."""
    context, mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if context in _TOKEN_CONTEXTS and mark is not None:
        problem = f"{context.removeprefix('while scanning ')} that starts here: {problem}"
    else:
        mark = getattr(exc, "problem_mark", None) or mark
        began = _run_on(text, mark) if mark is not None and problem == "mapping values are not allowed here" else None
        if began is not None:
            problem += (f"; the text from line {began} runs on to line {mark.line + 1}: a missing ':' on line {began}, "
                        f"or line {mark.line + 1} indented too far")
            return f"{name}:{began}: the recipe is not valid YAML ({problem})"
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
    return f"{where}: the recipe is not valid YAML ({problem}); fix that line (indentation, a missing ':' or quote)"


def _repeated(node: yaml.Node, path: str, done: set[int]) -> tuple[str, int, int] | None:
    """The first key given twice in a mapping under `node`: (dotted key, first line, second line).
    `done` holds the nodes already walked (an alias repeats a node, and may point back at its parent)."""
    if id(node) in done:
        return None
    done.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                dotted = f"{path}.{key.value}" if path else str(key.value)
                if key.value in seen:
                    return dotted, seen[key.value], key.start_mark.line + 1
                seen[key.value] = key.start_mark.line + 1
                found = _repeated(value, dotted, done)
            else:
                found = _repeated(value, path, done)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _repeated(item, f"{path}[{i}]", done)
            if found:
                return found
    return None


def read_yaml(text: str, name: str):
    """The YAML document `text` (from the file `name`) as Python values; RecipeError naming the line for a
    syntax error and both lines for a key given twice in one mapping."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        twice = _repeated(node, "", set())
        if twice:
            key, first, second = twice
            raise RecipeError(f"{name}:{second}: key '{key}' is given twice (lines {first} and {second}); the second "
                              "would silently replace the first: merge them into one")
        loader = yaml.SafeLoader(text)
        try:
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise RecipeError(syntax_error(name, text, exc)) from None
