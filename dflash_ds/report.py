"""A picture of a run without wandb: PNG plots and one HTML page from metrics.jsonl.

    python -m dflash_ds.report RUN_DIR [--out DIR]

Written to RUN_DIR/report/ (index.html, overview.png and one PNG per panel), and automatically at
the end of a run on the lead drafter rank. The run's drafter architecture (its recipe record) adds
its own fields to the panels and the summary and may add panels (its spec's `logs`, their `figures`):
the report names no architecture's field. matplotlib (Agg backend: no display needed) draws the
plots; it is a project dependency because hand-drawn PNGs would need their own text rendering.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import yaml

from dflash_ds.architectures import DEFAULT, spec_of
from dflash_ds.network.arch_types import LogView
from dflash_ds.network.contract import Spec
from dflash_ds.metrics import read_metrics, shown
from dflash_ds.safety import Exit, say

# (file stem, title, y label, [(metrics key, legend label)], y scale); drawn from the step records,
# with the architecture's own fields in the panels its `logs.series` names.
STEP_PANELS = [
    ("loss", "training loss (weighted CE)", "loss",
     [("loss", "loss"), ("kl", "KL term")], "log"),
    ("accept_proxy", "acceptance proxy (anchor-averaged, training batches)", "tokens per block",
     [("accept_proxy", "accept proxy")], "linear"),
    ("throughput", "throughput (context tokens/s)", "tokens/s",
     [("tok_per_s", "run"), ("drafter_tok_per_s", "per drafter rank"), ("target_tok_per_s", "per target rank")],
     "linear"),
    ("wait", "waiting shares", "share of wall time",
     [("drafter_wait_share", "drafters wait for data"), ("drafter_sync_share", "drafters idle in device syncs"),
      ("target_send_wait_share", "targets wait to send")], "linear"),
    ("lr", "learning rate", "lr", [("lr", "lr")], "linear"),
]


def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training step records, tau records), each the last record per step (a resumed run
    re-logs the steps after its checkpoint)."""
    steps: dict[int, dict] = {}
    taus: dict[tuple[int, str], dict] = {}
    for r in records:
        if "loss" in r and "step" in r:
            steps[int(r["step"])] = r
        elif "tau" in r and "step" in r:
            taus[(int(r["step"]), str(r.get("eval", "")))] = r
    return [steps[k] for k in sorted(steps)], [taus[k] for k in sorted(taus)]


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _draw_series(ax, recs: list[dict], series, title: str, *, ylabel: str, yscale: str) -> bool:
    drawn = False
    for key, label in series:
        pts = [(r["step"], r[key]) for r in recs if _num(r.get(key))]
        if not pts:
            continue
        xs, ys = zip(*pts)
        # The first series is drawn wide and pale so a later, identical one (one drafter rank:
        # run = per drafter rank) does not hide it.
        style = dict(linewidth=4, alpha=0.45) if key == "tok_per_s" else {}
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label, **style)
        drawn = True
        if yscale == "log" and min(ys) <= 0:
            yscale = "linear"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_yscale(yscale)
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif len(series) > 1:
        ax.legend(fontsize=8, loc="best")
    if ylabel == "share of wall time" and drawn:
        ax.set_ylim(0, 1.02)
    return drawn


