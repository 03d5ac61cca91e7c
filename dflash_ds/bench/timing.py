"""Timing without host syncs inside the timed region, memory peaks, the matmul ceiling, the timed loop.

Timing uses CUDA events with a host synchronisation only at the edges of the timed region.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing: module import time is the next best thing
        return time.time()


PROCESS_START = _process_start()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Wall time between consecutive marks: CUDA events on GPU, so the timed region never syncs.

    Events are recorded in stream order, so an interval also covers any time the GPU waited on
    the host: it is the step's wall time as the stream sees it.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class MemoryTrace:
    """Peak allocated GPU memory of each step (host-side allocator stats: no sync needed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: list[int] = []

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> None:
        if self.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated(self.device))

    def summary(self) -> dict:
        gib = 1024 ** 3
        out = {"host_max_rss_gib": _max_rss() / gib}
        if self.peaks:
            out.update(first_step_peak_gib=self.peaks[0] / gib, last_step_peak_gib=self.peaks[-1] / gib,
                       max_step_peak_gib=max(self.peaks) / gib,
                       growth_gib=(self.peaks[-1] - self.peaks[0]) / gib,
                       step_peaks_gib=[p / gib for p in self.peaks],
                       reserved_gib=torch.cuda.memory_reserved(self.device) / gib)
        return out


def _max_rss() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    except Exception:
        return 0


def matmul_ceiling(device: torch.device) -> dict:
    """Achieved matmul TFLOP/s: bf16 8192^3 on GPU (CUDA events), fp32 512^3 on CPU."""
    if device.type == "cuda":
        n, dtype, warm, iters = 8192, torch.bfloat16, 10, 50
    else:
        n, dtype, warm, iters = 512, torch.float32, 2, 10
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warm):
        torch.mm(a, b, out=out)
    synchronize(device)
    clock = StepClock(device)
    clock.mark()
    for _ in range(iters):
        torch.mm(a, b, out=out)
    clock.mark()
    seconds = clock.intervals()[0]
    del a, b, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tflops": 2 * n ** 3 * iters / seconds / 1e12, "size": n, "dtype": str(dtype).replace("torch.", ""),
            "iters": iters}


def dynamo_counters() -> dict:
    """Compile bookkeeping: graphs compiled, graph breaks, recompilations (cumulative)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
            "frames_ok": int(counters["frames"].get("ok", 0))}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


DRIFT = 0.05
"""The timed steps still drift when the median step of their second half differs from the first half's
by more than this share."""


def step_stats(times: list[float]) -> dict:
    return {"mean": sum(times) / len(times), "median": statistics.median(times), "min": min(times),
            "max": max(times), "all": times}


def steadiness(times: list[float]) -> dict:
    """Whether the timed steps had settled: the median step of the first and of the second half, the
    second's change over the first (`drift`), and the mean over the median (slow outliers pull the
    mean, so the rate from the mean reads low). `steady` is None below 4 steps (too few to tell)."""
    n = len(times)
    out = {"mean_over_median": (sum(times) / n) / statistics.median(times), "steady": None}
    if n >= 4:
        first, second = statistics.median(times[:n // 2]), statistics.median(times[n - n // 2:])
        drift = second / first - 1
        out.update(halves_median_s=[first, second], drift=drift, steady=abs(drift) <= DRIFT)
    return out


def drift_warnings(result: dict) -> list[str]:
    """One line per way the timed steps were not steady (empty when they were)."""
    st = result.get("steadiness") or {}
    out = []
    if st.get("steady") is False:
        out.append(f"the timed steps still drift: the median step of their second half is {st['drift']:+.1%} from "
                   "the first half's; time more steps (--steps) or warm up longer (--warmup)")
    if st.get("mean_over_median", 1.0) > 1 + DRIFT:
        out.append(f"slow steps pull the mean step {st['mean_over_median'] - 1:.1%} above the median: the median "
                   "rate (tok_s_median) is the steadier figure")
    return out


# ---------------------------------------------------------------------------- the timed loop


def profile_steps(step_fn, first: int, count: int, path: str) -> None:
    """Kernel-level time table of `count` extra steps (torch.profiler), top 40 by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for s in range(first, first + count):
            step_fn(s)
        synchronize(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))


def drive(step_fn, device: torch.device, warmup: int, steps: int, *, t_build: float,
          profile: str | None = None) -> dict:
    """First step (alone, synchronised), the rest of the warmup, then `steps` timed steps."""
    out = {}
    c0 = dynamo_counters()
    synchronize(device)
    t0 = time.perf_counter()
    step_fn(0)
    synchronize(device)
    now = time.perf_counter()
    out["first_step_s"] = now - t0
    out["first_step_since_build_s"] = now - t_build
    out["first_step_since_process_start_s"] = time.time() - PROCESS_START
    c1 = dynamo_counters()
    for s in range(1, warmup):
        step_fn(s)
    synchronize(device)
    c2 = dynamo_counters()
    clock, mem = StepClock(device), MemoryTrace(device)
    clock.mark()
    for s in range(warmup, warmup + steps):
        mem.begin()
        step_fn(s)
        clock.mark()
        mem.end()
    times = clock.intervals()
    c3 = dynamo_counters()
    out["step_s"] = step_stats(times)
    out["steadiness"] = steadiness(times)
    out["timed_s"] = sum(times)
    out["memory"] = mem.summary()
    out["compile"] = {"first_step": _delta(c1, c0), "warmup": _delta(c2, c1), "timed": _delta(c3, c2),
                      "total": c3}
    out["first_step_overhead_s"] = out["first_step_s"] - out["step_s"]["median"]
    if profile:
        profile_steps(step_fn, warmup + steps, 2, profile)
    return out


def record_rates(result: dict, tokens_per_step: int, flops_per_step: float, ceiling: dict) -> None:
    step = result["timed_s"] / len(result["step_s"]["all"])
    result["tokens_per_step"] = tokens_per_step
    result["tok_s"] = tokens_per_step / step
    result["tok_s_median"] = tokens_per_step / result["step_s"]["median"]
    result["flops_per_step"] = flops_per_step
    result["tflops"] = flops_per_step / step / 1e12
    result["mfu"] = result["tflops"] / ceiling["tflops"]
