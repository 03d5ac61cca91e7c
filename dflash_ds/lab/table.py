"""The lab's table: every run's summary side by side, one markdown and one JSON file.

Rows per benchmark set and sampling (greedy, T = 1): tau_mean with its standard error over responses
for each run; each run's difference from the reference run (v1, seed 0) with the standard error of the
difference (the runs' responses are independent: sqrt(se_a^2 + se_b^2)), called a difference only at
2 standard errors or more; the seed-to-seed difference of v1 beside it; per-position acceptance;
llama.cpp's counted acceptance (first round apart from the later ones); final losses and wall times.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REFERENCE = "v1"
SEED_TWIN = "v1-seed1"
LAB_SET_NAMES = {"heldout": "prose (held-out docs)", "humaneval": "code completion", "mbpp": "instruction -> code",
                 "mt_bench": "two turns"}
SIGNIFICANT_SE = 2.0


def load_summaries(folder: Path) -> dict[str, dict]:
    """Every `<name>.json` summary in `folder` (the lab's own table files excluded), by run name."""
    out = {}
    for f in sorted(Path(folder).glob("*.json")):
        data = json.loads(f.read_text())
        if isinstance(data, dict) and "benchmarks" in data and "name" in data:
            out[data["name"]] = data
    if not out:
        raise ValueError(f"lab table: no run summaries (<name>.json) in {folder}; each `bash scripts/quality_lab.sh "
                         f"OUT train NAME` writes one there")
    return out


def _rows(summary: dict) -> dict[tuple[str, str], dict]:
    return {(r["bench"], r["sampling"]): r for r in summary.get("benchmarks", [])}


def difference(a: dict, b: dict) -> dict | None:
    """b - a in tau_mean, its standard error and the ratio (None when either lacks a number)."""
    if a.get("tau_mean") is None or b.get("tau_mean") is None:
        return None
    se = math.sqrt((a.get("tau_mean_se") or 0.0) ** 2 + (b.get("tau_mean_se") or 0.0) ** 2)
    delta = b["tau_mean"] - a["tau_mean"]
    z = delta / se if se > 0 else (math.inf if delta else 0.0)
    return {"delta": delta, "se": se, "z": z, "significant": abs(z) >= SIGNIFICANT_SE}


def build(summaries: dict[str, dict]) -> dict:
    first = [n for n in (REFERENCE, SEED_TWIN) if n in summaries]
    summaries = {n: summaries[n] for n in first + sorted(set(summaries) - set(first))}
    keys = sorted({k for s in summaries.values() for k in _rows(s)}, key=lambda k: (k[0], k[1] != "greedy", k[1]))
    ref = summaries.get(REFERENCE)
    diffs = []
    for name, s in summaries.items():
        if ref is None or name == REFERENCE:
            continue
        mine, base = _rows(s), _rows(ref)
        for k in keys:
            if k in mine and k in base:
                d = difference(base[k], mine[k])
                if d is not None:
                    diffs.append({"run": name, "against": REFERENCE, "bench": k[0], "sampling": k[1], **d})
    return {"runs": summaries, "sets": [list(k) for k in keys], "differences": diffs,
            "reference": REFERENCE, "seed_twin": SEED_TWIN, "significant_se": SIGNIFICANT_SE}


def _pm(row: dict | None) -> str:
    if not row or row.get("tau_mean") is None:
        return "-"
    se = row.get("tau_mean_se")
    return f"{row['tau_mean']:.3f} ± {se:.3f}" if se is not None else f"{row['tau_mean']:.3f}"


def _num(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(table: dict) -> str:
    runs = table["runs"]
    names = list(runs)
    lines = ["# Quality lab", "",
             f"tau_mean ± its standard error over responses; a difference from `{REFERENCE}` counts only at "
             f">= {table['significant_se']:g} standard errors. `{SEED_TWIN}` against `{REFERENCE}` is the "
             "seed-to-seed noise.", "", "## Runs", "",
             "| run | architecture | block | seed | steps | final loss | other final terms | training s | command s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        s, f = runs[n], runs[n].get("final", {})
        extra = ", ".join(f"{k} {v:.4f}" for k, v in sorted(f.items())
                          if isinstance(v, float) and k not in ("loss", "lr", "accept_proxy")
                          and not k.endswith(("tok_per_s", "_share", "_s")))
        lines.append(f"| {n} | {s.get('architecture')} | {s.get('block_size')} | {s.get('seed')} | {f.get('step', '-')} "
                     f"| {_num(f.get('loss'))} | {extra or '-'} | {_num(s.get('train_s'), '.0f')} | {_num(s.get('wall_s'), '.0f')} |")
    lines += ["", "## tau by set", "", "| set | sampling | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for bench, sampling in table["sets"]:
        cells = [_pm(_rows(runs[n]).get((bench, sampling))) for n in names]
        lines.append(f"| {LAB_SET_NAMES.get(bench, bench)} | {sampling} | " + " | ".join(cells) + " |")
    if table["differences"]:
        lines += ["", f"## Differences from {REFERENCE}", "", "| run | set | sampling | delta | se | delta/se | counts |",
                  "|---|---|---|---|---|---|---|"]
        for d in table["differences"]:
            lines.append(f"| {d['run']} | {LAB_SET_NAMES.get(d['bench'], d['bench'])} | {d['sampling']} | "
                         f"{d['delta']:+.3f} | {d['se']:.3f} | {d['z']:+.1f} | {'yes' if d['significant'] else 'no'} |")
    lines += ["", "## Acceptance by position (P(slot k | slots < k accepted))", "", "| run | set | sampling | positions |",
              "|---|---|---|---|"]
    for n in names:
        for (bench, sampling), r in _rows(runs[n]).items():
            pos = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(r.get("position_acceptance") or [], 1))
            lines.append(f"| {n} | {LAB_SET_NAMES.get(bench, bench)} | {sampling} | {pos} |")
    lines += ["", "## llama.cpp's count (held-out prose, greedy)", "",
              "| run | draft n max | llama-server mean acc len | first round | later rounds | llama-speculative-simple "
              "| first round | later rounds |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        c = runs[n].get("llama_cpp")
        if not c:
            lines.append(f"| {n} | - | - | - | - | - | - | - |")
            continue
        srv, sim = c["llama_server"], c["llama_speculative_simple"]
        lines.append(f"| {n} | {c.get('spec_draft_n_max')} | {_num(srv['mean_accept_length'], '.3f')} | "
                     f"{_num(srv['first_round_accepted'], '.3f')} | {_num(srv['later_rounds_accepted'], '.3f')} | "
                     f"{_num(sim['mean_accept_length'], '.3f')} | {_num(sim['first_round_accepted'], '.3f')} | "
                     f"{_num(sim['later_rounds_accepted'], '.3f')} |")
    lines += ["", "(first round / later rounds: mean accepted drafts per round.)", ""]
    return "\n".join(lines)


def write(folder: Path, out: Path) -> tuple[Path, Path]:
    table = build(load_summaries(folder))
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "quality_lab.md", out / "quality_lab_table.json"
    md.write_text(markdown(table))
    js.write_text(json.dumps(table, indent=1) + "\n")
    return md, js