def _draw_tau(ax, taus: list[dict]) -> None:
    pts = [(r["step"], r["tau"]) for r in taus if _num(r.get("tau"))]
    pooled = [(r["step"], r["tau_pooled"]) for r in taus if _num(r.get("tau_pooled"))]
    if pts:
        ax.plot(*zip(*pts), marker="o", label="tau (mean of responses)")
        for x, y in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if pooled:
        ax.plot(*zip(*pooled), marker="s", linestyle="--", label="tau pooled")
    ax.set_title("acceptance length tau (exact, held-out prompts)", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens per cycle")
    ax.grid(alpha=0.3)
    if pts:
        ax.set_ylim(bottom=min(1.0, min(y for _, y in pts)) - 0.05)
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no eval logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _tau_label(r: dict) -> str:
    return f"step {r['step']}" + (f" ({r['eval']})" if r.get("eval") not in (None, "", "periodic") else "")


def _draw_positions(ax, taus: list[dict]) -> None:
    evals = [r for r in taus if r.get("tau_position_acceptance")]
    # Few curves stay readable: the first, the last and up to three evenly spaced in between.
    if len(evals) > 5:
        idx = sorted({round(i * (len(evals) - 1) / 4) for i in range(5)})
        evals = [evals[i] for i in idx]
    for r in evals:
        pts = [(k, p) for k, p in enumerate(r["tau_position_acceptance"], 1) if _num(p)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=_tau_label(r))
    ax.set_title("acceptance by draft position: P(slot k | slots < k accepted)", fontsize=10)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("conditional acceptance")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if evals:
        n = len(evals[-1]["tau_position_acceptance"])
        ax.set_xticks(range(1, n + 1))
        # Late positions, reached only after long accepted runs, sit high: keep the legend low.
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no eval logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _draw_histogram(ax, taus: list[dict]) -> None:
    evals = [r for r in taus if r.get("tau_histogram")]
    if len(evals) > 2:
        evals = [evals[0], evals[-1]]
    width = 0.8 / max(len(evals), 1)
    for i, r in enumerate(evals):
        h = r["tau_histogram"]
        total = max(sum(h), 1)
        ax.bar([j + (i - (len(evals) - 1) / 2) * width for j in range(len(h))], [c / total for c in h], width,
               label=_tau_label(r))
    ax.set_title("accepted drafts per cycle", fontsize=10)
    ax.set_xlabel("drafts accepted")
    ax.set_ylabel("share of cycles")
    ax.grid(alpha=0.3, axis="y")
    if evals:
        ax.set_xticks(range(len(evals[-1]["tau_histogram"])))
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no eval logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _panels(steps, taus, view: LogView = LogView()):
    """(stem, draw function) for every panel, in page order."""
    panels = [(stem, title, ylabel, series + [(key, label) for on, key, label in view.series if on == stem], scale)
              for stem, title, ylabel, series, scale in STEP_PANELS]
    out = [(stem, lambda ax, s=series, t=title, y=ylabel, sc=scale: _draw_series(ax, steps, s, t, ylabel=y, yscale=sc))
           for stem, title, ylabel, series, scale in panels[:2]]
    out += [("tau", lambda ax: _draw_tau(ax, taus)), ("position_acceptance", lambda ax: _draw_positions(ax, taus))]
    out += [(stem, lambda ax, s=series, t=title, y=ylabel, sc=scale: _draw_series(ax, steps, s, t, ylabel=y, yscale=sc))
            for stem, title, ylabel, series, scale in panels[2:]]
    out.append(("accepted_histogram", lambda ax: _draw_histogram(ax, taus)))
    return out


def _summary(steps: list[dict], taus: list[dict], view: LogView = LogView()) -> list[tuple[str, str]]:
    rows = []
    if steps:
        last = steps[-1]
        rows.append(("optimizer steps", str(last["step"])))
        rows.append(("final loss", f"{last['loss']:.4f}"))
        if _num(last.get("accept_proxy")):
            rows.append(("final acceptance proxy", f"{last['accept_proxy']:.2f}"))
        for label, template in view.summary:  # the architecture's own, where the last record has their fields
            rows += [(label, text) for text in shown([template], last)]
        rates = [r["tok_per_s"] for r in steps if _num(r.get("tok_per_s"))]
        if rates:
            rows.append(("median tokens/s", f"{sorted(rates)[len(rates) // 2]:,.0f}"))
    for r in taus:
        if _num(r.get("tau")):
            pooled = f" (pooled {r['tau_pooled']:.3f})" if _num(r.get("tau_pooled")) else ""
            rows.append((f"tau, {_tau_label(r)}", f"{r['tau']:.3f}{pooled}"))
    if taus and taus[-1].get("tau_position_acceptance"):
        rows.append(("acceptance by position (last eval)", " ".join(
            f"{k}:{'-' if not _num(p) else f'{p:.2f}'}" for k, p in enumerate(taus[-1]["tau_position_acceptance"], 1))))
    return rows


def bench_html(run_dir: Path) -> str:
    """The benchmark table of <run_dir>/benchmarks.json (python -m dflash_ds.eval.benchmark_table), or nothing."""
    try:
        rows = json.loads((run_dir / "benchmarks.json").read_text())
    except (OSError, ValueError):
        return ""

    def pm(x, se):
        return "-" if x is None else f"{x:.3f}" + (f" &plusmn; {se:.3f}" if se is not None else "")

    head = "".join(f"<th>{h}</th>" for h in ("benchmark", "sampling", "tau (mean)", "tau (pooled)", "tau (expected)",
                                              "responses", "cycles", "acceptance by draft position"))
    body = ""
    for r in rows:
        pos = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(r["position_acceptance"], 1))
        cells = (html.escape(r["bench"]), html.escape(r["sampling"]), pm(r["tau_mean"], r["tau_mean_se"]),
                 pm(r["tau_pooled"], r["tau_pooled_se"]), pm(r["tau_expected"], r["tau_expected_se"]),
                 str(r["responses"]), str(r["cycles"]), pos)
        body += "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
    return (f"<h2>Acceptance by benchmark</h2><table><tr>{head}</tr>{body}</table><p>Sampled rows: the engines' "
            "verification rule on the target's sampled responses, &plusmn; standard error over responses.</p>")


