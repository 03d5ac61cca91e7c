"""The lab's table: every run's summary side by side, one markdown and one JSON file.

Rows per benchmark set and sampling (greedy, T = 1): tau_mean with its standard error over responses
for each run; each run's difference from the reference run (v1, seed 0) with the standard error of the
difference (the runs' responses are independent: sqrt(se_a^2 + se_b^2)), called a difference only at
2 standard errors or more; the seed-to-seed difference of v1 beside it; per-position acceptance;
llama.cpp's counted acceptance (first round apart from the later ones) on the held-out prose and, where
the runs have it, on the in-domain set (conversations of the training projects, whose exact greedy tau
is one more set of rows: "in-domain"); final losses and wall times;
and the comparisons of lab/decisions.py (each catalog run against its baseline): the
ordering check (v1 < DFlash2, v1 < DSpark, v1 < LiLiCorr, beside the seed-to-seed noise) and the decisions.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab import decisions
from lab.decisions import SIGNIFICANT_SE, difference
from lab.decisions import rows_of as _rows

REFERENCE = "v1"
SEED_TWIN = "v1-seed1"
LAB_SET_NAMES = {"heldout": "prose (held-out docs)", "humaneval": "code completion", "mbpp": "instruction -> code",
                 "mt_bench": "two turns", decisions.INDOMAIN: "in-domain (training projects)"}
LLAMA_SECTIONS = (("llama_cpp", "held-out prose"), ("llama_cpp_indomain", "in-domain"))
"""The summary keys of llama.cpp's counts and their sections' titles; the in-domain one is drawn only
where a run has it (summaries written before it have none)."""


def load_summaries(folder: Path) -> dict[str, dict]:
    """Every `<name>.json` summary in `folder` (the lab's own table files excluded), by run name."""
    out = {}
    for f in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except ValueError as e:  # a summary cut short (a command killed while it wrote): name the file
            raise ValueError(f"lab table: {f} is not JSON ({e}); write it again (bash scripts/quality_lab.sh OUT run "
                             f"eval {f.stem}) or move it out of {folder}") from None
        if isinstance(data, dict) and "benchmarks" in data and "name" in data:
            out[data["name"]] = data
    if not out:
        raise ValueError(f"lab table: no run summaries (<name>.json) in {folder}; each `bash scripts/quality_lab.sh "
                         f"OUT train NAME` writes one there")
    return out


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
            "reference": REFERENCE, "seed_twin": SEED_TWIN, "significant_se": SIGNIFICANT_SE,
            "decisions": decisions.compare(summaries)}


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
             "| run | architecture | block | seed | steps | final loss | other final terms | training s | evaluation s "
             "| command s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        s, f = runs[n], runs[n].get("final", {})
        extra = ", ".join(f"{k} {v:.4f}" for k, v in sorted(f.items())
                          if isinstance(v, float) and k not in ("loss", "lr", "accept_proxy")
                          and not k.endswith(("tok_per_s", "_share", "_s")))
        lines.append(f"| {n} | {s.get('architecture')} | {s.get('block_size')} | {s.get('seed')} | {f.get('step', '-')} "
                     f"| {_num(f.get('loss'))} | {extra or '-'} | {_num(s.get('train_s'), '.0f')} | {_num(s.get('eval_s'), '.0f')} "
                     f"| {_num(s.get('wall_s'), '.0f')} |")
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
    lines += _curves_md(runs)
    lines += _ordering_md(table["decisions"]) + _decisions_md(table["decisions"])
    lines += ["", "## Acceptance by position (P(slot k | slots < k accepted))", "", "| run | set | sampling | positions |",
              "|---|---|---|---|"]
    for n in names:
        for (bench, sampling), r in _rows(runs[n]).items():
            pos = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(r.get("position_acceptance") or [], 1))
            lines.append(f"| {n} | {LAB_SET_NAMES.get(bench, bench)} | {sampling} | {pos} |")
    for key, title in LLAMA_SECTIONS:
        if key != "llama_cpp" and not any(runs[n].get(key) for n in names):
            continue
        lines += _llama_md(runs, key, title)
    lines += ["", "(first round / later rounds: mean accepted drafts per round.)", ""]
    return "\n".join(lines)


def _curves_md(runs: dict) -> list[str]:
    """Each run's held-out tau along training beside the same walk's tau on training rows (the
    memorisation gap: training / held-out at the last evaluation), and where and why it ended."""
    curved = {n: s for n, s in runs.items() if any(e.get("eval") == "periodic" for e in s.get("tau_evals") or [])}
    if not curved:
        return []
    lines = ["", "## Training curves (exact greedy tau during training: held-out prompts / training rows)", "",
             "| run | end | last held-out | last training rows | training / held-out | curve (step: held-out / training) |",
             "|---|---|---|---|---|---|"]
    for n, s in curved.items():
        evals = [e for e in s["tau_evals"] if e.get("eval") == "periodic"] + \
            [e for e in s["tau_evals"] if e.get("eval") == "after training"]
        last = evals[-1]
        e = s.get("early_end")
        end = f"{e['early_end']} at {e['step']}, ended {e['end_step']}" if e else f"planned ({s.get('final', {}).get('step', '-')})"
        gap = last["train_tau"] / last["tau"] if last.get("train_tau") and last.get("tau") else None
        curve = ", ".join(f"{x['step']}: {_num(x.get('tau'), '.2f')} / {_num(x.get('train_tau'), '.2f')}" for x in evals)
        lines.append(f"| {n} | {end} | {_num(last.get('tau'), '.3f')} | {_num(last.get('train_tau'), '.3f')} | "
                     f"{_num(gap, '.2f')} | {curve} |")
    return lines


