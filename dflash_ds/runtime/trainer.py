"""The drafter rank's role: receive micro-batches, train the drafter, log, evaluate, checkpoint, export.

A `DrafterTrainer` owns the drafter's DeepSpeed engine, the draft model (drafter + the target's
frozen embedding and lm_head), the payload source (a `Receiver` from target ranks, or a
`LocalSource` in colocated mode), the run control, the metrics sink and the step settings. It is
built whole, in one place (`DrafterTrainer.load`, as `TargetWorker.load` is); nothing is set on it
afterwards. `train_step` is one optimizer step; `train` is the loop around it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_ds.data.prepare import PreparedData
from dflash_ds.eval.tau import TauReport, tau_from_taps
from dflash_ds.export.card import card_info
from dflash_ds.metrics import Metrics, TargetWindow, print_progress, read_status
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.objective.blocks import make_blocks
from dflash_ds.objective.drafter_loss import acceptance_proxy, drafter_loss
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.report import finish_run
from dflash_ds.resolve import contract
from dflash_ds.resolve.payload import PayloadLayout, unpack
from dflash_ds.resolve.plan import Cooldown, receive_depth
from dflash_ds.resolve.run import RunSpec
from dflash_ds.runtime import checkpoint
from dflash_ds.runtime.profiling import StepProfiler, SyncStallTimer
from dflash_ds.runtime.stopping import EarlyEnd
from dflash_ds.runtime.target_worker import TargetWorker, eval_payload_count, wants_eval
from dflash_ds.runtime.transport import Receiver
from dflash_ds.runtime.untrained import TrainingWatch
from dflash_ds.runtime.watchdog import waiting_on
from dflash_ds.safety import CheckpointError, Stopped, say


@dataclass
class StepStats:
    ce_sum: torch.Tensor
    weight: torch.Tensor
    accept: torch.Tensor
    anchors: torch.Tensor
    kl_sum: torch.Tensor | float = 0.0  # sum(w * KL) of the step (0 with the KL term off)
    extra: dict = field(default_factory=dict)  # the architecture's named logs: its sums of the step


class LocalSource:
    """Colocated mode: payloads produced in this process by the target, in schedule order."""

    def __init__(self, worker: TargetWorker, rank: int, start: int):
        spec = worker.spec
        self.worker, self.rank, self.plan = worker, rank, spec.plan
        self.items = ((s, g) for s in range(start, spec.plan.total_steps) for g in range(spec.plan.grad_accum))
        # A step holds all grad_accum payloads at once (the loss is normalised over the whole step).
        self.free = [spec.payload.empty(spec.device) for _ in range(spec.plan.grad_accum)]
        self.wait_seconds = 0.0

    def get(self) -> torch.Tensor:
        s, g = next(self.items)
        m = self.plan.layout.micro_index(s, g, self.plan.grad_accum, self.rank)
        t0 = time.perf_counter()
        buf = self.worker.fill(self.free.pop(), m)
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def release(self, buf) -> None:
        self.free.append(buf)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class DrafterParts:
    """What a drafter rank trains with, built by `DrafterTrainer.load` (or by the bench)."""

    engine: Any  # the drafter's DeepSpeed ZeRO-2 engine
    model: DraftModel
    source: Any  # Receiver (split) or LocalSource (colocated): get / release / close, wait_seconds
    group: Any  # the drafter process group (the step-wide weight and metrics all-reduces)
    # Idle time in device-wide synchronisations (.seconds, close()); the bench passes a stand-in.
    syncs: SyncStallTimer
    start: int = 0  # the first step (the run control's decision; the metrics continue from it)
    eval_set: list[torch.Tensor] = field(default_factory=list)  # held-out payloads (host memory), lead only
    probe_set: list[torch.Tensor] = field(default_factory=list)  # eval.train_probe's training-row payloads, lead only
    cooldown: Cooldown = field(default_factory=Cooldown)  # the schedule's early end (runtime/stopping.py)


@dataclass
class LogWindow:
    """The counters at the previous log step: rates are over each log window, not since the start."""

    wait_before: float = 0.0
    sync_before: float = 0.0
    targets: TargetWindow = field(default_factory=TargetWindow)

    def advance(self, wait: float, sync: float) -> tuple[float, float]:
        """The data-wait and sync-stall seconds since the previous log step, from their running totals
        (which it keeps for the next one)."""
        waited, synced = wait - self.wait_before, sync - self.sync_before
        self.wait_before, self.sync_before = wait, sync
        return waited, synced


class DrafterTrainer:
    def __init__(self, spec: RunSpec, rank: int, parts: DrafterParts, control):
        """`control`: guard.control.RunControl (stop votes); the bench passes bench.stand_ins.NullControl."""
        self.spec, self.rank, self.control = spec, rank, control
        self.engine, self.model, self.source, self.group = parts.engine, parts.model, parts.source, parts.group
        self.syncs, self.start, self.eval_set = parts.syncs, parts.start, parts.eval_set
        self.probe_set, self.cooldown = parts.probe_set, parts.cooldown
        self.lead = rank == spec.layout.drafter_ranks[0]
        self.settings = spec.settings
        # What runs the loss's terms; the bench swaps in another with the same interface to compare.
        self.loss_class = ChunkedLoss
        self._metrics: Metrics | None = None
        self.last_tau: TauReport | None = None  # the latest evaluation, for the export's model card
        self.window = LogWindow()
        self.profiler = StepProfiler(spec.recipe, rank, spec.layout.role(rank), spec.device)
        self.watch = TrainingWatch(spec, self.engine, start=self.start)  # a run that trains nothing stops

    @classmethod
    def load(cls, spec: RunSpec, data: PreparedData, rank: int, groups, *, control) -> "DrafterTrainer":
        """A drafter (or colocated) rank's trainer: the target's embedding and lm_head, the drafter
        (fresh or drafter.init_from) under its engine, resumed at the step `control` decided, the
        held-out payloads, and the payload source."""
        from dflash_ds.runtime.engines import build_drafter_engine, loss_head
        from dflash_ds.target_model.model import embed_and_head

        r, lay = spec.recipe, spec.layout
        lead = rank == lay.drafter_ranks[0]
        embed, head = embed_and_head(r.target.path, spec.dtype, spec.device)
        drafter = build_drafter(spec)
        cooldown = Cooldown()
        engine, _ = build_drafter_engine(r, drafter, spec.plan, groups.drafter, rank=rank, device=spec.device,
                                         cooldown=cooldown)
        start = checkpoint.load(engine, r.run.output_dir, groups.drafter, control.start,
                                universal=r.checkpoint.universal, is_lead=lead)
        if lead:  # the run's contract: recorded once the drafter is built and resumed, never from a failed start
            contract.record(r, control.start_step)
        source, eval_set, probe_set = (colocated_source if lay.colocated else received_source)(spec, data, rank, groups,
                                                                                               start=start)
        from deepspeed.accelerator import get_accelerator

        parts = DrafterParts(engine, DraftModel(drafter, embed, head, loss_head(r, head)), source, groups.drafter,
                             SyncStallTimer(get_accelerator(), spec.device), start, eval_set, probe_set, cooldown)
        return cls(spec, rank, parts, control)

    @property
    def metrics(self) -> Metrics:
        # Opened on first use: a trainer that only steps (the bench) writes nothing.
        if self._metrics is None:
            r = self.spec.recipe
            self._metrics = Metrics(r.run.output_dir, dataclasses.asdict(r), r.log.wandb, r.run.name, enabled=self.lead,
                                    start_step=self.start)
        return self._metrics

    def train_step(self, step: int) -> StepStats:
        """One optimizer step over this rank's grad_accum payloads. No host synchronisation."""
        spec, s = self.spec, self.settings
        plan, lay = spec.plan, spec.layout
        self.profiler.before(step + 1)
        payloads = [self.source.get() for _ in range(plan.grad_accum)]
        mbs = [unpack(p, spec.payload, spec.dtype) for p in payloads]
        blocks = [make_blocks(mb, s, lay.micro_index(step, g, plan.grad_accum, self.rank)) for g, mb in enumerate(mbs)]
        # Normalise by the whole step's weight (all micro-batches, all drafter ranks): the engine
        # divides by grad_accum and averages over ranks, so scale the loss back up by both.
        weight = torch.stack([b.weights.sum() for b in blocks]).sum()
        with waiting_on("the loss-weight all-reduce", lay.drafter_ranks):
            dist.all_reduce(weight, group=self.group)
        scale = plan.grad_accum * lay.num_drafters
        ce_sum, accept, anchors, kl_sum, extra = 0.0, 0.0, 0.0, 0.0, {}
        for mb, bl in zip(mbs, blocks):
            out = drafter_loss(self.model, mb, bl, weight / scale, settings=s, step=step, total_steps=plan.total_steps,
                               loss_class=self.loss_class)
            self.engine.backward(out.loss)
            self.engine.step()
            w = bl.weights.view(bl.weights.shape[0], -1, s.block_size)
            run_sum, counted = acceptance_proxy(out.correct.view_as(w), w, reduce=False, first=s.shape.first_draft_slot)
            accept, anchors, ce_sum = accept + run_sum, anchors + counted, ce_sum + out.sums["ce"]
            kl_sum = kl_sum + out.sums.get("kl", 0.0)
            extra = {n: extra.get(n, 0.0) + v for n, v in out.sums.items() if n not in ("ce", "kl")}
        # The profile window closes before the releases post the next receives: a transfer started
        # inside the window and finished after it would close its profiler record on a profiler that
        # is gone (a crash in the wait).
        self.profiler.after(step + 1)
        for p in payloads:
            self.source.release(p)
        return StepStats(ce_sum, weight, accept, anchors, kl_sum, extra)

    def train(self) -> None:
        r, plan, start, eval_set = self.spec.recipe, self.spec.plan, self.start, self.eval_set
        metrics = self.metrics  # opened before the first step: a wandb.init that fails costs no training
        early = EarlyEnd(r, plan.total_steps, self.cooldown, group=self.group, device=self.spec.device, lead=self.lead)
        early.resume(Path(r.run.output_dir) / "metrics.jsonl", start)
        if self.lead and eval_set and r.eval.at_start and start == 0:
            self.log_tau(0, eval_set, "before training")
        t0 = time.perf_counter()
        window_t, window_steps = t0, 0
        done = start
        while done < early.end_step:
            stats = self.train_step(done)
            window_steps += 1
            done += 1
            last = done == early.end_step
            logged = done % r.log.every_steps == 0 or last
            if logged:
                self.log_step(done, stats, time.perf_counter() - window_t, window_steps, t0=t0, start=start)
                window_t, window_steps = time.perf_counter(), 0
            evaluated = bool(r.eval.every_steps) and done % r.eval.every_steps == 0 and not last
            if evaluated and self.lead:
                report = self.log_tau(done, eval_set, "")
                if report.cycles:
                    early.evaluated(report.tau_mean)
            if (logged or evaluated) and not last:  # where the loop synchronises anyway
                last = self.end_early(early, done, time.perf_counter() - t0)
            saved = done % r.checkpoint.every_steps == 0 or last
            if saved:
                self.save(done, final=last)
            if not last and self.control.should_stop():
                self.stop(done, saved)
        end = early.end_step
        if self.lead and eval_set and r.eval.at_end:
            self.log_tau(end, eval_set, "after training")
        metrics.close()
        if self.lead:
            finish_run(r.run.output_dir, card_info(r, end, self.last_tau))

    def end_early(self, early: EarlyEnd, done: int, elapsed: float) -> bool:
        """Whether the plateau's or the time box's cooldown starts after step `done` (every drafter rank
        agrees: runtime/stopping.py); True when the run ends right here (no cooldown steps)."""
        record = early.decide(done, elapsed)
        if record is None:
            return False
        self.reschedule()
        self.metrics.log({**record, "lr": self.engine.get_lr()[0]})  # the next step's, the cooldown's first
        if self.lead:
            say(f"step {done}: {record['early_end']} (held-out tau best {early.plateau.best:.3f}); the learning rate "
                f"cools down over {record['cooldown_steps']} steps, the run ends at step {record['end_step']}")
        return done == early.end_step

    def reschedule(self) -> None:
        """The rate of the next step again, now that the cooldown bends the schedule: the scheduler set it
        after the last step, before the cooldown existed."""
        sched = self.engine.lr_scheduler
        lrs = [base * f(sched.last_epoch) for f, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs  # what get_last_lr reports (the engine's get_lr reads the groups)

    def log_step(self, step: int, stats: StepStats, seconds: float, steps: int, *, t0: float, start: int) -> None:
        # The only host synchronisation of the loop: at log steps.
        vec = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.spec.device).reshape(())
                           for x in (stats.ce_sum, stats.accept, stats.anchors, stats.kl_sum, *stats.extra.values())])
        with waiting_on("the metrics all-reduce", self.spec.layout.drafter_ranks):
            dist.all_reduce(vec, group=self.group)
        self.watch.check(step, float(vec[0]) / float(stats.weight))  # on every drafter rank alike, before an export
        if not self.lead:
            return
        plan = self.spec.plan
        ce, acc, anchors, kl, *extra = vec.tolist()
        tokens = steps * plan.tokens_per_step
        elapsed = time.perf_counter() - t0
        # Rates over each log window (the drafter's own and the targets'), not since the start.
        waited, synced = self.window.advance(self.source.wait_seconds, self.syncs.seconds)
        rec = {"step": step, "loss": ce / float(stats.weight), "accept_proxy": acc / max(anchors, 1.0),
               "lr": self.engine.get_lr()[0], "tok_per_s": tokens / seconds,
               "drafter_tok_per_s": tokens / seconds / plan.layout.num_drafters,
               "drafter_wait_share": waited / max(seconds, 1e-9),
               "eta_s": elapsed / max(step - start, 1) * (plan.total_steps - step)}
        if self.settings.kl_weight > 0:
            rec["kl"] = kl / float(stats.weight)  # sum(w * KL) / sum(w); "loss" stays the CE part
        logs = self.settings.shape.spec.logs
        rec.update(logs.record(dict(zip(stats.extra, extra)), float(stats.weight)))
        norm = self.engine.get_global_grad_norm()  # the last step's, before clipping (one value for all ranks)
        if norm is not None:
            rec["grad_norm"] = float(norm)
        rec["drafter_sync_share"] = synced / max(seconds, 1e-9)
        rec.update(self.window.targets.update(read_status(self.spec.recipe.run.output_dir)))
        self.metrics.log(rec)
        if self.spec.recipe.log.progress:
            print_progress(rec, plan.total_steps, logs.progress)

    def log_tau(self, step: int, eval_set: list[torch.Tensor], label: str) -> TauReport:
        report = tau_of_payloads(self.model, eval_set, self.spec.payload, self.spec.dtype)
        self.last_tau = report
        rec = {"step": step, **report.metrics_record(), "eval": label or "periodic"}
        line = (f"tau {label or f'at step {step}'}: {report.tau_mean:.3f} (pooled {report.tau_pooled:.3f}, "
                f"{len(report.cycles)} responses)")
        if self.probe_set:  # the same walk over training rows: the memorisation gap beside the held-out tau
            probe = tau_of_payloads(self.model, self.probe_set, self.spec.payload, self.spec.dtype)
            rec.update(train_tau=probe.tau_mean, train_tau_pooled=probe.tau_pooled, train_responses=len(probe.cycles))
            line += f"; training rows {probe.tau_mean:.3f} ({len(probe.cycles)})"
        self.metrics.log(rec)
        say(line)
        say(report.position_line())
        return report

    def save(self, step: int, *, final: bool = False) -> None:
        from dflash_ds.export import ExportWriteError, save_drafter

        r = self.spec.recipe
        t0 = time.perf_counter()
        if self.lead and final:
            say(f"step {step}: writing the final checkpoint and export")
        checkpoint.save(self.engine, r.run.output_dir, step, self.group, is_lead=self.lead,
                        keep_last=r.checkpoint.keep_last)
        if self.lead:
            t1 = time.perf_counter()
            try:
                out = save_drafter(self.model.drafter, Path(r.run.output_dir) / "export",
                                   card=card_info(r, step, self.last_tau), num_anchors=r.objective.num_anchors)
            except ExportWriteError as exc:  # the export is swapped in only when complete: the old one stays
                raise CheckpointError(
                    f"could not write the export {Path(r.run.output_dir) / 'export'}: "
                    f"{checkpoint.describe_error(exc.__cause__ or exc)}; "
                    f"the previous export is untouched and checkpoint step {step} is complete") from None
            # Timed: a 27B-width drafter's checkpoint (ZeRO-2 states) is ~24 GB and can take minutes.
            say(f"step {step}: checkpoint written ({t1 - t0:.0f} s); drafter exported to {out} "
                f"({time.perf_counter() - t1:.0f} s)")

    def stop(self, done: int, saved: bool) -> None:
        """Every drafter rank voted at the same step boundary, so all of them save this step."""
        if not saved:
            self.save(done)
        self.metrics.close()
        r = self.spec.recipe
        raise Stopped(done, str(checkpoint.checkpoint_dir(r.run.output_dir) / checkpoint.tag_of(done)))


