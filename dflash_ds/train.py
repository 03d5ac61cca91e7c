"""Entry point: `deepspeed launch.sh RECIPE [key=value ...]` runs main() on every rank.

Each rank checks the recipe, joins the process groups, prepares (rank 0) or loads the data, and
runs its role: target ranks fill and send payloads, drafter ranks receive and train, a colocated
rank does both in memory.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.runtime import checkpoint
from dflash_ds.runtime.control import Stopped
from dflash_ds.runtime.watchdog import waiting_on
from dflash_ds.config import dump_yaml, load_recipe, ranks_per_node, to_dict
from dflash_ds.metrics import Metrics, print_progress, read_status, write_status
from dflash_ds.runtime.plan import describe
from dflash_ds.run import Context, finish, load_data, preflight
from dflash_ds.model.loss import StepSettings
from dflash_ds.target.model import DTYPES, truncate_after
from dflash_ds.runtime.transport import Receiver, Sender
from dflash_ds.runtime.workers import StepStats, TargetWorker, greedy_sequences, tau_of_payloads, train_step


# Tests set this to kill every drafter rank right after the given step (a simulated crash).
CRASH_AFTER_STEP = int(os.environ.get("DFLASH_CRASH_AFTER_STEP", "0")) or None


def parse_args(argv: list[str]) -> argparse.Namespace:
    # The DeepSpeed launcher appends --local_rank=N; the rank comes from the environment instead.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    p = argparse.ArgumentParser(prog="dflash_ds.train", description="Train a DFlash drafter.")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without touching a GPU")
    p.add_argument("--world-size", type=int, default=None, help="world size assumed by --dry-run")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        world = args.world_size or int(os.environ.get("WORLD_SIZE", ranks_per_node(recipe)))
        ctx = preflight(recipe, world)
    except ValueError as exc:  # RecipeError, TargetError and the model/config checks: the user's to fix
        print(f"[dflash] error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        finish(ctx)
        print(describe(recipe, ctx.plan, ctx.memory))
        for note in ctx.notes:
            print("note:", note)
        return 0
    from dflash_ds.runtime.engines import init_distributed, make_groups

    from dflash_ds.run import check_world
    from dflash_ds.runtime.control import RunControl, run_guarded

    rank, _ = init_distributed(ctx.device)
    ctx.rank = rank
    # The run lock and the start point are settled before any data or model is loaded.
    ctx.control = RunControl.setup(recipe, check_world(recipe, world), rank)
    if ctx.control.error:
        return 2
    # Rank 0 prepares (or validates the cache of) the data; the others then read the cache.
    if rank == 0:
        ctx.data = load_data(ctx)
    dist.barrier()
    if rank != 0:
        ctx.data = load_data(ctx)
    finish(ctx)
    ctx.groups = make_groups(ctx.plan.layout)
    ctx.control.bound(ctx.groups.drafter, ctx.groups.target)
    run_dir = Path(recipe.run.output_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(dump_yaml(recipe))
        (run_dir / "plan.txt").write_text(describe(recipe, ctx.plan, ctx.memory) + "\n")
    role = ctx.plan.layout.role(rank)
    # No barrier on failure: the launcher tears every rank down when one exits non-zero, while a
    # barrier would leave the failed rank waiting for peers that wait for it.
    code = run_guarded(lambda: run_target(ctx) if role == "target" else run_drafter(ctx), ctx.control)
    dist.barrier()
    ctx.control.release()
    dist.destroy_process_group()
    return code


# ----------------------------------------------------------------------------- target side


def load_target_worker(ctx: Context):
    """The target model under its DeepSpeed engine (layers after the last tap still present)."""
    from dflash_ds.runtime.engines import load_target_engine

    return load_target_engine(ctx.recipe, ctx.plan, ctx.groups.target, ctx.device)


def eval_sequences(ctx: Context, model, write: bool = True) -> list[dict]:
    """The target's greedy continuations of the held-out prompts (cached in the run directory)."""
    r = ctx.recipe
    cache = Path(r.run.output_dir) / "eval_sequences.json"
    return greedy_sequences(model, ctx.data.eval_prompts, r.eval.max_new_tokens, ctx.device, cache, write)


