"""The benchmark table's rows so far, kept in the run directory so that a rerun resumes.

`python -m dflash_ds.eval.benchmark_table` writes `<run.output_dir>/benchmarks.partial.json` after each
row: the rows done and the settings that produced them. A rerun whose settings are the same reuses
those rows and computes only the others (a command cut by a time limit loses at most the row it was
on); `benchmarks.json` is written once the table is whole, and the partial file is then removed.

The settings are everything a row's numbers depend on: the sets, prompts per set, budget, sampling,
samples, run seed, enable_thinking, the sets' directory, the target, and the export's weights and
config (sizes and modification times, so a retrained drafter in the same run directory starts over).
The generation batch (eval.bench_batch) is not among them: it changes no response.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PARTIAL = "benchmarks.partial.json"


def _export_identity(export: Path) -> list[list]:
    files = sorted(p for p in export.glob("*") if p.is_file() and (p.suffix in (".safetensors", ".bin")
                                                                     or p.name == "config.json"))
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def table_settings(recipe) -> dict:
    """What the rows of a recipe's table depend on (module docstring), JSON-ready."""
    e = recipe.eval
    return {"benchmarks": list(e.benchmarks), "bench_limit": e.bench_limit, "bench_dir": e.bench_dir,
            "max_new_tokens": e.max_new_tokens, "temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k,
            "samples": e.samples, "seed": recipe.run.seed, "thinking": recipe.data.thinking,
            "target": str(recipe.target.path), "export": _export_identity(Path(recipe.run.output_dir) / "export")}


def read_partial(run_dir: Path) -> dict | None:
    """The partial file's content ({"settings", "rows"}), None when there is none or it is unreadable
    (a write cut half-way is rewritten from scratch)."""
    path = Path(run_dir) / PARTIAL
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("rows"), list) else None


def rows_done(run_dir: Path, settings: dict) -> dict[tuple[str, str], dict]:
    """The finished rows of an earlier run with the same settings, by (bench, sampling label)."""
    got = read_partial(run_dir)
    if got is None or got.get("settings") != settings:
        return {}
    return {(r["bench"], r["sampling"]): r for r in got["rows"]}


def save_partial(run_dir: Path, settings: dict, rows: list[dict]) -> None:
    """The rows so far, written whole (temporary file, then rename) so a cut leaves the last good one."""
    path = Path(run_dir) / PARTIAL
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    os.replace(tmp, path)


def drop_partial(run_dir: Path) -> None:
    (Path(run_dir) / PARTIAL).unlink(missing_ok=True)