@torch.no_grad()
def tau_of_payloads(model: DraftModel, payloads: list[torch.Tensor], layout: PayloadLayout, dtype: torch.dtype) -> TauReport:
    """Exact offline tau of the held-out payloads (loss_mask marks each response)."""
    drafter = model.drafter
    was_training = drafter.training
    drafter.eval()
    cycles = []
    # Held-out sequences have many lengths: compiled layers would recompile for each, so run eager.
    with torch.compiler.set_stance("force_eager"):
        device = next(drafter.parameters()).device
        for p in payloads:
            mb = unpack(p.to(device), layout, dtype)
            for j in range(mb.input_ids.shape[0]):
                # Each document of the row is one held-out sequence (target_worker.eval_rows).
                for d in range(int(mb.doc_ids[j].max()) + 1):
                    where = torch.nonzero(mb.doc_ids[j] == d).flatten()
                    a, b = int(where[0]), int(where[-1]) + 1
                    resp = torch.nonzero(mb.loss_mask[j, a:b]).flatten()
                    if resp.numel() == 0:
                        continue
                    cycles.append(tau_from_taps(model, mb.taps[j, a:b], mb.input_ids[j, a:b], int(resp[0]), end=b - a))
    drafter.train(was_training)
    return TauReport(block_size=model.max_emitted, cycles=cycles)