def wants_eval(ctx: Context) -> bool:
    e = ctx.recipe.eval
    return bool(ctx.data.eval_prompts) and (e.at_start or e.at_end or e.every_steps > 0)


def run_target(ctx: Context) -> None:
    r, plan, rank = ctx.recipe, ctx.plan, ctx.rank
    model, kind = load_target_worker(ctx)
    lay = plan.layout
    sender = Sender(ctx.spec, ctx.device, r.topology.max_in_flight)
    is_eval_rank = wants_eval(ctx) and rank == lay.eval_target()
    # Under ZeRO-3 every forward gathers weights from all target ranks, so they all generate the
    # (identical, greedy) evaluation continuations in lock-step; only one rank sends them.
    seqs = eval_sequences(ctx, model, write=is_eval_rank) if is_eval_rank or (wants_eval(ctx) and kind == "zero3") else None
    truncate_after(model, max(ctx.drafter_cfg.target_layer_ids))
    worker = TargetWorker(model, ctx.drafter_cfg.target_layer_ids, ctx.data.rows, plan, ctx.spec, r.run.seed, ctx.device)
    if is_eval_rank:
        for buf in worker.eval_payloads(seqs, sender.buffer):
            sender.send(buf, dst=lay.drafter_ranks[0])
    elif seqs is not None:
        for _ in worker.eval_payloads(seqs, lambda: ctx.spec.empty(ctx.device)):
            pass  # the same forwards, keeping ZeRO-3 ranks in step
    start = resume_step(ctx)
    t0 = time.perf_counter()
    for step in range(start, plan.total_steps):
        for _, dst, m in lay.target_work(rank, step, plan.grad_accum):
            sender.send(worker.fill(sender.buffer(), m), dst=dst)
        if (step + 1) % r.log.every_steps == 0:
            now = time.perf_counter()
            write_status(r.run.output_dir, rank, {"rank": rank, "step": step + 1, "tok_per_s": worker.tokens / (now - t0),
                                                  "send_wait_share": sender.wait_seconds / (now - t0),
                                                  "in_flight": sender.in_flight})
    sender.flush()


def resume_step(ctx: Context) -> int:
    # Decided on the lead and shared through the process group (no shared filesystem assumed).
    return ctx.control.start_step


# ----------------------------------------------------------------------------- drafter side


class LocalSource:
    """Colocated mode: payloads produced in this process by the target, in schedule order."""

    def __init__(self, worker: TargetWorker, ctx: Context, start: int):
        self.worker = worker
        self.items = ((s, g) for s in range(start, ctx.plan.total_steps) for g in range(ctx.plan.grad_accum))
        self.ctx = ctx
        # A step holds all grad_accum payloads at once (the loss is normalised over the whole step).
        self.free = [ctx.spec.empty(ctx.device) for _ in range(ctx.plan.grad_accum)]
        self.wait_seconds = 0.0

    def get(self) -> torch.Tensor:
        s, g = next(self.items)
        m = self.ctx.plan.layout.micro_index(s, g, self.ctx.plan.grad_accum, self.ctx.rank)
        t0 = time.perf_counter()
        buf = self.worker.fill(self.free.pop(), m)
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def release(self, buf) -> None:
        self.free.append(buf)

    def close(self) -> None:
        pass


def build_drafter(ctx: Context):
    from dflash_ds.model.drafter import DFlashDrafter
    from dflash_ds.export import load_drafter

    r = ctx.recipe
    if r.drafter.init_from:
        return load_drafter(r.drafter.init_from, dtype=torch.float32, device=ctx.device)
    torch.manual_seed(r.run.seed)
    return DFlashDrafter(ctx.drafter_cfg).to(ctx.device)


