"""What every bench role runs on: the resolved recipe, target and drafter configs, one rank's world.

The recipe supplies what is not geometry, exactly as a training run reads it; the flags fix the
batch shape and a single-rank colocated layout. Rows are synthetic (speed does not depend on them).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_ds.config import Recipe
from dflash_ds.guard.launch import free_port  # noqa: F401  (re-exported by dflash_ds.bench)
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.payload import PayloadLayout
from dflash_ds.resolve.plan import Plan
from dflash_ds.resolve.run import RunSpec

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "qwen27b.yaml"


@dataclass(frozen=True)
class Setup:
    args: argparse.Namespace
    target_config: Any  # the transformers text config the random-weight target is built from
    geometry_name: str
    run: RunSpec  # the run a 1-rank colocated training of this recipe would have

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def recipe(self) -> Recipe:
        return self.run.recipe

    @property
    def drafter_config(self) -> DrafterShape:
        return self.run.drafter

    @property
    def plan(self) -> Plan:
        return self.run.plan

    @property
    def payload(self) -> PayloadLayout:
        return self.run.payload

    @property
    def tap_ids(self) -> list[int]:
        return list(self.drafter_config.target_layer_ids)


def pick_device(name: str) -> torch.device:
    from dflash_ds.resolve.run import resolve_device

    return resolve_device(name, "--device")


def _resize_layers(config, layers: int):
    """A copy of a loaded target config with `layers` decoder layers (layer pattern repeated)."""
    d = config.to_dict()
    types = d.get("layer_types")
    d["num_hidden_layers"] = layers
    if types:
        d["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return type(config)(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})


def fill_row_defaults(args: argparse.Namespace, recipe: Recipe) -> None:
    """The recipe's rows where the flags leave them open: row length (--seq-len), rows per micro-batch,
    grad_accum, and anchors at the recipe's anchors per row token (its own count at its own row length).
    The longest conversation is the recipe's, cut to the row length."""
    d, o = recipe.data, recipe.optim
    if args.seq_len is None:
        args.seq_len = d.row_length
    if args.anchors is None:
        args.anchors = max(1, round(recipe.objective.num_anchors * args.seq_len / d.row_length))
    if args.rows is None:
        args.rows = o.rows_per_micro_batch
    if args.grad_accum is None:
        args.grad_accum = o.grad_accum
    args.max_length = min(d.max_length, args.seq_len)


