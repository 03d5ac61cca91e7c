"""Conversations framed from the corpus's own text, and the held-out benchmark sets.

Kinds of exchange (each a user turn and the answer the corpus gives):
- `instruct`: a function's docstring summary as the ask, the whole function as the answer (MBPP-like);
- `complete`: a function's signature and docstring, worded as the HumanEval set asks, its whole
  definition as the answer (code completion);
- `docqa`: a documentation section's title as a question, the section's text as the answer (prose);
- `continue`: the start of a file as the prompt, what follows it as the answer;
- `multiturn`: two exchanges of one project, one after the other.
Training conversations come from training projects only; the held-out split and every benchmark set
come from held-out projects only (the corpus's split is by whole project). The in-domain set
(`indomain.jsonl`) is more conversations of the training projects, drawn as the training ones are but
not among them: acceptance on the distribution the drafters trained on, beside the held-out figures.

The benchmark files are written as `eval.bench_dir` reads them, under the names the evaluator knows:
`humaneval.jsonl` holds the code completions (field `prompt`, wrapped by the set's own request),
`mbpp.jsonl` the instructions (used as written), `mt_bench.jsonl` the two-turn conversations; the
prose questions are the recipe's held-out prompts (`data.eval_path`, the `heldout` set).
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import textwrap
from pathlib import Path

from dflash_ds.eval.benchmarks import BENCHMARKS

ANSWER_CHARS = 1600  # ~450 tokens of code: answers fit the lab's 1,024-token conversations
MIN_BODY_LINES = 2
KINDS = ("instruct", "complete", "docqa", "continue")
# Weights of the kinds a document of each kind can give; a kind the document cannot give (no function
# with a docstring, no titled section) falls through to the next drawn one, so every document counts.
MIX = {"code": {"instruct": 3, "complete": 3, "continue": 2}, "doc": {"docqa": 4, "continue": 1}}
MULTITURN_SHARE = 0.15
PASSES = 4  # a small corpus gives fewer conversations rather than many repeats
INDOMAIN_DRAWS = 2  # in-domain candidates drawn per record kept: some repeat a training turn (`frame`)
_TITLE = re.compile(r"^(?P<title>\S[^\n]{2,80})\n(?P<rule>[=\-~^\"'`#*+]{3,})$", re.M)


@functools.lru_cache(maxsize=8192)
def functions(text: str) -> list[dict]:
    """Functions with a docstring and a body of at least MIN_BODY_LINES lines: name, stub (signature and
    docstring, dedented), whole source (dedented), summary (the docstring's first paragraph)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if not doc or len(node.body) < 2 or first.end_lineno is None or node.end_lineno is None:
            continue
        stub = lines[node.lineno - 1:first.end_lineno]
        source = lines[node.lineno - 1:node.end_lineno]
        if len(source) - len(stub) < MIN_BODY_LINES:
            continue
        whole = textwrap.dedent("\n".join(source))
        if len(whole) > ANSWER_CHARS:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if len(summary) < 12:
            continue
        out.append({"name": node.name, "stub": textwrap.dedent("\n".join(stub)), "source": whole,
                    "summary": summary})
    return out


@functools.lru_cache(maxsize=8192)
def sections(text: str) -> list[dict]:
    """reStructuredText sections: title and the text up to the next title, cut at a paragraph end to fit."""
    heads = list(_TITLE.finditer(text))
    out = []
    for i, m in enumerate(heads):
        if len(m.group("rule")) < len(m.group("title").rstrip()) or len(set(m.group("rule"))) != 1:
            continue
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = cut(text[m.end():end].strip("\n"), ANSWER_CHARS)
        title = m.group("title").strip().strip("`*:")
        if len(body) >= 200 and title:
            out.append({"title": title, "text": body})
    return out


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, ended at the last paragraph (else line) break before it."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    for sep in ("\n\n", "\n"):
        k = head.rfind(sep)
        if k > limit // 3:
            return head[:k].rstrip()
    return head.rstrip()


def _fence(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code.rstrip()}\n```"


def exchange(kind: str, doc: dict, rng: random.Random) -> tuple[str, str] | None:
    """One (question, answer) of `kind` from a document, or None when the document has none."""
    if kind in ("instruct", "complete"):
        fns = functions(doc["text"]) if doc["kind"] == "code" else []
        if not fns:
            return None
        f = rng.choice(fns)
        if kind == "complete":
            return BENCHMARKS["humaneval"].template.replace("{text}", f["stub"]), _fence(f["source"])
        return instruct_prompt(f["name"], f["summary"]), _fence(f["source"])
    if kind == "docqa":
        secs = sections(doc["text"]) if doc["kind"] == "doc" else []
        if not secs:
            return None
        s = rng.choice(secs)
        return docqa_prompt(s["title"], doc["project"], rng), s["text"]
    lines = doc["text"].split("\n")
    if len(lines) < 12:
        return None
    k = rng.randint(4, min(40, len(lines) // 2))
    prefix, rest = cut("\n".join(lines[:k]), ANSWER_CHARS // 2), cut("\n".join(lines[k:]), ANSWER_CHARS)
    if len(rest) < 100:
        return None
    lang = "python" if doc["kind"] == "code" else "rst"
    return f"Continue this file ({doc['path']}):\n{_fence(prefix, lang)}", rest


def instruct_prompt(name: str, summary: str) -> str:
    return f"Write a Python function `{name}`: {summary}"


def docqa_prompt(title: str, project: str, rng: random.Random) -> str:
    forms = (f"What does the {project} documentation say about \"{title}\"?",
             f"Explain \"{title}\" as the {project} documentation does.",
             f"Write the documentation section \"{title}\" for {project}.")
    return rng.choice(forms)


def conversations(docs: list[dict], count: int, seed: int) -> list[dict]:
    """`count` conversations (or as many as PASSES over the documents give) in OpenAI `messages` form,
    each tagged with its kind and project; kinds drawn by MIX, MULTITURN_SHARE of them two-turn."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    out, seen = [], set()
    for i in range(PASSES * len(order)):
        if len(out) == count:
            break
        doc = docs[order[i % len(order)]]
        turns = 2 if rng.random() < MULTITURN_SHARE else 1
        messages = []
        for _ in range(turns):
            ex = drawn_exchange(doc, rng)
            if ex is None:
                break
            messages += [{"role": "user", "content": ex[0]}, {"role": "assistant", "content": ex[1]}]
        key = json.dumps(messages)
        if len(messages) != 2 * turns or key in seen:
            continue
        seen.add(key)
        out.append({"messages": messages, "kind": "multiturn" if turns == 2 else kind_of_prompt(messages[0]),
                    "project": doc["project"]})
    return out


def drawn_exchange(doc: dict, rng: random.Random) -> tuple[str, str] | None:
    """An exchange of a kind drawn by MIX (without replacement until one works), or None."""
    weights = dict(MIX[doc["kind"]])
    while weights:
        kind = rng.choices(list(weights), list(weights.values()))[0]
        ex = exchange(kind, doc, rng)
        if ex is not None:
            return ex
        del weights[kind]
    return None


def kind_of_prompt(message: dict) -> str:
    text = message["content"]
    if text.startswith("Continue this file"):
        return "continue"
    if text.startswith("Write a Python function"):
        return "instruct"
    if text.startswith(BENCHMARKS["humaneval"].template.split("{text}")[0]):
        return "complete"
    return "docqa"


def single(docs: list[dict], kind: str, count: int, seed: int) -> list[tuple[str, str, dict]]:
    """`count` exchanges of one kind: (question, answer, document)."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    out = []
    for j in order:
        ex = exchange(kind, docs[j], rng)
        if ex is not None:
            out.append((*ex, docs[j]))
            if len(out) == count:
                break
    return out


def bench_sets(docs: list[dict], count: int, seed: int) -> dict[str, list[dict]]:
    """The held-out benchmark records by file name (see the module docstring)."""
    held = [d for d in docs if d["split"] == "heldout"]
    complete = single(held, "complete", count, seed)
    instruct = single(held, "instruct", count, seed + 1)
    prose = single(held, "docqa", count, seed + 2)
    firsts = single(held, "continue", count, seed + 3)
    seconds = single(held, "docqa", count, seed + 4) + single(held, "instruct", count, seed + 5)
    random.Random(seed + 6).shuffle(seconds)
    # humaneval's field is the bare stub (the set's template wraps it); the answer is kept for reference
    stub = BENCHMARKS["humaneval"].template.split("{text}")
    sets = {
        "humaneval": [{"task_id": f"lab/{i}", "prompt": q[len(stub[0]):len(q) - len(stub[1])],
                       "canonical_solution": a, "project": d["project"]} for i, (q, a, d) in enumerate(complete)],
        "mbpp": [{"task_id": i, "prompt": q, "code": a, "project": d["project"]}
                 for i, (q, a, d) in enumerate(instruct)],
        "mt_bench": [{"prompt": [q1, q2], "prompt_id": i, "category": "lab", "reference": []}
                     for i, ((q1, _, _), (q2, _, _)) in enumerate(zip(firsts, seconds))],
        "heldout": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                     "kind": "docqa", "project": d["project"]} for q, a, d in prose],
    }
    return sets


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def frame(docs: list[dict], out: Path, *, train_count: int, bench_count: int, seed: int) -> dict:
    """Write train.jsonl, indomain.jsonl (every kind, training projects, not in train.jsonl),
    heldout.jsonl (every kind, held-out projects) and bench/<name>.jsonl under `out`."""
    train_docs = [d for d in docs if d["split"] == "train"]
    held_docs = [d for d in docs if d["split"] == "heldout"]
    if not train_docs or not held_docs:
        raise ValueError("lab frame: the corpus needs documents of both splits (train and heldout)")
    # The in-domain set continues the training draw: conversations() stops at its count, so its first
    # train_count conversations are exactly what a draw of train_count gives, and train.jsonl (which the
    # target's fine-tuning and the regeneration read) stays what it was before the in-domain set existed.
    drawn = conversations(train_docs, train_count + INDOMAIN_DRAWS * bench_count, seed)
    train = drawn[:train_count]
    # A later draw can repeat a training turn word for word (a two-turn conversation whose second
    # exchange is a training one, a function asked for again): the drafters may have trained on the
    # target's answer to it, so such a conversation would measure recall, not the training distribution.
    seen = {m["content"] for c in train for m in c["messages"]}
    indomain = [c for c in drawn[train_count:] if not any(m["content"] in seen for m in c["messages"])][:bench_count]
    if not indomain:
        raise ValueError(f"lab frame: the training documents gave {len(drawn)} conversations and none past "
                         f"--train-count {train_count} is new to training, so the in-domain set is empty; pass a "
                         "lower --train-count (or frame a larger corpus)")
    heldout = conversations(held_docs, max(bench_count, 4), seed + 1)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "indomain.jsonl", indomain)
    write_jsonl(out / "heldout.jsonl", heldout)
    sets = bench_sets(docs, bench_count, seed + 2)
    for name, rows in sets.items():
        if not rows:
            raise ValueError(f"lab frame: the held-out projects gave no {name} records")
        write_jsonl(out / "bench" / f"{name}.jsonl", rows)
    counts = {"train": len(train), "indomain": len(indomain), "heldout": len(heldout)}
    counts.update({f"bench/{k}": len(v) for k, v in sets.items()})
    for name, rows in (("train", train), ("indomain", indomain)):
        counts[f"{name}_kinds"] = {k: sum(c["kind"] == k for c in rows) for k in (*KINDS, "multiturn")}
    return counts
