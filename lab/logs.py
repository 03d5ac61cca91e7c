"""A run's summary from its log, for a run whose evaluation a command's time limit cut before
`benchmarks.json` was written: the benchmark rows the table printed as it went (`[dflash] <set>
<sampling> <tau_mean> ±<se> ...`, eval/benchmark_table.py `table_lines`) and the last training progress
line. What the log cannot give (the llama.cpp count, the run's metrics.jsonl) is left out, and the
summary says where it came from (`source: log`, `benchmarks_complete: false`).
"""

from __future__ import annotations

import re
from pathlib import Path

_NUM = r"(-|[0-9.]+(?: ±[0-9.]+)?)"
_ROW = re.compile(r"^\[dflash\] (?P<bench>\S+)\s+(?P<sampling>\S.*?)\s+" + r"\s+".join([_NUM] * 3) +
                  r"\s+(?P<llama>-|[0-9.]+)\s+(?P<vllm>-|[0-9.]+)\s+(?P<resp>\d+)\s+(?P<cycles>\d+)\s+(?P<pos>(?:\d+:\S+ ?)+)$")
_STEP = re.compile(r"^step (\d+)/(\d+) \|.*?\| loss ([0-9.]+) \| accept ([0-9.]+)")


def _value(cell: str) -> tuple[float | None, float | None]:
    if cell == "-":
        return None, None
    parts = cell.split(" ±")
    return float(parts[0]), (float(parts[1]) if len(parts) > 1 else None)


def _float(cell: str) -> float | None:
    return None if cell == "-" else float(cell)


def bench_rows(text: str) -> list[dict]:
    """Every benchmark row the log printed, in benchmarks.json's form; a row printed twice (a rerun of
    a cut evaluation) counts once, its last printing."""
    rows: dict[tuple[str, str], dict] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m or m["bench"] == "bench":
            continue
        (tm, tm_se), (tp, tp_se), (te, te_se) = (_value(c) for c in m.groups()[2:5])
        pos = [_float(p.split(":", 1)[1]) for p in m["pos"].split()]
        sampling = m["sampling"].strip()
        rows[m["bench"], sampling] = {
            "bench": m["bench"], "sampling": sampling, "tau_mean": tm, "tau_mean_se": tm_se, "tau_pooled": tp,
            "tau_pooled_se": tp_se, "tau_expected": te, "tau_expected_se": te_se, "position_acceptance": pos,
            "responses": int(m["resp"]), "cycles": int(m["cycles"]), "block_size": len(pos) + 1,
            "llama_server": _float(m["llama"]), "vllm": _float(m["vllm"])}
    return list(rows.values())


def last_progress(text: str) -> dict:
    """The last training progress line's step, loss and in-training acceptance."""
    last = {}
    for line in text.splitlines():
        m = _STEP.match(line.strip())
        if m:
            last = {"step": int(m[1]), "max_steps": int(m[2]), "loss": float(m[3]), "accept": float(m[4])}
    return last


def summary_from_log(log: Path, name: str) -> dict:
    """The lab summary of run `name` (lab/catalog.py) from its log OUT/NAME.log."""
    from dflash_ds.config import load_recipe
    from lab.catalog import settings_lines

    lines = settings_lines(name)
    recipe = load_recipe(lines[0], lines[1:])
    text = Path(log).read_text(errors="replace")
    return {"name": name, "architecture": recipe.drafter.architecture, "block_size": recipe.drafter.block_size,
            "seed": recipe.run.seed, "final": last_progress(text), "tau_evals": [], "benchmarks": bench_rows(text),
            "heldout_greedy": None, "llama_cpp": None, "train_s": None, "wall_s": None,
            "source": "log", "benchmarks_complete": False}
