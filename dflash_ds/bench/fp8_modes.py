"""The drafter's precision modes one after another in one process, on the same weights and payloads.

    python -m dflash_ds.bench --role drafter --compile-layers --fp8-modes bf16,rowwise,tensorwise,rowwise+lm_head

A mode is `LAYERS[+lm_head][@SEED]`: LAYERS bf16, rowwise or tensorwise (drafter.fp8.layers; bf16 = none),
`+lm_head` adds drafter.fp8.lm_head, `lm_head` alone is the bf16 layers with the FP8 lm_head, `@SEED`
initialises the drafter (and seeds anchors and data order) from another seed. Each mode builds a
fresh drafter from the same initialisation under its own ZeRO-2 engine (the FP8 layers converted as
the engine is built, as in training), is timed like the drafter role, and is torn down before the
next. The result's rate is the last mode's (so the JSON feeds `--role plan` as that drafter); every
mode's rate, median-step rate, peak memory and compile counts are under `fp8_modes`, with the
ratios to the first mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

from .setup import Setup
from .timing import synchronize

LAYER_MODES = {"bf16": "none", "rowwise": "rowwise", "tensorwise": "tensorwise"}
DEFAULT_SPEED_MODES = "bf16,rowwise,tensorwise,rowwise+lm_head"


class Mode(NamedTuple):
    name: str
    layers: str  # drafter.fp8.layers
    lm_head: bool  # drafter.fp8.lm_head
    seed: int | None = None  # None: --seed


def parse_mode(text: str) -> Mode:
    body, _, seed = text.strip().partition("@")
    parts = body.split("+")
    lm_head = "lm_head" in parts
    rest = [p for p in parts if p != "lm_head"] or ["bf16"]
    if len(rest) != 1 or rest[0] not in LAYER_MODES or parts.count("lm_head") > 1 or (seed and not seed.isdigit()):
        raise ValueError(f"--fp8-modes: {text!r} is not a mode; use bf16, rowwise or tensorwise, optionally "
                         "+lm_head and @SEED (e.g. rowwise+lm_head, lm_head, bf16@1)")
    return Mode(text.strip(), LAYER_MODES[rest[0]], lm_head, int(seed) if seed else None)


def parse_modes(text: str) -> list[Mode]:
    modes = [parse_mode(t) for t in text.split(",") if t.strip()]
    names = [m.name for m in modes]
    if not modes or len(set(names)) != len(names):
        raise ValueError(f"--fp8-modes needs one or more distinct modes, got {text!r}")
    return modes


def with_mode(setup: Setup, mode: Mode) -> Setup:
    """The setup with the mode's drafter.fp8 and seed (run.seed and --seed)."""
    from dflash_ds.config.sections import DrafterFp8Config

    recipe = setup.recipe
    seed = setup.args.seed if mode.seed is None else mode.seed
    drafter = dataclasses.replace(recipe.drafter, fp8=DrafterFp8Config(mode.layers, mode.lm_head))
    recipe = dataclasses.replace(recipe, drafter=drafter, run=dataclasses.replace(recipe.run, seed=seed))
    args = argparse.Namespace(**{**vars(setup.args), "seed": seed})
    return dataclasses.replace(setup, args=args, run=dataclasses.replace(setup.run, recipe=recipe))


def check_modes(setup: Setup, modes: list[Mode]) -> None:
    """Every mode's drafter.fp8 against the recipe and this machine, before anything is built."""
    from dflash_ds.config.checks import check_drafter_fp8
    from dflash_ds.resolve import quantization

    for mode in modes:
        recipe = with_mode(setup, mode).recipe
        try:
            check_drafter_fp8(recipe)
        except ValueError as exc:
            raise ValueError(f"--fp8-modes {mode.name}: {exc} (the bench's --compile-layers sets drafter.compile)") \
                from None
        try:
            quantization.check_drafter_quantization(recipe.drafter.fp8, setup.device, setup.drafter_config)
        except ValueError as exc:
            raise ValueError(f"--fp8-modes {mode.name}: {exc}") from None