def build_drafter(spec: RunSpec):
    """A fresh drafter (seeded by run.seed) or the export named by drafter.init_from, in float32."""
    from dflash_ds.export import load_backbone, load_drafter, read_export_config
    from dflash_ds.network.drafter import DFlashDrafter

    r = spec.recipe
    if r.drafter.init_from:
        if read_export_config(r.drafter.init_from)["architectures"] == [spec.drafter.spec.class_name]:
            return load_drafter(r.drafter.init_from, dtype=torch.float32, device=spec.device, shape=spec.drafter)
        torch.manual_seed(r.run.seed)  # another architecture's backbone (run.check_init_from), the heads fresh
        return load_backbone(r.drafter.init_from, spec.drafter, dtype=torch.float32, device=spec.device)
    torch.manual_seed(r.run.seed)
    return DFlashDrafter(spec.drafter).to(spec.device)


def colocated_source(spec: RunSpec, data: PreparedData, rank: int, groups, *, start: int):
    """Colocated mode: the target in this process fills the payloads; it also makes the held-out ones."""
    lead = rank == spec.layout.drafter_ranks[0]
    worker = TargetWorker.load(spec, data, rank, groups.target, eval_lead=lead)
    eval_set: list[torch.Tensor] = []
    probe_set: list[torch.Tensor] = []
    empty = lambda: spec.payload.empty(spec.device)  # noqa: E731
    if worker.eval_sequences is not None:
        eval_set = [p.cpu() for p in worker.eval_payloads(empty)]
        if spec.recipe.eval.train_probe:  # the training rows' own text: nothing to generate
            probe_set = [p.cpu() for p in worker.eval_payloads(empty, worker.probe_sequences(spec.recipe.eval.train_probe))]
        eval_set, probe_set = (eval_set, probe_set) if lead else ([], [])  # ZeRO-3 ranks only joined the forwards
    return LocalSource(worker, rank, start), eval_set, probe_set


