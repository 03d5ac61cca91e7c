"""A mixture-of-experts target with each experts implementation in turn, on the same random weights.

    python -m dflash_ds.bench --role target --geometry qwen3.6-35b-a3b --experts eager,grouped_mm,dflash_grouped

Builds the target once, then for every implementation named (target_model/moe.py IMPLEMENTATIONS)
switches the experts to it and times the fill loop, recording rate, MFU on the active parameters,
the peak memory of the timed steps, and the relative RMS difference of the tapped states from the
first implementation's on one micro-batch (all compute the same function; bf16 rounding differs).
An implementation that runs out of GPU memory is recorded as such and the next one runs. The
result's own rate is the last implementation's, so the JSON feeds `--role plan` as that target.
"""

from __future__ import annotations

import time

import torch

from .quantized import relative_rms
from .setup import Setup
from .target_side import build_target_model, target_worker, time_target
from .timing import synchronize

KEPT = ("tok_s", "useful_tok_s", "mfu", "tflops", "step_s", "memory", "first_step_s")


def experts_names(value: str) -> list[str]:
    from dflash_ds.target_model.moe import IMPLEMENTATIONS

    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in IMPLEMENTATIONS]
    if not names or bad:
        raise ValueError(f"--experts takes a comma-separated list of {', '.join(IMPLEMENTATIONS)}; got {value!r}")
    return names


def run_target_experts(setup: Setup, ceiling: dict) -> dict:
    from dflash_ds.resolve.payload import taps_view
    from dflash_ds.target_model import moe

    a = setup.args
    names = experts_names(a.experts)
    t_build = time.perf_counter()
    model, kind = build_target_model(setup, not a.no_engine)
    if not moe.experts_modules(model):
        raise ValueError(f"--experts compares experts implementations, but --geometry {setup.geometry_name} is a "
                         "dense target; pick a mixture-of-experts geometry (e.g. qwen3.6-35b-a3b)")
    for _, mod in moe.experts_modules(model):
        mod.chunk_tokens = a.expert_chunk
    worker = target_worker(setup, model)
    synchronize(setup.device)
    build_s = time.perf_counter() - t_build
    buf = setup.payload.empty(setup.device)
    runs, reference, result = {}, None, None
    for name in names:
        moe.use_experts(model, name)
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        try:
            result = time_target(setup, worker, ceiling, t0, build_s=build_s, engine=kind, experts=name)
            worker.fill(buf, 0)
        except torch.OutOfMemoryError as exc:
            runs[name] = {"error": f"out of GPU memory: {str(exc).splitlines()[0]}"}
            result = None
            continue
        taps = taps_view(buf, setup.payload).clone()
        reference = taps if reference is None else reference
        runs[name] = {k: result[k] for k in KEPT if k in result}
        runs[name]["taps_rel_rms_vs_first"] = relative_rms(taps, reference)
    if result is None:
        raise ValueError(f"every --experts implementation ran out of GPU memory: {runs}")
    result["experts_runs"] = runs
    return result