def resolve_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    """Target config, drafter config and the bench recipe from --geometry / --recipe and the flags.

    The recipe supplies everything that is not geometry (DeepSpeed JSONs, loss chunks, optimiser,
    activation checkpointing) exactly as a training run would read it. Batch shape, topology and
    output directory are overridden for a single-rank colocated layout, the one every role fits.
    """
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve import quantization
    from dflash_ds.resolve.run import payload_layout, plan_and_memory
    from dflash_ds.target_model.model import DTYPES, load_config, target_geometry, text_config
    from dflash_ds.target_model.presets import get_geometry, target_config

    cuda = device.type == "cuda"
    recipe_path = Path(args.recipe) if args.recipe else DEFAULT_RECIPE
    # The rows follow the recipe and the --set overrides of its rows (the others may only be valid with
    # the geometry's overrides below).
    rows_set = [o for o in args.set or [] if o.split("=", 1)[0].split(".")[0] in ("data", "optim", "objective")]
    fill_row_defaults(args, load_recipe(recipe_path, rows_set))
    total_steps = args.warmup + args.steps
    cfgs = REPO / "ds_configs"
    # The target and transport roles draw no anchors; keep the recipe valid at short --seq-len.
    anchors = args.anchors if args.role in ("drafter", "colocated") else min(args.anchors, args.seq_len)
    # Nothing is written to the run directory (no metrics, no checkpoints); it only has to be valid.
    over = [f"run.output_dir={Path(tempfile.gettempdir()) / 'dflash_bench'}", f"run.seed={args.seed}",
            f"run.device={device.type}", "log.wandb.enabled=false", "log.progress=false",
            f"data.row_length={args.seq_len}", f"data.max_length={args.max_length}", f"objective.num_anchors={anchors}",
            f"drafter.block_size={args.block_size}", f"optim.rows_per_micro_batch={args.rows}",
            f"optim.grad_accum={args.grad_accum}", "optim.epochs=1", f"optim.max_steps={total_steps}",
            "topology.colocated=true", "topology.drafters_per_node=1", "topology.targets_per_node=0",
            "checkpoint.resume=restart", f"target.dtype={'bfloat16' if cuda else 'float32'}"]
    if not cuda:
        # The GPU JSONs enable bf16, which the CPU engine cannot run.
        over += [f"drafter.ds_config={cfgs / 'drafter_zero2_cpu.json'}",
                 f"target.ds_config={cfgs / 'target_replica_cpu.json'}"]
    elif not args.recipe:
        over += [f"drafter.ds_config={cfgs / 'drafter_zero2.json'}", f"target.ds_config={cfgs / 'target_replica.json'}"]
    local_target = None
    if args.recipe:
        path = load_recipe(recipe_path).target.path
        local_target = path if Path(path).is_dir() else None
    if local_target:
        tcfg = text_config(load_config(local_target))
        if args.layers:
            tcfg = _resize_layers(tcfg, args.layers)
            over.append("drafter.target_layer_ids=null")
        geometry_name = f"recipe:{local_target}"
    else:
        geo = get_geometry(args.geometry)
        tcfg = target_config(args.geometry, args.layers)
        geometry_name = geo.name
        over += [f"drafter.num_layers={geo.drafter_layers}", f"drafter.mask_token_id={geo.mask_token_id}",
                 "drafter.target_layer_ids=null", "drafter.intermediate_size=null",
                 "drafter.num_attention_heads=null", "drafter.num_key_value_heads=null", "drafter.head_dim=null"]
        types = load_recipe(recipe_path).drafter.layer_types
        if types is not None and len(types) != geo.drafter_layers:
            # The recipe's per-layer attention is for another layer count: this geometry's drafter runs
            # full attention unless --set gives it a layout of its own.
            over += ["drafter.layer_types=null", "drafter.sliding_window=null"]
    if getattr(args, "architecture", None):
        over.append(f"drafter.architecture={args.architecture}")
    # Layers are compiled by the runtime when the recipe says so; the bench's flag decides.
    over.append(f"drafter.compile={'true' if getattr(args, 'compile_layers', False) else 'false'}")
    recipe = load_recipe(recipe_path, over + list(args.set or []))
    dcfg = drafter_shape(tcfg, recipe.drafter)
    if args.role in ("drafter", "colocated"):
        quantization.check_drafter_quantization(recipe.drafter.fp8, device, dcfg)
    o = recipe.optim
    geo = target_geometry(tcfg)
    plan, memory = plan_and_memory(recipe, 1, dcfg, geo, num_rows=total_steps * o.grad_accum * o.rows_per_micro_batch)
    # The bench's dtype: target.dtype on a GPU, float32 on CPU (its drafter JSON agrees with it);
    # training runs take the payload dtype from resolve.dtypes.payload_dtype (resolve_run).
    dtype = DTYPES[recipe.target.dtype] if cuda else torch.float32
    payload = payload_layout(recipe, dcfg, dtype)
    run = RunSpec(recipe, device, dtype, geo, dcfg, payload, plan, memory, rows_known=True)
    return Setup(args, tcfg, geometry_name, run)



def init_single_process(device: torch.device):
    """A world of one rank (the engines need a process group); returns its group."""
    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cpu":
        # Read when deepspeed first picks its accelerator, so set before it is imported.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        from dflash_ds.runtime.engines import init_distributed

        init_distributed(device)
    return dist.new_group([0])


def synthetic_rows(num_rows: int, seq_len: int, vocab: int, prompt_tokens: int, *, seed: int) -> dict[str, np.ndarray]:
    """One document per row: random ids, loss mask off on the prompt prefix and on after it."""
    if not 0 <= prompt_tokens < seq_len - 1:
        raise ValueError(f"--prompt-tokens must be in [0, seq_len - 1), got {prompt_tokens} for --seq-len {seq_len}")
    rng = np.random.default_rng(seed)
    loss_mask = np.ones((num_rows, seq_len), dtype=np.int32)
    loss_mask[:, :prompt_tokens] = 0
    return {"input_ids": rng.integers(0, vocab, size=(num_rows, seq_len), dtype=np.int64),
            "loss_mask": loss_mask,
            "doc_ids": np.zeros((num_rows, seq_len), dtype=np.int32)}


def prompt_tokens(args) -> int:
    return args.prompt_tokens if args.prompt_tokens is not None else args.seq_len // 8


def setup_rows(setup: Setup, num_rows: int) -> dict[str, np.ndarray]:
    """`num_rows` synthetic rows of the setup's shape, vocabulary and seed: one full-length document per row,
    or, with --lengths, documents from a length distribution packed as the recipe's data.pack says."""
    a = setup.args
    if getattr(a, "lengths", None):
        from .lengths import length_rows

        return length_rows(num_rows, a.seq_len, setup.recipe.data.max_length, setup.drafter_config.vocab_size,
                           spec=a.lengths, pack=setup.recipe.data.pack, seed=a.seed)
    return synthetic_rows(num_rows, a.seq_len, setup.drafter_config.vocab_size, prompt_tokens(a), seed=a.seed)
