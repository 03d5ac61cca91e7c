"""A ZeRO-2 drafter engine on the drafter group (GroupMPU) while the target rank waits.

Checks that data parallelism follows the group (dp world size, batch size, ZeRO partitions), that
the drafter ranks stay identical, and that the result equals single-process AdamW on the
averaged gradient of all ranks' micro-batches. `--without mpu` (mpu=None, i.e. WORLD) hangs
(with the injected train_batch_size it fails DeepSpeed's batch check even earlier).
"""

from __future__ import annotations

import common
import torch
import torch.distributed as dist

from dflash_ds.runtime.deepspeed_patches import GroupMPU

ROWS, ACCUM, STEPS = 2, 2, 3


def reference(num_drafters: int) -> tuple[torch.nn.Module, list[float]]:
    """What data parallelism must compute: every rank's micro-batches in one process.

    Also returns the gradient norm before clipping of each step: AdamW's update hardly depends
    on the gradient's scale, the norm does (averaging over 3 ranks instead of 2 shows there).
    """
    model = common.tiny_module()
    opt = common.client_optimizer(model)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(num_drafters):
            for m in range(ACCUM):
                (common.loss_fn(model, *common.micro_batch(step, m, r, ROWS)) / (ACCUM * num_drafters)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP).item())
        opt.step()
    return model, norms


def run_drafter(ctx) -> None:
    import deepspeed

    n = len(ctx.drafter_ranks)
    cfg = common.drafter_ds_config(n, ROWS, ACCUM)
    model = common.tiny_module()
    mpu = GroupMPU(ctx.drafter_group, ctx.drafter_ranks, ctx.rank)
    if "mpu" in ctx.args.without:
        # Without the mpu DeepSpeed counts WORLD in the batch check first; drop the injected total
        # to get past it to the collectives.
        mpu = None
        del cfg["train_batch_size"]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=common.client_optimizer(model), config=cfg,
                                           mpu=mpu, dist_init_required=False)
    assert engine.zero_optimization_stage() == 2
    assert engine.dp_world_size == n, engine.dp_world_size
    assert engine.train_batch_size() == ROWS * ACCUM * n
    assert dist.get_world_size(engine.optimizer.dp_process_group) == n
    assert all(c == n for c in engine.optimizer.partition_count), engine.optimizer.partition_count

    dp_rank = ctx.drafter_ranks.index(ctx.rank)
    ref_model, ref_norms = reference(n)
    for step in range(STEPS):
        common.train_step(engine, step, dp_rank, ROWS)
        norm = float(engine.get_global_grad_norm())
        assert abs(norm - ref_norms[step]) <= 1e-5 * ref_norms[step], (step, norm, ref_norms[step])
    flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat, group=ctx.drafter_group)
    for other in gathered:
        assert torch.equal(other, flat), "drafter ranks diverged"
    ref = torch.cat([p.detach().flatten() for p in ref_model.parameters()])
    assert not torch.equal(ref, torch.cat([p.detach().flatten() for p in common.tiny_module().parameters()]))
    assert torch.allclose(flat, ref, rtol=1e-5, atol=1e-6), (flat - ref).abs().max().item()
    print(f"rank {ctx.rank}: dp world {engine.dp_world_size}, params equal across drafters and to the reference",
          flush=True)


def main() -> None:
    args = common.parser(__doc__).parse_args()
    common.run_one_group(common.setup(args), run_drafter, busy="drafter")


if __name__ == "__main__":
    main()