class Contents(NamedTuple):
    steps: list[dict]
    taus: list[dict]
    panels: list  # (file stem, draw(ax)) in page order
    rows: list[tuple[str, str]]  # the summary table


def run_spec(run_dir: Path) -> Spec:
    """The drafter architecture the run's recipe record names (RUN_DIR/recipe.yaml, written at the
    run's first start); the default one without a record or with a name this version does not know
    (then no architecture panels are drawn)."""
    try:
        raw = yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}
        name = (raw.get("drafter") or {}).get("architecture")
    except (OSError, yaml.YAMLError, AttributeError):
        return DEFAULT.spec
    try:
        return spec_of(name or DEFAULT.spec.name)
    except ValueError:
        return DEFAULT.spec


def report_contents(run_dir: str | Path) -> Contents:
    """What the report of `run_dir` shows: the panels (the architecture's after the common ones) and
    the summary rows."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} is missing or empty; pass a run directory (run.output_dir)")
    steps, taus = split_records(records)
    arch = run_spec(run_dir)
    figures = arch.logs.figures(steps)
    return Contents(steps, taus, _panels(steps, taus, arch.logs) + [(f.stem, f.draw) for f in figures],
                    _summary(steps, taus, arch.logs) + [row for f in figures for row in f.rows])


def page_html(run_dir: Path, contents: Contents) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in contents.rows)
    imgs = "".join(f'<figure><img src="{stem}.png" alt="{stem}"></figure>' for stem, _ in contents.panels)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>dflash-ds report: {html.escape(run_dir.name)}"
            "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}figure{display:inline-block;margin:6px}"
            "</style></head><body>"
            f"<h1>dflash-ds run {html.escape(str(run_dir))}</h1><table>{rows}</table>{bench_html(run_dir)}{imgs}"
            "<p>From metrics.jsonl; tau is the exact offline acceptance length on the held-out prompts.</p>"
            "</body></html>\n")


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Draw the report of `run_dir` into `out_dir` (default RUN_DIR/report); returns index.html."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    contents = report_contents(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    panels = contents.panels
    for stem, draw in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        draw(ax)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png")
        plt.close(fig)
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(5.2 * cols, 3.8 * math.ceil(len(panels) / cols)),
                             dpi=80)
    for ax, (_, draw) in zip(axes.flat, panels):
        draw(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"dflash-ds run {run_dir.resolve().name}", fontsize=13)
    fig.tight_layout()
    fig.savefig(out / "overview.png")
    plt.close(fig)
    (out / "index.html").write_text(page_html(run_dir, contents))
    return out / "index.html"


def finish_run(run_dir: str | Path, card: dict | None) -> None:
    """End of a run on the lead drafter rank: the export's model card gets the final tau (card None:
    left as it is), and the report is drawn. Neither may fail the finished run: problems are printed,
    not raised."""
    from dflash_ds.export import write_card

    export = Path(run_dir) / "export"
    try:
        if export.is_dir() and card is not None:
            write_card(export, **card)
        page = write_report(run_dir)
        say(f"report: {page}")
    except ImportError as e:
        say(f"report skipped ({e}); pip install matplotlib, then python -m dflash_ds.report {run_dir}")
    except Exception as e:  # noqa: BLE001 - a plotting problem must not turn a finished run into a failure
        say(f"report failed ({type(e).__name__}: {e}); rerun python -m dflash_ds.report {run_dir}")


def main(argv: list[str] | None = None) -> int:
    from dflash_ds.arguments import Parser, existing_folder, output_folder

    p = Parser(prog="python -m dflash_ds.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=existing_folder, help="a run's output directory (run.output_dir), holding metrics.jsonl")
    p.add_argument("--out", type=output_folder, help="where to write (default RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        page = write_report(args.run_dir, args.out)
    except ValueError as e:
        say(f"error: {e}")
        return Exit.USER
    print(page)
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
