"""metrics.jsonl (always), wandb (when enabled), and the progress line on the lead drafter rank."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dflash_ds.io import write_json_atomic
from dflash_ds.safety import SettingError, say


class Metrics:
    def __init__(self, run_dir: str | Path, recipe_dict: dict, wandb_cfg, run_name: str, *, enabled: bool = True,
                 start_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_after(self.path, start_step)
        if wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            import wandb

            # The API key is read by wandb from WANDB_API_KEY; nothing secret goes into the recipe.
            # WANDB_MODE wins: launch.sh sets it to offline when the service did not answer before launch.
            mode = os.environ.get("WANDB_MODE", wandb_cfg.mode)
            args = {"project": wandb_cfg.project, "name": run_name, "config": recipe_dict, "dir": str(run_dir)}
            try:
                self.wandb = wandb.init(mode=mode, **args)
            except Exception as exc:  # noqa: BLE001 - wandb raises its own error types, and more than those
                cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
                if not wandb_cfg.offline_fallback or mode == "offline":
                    raise SettingError(f"log.wandb: wandb.init failed ({cause}); check WANDB_API_KEY, "
                                       f"log.wandb.project ({wandb_cfg.project}) and WANDB_BASE_URL, or set "
                                       "log.wandb.mode=offline, log.wandb.offline_fallback=true or "
                                       "log.wandb.enabled=false") from None
                say(f"warning: wandb.init failed ({cause}); logging offline (wandb sync RUN_DIR/wandb later)")
                self.wandb = wandb.init(mode="offline", **args)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def truncate_after(path: Path, step: int) -> None:
    """Drop the records a resumed run will write again (step > `step`; all of them for a fresh
    start), atomically, so metrics.jsonl never holds a step twice."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            rec_step = json.loads(line).get("step", 0)
        except ValueError:
            continue  # a line cut short by a crash
        if step > 0 and rec_step <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl's records. A last line cut short (a run that ended mid-write) is left out with a
    note naming it; a damaged line before the last is a ValueError naming the file and the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if i == last:
                say(f"note: {path}:{i + 1} is cut short (the run ended while writing it); it is left out")
                continue
            raise ValueError(f"{path}:{i + 1} is not a JSON record ({exc}); repair or delete that line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{i + 1} is not a JSON object; repair or delete that line")
        records.append(record)
    return records


def fmt_eta(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def shown(templates: Sequence[str], r: dict) -> list[str]:
    """The format strings over record `r` whose fields `r` all has, formatted (a field the step did not
    log hides its entry)."""
    out = []
    for t in templates:
        try:
            out.append(t.format_map(r))
        except KeyError:
            pass
    return out


def progress_line(r: dict, total_steps: int, own: Sequence[str] = ()) -> str:
    """The progress line of step record `r`; `own`: the drafter architecture's entries (its
    `logs.progress`, format strings over the record), shown after the acceptance proxy."""
    parts = [f"step {r['step']}/{total_steps}", f"{r.get('tok_per_s', 0):,.0f} tok/s", f"ETA {fmt_eta(r.get('eta_s', 0))}",
             f"loss {r.get('loss', float('nan')):.4f}", f"accept {r.get('accept_proxy', float('nan')):.2f}"]
    parts += shown(own, r)
    if "target_tok_per_s" in r:
        parts.append(f"target {r['target_tok_per_s']:,.0f} tok/s")
    parts.append(f"drafter {r.get('drafter_tok_per_s', 0):,.0f} tok/s")
    if "in_flight" in r:
        parts.append(f"in flight {r['in_flight']}")
    parts.append(f"data wait {100 * r.get('drafter_wait_share', 0):.0f}%")
    if "drafter_sync_share" in r:
        parts.append(f"sync stall {100 * r['drafter_sync_share']:.0f}%")
    if "target_send_wait_share" in r:
        parts.append(f"send wait {100 * r['target_send_wait_share']:.0f}%")
    return " | ".join(parts)


def print_progress(r: dict, total_steps: int, own: Sequence[str] = ()) -> None:
    line = progress_line(r, total_steps, own)
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line[: os.get_terminal_size().columns - 1])
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def write_status(run_dir: str | Path, rank: int, data: dict) -> None:
    """Target ranks publish their rates here; the lead drafter reads them at log steps (no collective)."""
    write_json_atomic(Path(run_dir) / "status" / f"target{rank}.json", data)


def read_status(run_dir: str | Path) -> list[dict]:
    d = Path(run_dir) / "status"
    out = []
    for p in sorted(d.glob("target*.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            pass
    return out


def target_counters(rank: int, step: int, start: float, tokens: int, *, send_wait_s: float, in_flight: int,
                    now: float | None = None) -> dict:
    """What a target rank publishes: counters since `start` (its loop start), so the reader can take any window."""
    return {"rank": rank, "step": step, "start": start, "time": time.perf_counter() if now is None else now,
            "tokens": tokens,
            "send_wait_s": send_wait_s, "in_flight": in_flight}


class TargetWindow:
    """Target rates over the lead drafter's log window, from the targets' cumulative counters.

    A since-start average hides a target that became the bottleneck (it keeps climbing from the slow
    start for a long time), so each log step differences the counters against the previous read:
    the target figure then covers the same log.every_steps steps as the drafter figure. Target ranks
    share the host clock with the lead only on one node, so only differences of a rank's own
    timestamps are used.
    """

    def __init__(self):
        self.prev: dict[int, dict] = {}
        self.rates: dict[int, tuple[float, float]] = {}

    def update(self, status: list[dict]) -> dict:
        if not status:
            return {}
        for s in status:
            p = self.prev.get(s["rank"])
            if p is None or p["start"] != s["start"]:  # first report of this rank's (new) run
                p = {"start": s["start"], "time": s["start"], "tokens": 0, "send_wait_s": 0.0}
            dt = s["time"] - p["time"]
            if dt > 0:  # otherwise no new report since the last read: keep that window's figures
                self.rates[s["rank"]] = ((s["tokens"] - p["tokens"]) / dt, (s["send_wait_s"] - p["send_wait_s"]) / dt)
                self.prev[s["rank"]] = s
        rates = [self.rates[s["rank"]] for s in status if s["rank"] in self.rates]
        if not rates:
            return {}
        return {"target_tok_per_s": sum(r for r, _ in rates) / len(rates),
                "target_send_wait_share": sum(w for _, w in rates) / len(rates),
                "in_flight": sum(s["in_flight"] for s in status)}