def allow_recompiles() -> None:
    """Each mode compiles its drafter's layers again (new modules, other linears); torch's default
    recompile limit per function is sized for one model."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))


def free_memory() -> None:
    """After a mode's engine is destroyed and every reference to it dropped: collect its reference
    cycles (hooks), so its optimizer states and flat buffers are gone before the next mode is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def run_drafter_modes(setup: Setup, ceiling: dict) -> dict:
    """The drafter role's synthetic payloads, reused by every mode of --fp8-modes (time_modes)."""
    from .roles import SyntheticSource, payload_count, synthetic_payloads
    from .setup import init_single_process, setup_rows

    group = init_single_process(setup.device)
    rows = setup_rows(setup, payload_count(setup) * setup.payload.rows)
    payloads = synthetic_payloads(setup, payload_count(setup), rows)
    return time_modes(setup, ceiling, group, lambda: SyntheticSource(payloads), row_doc_ids=rows["doc_ids"])


def time_modes(setup: Setup, ceiling: dict, group, source_factory, *, row_doc_ids) -> dict:
    """Every mode of --fp8-modes timed as the drafter role times one; `source_factory()` gives a
    fresh payload source per mode."""
    from .flops import drafter_flops_of_steps
    from .lengths import add_useful
    from .roles import build_drafter, drafter_step, frozen_matrices
    from .timing import drive, record_rates

    a = setup.args
    modes = parse_modes(a.fp8_modes)
    check_modes(setup, modes)
    allow_recompiles()
    matrices = frozen_matrices(setup)
    counted = drafter_flops_of_steps(setup, range(a.warmup, a.warmup + a.steps))
    table, result = {}, {}
    for mode in modes:
        s = with_mode(setup, mode)
        before = allocated_gib(setup.device)
        t_build = time.perf_counter()
        model, engine, _ = build_drafter(s, group, matrices, s.args.seed)
        step = drafter_step(s, engine, model, source_factory(), group=group)
        synchronize(setup.device)
        result = drive(step, setup.device, a.warmup, a.steps, t_build=t_build, profile=None)
        record_rates(result, setup.plan.grad_accum * setup.payload.rows * a.seq_len, counted["per_step"]["total"],
                     ceiling)
        add_useful(result, row_doc_ids)
        from dflash_ds.objective.head_matmuls import GemmHead

        head = model.loss_head.gemms if isinstance(model.loss_head, GemmHead) else None
        result.update(fp8_layers=float8_layers(model.drafter, mode), lm_head_fp8=head is not None,
                      lm_head_fp8_gib=head.nbytes() / 2**30 if head is not None else 0.0,
                      allocated_before_gib=before, drafter_flops=counted)
        table[mode.name] = {k: result[k] for k in ("tok_s", "tok_s_median", "step_s", "steadiness", "memory",
                                                   "compile", "mfu", "fp8_layers", "lm_head_fp8", "lm_head_fp8_gib",
                                                   "allocated_before_gib", "first_step_s")}
        engine.destroy()
        del model, step, head, engine
        free_memory()
        _ratios(table, modes[0].name)
        result["fp8_modes"] = table
        if a.out:  # the modes timed so far survive a run cut short
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps({"role": "drafter", "partial": True, "args": vars(a), "result": result},
                                              default=str) + "\n")
    return result


def _ratios(table: dict, first: str) -> None:
    for row in table.values():
        row["vs_first"] = row["tok_s"] / table[first]["tok_s"]
        row["vs_first_median"] = row["tok_s_median"] / table[first]["tok_s_median"]


def float8_layers(drafter, mode: Mode) -> int:
    """torchao float8 linears in `drafter` (torchao is imported only for a mode that converts)."""
    if mode.layers == "none":
        return 0
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in drafter.modules())
