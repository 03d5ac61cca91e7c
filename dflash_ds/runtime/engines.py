"""Setting up a rank: process groups, the drafter's ZeRO-2 engine and the target's engine."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_ds.runtime import deepspeed_patches as patches
from dflash_ds.config import Recipe
from dflash_ds.resolve.ds_config import checkpointed_layers, drafter_ds_config, replica_dtype, target_ds_config
from dflash_ds.resolve.plan import Cooldown, Plan, lr_factor
from dflash_ds.resolve.topology import Layout
from dflash_ds.safety import say


@dataclass(frozen=True)
class Groups:
    """This rank's two process groups (the same group twice in colocated mode), and the one the
    payloads travel over (None: the default group)."""

    drafter: dist.ProcessGroup
    target: dist.ProcessGroup
    payload: dist.ProcessGroup | None = None
    experts: dist.ProcessGroup | None = None  # the target ranks holding this rank's target (target.expert_parallel)


def apply_layers(recipe: Recipe, drafter: torch.nn.Module) -> list[str]:
    """drafter.fp8.layers on a freshly built drafter (before its engine); [] when off."""
    fp8 = recipe.drafter.fp8
    if fp8.layers == "none":
        return []
    from dflash_ds.quantization.fp8_drafter import convert_layers  # torchao: only when the layers ask for it

    return convert_layers(drafter, fp8.layers)


def loss_head(recipe: Recipe, lm_head: torch.Tensor):
    """The loss's lm_head matmuls for the run's DraftModel: FP8 (drafter.fp8.lm_head:
    quantization.fp8_head.Fp8Head), or torch.mm through a DenseHead the run keeps (it holds the folded
    weight of a logit bias from one step to the next)."""
    from dflash_ds.objective.head_matmuls import DenseHead, GemmHead
    from dflash_ds.quantization.fp8_head import Fp8Head

    return GemmHead(Fp8Head(lm_head)) if recipe.drafter.fp8.lm_head else DenseHead()


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


def make_groups(layout: Layout, payload_ctas: int = 0) -> Groups:
    # Every rank creates every group, in the same order (new_group is collective over WORLD).
    drafter = dist.new_group(layout.drafter_ranks)
    target = drafter if layout.colocated else dist.new_group(layout.target_ranks)
    payload = payload_group(layout, payload_ctas)
    return Groups(drafter, target, payload, expert_group(layout))


def expert_group(layout: Layout) -> dist.ProcessGroup | None:
    """This rank's expert group (every rank creates every one, in the same order); None without
    expert parallelism and on drafter ranks."""
    if layout.expert_parallel == 1:
        return None
    mine = None
    for ranks in layout.expert_groups():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def payload_group(layout: Layout, ctas: int) -> dist.ProcessGroup | None:
    """A group of all ranks whose NCCL communicators use at most `ctas` thread blocks, for the
    payload sends and receives only (the drafters' gradient reduction keeps its own); None where
    there is nothing to limit (colocated, gloo, or ctas 0)."""
    if layout.colocated or ctas == 0 or dist.get_backend() != "nccl":
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.min_ctas = ctas
    opts.config.max_ctas = ctas
    return dist.new_group(list(range(dist.get_world_size())), pg_options=opts)


def build_drafter_engine(recipe: Recipe, drafter, plan: Plan, group, *, rank: int, device: torch.device,
                         cooldown: Cooldown | None = None):
    """The drafter under ZeRO-2 with AdamW and the plan's schedule; `cooldown` (set later by the trainer)
    bends the schedule into an early end's decay."""
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
    # Before the engine: it flattens the parameters the FP8 layers keep.
    converted = apply_layers(recipe, drafter)
    if (converted or recipe.drafter.fp8.lm_head) and plan.layout.drafter_ranks[0] == rank:
        say(f"drafter.fp8: {len(converted)} projections train in float8 ({recipe.drafter.fp8.layers}), the loss's "
            f"lm_head GEMMs in {'FP8' if recipe.drafter.fp8.lm_head else 'bf16'}")
    o = recipe.optim
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt_kwargs = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    optimizer = torch.optim.AdamW(params, **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan, o.min_lr_ratio, cooldown))
    engine, _, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=cfg,
                                           mpu=mpu, dist_init_required=False)
    if recipe.drafter.compile and device.type == "cuda":
        # Fuses each layer's norms, RoPE and SwiGLU, and the elementwise work of a head that asks for it
        # (LiLiCorr's over its lattice); shapes are static, so one graph per unit.
        for unit in drafter.compile_units():
            unit.compile(dynamic=False)
    return engine, cfg