def run_drafter(ctx: Context) -> None:
    from dflash_ds.runtime.engines import build_drafter_engine
    from dflash_ds.target.model import embed_and_head

    r, plan, rank = ctx.recipe, ctx.plan, ctx.rank
    lay = plan.layout
    lead = rank == lay.drafter_ranks[0]
    # CPU runs train in float32 whatever the target dtype (bf16 matmuls on CPU are slow and inexact).
    dtype = DTYPES[r.target.dtype] if ctx.device.type == "cuda" else torch.float32
    embed, head = embed_and_head(r.target.path, dtype, ctx.device)
    drafter = build_drafter(ctx)
    engine, _ = build_drafter_engine(r, drafter, plan, ctx.groups.drafter, rank, ctx.device)
    start = checkpoint.load(engine, r.run.output_dir, ctx.groups.drafter, ctx.control.start, r.checkpoint.universal, lead)
    eval_set: list[torch.Tensor] = []
    if lay.colocated:
        model, kind = load_target_worker(ctx)
        # Under ZeRO-3 every rank joins each forward, so all generate; only the lead keeps the result.
        generate = wants_eval(ctx) and (lead or kind == "zero3")
        seqs = eval_sequences(ctx, model, write=lead) if generate else None
        truncate_after(model, max(ctx.drafter_cfg.target_layer_ids))
        worker = TargetWorker(model, ctx.drafter_cfg.target_layer_ids, ctx.data.rows, plan, ctx.spec, r.run.seed, ctx.device)
        if generate:
            # Held on the host: 64 held-out rows of a 27B target are ~10 GB of hidden states.
            eval_set = [p.cpu() for p in worker.eval_payloads(seqs, lambda: ctx.spec.empty(ctx.device))]
            eval_set = eval_set if lead else []
        source = LocalSource(worker, ctx, start)
    else:
        if wants_eval(ctx) and lead:
            n = math.ceil(len(ctx.data.eval_prompts) / ctx.spec.rows)
            rx = Receiver(ctx.spec, ctx.device, 2, [lay.eval_target()] * n)
            for _ in range(n):  # held on the host: 64 rows of a 27B target are ~10 GB
                buf = rx.get()
                eval_set.append(buf.cpu())
                rx.release(buf)
        sources = (lay.source_of(s, g, plan.grad_accum, rank) for s in range(start, plan.total_steps)
                   for g in range(plan.grad_accum))
        source = Receiver(ctx.spec, ctx.device, plan.grad_accum + 1, sources)
    trainer = DrafterTrainer(ctx, engine, drafter, embed, head, source, lead)
    if lead and eval_set and r.eval.at_start and start == 0:
        trainer.log_tau(0, eval_set, "before training")
    trainer.loop(start, eval_set)
    source.close()


