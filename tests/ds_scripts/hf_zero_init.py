"""HF from_pretrained under HfDeepSpeedConfig (ZeRO-3) on the target group; the drafter rank waits.

Inside zero_init_on the model is partitioned over the target group, not WORLD, and the target
group's first rank (global rank 1: drafters come first) writes the checkpoint's weights. Every
rank's shard must equal its slice of the checkpoint tensor. `--without zero_init` hangs;
`--without loader_rank` (only the loader's rank fix off) leaves the weights unloaded.
"""

from __future__ import annotations

import contextlib
import json
import math

import common
import torch
import torch.distributed as dist

from dflash_ds.runtime import deepspeed_patches as patches


def check_shards(model, path: str, ctx) -> int:
    from safetensors import safe_open

    n = len(ctx.target_ranks)
    me = ctx.target_ranks.index(ctx.rank)
    checked = 0
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name, p in model.named_parameters():
            assert dist.get_process_group_ranks(p.ds_process_group) == ctx.target_ranks, name
            size = math.ceil(p.ds_numel / n)
            assert p.ds_tensor.numel() == size, (name, p.ds_tensor.numel(), p.ds_numel)
            # ZeRO-3 pads the flattened tensor to n equal slices; rank i holds slice i.
            full = f.get_tensor(name).flatten()
            expect = torch.zeros(size * n, dtype=full.dtype)
            expect[: full.numel()] = full
            assert torch.equal(p.ds_tensor.flatten(), expect[me * size:(me + 1) * size]), f"{name}: wrong shard"
            checked += 1
    return checked


def run_target(ctx) -> None:
    from transformers import Qwen3ForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = json.loads((common.ROOT / "ds_configs" / "target_zero3.json").read_text())
    cfg["bf16"] = {"enabled": False}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    n = len(ctx.target_ranks)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=n)
    if "zero_init" in ctx.args.without:
        del cfg["train_batch_size"]  # else zero.Init's batch check (it counts WORLD) fails before any collective
    hf_ds_config = HfDeepSpeedConfig(cfg)  # HF holds only a weak reference: keep it for the load
    with patches.zero_init_on(ctx.target_group):
        model = Qwen3ForCausalLM.from_pretrained(ctx.args.model, dtype=torch.float32)
    del hf_ds_config
    checked = check_shards(model, ctx.args.model, ctx)
    print(f"rank {ctx.rank}: {checked} shards over ranks {ctx.target_ranks} match the checkpoint", flush=True)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    if "zero_init" in args.without:
        patches.zero_init_on = lambda group: contextlib.nullcontext()
    if "loader_rank" in args.without:  # zero.Init on the group, but HF's loader writes on rank 0 only
        patches._group_rank_as_rank = lambda group: contextlib.nullcontext()
    common.run_one_group(common.setup(args), run_target, busy="target")


if __name__ == "__main__":
    main()
