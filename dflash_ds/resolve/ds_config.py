"""DeepSpeed JSON: loading, checking, and injecting the recipe's batch, clipping and lr settings.

ds_configs/*.json hold engine options (ZeRO stage, bf16, activation checkpointing, offload,
communication tuning). Batch sizes and clipping come from the recipe and are written in exactly
once; a JSON value that disagrees is an error rather than a silent overwrite. The learning rate
and schedule belong to the recipe, so optimizer/scheduler sections are refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dflash_ds.config import Recipe, RecipeError


def load_json(path: str, setting: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{setting}: DeepSpeed config {path!r} not found; point {setting} at a JSON file "
                          "such as ds_configs/drafter_zero2.json")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{setting}: {path} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(cfg, dict):
        raise RecipeError(f"{setting}: {path} must hold a JSON object")
    return cfg


def _inject(cfg: dict, key: str, value, setting: str, *, source: str, recipe_key: str) -> None:
    if key in cfg and cfg[key] != "auto" and cfg[key] != value:
        raise RecipeError(
            f"{setting} ({source}) sets {key}={cfg[key]!r} but the recipe gives {value!r} (from {recipe_key}); "
            f"remove {key} from the JSON (the recipe owns it) or change {recipe_key}")
    cfg[key] = value


def zero_stage(cfg: dict) -> int:
    return int(cfg.get("zero_optimization", {}).get("stage", 0))


def drafter_ds_config(recipe: Recipe, num_drafters: int) -> dict:
    setting, path = "drafter.ds_config", recipe.drafter.ds_config
    cfg = copy.deepcopy(load_json(path, setting))
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise RecipeError(f"{setting} ({path}) has an '{section}' section; the optimizer and lr schedule come "
                              "from the recipe's optim section: delete the section from the JSON")
    if zero_stage(cfg) > 2:
        raise RecipeError(f"{setting} ({path}): zero_optimization.stage {zero_stage(cfg)} is not supported for the "
                          "drafter (its 1.7B parameters fit every GPU); use stage 2 (or 0/1)")
    o = recipe.optim
    _inject(cfg, "train_micro_batch_size_per_gpu", o.rows_per_micro_batch, setting, source=path,
            recipe_key="optim.rows_per_micro_batch")
    _inject(cfg, "gradient_accumulation_steps", o.grad_accum, setting, source=path, recipe_key="optim.grad_accum")
    _inject(cfg, "train_batch_size", o.rows_per_micro_batch * o.grad_accum * num_drafters, setting, source=path,
            recipe_key="optim.rows_per_micro_batch x optim.grad_accum x drafter ranks")
    _inject(cfg, "gradient_clipping", o.grad_clip, setting, source=path, recipe_key="optim.grad_clip")
    # Checkpoint tag validation all-reduces over WORLD, which the target ranks never join.
    cfg.setdefault("checkpoint", {})["tag_validation"] = "Ignore"
    ac = cfg.get("activation_checkpointing")
    if ac is not None:
        for key in ("partition_activations", "cpu_checkpointing"):
            if ac.get(key):
                raise RecipeError(f"{setting} ({path}): activation_checkpointing.{key} needs tensor parallelism, which "
                                  "the drafter does not use; set it to false")
    return cfg


def checkpointed_layers(ds_cfg: dict, num_layers: int) -> int:
    """How many drafter layers run under activation checkpointing, from the JSON.

    A missing `activation_checkpointing` section means none; `number_checkpoints` (DeepSpeed's own
    key) caps the count, otherwise every layer is checkpointed.
    """
    ac = ds_cfg.get("activation_checkpointing")
    if ac is None:
        return 0
    n = ac.get("number_checkpoints")
    return num_layers if n is None else max(0, min(int(n), num_layers))


def target_engine_kind(cfg: dict, path: str) -> str:
    stage = zero_stage(cfg)
    if stage == 3:
        return "zero3"
    if stage in (1, 2):
        raise RecipeError(f"target.ds_config ({path}): zero_optimization.stage {stage} does nothing for a frozen "
                          "model; use no zero_optimization (full replica per GPU) or stage 3 (ZeRO-Inference)")
    return "replica"


def target_ds_config(recipe: Recipe, num_targets: int) -> tuple[str, dict]:
    setting, path = "target.ds_config", recipe.target.ds_config
    cfg = copy.deepcopy(load_json(path, setting))
    kind = target_engine_kind(cfg, path)
    if kind == "zero3":
        r = recipe.optim.rows_per_micro_batch
        _inject(cfg, "train_micro_batch_size_per_gpu", r, setting, source=path, recipe_key="optim.rows_per_micro_batch")
        _inject(cfg, "gradient_accumulation_steps", 1, setting, source=path,
                recipe_key="(fixed: the target does not train)")
        _inject(cfg, "train_batch_size", r * num_targets, setting, source=path,
                recipe_key="optim.rows_per_micro_batch x target ranks")
        t = recipe.topology
        if (t.drafters_per_node * recipe.optim.grad_accum) % max(t.targets_per_node, 1):
            raise RecipeError(
                "a ZeRO-3 target runs its forwards in lock-step across target ranks, so every target must produce "
                "the same number of micro-batches per step: make topology.drafters_per_node x optim.grad_accum a "
                "multiple of topology.targets_per_node")
    else:
        replica_dtype(cfg, path)
        if cfg.get("replace_with_kernel_inject") or int((cfg.get("tensor_parallel") or {}).get("tp_size", 1)) != 1:
            raise RecipeError(f"{setting} ({path}): kernel injection and tensor parallelism are not supported for the "
                              "target (a full replica per GPU runs the transformers model as is); set "
                              "replace_with_kernel_inject false and tensor_parallel.tp_size 1")
    return kind, cfg


REPLICA_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                  "fp32": "float32", "float32": "float32"}


def replica_dtype(cfg: dict, path: str) -> str | None:
    """The replica JSON's `dtype` as a torch dtype name; None keeps the loaded dtype (target.dtype)."""
    if "dtype" not in cfg:
        return None
    name = REPLICA_DTYPES.get(str(cfg["dtype"]))
    if name is None:
        raise RecipeError(f"target.ds_config ({path}): dtype {cfg['dtype']!r} is not one of {sorted(REPLICA_DTYPES)}")
    return name