class DrafterTrainer:
    def __init__(self, ctx: Context, engine, drafter, embed, head, source, lead: bool):
        self.ctx, self.engine, self.drafter, self.embed, self.head = ctx, engine, drafter, embed, head
        self.source, self.lead = source, lead
        self.settings = StepSettings.from_recipe(ctx.recipe, ctx.device)
        self.dtype = DTYPES[ctx.recipe.target.dtype] if ctx.device.type == "cuda" else torch.float32
        self.metrics = Metrics(ctx.recipe.run.output_dir, to_dict(ctx.recipe), ctx.recipe.log.wandb, ctx.recipe.run.name,
                               enabled=lead, start_step=ctx.control.start_step)

    def train_step(self, step: int) -> StepStats:
        c = self.ctx
        return train_step(self.engine, self.drafter, self.embed, self.head, self.source, self.settings, c.plan,
                          c.rank, c.groups.drafter, c.spec, self.dtype, step)

    def loop(self, start: int, eval_set) -> None:
        r, plan = self.ctx.recipe, self.ctx.plan
        t0 = time.perf_counter()
        window_t, window_steps = t0, 0
        for step in range(start, plan.total_steps):
            stats = self.train_step(step)
            window_steps += 1
            done = step + 1
            if done % r.log.every_steps == 0 or done == plan.total_steps:
                self.log_step(done, stats, time.perf_counter() - window_t, window_steps, t0, start)
                window_t, window_steps = time.perf_counter(), 0
            if r.eval.every_steps and done % r.eval.every_steps == 0 and self.lead and done != plan.total_steps:
                self.log_tau(done, eval_set, "")
            saved = done % r.checkpoint.every_steps == 0 or done == plan.total_steps
            if saved:
                self.save(done)
            if done < plan.total_steps and self.ctx.control.should_stop():
                # Every drafter rank voted on the same step boundary, so they all save this step.
                if not saved:
                    self.save(done)
                self.metrics.close()
                raise Stopped(done, str(checkpoint.checkpoint_dir(r.run.output_dir) / checkpoint.tag_of(done)))
            if done == CRASH_AFTER_STEP:
                # Fault injection for the resume tests: die the way a preempted job does.
                os._exit(17)
        if self.lead and eval_set and r.eval.at_end:
            self.log_tau(plan.total_steps, eval_set, "after training")
        self.metrics.close()

    def log_step(self, step: int, stats: StepStats, seconds: float, steps: int, t0: float, start: int) -> None:
        # The only host synchronisation of the loop: at log steps.
        vec = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.ctx.device).reshape(())
                           for x in (stats.ce_sum, stats.accept, stats.anchors)])
        with waiting_on("the metrics all-reduce", self.ctx.plan.layout.drafter_ranks):
            dist.all_reduce(vec, group=self.ctx.groups.drafter)
        if not self.lead:
            return
        plan = self.ctx.plan
        ce, acc, anchors = vec.tolist()
        tokens = steps * plan.tokens_per_step
        elapsed = time.perf_counter() - t0
        rec = {"step": step, "loss": ce / float(stats.weight), "accept_proxy": acc / max(anchors, 1.0),
               "lr": self.engine.get_lr()[0], "tok_per_s": tokens / seconds,
               "drafter_tok_per_s": tokens / seconds / plan.layout.num_drafters,
               "drafter_wait_share": self.source.wait_seconds / max(elapsed, 1e-9),
               "eta_s": elapsed / max(step - start, 1) * (plan.total_steps - step)}
        status = read_status(self.ctx.recipe.run.output_dir)
        if status:
            rec["target_tok_per_s"] = sum(s["tok_per_s"] for s in status) / len(status)
            rec["target_send_wait_share"] = sum(s["send_wait_share"] for s in status) / len(status)
            rec["in_flight"] = sum(s["in_flight"] for s in status)
        self.metrics.log(rec)
        if self.ctx.recipe.log.progress:
            print_progress(rec, plan.total_steps)

    def log_tau(self, step: int, eval_set, label: str) -> None:
        s = self.settings
        report = tau_of_payloads(self.drafter, self.embed, self.head, eval_set, self.ctx.spec, self.dtype,
                                 s.block_size, s.mask_token_id)
        self.metrics.log({"step": step, "tau": report.tau_mean, "tau_pooled": report.tau_pooled,
                          "tau_histogram": report.histogram, "eval": label or "periodic"})
        print(f"[dflash] tau {label or f'at step {step}'}: {report.tau_mean:.3f} (pooled {report.tau_pooled:.3f}, "
              f"{len(report.cycles)} responses)", flush=True)

    def save(self, step: int) -> None:
        from dflash_ds.export import save_drafter

        r = self.ctx.recipe
        checkpoint.save(self.engine, r.run.output_dir, step, self.ctx.groups.drafter, self.lead, r.checkpoint.keep_last)
        if self.lead:
            try:
                out = save_drafter(self.drafter, Path(r.run.output_dir) / "export")
            except OSError as exc:  # the export is swapped in only when complete: the old one stays
                raise checkpoint.CheckpointError(
                    f"could not write the export {Path(r.run.output_dir) / 'export'}: {checkpoint.describe_error(exc)}; "
                    f"the previous export is untouched and checkpoint step {step} is complete") from None
            print(f"[dflash] step {step}: checkpoint written; drafter exported to {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
