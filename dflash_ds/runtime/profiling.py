"""Where a rank's time goes: the wait timers behind the progress line's shares, and a profile of a few steps.

`WaitTimer` times a role's waits on its transfers (runtime/transport.py), `SyncStallTimer` a
drafter's idle in device-wide synchronisations: the progress line's "data wait", "send wait" and
"sync stall" shares.

A profile of a few steps on every rank: `log.profile_start` (a step number, 0 = off) and `log.profile_steps`.

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

import bisect
import gzip
import json
import os
import shutil
import time
from collections import defaultdict, deque
from pathlib import Path

import torch

from dflash_ds.safety import say

GPU_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals merged into disjoint ones, in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once (kernels of several streams)."""
    return sum(b - a for a, b in merged(intervals))


def overlaps(disjoint: list[tuple[float, float]], starts: list[float], a: float, b: float) -> bool:
    """Whether [a, b) meets one of the disjoint sorted intervals (starts: their start times)."""
    i = bisect.bisect_left(starts, b) - 1  # the last interval starting before b is the only candidate
    return i >= 0 and disjoint[i][1] > a


def slowed_beside(compute: list[tuple[str, float, float]], comm: list[tuple[float, float]]) -> dict[str, list]:
    """Per kernel name, the durations of the calls that ran alone and of those that ran while an NCCL
    kernel was resident: a waiting NCCL kernel holds SMs, and a GEMM beside it takes longer."""
    disjoint = merged(comm)
    starts = [a for a, _ in disjoint]
    by_name: dict[str, list] = defaultdict(lambda: [[], []])
    for name, a, b in compute:
        by_name[name][overlaps(disjoint, starts, a, b)].append(b - a)
    return by_name


def summarise(trace: dict, wall_s: float, top: int = 12) -> dict:
    """Busy and communication shares of the device, and the heaviest kernels, from a chrome trace."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_KINDS]
    out: dict = {"wall_s": wall_s, "gpu_events": len(gpu)}
    if not gpu:
        return out  # a CPU run: no device timeline
    spans, comm, named = [], [], []  # named: (kernel name, start, end) of every non-NCCL kernel
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        name = e.get("name", "?")
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        spans.append(span)
        if "nccl" in name.lower():
            comm.append(span)
        else:
            named.append((name, *span))
        acc = by_name[name]
        acc[0] += (span[1] - span[0]) / 1e6
        acc[1] += 1
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    busy = union_seconds(spans) / 1e6
    beside = slowed_beside(named, comm)
    lost = sum(sum(near) - len(near) * _mean(alone) for alone, near in beside.values() if alone and near)
    out.update({
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall_s,
        # Kernels other than NCCL's: the share of the window the device computed.
        "compute_busy_share": union_seconds([(a, b) for _, a, b in named]) / 1e6 / wall_s,
        # NCCL kernels run from launch until their peer has matched them: this includes waiting.
        "nccl_share": union_seconds(comm) / 1e6 / wall_s,
        # Compute time added by NCCL kernels resident beside it: each call that overlapped one,
        # against the mean of the same kernel's calls that did not.
        "compute_slowed_beside_nccl_s": lost / 1e6,
        # Host time blocked in device-wide synchronisations, which also wait for transfers posted on
        # other streams (a receive posted ahead waits for its peer).
        "host_device_sync_s": sum(float(e.get("dur", 0)) for e in trace["traceEvents"]
                                  if e.get("name") == "cudaDeviceSynchronize") / 1e6,
        "top_kernels": [_kernel_entry(n, s, c, beside.get(n)) for n, (s, c) in heaviest],
    })
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _kernel_entry(name: str, seconds: float, calls: int, beside) -> dict:
    entry = {"name": name[:160], "seconds": round(seconds, 6), "calls": calls}
    if beside and beside[0] and beside[1]:
        alone, near = beside
        entry["beside_nccl_ratio"] = round(_mean(near) / _mean(alone), 4)
    return entry


class WaitTimer:
    """Time a role spent waiting on its transfers, as the device saw it.

    On CPU (gloo) `work.wait()` blocks the host, so host time is the wait. On CUDA (NCCL) it only
    makes the current stream wait and returns at once: the host never sees the stall. There, two
    timing events around the wait measure how long the stream sat idle between the work queued
    before it and the transfer's completion; they are read lazily (no host synchronisation).
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = 0.0
        self.stream = 0.0
        self.events: deque = deque()

    def wait(self, work) -> None:
        self.around(work.wait)

    def around(self, call, *args, **kwargs):
        """call(*args, **kwargs), timing the stream's idle across it (the host's time on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.host += time.perf_counter() - t0
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = call(*args, **kwargs)
        after.record()
        self.events.append((before, after))
        return out

    @property
    def seconds(self) -> float:
        while self.events and self.events[0][1].query():
            before, after = self.events.popleft()
            self.stream += before.elapsed_time(after) / 1000.0
        return self.host + self.stream


class SyncStallTimer:
    """Time a drafter's stream sat idle while its host was blocked in a device-wide synchronisation.

    DeepSpeed's ZeRO-2 (with overlap_comm) synchronises the whole device in every backward's
    epilogue. That also waits for a payload receive posted ahead whose target has not sent it yet,
    so a drafter can idle without its stream ever waiting for data, which the data-wait timer cannot
    see. Wraps the accelerator's synchronize until close(); the events around each call measure from
    the stream's last queued kernel to the host's return, i.e. only the idle part.
    """

    def __init__(self, accelerator, device):
        self.accelerator, self.original = accelerator, accelerator.synchronize
        self.timer = WaitTimer(device)
        accelerator.synchronize = lambda *args, **kwargs: self.timer.around(self.original, *args, **kwargs)

    @property
    def seconds(self) -> float:
        return self.timer.seconds

    def close(self) -> None:
        self.accelerator.synchronize = self.original


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
        say(f"profile of steps {self.first}-{self.last} in {self.dir}{what}", self.name)
