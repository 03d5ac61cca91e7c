"""Setting up a rank: process groups, the drafter's ZeRO-2 engine and the target's engine."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import deepspeed_patches as patches
from .config import Recipe
from .engine_config import checkpointed_layers, drafter_ds_config, target_ds_config
from .plan import Plan, lr_factor
from .topology import Layout


@dataclass
class Groups:
    drafter: object
    target: object


def pick_device(recipe: Recipe) -> torch.device:
    want = recipe.run.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("run.device is cuda but no GPU is visible; set run.device: cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device) -> tuple[int, int]:
    import deepspeed

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        patches.disable_cpu_shm_build()
    else:
        torch.cuda.set_device(device)
    # Data preparation on rank 0 can take a while before the first collective.
    deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl",
                               timeout=datetime.timedelta(minutes=int(os.environ.get("DFLASH_DIST_TIMEOUT_MIN", "60"))))
    return dist.get_rank(), dist.get_world_size()


def make_groups(layout: Layout) -> Groups:
    # Every rank creates both groups, in the same order (new_group is collective over WORLD).
    drafter = dist.new_group(layout.drafter_ranks)
    target = drafter if layout.colocated else dist.new_group(layout.target_ranks)
    return Groups(drafter, target)


def build_drafter_engine(recipe: Recipe, drafter, plan: Plan, group, rank: int, device: torch.device):
    import deepspeed

    cfg = drafter_ds_config(recipe, plan.layout.num_drafters)
    if recipe.checkpoint.universal:
        cfg["checkpoint"]["load_universal"] = True
    n_ckpt = checkpointed_layers(cfg, len(drafter.layers))
    mpu = patches.GroupMPU(group, plan.layout.drafter_ranks, rank)
    if n_ckpt:
        # The mpu makes DeepSpeed's batch-size check count the drafter group, not WORLD.
        deepspeed.checkpointing.configure(mpu, deepspeed_config=cfg)
        # Non-reentrant: the block inputs (received hidden states) do not require grad, and the
        # reentrant variant would then silently give the checkpointed layers no gradient.
        drafter.checkpoint_fn = deepspeed.checkpointing.non_reentrant_checkpoint
    drafter.checkpoint_layers = n_ckpt
    o = recipe.optim
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt_kwargs = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    optimizer = torch.optim.AdamW(params, **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan, o.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=cfg,
                                           mpu=mpu, dist_init_required=False)
    return engine, cfg


def build_target_engine(recipe: Recipe, model, plan: Plan, group):
    """The frozen target under the engine the JSON asks for; returns the module to call."""
    import deepspeed

    from .kernels import fuse_target_elementwise, use_fla_short_conv

    if os.environ.get("DFLASH_FLA_SHORT_CONV", "1") != "0":
        use_fla_short_conv()
    if os.environ.get("DFLASH_FUSE_TARGET", "1") != "0":
        fuse_target_elementwise()
    kind, cfg = target_ds_config(recipe, plan.layout.num_targets)
    if kind == "zero3":
        patches.skip_zero3_trace_check()
        mpu = patches.GroupMPU(group, plan.layout.target_ranks, dist.get_rank())
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu, dist_init_required=False)
        engine.eval()
        return engine.module, kind
    engine = deepspeed.init_inference(model, config=cfg)
    return engine.module, kind