def speed_up_target_kernels(fla_short_conv: bool = True, fused_elementwise: bool = True) -> None:
    """Swap in the faster target kernels of target_model/kernels.py (GPU only). Training always uses both;
    the bench's --no-fla-conv and --no-fused-target leave them out for A/B runs."""
    from dflash_ds.target_model.kernels import fuse_target_elementwise, use_fla_short_conv
    from dflash_ds.target_model.moe_block import fuse_moe_blocks

    if fla_short_conv:
        use_fla_short_conv()
    if fused_elementwise:
        fuse_target_elementwise()
        fuse_moe_blocks()


def replica(model: torch.nn.Module, cfg: dict, device: torch.device) -> torch.nn.Module:
    """A full target replica on `device` in the replica JSON's dtype.

    Not `deepspeed.init_inference`: with tensor parallelism 1 and no kernel injection (the only
    settings target_ds_config accepts) it only casts and moves the model, and its engine was
    discarded anyway, since the forward runs the transformers module itself. The JSON
    (ds_configs/target_replica.json) still selects this path and its dtype.
    """
    name = replica_dtype(cfg, "target.ds_config")
    return model.to(device=device, dtype=getattr(torch, name) if name else None)


def load_target_engine(recipe: Recipe, plan: Plan, group, device: torch.device, *, experts=None):
    """The frozen target from target.path under the engine target.ds_config asks for.

    A full replica per rank when it fits, else ZeRO-Inference: weights partitioned over the
    target group at load time, gathered layer by layer each forward. A mixture-of-experts target
    with target.expert_parallel > 1 is split over the `experts` group instead (kind
    "expert_parallel"): every rank reads its share of the experts and the rest of the model.
    """
    from dflash_ds.target_model.model import load_target
    from dflash_ds.runtime.zero_inference import load_target_zero3

    speed_up_target_kernels()
    t = recipe.target
    kind, cfg = target_ds_config(recipe, plan.layout.num_targets)
    if kind == "zero3":
        return load_target_zero3(t.path, cfg, group, dtype=t.dtype, attn_implementation=t.attn_implementation,
                                 adapter=t.adapter), kind
    fp8 = t.quantization == "fp8"  # may run on this rank's GPU: resolve/quantization.py checked it
    if t.expert_parallel > 1:
        from dflash_ds.runtime.expert_group import GroupComm
        from dflash_ds.target_model.expert_parallel import load_expert_shard

        model = load_expert_shard(t.path, GroupComm(experts), dtype=t.dtype, device=device,
                                  attn_implementation=t.attn_implementation)
        kind = "expert_parallel"
    else:
        model = load_target(t.path, adapter=t.adapter, dtype=t.dtype, device=device,
                            attn_implementation=t.attn_implementation, keep_fp8=fp8)
    return quantized_replica(recipe, model, cfg, device), kind


def quantized_replica(recipe: Recipe, model: torch.nn.Module, cfg: dict, device: torch.device) -> torch.nn.Module:
    """The replica, its linear layers in FP8 when target.quantization says so (quantized on the
    device, after the move; an FP8 checkpoint's layers already are), compiled for the micro-batch
    shape. The replica JSON's dtype equals target.dtype (checked before launch), which the model was
    loaded in, so the FP8 weights are never cast."""
    from dflash_ds.quantization import fp8 as fp8_target
    from dflash_ds.target_model import moe
    from dflash_ds.target_model.model import TargetError

    if moe.experts_modules(model):
        try:
            moe.use_experts(model, recipe.target.experts_implementation)
        except ValueError as exc:
            raise TargetError(f"target.experts_implementation: {exc}") from None
    if recipe.target.quantization != "fp8":
        return replica(model, cfg, device)
    model = model.to(device)
    if not any(isinstance(m, fp8_target.Fp8Linear) for m in model.modules()):
        fp8_target.quantize_model(model, fp8_target.ROWS)
        moe.quantize_experts(model)  # the routed experts: one scale per expert row (none on a dense target)
    fp8_target.compile_for(model, recipe.optim.rows_per_micro_batch * recipe.data.max_length)
    return model