def _llama_md(runs: dict, key: str, title: str) -> list[str]:
    lines = ["", f"## llama.cpp's count ({title}, greedy)", "",
             "| run | draft n max | llama-server mean acc len | first round | later rounds | llama-speculative-simple "
             "| first round | later rounds |", "|---|---|---|---|---|---|---|---|"]
    for n, s in runs.items():
        c = s.get(key)
        if not c:
            lines.append(f"| {n} | - | - | - | - | - | - | - |")
            continue
        cells = [_num((c.get(program) or {}).get(k), ".3f") for program in ("llama_server", "llama_speculative_simple")
                 for k in ("mean_accept_length", "first_round_accepted", "later_rounds_accepted")]
        lines.append(f"| {n} | {c.get('spec_draft_n_max')} | " + " | ".join(cells) + " |")
    return lines


def _cell(d: dict) -> str:
    """delta ± se (delta/se), starred when it counts."""
    if d["se"] is None:
        return f"{d['delta']:+.3f} (no SE)"
    mark = " *" if d["significant"] else ""
    if d.get("beyond_noise"):
        mark += "†"
    return f"{d['delta']:+.3f} ± {d['se']:.3f} ({d['z']:+.1f}){mark}"


def _verdict(e: dict, se: float) -> str:
    out = (f"`{e['run']}` against `{e['against']}`: better at >= {se:g} SE on {e['better']} of {e['tau_rows']} "
           f"set/sampling rows, worse on {e['worse']}")
    if e.get("noise_rows"):
        out += (f"; beyond {decisions.NOISE_FACTOR:g}x the seed twin's difference: better on "
                f"{e['better_beyond_noise']} of {e['noise_rows']}, worse on {e['worse_beyond_noise']}")
    return out


def _ordering_md(dec: dict) -> list[str]:
    entries = dec["ordering"] + dec["noise"]
    if not entries:
        return []
    se = dec["significant_se"]
    cells = {(e["run"], r["bench"], r["sampling"]): r for e in entries for r in e["rows"] if r["measure"] == "tau"}
    keys = sorted({(r["bench"], r["sampling"]) for e in entries for r in e["rows"] if r["measure"] == "tau"},
                  key=lambda k: (k[0], k[1] != "greedy", k[1]))
    names = [e["run"] for e in entries]
    lines = ["", "## Ordering check: v1 < DFlash2, v1 < DSpark, v1 < LiLiCorr", "",
             f"run - {REFERENCE} in tau_mean ± the SE of the difference (difference / SE); * = at >= {se:g} SE, "
             f"† = also at least {decisions.NOISE_FACTOR:g}x the seed twin's difference on that row. "
             f"`{SEED_TWIN}` - `{REFERENCE}` is the seed-to-seed noise: by chance about 1 row in 20 reaches "
             f"{se:g} SE; more says the SE over responses misses the run-to-run noise.", "",
             f"| set | sampling | {REFERENCE} | " + " | ".join(f"{n} - {REFERENCE}" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for bench, sampling in keys:
        base = next(cells[n, bench, sampling] for n in names if (n, bench, sampling) in cells)
        row = [_cell(cells[n, bench, sampling]) if (n, bench, sampling) in cells else "-" for n in names]
        lines.append(f"| {LAB_SET_NAMES.get(bench, bench)} | {sampling} | {base['baseline']:.3f} ± "
                     f"{base['baseline_se']:.3f} | " + " | ".join(row) + " |")
    lines += [""] + [f"- {_verdict(e, se)}" for e in entries]
    return lines


def _decisions_md(dec: dict) -> list[str]:
    se = dec["significant_se"]
    lines = ["", "## Decisions: each run against its baseline", "",
             f"run - baseline ± the SE of the difference (difference / SE); * = at >= {se:g} SE, † = tau rows also at "
             f"least {decisions.NOISE_FACTOR:g}x the seed twin's difference on that set. Drafting FLOPs: "
             f"one cycle's forward of the block over a {dec['context_tokens']}-token context "
             "(lab/decisions.py `drafting_flops`). llama.cpp rows: mean accepted drafts a round on the "
             "set named (held-out prose or in-domain), greedy.", "",
             "| decision | run | baseline | set | sampling | measure | baseline value | run value | run - baseline |",
             "|---|---|---|---|---|---|---|---|---|"] if dec["decision"] else ["", "## Decisions", ""]
    for e in dec["decision"]:
        for r in e["rows"]:
            lines.append(f"| {e['question']} | {e['run']} | {e['against']} | {LAB_SET_NAMES.get(r['bench'], r['bench'])} "
                         f"| {r['sampling']} | {r['measure']} | {_num(r['baseline'], '.3f')} | {_num(r['value'], '.3f')} "
                         f"| {_cell(r)} |")
    lines.append("")
    for e in dec["decision"]:
        g = e.get("drafting_gflops")
        flops = f" (drafting GFLOPs a cycle: `{e['against']}` {g['baseline']:.3f}, `{e['run']}` {g['run']:.3f})" if g else ""
        lines.append(f"- {e['question']}: {_verdict(e, se)}{flops}")
    for m in dec["missing"]:
        lines.append(f"- not in this folder: `{m['run']}` against `{m['against']}` ({m['question']}): no summary "
                     f"of {', '.join(m['lacks'])}")
    return lines


def write(folder: Path, out: Path) -> tuple[Path, Path]:
    table = build(load_summaries(folder))
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "quality_lab.md", out / "quality_lab_table.json"
    md.write_text(markdown(table))
    js.write_text(json.dumps(table, indent=1) + "\n")
    return md, js
