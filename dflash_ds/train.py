"""Entry point: `deepspeed launch.sh RECIPE [key=value ...]` runs main() on every rank.

Each rank checks the recipe (`resolve.run.resolve_run`), joins the process groups, prepares (rank 0) or
loads the data, and runs its role: target ranks fill and send payloads
(`runtime.target_worker`), drafter ranks receive and train (`runtime.trainer`), a colocated rank
does both in memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import dflash_ds.architectures  # noqa: F401  (registers every drafter architecture)
from dflash_ds.arguments import Parser, integer
from dflash_ds.config import load_recipe, ranks_per_node
from dflash_ds.libraries import quiet_libraries
from dflash_ds.resolve.run import resolve_run
from dflash_ds.resolve.plan import describe
from dflash_ds.safety import Exit, exit_now, say


def parse_args(argv: list[str]) -> argparse.Namespace:
    # The DeepSpeed launcher appends --local_rank=N; the rank comes from the environment instead.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    p = Parser(prog="dflash_ds.train", description="Train a DFlash drafter.")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without touching a GPU")
    p.add_argument("--world-size", type=integer(1), default=None, help="world size assumed by --dry-run")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        world = args.world_size or int(os.environ.get("WORLD_SIZE", ranks_per_node(recipe)))
        if args.dry_run:
            from dflash_ds.guard.launch import check_hub

            # A hub out of reach: the local cache only, at once, not 30 s of retries per file.
            check_hub(recipe)
        # After the hub check: it may set HF_HUB_OFFLINE, which huggingface_hub reads as it is imported.
        quiet_libraries(torchao=recipe.drafter.fp8.layers != "none")
        spec = resolve_run(recipe, world, planning=args.dry_run)
    except ValueError as exc:  # RecipeError, TargetError and the model/config checks: the user's to fix
        say(f"error: {exc}")
        return Exit.USER
    if args.dry_run:  # launch.sh runs it in place of the pre-launch step, which says the recipe's notes
        for note in recipe.notes:
            say(f"warning: {note}")
        print(describe(spec.plan, spec.memory))
        for note in spec.notes:
            print("note:", note)
        return Exit.OK
    import torch.distributed as dist

    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.guard.control import RunControl, run_guarded
    from dflash_ds.runtime.engines import init_distributed, make_groups
    from dflash_ds.runtime.target_worker import run_target
    from dflash_ds.runtime.trainer import run_drafter

    rank, _ = init_distributed(spec.device)
    # The run lock and the start point are settled before any data or model is loaded.
    control = RunControl.setup(recipe, spec.layout, rank)
    if control.error:  # the lead printed it; every rank ends without tearing down its process groups,
        exit_now(Exit.USER)  # whose destructors can abort (gloo) while a peer is already gone
    # Rank 0 prepares (or validates the cache of) the data; the others then read the cache.
    if rank == 0:
        try:
            data = load_training_data(recipe)
        except ValueError as exc:  # the data's, the user's to fix (launch.sh finds it before launch)
            say(f"error: {str(exc).strip().splitlines()[0]}")
            control.leaving(Exit.USER)  # the ranks waiting below end with this code, silently
            control.release()  # no lock left behind
            exit_now(Exit.USER)
    # Not bounded by the peer timeout: preparing the data may take longer (the world keeps its own).
    run_guarded(dist.barrier, control)
    if rank != 0:
        data = load_training_data(recipe)
    spec = spec.with_rows(data.num_rows)
    groups = make_groups(spec.layout, recipe.topology.payload_ctas)
    control.bound(groups.drafter, groups.target)
    if rank == 0:
        run_dir = Path(recipe.run.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(describe(spec.plan, spec.memory) + "\n")
    # No barrier on failure: the launcher tears every rank down when one exits non-zero, while a
    # barrier would leave the failed rank waiting for peers that wait for it.
    if spec.layout.role(rank) == "target":
        code = run_guarded(lambda: run_target(spec, data, rank, groups, start=control.start_step), control)
    else:
        code = run_guarded(lambda: run_drafter(spec, data, rank, groups, control=control), control)
    control.leaving()  # before the barrier: past it, peers exit in any order
    run_guarded(dist.barrier, control)  # a peer failing in its last steps ends this rank with its code
    control.release()
    table = code == Exit.OK and rank == spec.layout.drafter_ranks[0] and recipe.eval.at_end and recipe.eval.benchmarks
    if table:
        control.stop.finishing("training and its checkpoint are complete; finishing the benchmark table")
    else:
        control.stop.done()
    dist.destroy_process_group()
    if table:
        from dflash_ds.eval.benchmark_table import after_training
        from dflash_ds.report import finish_run

        code = after_training(recipe)  # the other ranks have gone: the devices are free
        if code == Exit.OK:
            finish_run(recipe.run.output_dir, None)  # the report again, now with the table
        control.stop.done()
    # No interpreter teardown: the work is written, and a late signal must not end this rank by the
    # default action while Python restores it (the launcher would take that for a failure).
    exit_now(code)
    return int(code)  # not reached: exit_now ends the process


if __name__ == "__main__":
    sys.exit(main())
