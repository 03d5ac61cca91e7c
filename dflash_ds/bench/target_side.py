"""The target rank's side of the bench: the random-weight target under its engine, the worker
that fills payloads from it, and the timed fill loop (roles.run_target, quantized.run_target_compared)."""

from __future__ import annotations

import torch

from .flops import target_flops_per_micro
from .lengths import add_useful
from .setup import Setup, setup_rows
from .timing import drive, record_rates


def build_target_model(setup: Setup, use_engine: bool):
    """Random-weight target built on the device, truncated after the last tap, under its engine."""
    from transformers import AutoModelForCausalLM

    from dflash_ds.target_model import moe
    from dflash_ds.target_model.model import DTYPES, truncate_after

    dtype = DTYPES[setup.recipe.target.dtype]
    torch.manual_seed(setup.args.seed)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(setup.target_config, dtype=dtype,
                                                 attn_implementation=setup.recipe.target.attn_implementation)
    truncate_after(model, max(setup.tap_ids))
    model.requires_grad_(False)
    model.eval()
    if moe.experts_modules(model):
        moe.use_experts(model, setup.recipe.target.experts_implementation)
    if setup.recipe.target.quantization == "fp8" and getattr(setup.args, "fp8_blocks", False):
        from dflash_ds.quantization.fp8 import BLOCKS, quantize_model

        quantize_model(model, BLOCKS)  # as a published FP8 checkpoint stores it; the engine keeps these
    kind = "none"
    if use_engine:
        model, kind = target_replica(setup, model)
    return model, kind


def target_replica(setup: Setup, model):
    """The random-weight target as a replica under target.ds_config (its projections in FP8 with
    target.quantization: fp8), with the target kernels the flags leave in (--no-fla-conv,
    --no-fused-target)."""
    from dflash_ds.runtime.engines import quantized_replica, speed_up_target_kernels
    from dflash_ds.resolve.ds_config import target_ds_config

    speed_up_target_kernels(fla_short_conv=not getattr(setup.args, "no_fla_conv", False),
                            fused_elementwise=not getattr(setup.args, "no_fused_target", False))
    kind, cfg = target_ds_config(setup.recipe, setup.plan.layout.num_targets)
    if kind == "zero3":
        raise ValueError("the bench builds the target with random weights as a replica; a ZeRO-3 target.ds_config "
                         "loads a checkpoint partitioned (training only): set target.ds_config to a replica JSON")
    return quantized_replica(setup.recipe, model, cfg, next(model.parameters()).device), kind


def target_worker(setup: Setup, model):
    from dflash_ds.runtime.target_worker import TargetWorker

    return TargetWorker(setup.run, model, setup_rows(setup, setup.plan.num_rows))


def time_target(setup: Setup, worker, ceiling: dict, t_build: float, **extra) -> dict:
    """The timed fill loop of a target rank (every micro-batch of each step), its rates and MFU."""
    a, plan = setup.args, setup.plan
    buf = setup.payload.empty(setup.device)

    def step(s: int) -> None:
        for g in range(plan.grad_accum):
            worker.fill(buf, plan.layout.micro_index(s, g, plan.grad_accum, 0))

    result = drive(step, setup.device, a.warmup, a.steps, t_build=t_build, profile=a.profile)
    flops = target_flops_per_micro(setup, worker.model)
    result.update(taps=setup.tap_ids, flops_per_micro=flops, payload_bytes=setup.payload.nbytes, **extra)
    record_rates(result, plan.grad_accum * setup.payload.rows * a.seq_len, plan.grad_accum * flops["total"], ceiling)
    add_useful(result, worker.rows["doc_ids"])
    return result
