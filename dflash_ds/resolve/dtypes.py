"""The one dtype hidden states travel and train in, decided once from the recipe before launch.

The drafter computes in the dtype its DeepSpeed JSON gives it (bf16 / fp16 sections, else float32):
that is the payload dtype. The target may compute in another dtype (`target.dtype`); its tapped
states are then cast once, on the target rank, as they are written into the payload buffer, so
the drafter side never converts and never sees a dtype its weights do not have. Combinations that
cannot work stop before launch with one message naming the setting.
"""

from __future__ import annotations

import torch

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.resolve.ds_config import replica_dtype
from dflash_ds.target_model.model import DTYPES

def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def section_dtype(cfg: dict, setting: str, path: str) -> torch.dtype:
    """bf16 / fp16 `enabled` sections of a DeepSpeed JSON -> the dtype the engine holds weights in."""
    bf16 = bool(cfg.get("bf16", {}).get("enabled"))
    fp16 = bool(cfg.get("fp16", {}).get("enabled"))
    if bf16 and fp16:
        raise RecipeError(f"{setting} ({path}) enables both bf16 and fp16; enable at most one of them")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def drafter_compute_dtype(recipe: Recipe, drafter_cfg: dict, device: torch.device) -> torch.dtype:
    """The drafter's compute dtype = the payload dtype. CPU runs need float32 (no bf16 training there)."""
    setting, path = "drafter.ds_config", recipe.drafter.ds_config
    dtype = section_dtype(drafter_cfg, setting, path)
    if device.type == "cpu" and dtype != torch.float32:
        raise RecipeError(f"{setting} ({path}) enables {_name(dtype)} but run.device is cpu, where the drafter "
                          "trains in float32; use ds_configs/drafter_zero2_cpu.json (bf16.enabled false) on CPU")
    return dtype


def check_target_dtype(recipe: Recipe, kind: str, target_cfg: dict) -> torch.dtype:
    """target.dtype must be what the target engine will hold, or the engine silently recasts it."""
    setting, path = "target.ds_config", recipe.target.ds_config
    want = DTYPES[recipe.target.dtype]
    if kind == "zero3":
        got = section_dtype(target_cfg, setting, path)
        fix = f"set bf16.enabled {'true' if want == torch.bfloat16 else 'false'}" + \
              (" and fp16.enabled true" if want == torch.float16 else "")
    else:
        name = replica_dtype(target_cfg, path)
        if name is None:
            return want
        got = getattr(torch, name)
        fix = f"set \"dtype\" to {_name(want)!r}"
    if got != want:
        raise RecipeError(f"target.dtype is {recipe.target.dtype} but {setting} ({path}) makes the engine hold "
                          f"{_name(got)}: {fix} in the JSON, or change target.dtype")
    return want


def payload_dtype(recipe: Recipe, kind: str, target_cfg: dict, drafter_cfg: dict, *,
                  device: torch.device) -> torch.dtype:
    """Checks both sides and returns the dtype of the tapped states in every payload."""
    check_target_dtype(recipe, kind, target_cfg)
    return drafter_compute_dtype(recipe, drafter_cfg, device)