def received_source(spec: RunSpec, data: PreparedData, rank: int, groups, *, start: int):
    """Split mode: the held-out payloads first (lead only), then a Receiver in schedule order from `start`."""
    plan, lay = spec.plan, spec.layout
    # Evaluation payloads are held on the host: 64 held-out rows of a 27B target are ~10 GB.
    eval_set: list[torch.Tensor] = []
    if wants_eval(spec, data) and rank == lay.drafter_ranks[0]:
        n = eval_payload_count(spec, data)
        rx = Receiver(spec.payload, spec.device, 2, [lay.eval_target()] * n, group=groups.payload)
        for _ in range(n):
            buf = rx.get()
            eval_set.append(buf.cpu())
            rx.release(buf)
    sources = (lay.source_of(s, g, plan.grad_accum, rank) for s in range(start, plan.total_steps)
               for g in range(plan.grad_accum))
    return Receiver(spec.payload, spec.device, receive_depth(plan.grad_accum), sources, group=groups.payload), eval_set, []


def run_drafter(spec: RunSpec, data: PreparedData, rank: int, groups, *, control) -> None:
    """A drafter (or colocated) rank from start to end."""
    trainer = DrafterTrainer.load(spec, data, rank, groups, control=control)
    try:
        trainer.train()
    finally:
        trainer.syncs.close()  # the accelerator's own synchronize back, however the loop ended
    # Only after a complete run: every posted receive then has its payload (after a stop or a lost
    # peer some never will).
    trainer.source.close()
