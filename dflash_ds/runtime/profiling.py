"""A profile of a few steps on every rank: `log.profile_start` (a step number, 0 = off) and `log.profile_steps`.

The progress line gives each role's rate and waits; it cannot say where a role's time goes inside a
step, e.g. which role of a split runs below its bench. For steps profile_start .. profile_start +
profile_steps - 1 (the numbers of the progress line) every rank records a torch.profiler trace of its
host ops and, on GPU, its kernels, and writes

    <run.output_dir>/profile/rank<N>-<role>.trace.json.gz   the trace (Perfetto, chrome://tracing)
    <run.output_dir>/profile/rank<N>-<role>.json            wall time, GPU busy and communication shares,
                                                            the kernels that took the most time

Target ranks number their loop by the same steps, so in a split the windows cover the same work (the
target runs up to `topology.max_in_flight` micro-batches ahead). The window starts and ends with a
device synchronisation, so it measures whole steps; no transfer started inside it is still running when
it closes (drafters close it before posting the next receives, targets after their sends complete).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

GPU_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once (kernels of several streams)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(trace: dict, wall_s: float, top: int = 12) -> dict:
    """Busy and communication shares of the device, and the heaviest kernels, from a chrome trace."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_KINDS]
    out: dict = {"wall_s": wall_s, "gpu_events": len(gpu)}
    if not gpu:
        return out  # a CPU run: no device timeline
    spans, comm, compute = [], [], []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        name = e.get("name", "?")
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        spans.append(span)
        (comm if "nccl" in name.lower() else compute).append(span)
        acc = by_name[name]
        acc[0] += (span[1] - span[0]) / 1e6
        acc[1] += 1
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    busy = union_seconds(spans) / 1e6
    out.update({
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall_s,
        # Kernels other than NCCL's: the share of the window the device computed.
        "compute_busy_share": union_seconds(compute) / 1e6 / wall_s,
        # NCCL kernels run from launch until their peer has matched them: this includes waiting.
        "nccl_share": union_seconds(comm) / 1e6 / wall_s,
        "top_kernels": [{"name": n[:160], "seconds": round(s, 6), "calls": c} for n, (s, c) in heaviest],
    })
    return out


class StepProfiler:
    """Call `before(n)` and `after(n)` around step n (1-based); inactive unless log.profile_start > 0."""

    def __init__(self, recipe, rank: int, role: str, device):
        self.first = int(recipe.log.profile_start)
        self.last = self.first + int(recipe.log.profile_steps) - 1
        self.dir = Path(recipe.run.output_dir) / "profile"
        self.name = f"rank{rank}-{role}"
        self.cuda = torch.device(device).type == "cuda"
        self.prof = None
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def before(self, step: int) -> None:
        if self.first <= 0 or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        self.prof = profile(activities=acts)
        self.prof.start()
        self.t0 = time.perf_counter()

    def after(self, step: int, drain=None) -> None:
        """Close the window after step `last`; `drain` first completes the transfers started in it.

        c10d attaches a profiler record to every transfer started while profiling and closes it when
        the transfer completes; one completing after the profiler stopped writes into freed memory.
        """
        if self.prof is None or step != self.last:
            return
        if drain is not None:
            drain()
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        raw = self.dir / f"{self.name}.trace.json"
        self.prof.export_chrome_trace(str(raw))
        self.prof = None
        with open(raw) as f:
            summary = summarise(json.load(f), wall)
        summary.update({"steps": [self.first, self.last]})
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        (self.dir / f"{self.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        busy = summary.get("gpu_busy_share")
        what = "" if busy is None else f": GPU busy {busy:.0%}, NCCL kernels {summary['nccl_share']:.0%}"
        print(f"[dflash] {self.name}: profile of steps {self.first}-{self.last} in {self.dir}{what}",
              file=sys.stderr, flush=True)
