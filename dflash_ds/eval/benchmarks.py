"""The standard benchmark sets by name: where each comes from and how its prompts are worded.

Each set is a list of conversations, a conversation a list of user turns (MT-Bench has two; the
others one). Prompts are worded as in the public DFlash benchmark scripts, so the numbers sit beside
published ones: the maths sets ask for step-by-step reasoning and a boxed answer, HumanEval wraps its
function stub in a request for a solution, MBPP (sanitized) and MT-Bench are used as written.

A set comes from the hub through `datasets` (the HF cache serves it offline), or, with a bench
directory, from `<dir>/<name>.jsonl` (or .json / .parquet) with the same field as the hub set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_ds.config import BENCHMARK_SETS

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Bench:
    hub_id: str
    config: str | None
    split: str
    field: str
    template: str = "{text}"  # "{text}" is replaced by the field's value

    @property
    def source(self) -> str:
        return f"{self.hub_id}{f' ({self.config})' if self.config else ''} {self.split}[{self.field}]"


BENCHMARKS = {
    "gsm8k": Bench("openai/gsm8k", "main", "test", "question", "{text}" + MATH_SUFFIX),
    "math500": Bench("HuggingFaceH4/MATH-500", None, "test", "problem", "{text}" + MATH_SUFFIX),
    "humaneval": Bench("openai/openai_humaneval", None, "test", "prompt",
                       "Write a solution to the following problem and make sure that it passes the tests:\n"
                       "```python\n{text}\n```"),
    "mbpp": Bench("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
    "mt_bench": Bench("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
}
HELDOUT = "heldout"  # the recipe's held-out prompts (data.eval_path), already rendered by the data pipeline
BENCH_NAMES = BENCHMARK_SETS
assert set(BENCH_NAMES) == {*BENCHMARKS, HELDOUT}


def parse_names(text: str, setting: str = "--bench") -> list[str]:
    """'gsm8k,math500' -> names, each checked; one ValueError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BENCH_NAMES]
    if bad or not names:
        raise ValueError(f"{setting}: unknown benchmark(s) {bad or [text]}; known: {', '.join(BENCH_NAMES)}")
    return names


def _records_from_file(path: Path, name: str) -> list[dict]:
    """The records of a local benchmark file; ValueError naming the set, the file and the line."""
    if path.suffix == ".parquet":
        from datasets import load_dataset

        try:
            return list(load_dataset("parquet", data_files=str(path), split="train"))
        except Exception as e:  # noqa: BLE001 - pyarrow's errors name neither the file nor the set
            raise ValueError(f"benchmark {name}: {path} cannot be read as parquet ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:160]})") from None
    from dflash_ds.data.validate import check_json_file

    check_json_file(path, f"benchmark {name}")  # empty, not UTF-8, a malformed line: file and line named
    text = path.read_text(encoding="utf-8").lstrip("\ufeff")
    if path.suffix == ".json" and text.lstrip()[:1] == "[":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _records(name: str, bench_dir: str | None, setting: str) -> tuple[list[dict], str]:
    b = BENCHMARKS[name]
    if bench_dir:
        if Path(bench_dir).is_file():
            raise ValueError(f"{setting} {bench_dir} is a file, not a directory; point {setting} at the directory "
                             f"that holds {name}.jsonl (e.g. {Path(bench_dir).parent or '.'})")
        if not Path(bench_dir).is_dir():
            raise ValueError(f"{setting} {bench_dir} does not exist; point {setting} at a directory holding "
                             f"{name}.jsonl, or drop it to load the sets from the hub")
        files = [Path(bench_dir) / f"{name}{ext}" for ext in (".jsonl", ".json", ".parquet")]
        found = next((f for f in files if f.is_file()), None)
        if found is None:
            raise ValueError(f"benchmark {name}: no {name}.jsonl/.json/.parquet in {setting} {bench_dir}; put the "
                             f"records of {b.source} there (field '{b.field}'), or drop {setting} to load it "
                             "from the hub")
        return _records_from_file(found, name), str(found)
    try:
        from datasets import load_dataset

        return list(load_dataset(b.hub_id, b.config, split=b.split)), b.source
    except Exception as e:  # noqa: BLE001 - no network, no cache, a renamed set: one line saying how to provide it
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        raise ValueError(f"benchmark {name}: cannot load {b.source} ({reason}); "
                         f"make the hub reachable (or its HF cache present), or put {name}.jsonl with field "
                         f"'{b.field}' in a directory passed as {setting}") from None


def load_conversations(name: str, bench_dir: str | None = None, limit: int | None = None, *,
                       setting: str = "--bench-dir") -> list[list[str]]:
    """The first `limit` conversations of a set: each a list of user turns, worded as the module says."""
    b = BENCHMARKS[name]
    records, where = _records(name, bench_dir, setting)
    out = []
    for i, rec in enumerate(records[:limit] if limit else records):
        value = rec.get(b.field, rec.get("turns")) if isinstance(rec, dict) else None
        turns = [value] if isinstance(value, str) else value
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise ValueError(f"benchmark {name}: record {i} of {where} has no '{b.field}' "
                             f"({'a list of turns' if name == 'mt_bench' else 'a string'})")
        out.append([b.template.replace("{text}", t) for t in turns])
    if not out:
        raise ValueError(f"benchmark {name}: {where} holds no records")
    return out


def render_prompt(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    """Token ids of a conversation ending in a user turn, with the generation prompt, as training renders
    it (the chat template with enable_thinking; the text tokenised without extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
