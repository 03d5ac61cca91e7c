"""Drafter checkpoint save and load (dflash_ds/runtime/checkpoint.py) on the drafter group; the target rank waits.

Two drafters train a ZeRO-2 engine, save, train on, reload: the reloaded weights, fp32 master
partitions and AdamW state equal the saved ones exactly, and training on from the reload repeats
the same losses. Needs (each `--without` hangs): barriers_on (`--without barriers`) and the
injected `"checkpoint": {"tag_validation": "Ignore"}` (`--without tag_validation`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import common
import torch

from dflash_ds.runtime import checkpoint
from dflash_ds.runtime.deepspeed_patches import GroupMPU

ROWS, ACCUM = 2, 2


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Everything a resume must restore on this rank: weights, fp32 master slice, AdamW moments."""
    out = {f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    zero = engine.optimizer
    for i, part in enumerate(zero.single_partition_of_fp32_groups):
        out[f"master.{i}"] = part.detach().clone()
        for k, v in zero.optimizer.state[part].items():
            out[f"adam.{i}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def run_drafter(ctx) -> None:
    import deepspeed

    n = len(ctx.drafter_ranks)
    cfg = common.drafter_ds_config(n, ROWS, ACCUM)
    assert cfg["checkpoint"]["tag_validation"] == "Ignore"  # engine_config's injection
    if "tag_validation" in ctx.args.without:
        del cfg["checkpoint"]
    model = common.tiny_module()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=common.client_optimizer(model), config=cfg,
                                           mpu=GroupMPU(ctx.drafter_group, ctx.drafter_ranks, ctx.rank),
                                           dist_init_required=False)
    dp_rank = ctx.drafter_ranks.index(ctx.rank)
    is_lead = ctx.rank == ctx.drafter_ranks[0]
    run_dir = Path(ctx.args.run_dir)

    for step in range(2):
        common.train_step(engine, step, dp_rank, ROWS)
    tag = checkpoint.save(engine, run_dir, 2, ctx.drafter_group, is_lead=is_lead, keep_last=2)
    saved = snapshot(engine)
    first = [common.train_step(engine, step, dp_rank, ROWS) for step in (2, 3)]
    after_first = snapshot(engine)
    assert not torch.equal(after_first["master.0"], saved["master.0"]), "training after the save changed nothing"

    assert json.loads((checkpoint.checkpoint_dir(run_dir) / checkpoint.LATEST).read_text())["tag"] == tag
    assert checkpoint.load(engine, run_dir, ctx.drafter_group, checkpoint.resolve(run_dir, "auto")) == 2
    assert_same(snapshot(engine), saved, "reloaded state")
    again = [common.train_step(engine, step, dp_rank, ROWS) for step in (2, 3)]
    assert again == first, (again, first)
    assert_same(snapshot(engine), after_first, "state after training on from the reload")
    print(f"rank {ctx.rank}: save/load round trip exact (tag {tag})", flush=True)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--run_dir", required=True)
    args = p.parse_args()
    if "barriers" in args.without:
        checkpoint.barriers_on = lambda group: contextlib.nullcontext()
    common.run_one_group(common.setup(args), run_drafter, busy="drafter")


if __name__ == "__main__":
    main()
