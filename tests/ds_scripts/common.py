"""Shared set-up for the two-group worker scripts that tests/test_deepspeed_patches.py launches.

Ranks 0 .. d-1 are "drafters", the rest "targets", as in the runtime. One group works while the
other waits in a point-to-point receive (not a WORLD collective, which a stray WORLD collective of
the working group could pair with); at the end every rank meets in one WORLD barrier.

`--without NAME` (repeatable) runs a script with one workaround switched off, to re-check by hand
that it is still needed: such a run must hang (add `--dump_after 40` to see where). The tests
never pass it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


@dataclass
class Ctx:
    rank: int
    world: int
    drafter_ranks: list[int]
    target_ranks: list[int]
    drafter_group: object
    target_group: object
    args: argparse.Namespace

    @property
    def is_drafter(self) -> bool:
        return self.rank in self.drafter_ranks

    @property
    def group(self):
        return self.drafter_group if self.is_drafter else self.target_group

    @property
    def group_ranks(self) -> list[int]:
        return self.drafter_ranks if self.is_drafter else self.target_ranks


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--drafters", type=int, default=1)
    p.add_argument("--without", action="append", default=[])
    p.add_argument("--dump_after", type=float, default=0,
                   help="print every thread's stack after this many seconds (where does it hang?)")
    return p


def setup(args: argparse.Namespace) -> Ctx:
    if args.dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=False)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from dflash_ds.runtime import deepspeed_patches as patches

    patches.disable_cpu_shm_build()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    drafters = list(range(args.drafters))
    targets = list(range(args.drafters, world))
    assert drafters and targets, "the scripts need at least one rank in each group"
    # new_group is collective over WORLD: every rank creates both, in the same order.
    dg = dist.new_group(drafters)
    tg = dist.new_group(targets)
    torch.manual_seed(0)
    return Ctx(rank, world, drafters, targets, dg, tg, args)


def wait_for(ctx: Ctx, src: int) -> None:
    """Block until `src` calls release(): the idle group's stand-in for its own work."""
    token = torch.zeros(1)
    dist.recv(token, src=src)
    assert token.item() == 1.0


def release(ctx: Ctx, dsts: list[int]) -> None:
    for dst in dsts:
        dist.send(torch.ones(1), dst=dst)


def run_one_group(ctx: Ctx, work, busy: str) -> None:
    """`busy` ("drafter" or "target") runs work(ctx) alone while the other group waits for its
    leader's release message (a P2P token, not a collective), then everyone finishes."""
    is_busy = ctx.is_drafter if busy == "drafter" else not ctx.is_drafter
    busy_ranks, busy_group = ((ctx.drafter_ranks, ctx.drafter_group) if busy == "drafter"
                              else (ctx.target_ranks, ctx.target_group))
    idle_ranks = ctx.target_ranks if busy == "drafter" else ctx.drafter_ranks
    if is_busy:
        work(ctx)
        dist.barrier(group=busy_group)
        if ctx.rank == busy_ranks[0]:
            release(ctx, idle_ranks)
    else:
        wait_for(ctx, src=busy_ranks[0])
    finish(ctx)


def targets_work(args: argparse.Namespace, work) -> None:
    """The target group runs work(ctx) while each drafter rank computes something of its own that never
    touches the target group, then waits for the targets' release."""
    ctx = setup(args)
    if ctx.is_drafter:
        x = torch.randn(64, 64)
        for _ in range(10):
            x = torch.tanh(x @ x.T / 64)
    run_one_group(ctx, work, busy="target")


def finish(ctx: Ctx) -> None:
    dist.barrier()
    dist.destroy_process_group()
    print(f"WORKER OK rank {ctx.rank}", flush=True)


# ---------------------------------------------------------------------------- drafter-side helpers

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.01, 0.5


def drafter_ds_config(num_drafters: int, rows: int, grad_accum: int) -> dict:
    """The runtime's drafter JSON (ds_configs/drafter_zero2_cpu.json) with the recipe's values injected."""
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.ds_config import drafter_ds_config as build

    recipe = load_recipe(str(ROOT / "recipes" / "tiny.yaml"), [
        f"optim.rows_per_micro_batch={rows}", f"optim.grad_accum={grad_accum}",
        f"topology.drafters_per_node={num_drafters}", f"optim.grad_clip={CLIP}"])
    return build(recipe, num_drafters)


def tiny_module() -> torch.nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank, as for the real drafter
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def client_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def micro_batch(step: int, micro: int, dp_rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every drafter rank, a pure function of (step, micro-batch, rank)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def loss_fn(module, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


def train_step(engine, step: int, dp_rank: int, rows: int) -> float:
    losses = []
    for m in range(engine.gradient_accumulation_steps()):
        loss = loss_fn(engine, *micro_batch(step, m, dp_rank, rows))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)
