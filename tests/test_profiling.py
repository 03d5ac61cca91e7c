"""The step profiler (log.profile_start): interval arithmetic, the trace summary, the files it writes."""

from __future__ import annotations

import gzip
import json
import random
from types import SimpleNamespace

import pytest
import torch

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.runtime.profiling import StepProfiler, merged, overlaps, summarise, union_seconds

pytestmark = pytest.mark.unit


def covered_by_grid(intervals, step=0.5):
    """Reference: count grid cells (of width `step`) inside any interval; exact for half-integer ends."""
    hi = max(b for _, b in intervals)
    cells = 0
    t = 0.0
    while t < hi:
        mid = t + step / 2
        cells += any(a <= mid < b for a, b in intervals)
        t += step
    return cells * step


def test_union_counts_overlaps_once():
    rng = random.Random(0)
    for _ in range(200):
        iv = []
        for _ in range(rng.randint(1, 8)):
            a = rng.randint(0, 40) / 2
            iv.append((a, a + rng.randint(0, 12) / 2))
        assert union_seconds(iv) == pytest.approx(covered_by_grid(iv)), iv
    assert union_seconds([]) == 0.0


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_shares_and_heaviest_kernels():
    # Microseconds. Two compute streams overlap on [100, 150); an NCCL kernel spans [300, 700), of which
    # [300, 400) overlaps compute; a memcpy counts as busy; host ops (cat cpu_op) do not.
    trace = {"traceEvents": [
        kernel("gemm", 0, 150), kernel("gemm", 100, 100), kernel("ncclDevKernel_SendRecv", 300, 400),
        kernel("flash_fwd", 300, 100), kernel("Memcpy HtoD", 800, 50, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
    ]}
    s = summarise(trace, wall_s=1000e-6)
    assert s["gpu_events"] == 5
    assert s["gpu_busy_s"] == pytest.approx(650e-6)  # [0, 200) + [300, 700) + [800, 850)
    assert s["gpu_busy_share"] == pytest.approx(0.65)
    assert s["compute_busy_share"] == pytest.approx(0.35)  # [0, 200) + [300, 400) + [800, 850)
    assert s["nccl_share"] == pytest.approx(0.40)
    assert [k["name"] for k in s["top_kernels"]] == ["ncclDevKernel_SendRecv", "gemm", "flash_fwd", "Memcpy HtoD"]
    assert s["top_kernels"][1] == {"name": "gemm", "seconds": 250e-6, "calls": 2}
    assert summarise({"traceEvents": trace["traceEvents"][-1:]}, 1.0) == {"wall_s": 1.0, "gpu_events": 0}


def test_profiler_records_only_its_window(tmp_path):
    recipe = SimpleNamespace(log=SimpleNamespace(profile_start=2, profile_steps=2),
                             run=SimpleNamespace(output_dir=str(tmp_path)))
    prof = StepProfiler(recipe, rank=3, role="drafter", device="cpu")
    x = torch.randn(64, 64)
    for step in range(1, 6):
        prof.before(step)
        for _ in range(step * 2):  # marks each step by its count of matmuls
            x = torch.tanh(x @ x)
        prof.after(step)
    summary = json.loads((tmp_path / "profile" / "rank3-drafter.json").read_text())
    assert summary["steps"] == [2, 3] and summary["wall_s"] > 0 and summary["gpu_events"] == 0
    with gzip.open(tmp_path / "profile" / "rank3-drafter.trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    # Steps 2 and 3 ran 4 + 6 matmuls; steps 1, 4 and 5 (2, 8, 10) are outside the window.
    assert sum(e.get("name") == "aten::mm" for e in events) == 10
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank3-drafter.json", "rank3-drafter.trace.json.gz"]


def test_off_by_default_and_checked():
    recipe = load_recipe("recipes/tiny.yaml")
    assert recipe.log.profile_start == 0
    prof = StepProfiler(recipe, 0, "drafter", "cpu")
    prof.before(1)
    assert prof.prof is None
    with pytest.raises(RecipeError, match="log.profile_steps must be >= 1"):
        load_recipe("recipes/tiny.yaml", ["log.profile_start=5", "log.profile_steps=0"])


def test_window_closes_after_draining_and_before_the_caller_moves_on(tmp_path):
    # Transfers started inside the window must complete before the profiler stops (c10d closes their
    # profiler records on completion): the drain runs while the profiler is still recording.
    recipe = SimpleNamespace(log=SimpleNamespace(profile_start=1, profile_steps=2),
                             run=SimpleNamespace(output_dir=str(tmp_path)))
    prof = StepProfiler(recipe, rank=0, role="target", device="cpu")
    seen = []
    prof.before(1)
    prof.after(1, drain=lambda: seen.append("drained at step 1"))
    prof.before(2)
    prof.after(2, drain=lambda: seen.append(("drained at step 2, recording", prof.prof is not None)))
    assert seen == [("drained at step 2, recording", True)]
    assert prof.prof is None and (tmp_path / "profile" / "rank0-target.json").is_file()


def test_summary_measures_compute_slowed_beside_nccl_and_device_syncs():
    """The two effects that held a split below its benches: GEMMs running longer while a waiting NCCL
    kernel is resident, and a host blocked in device-wide synchronisations."""
    ev = [kernel("ncclDevKernel_SendRecv", 1000, 500), kernel("ncclDevKernel_SendRecv", 1400, 300)]  # union [1000, 1700)
    ev += [kernel("gemm", t, 100) for t in (0, 200, 400, 600)]  # alone: mean 100
    ev += [kernel("gemm", 1000, 130), kernel("gemm", 1600, 150)]  # beside NCCL (the second only partly)
    ev += [kernel("gemm", 1700, 100)]  # starts as the NCCL union ends: alone
    ev += [kernel("flash_fwd", 1100, 50)]  # never alone: no ratio, nothing counted
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": t, "dur": d}
           for t, d in ((0, 40), (900, 160))]
    s = summarise({"traceEvents": ev}, wall_s=2000e-6)
    assert s["compute_slowed_beside_nccl_s"] == pytest.approx((30 + 50) * 1e-6)
    assert s["host_device_sync_s"] == pytest.approx(200e-6)
    gemm = next(k for k in s["top_kernels"] if k["name"] == "gemm")
    assert gemm["beside_nccl_ratio"] == pytest.approx(140 / 100)
    assert "beside_nccl_ratio" not in next(k for k in s["top_kernels"] if k["name"] == "flash_fwd")


def test_overlap_lookup_matches_a_scan():
    rng = random.Random(3)
    comm = [(a, a + rng.uniform(0, 30)) for a in (rng.uniform(0, 1000) for _ in range(40))]
    disjoint = merged(comm)
    starts = [a for a, _ in disjoint]
    for _ in range(500):
        a = rng.uniform(-50, 1050)
        b = a + rng.uniform(0.1, 40)
        assert overlaps(disjoint, starts, a, b) == any(s < b and e > a for s, e in comm)
