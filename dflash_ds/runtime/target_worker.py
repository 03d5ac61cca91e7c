"""The target rank's role: run the frozen target over scheduled rows and send the tapped states.

A `TargetWorker` owns the target model (under its DeepSpeed engine), the tap capture that writes
the tapped layers straight into payload buffers, this rank's view of the prepared rows, and the
sender. `run()` walks the schedule: for every micro-batch this rank produces, fill a payload
and send it to the drafter rank that consumes it. The single-process reference trainer, the
colocated mode and the bench use `fill()` alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from dflash_ds.data.prepare import PreparedData
from dflash_ds.io import write_json_atomic
from dflash_ds.metrics import target_counters, write_status
from dflash_ds.objective.blocks import position_ids_from_doc_ids
from dflash_ds.resolve.payload import taps_view, write_meta
from dflash_ds.resolve.run import RunSpec
from dflash_ds.runtime.profiling import StepProfiler
from dflash_ds.runtime.transport import Sender
from dflash_ds.target_model.model import TapCapture, forward_taps, truncate_after


def wants_eval(spec: RunSpec, data: PreparedData) -> bool:
    e = spec.recipe.eval
    return bool(data.eval_prompts) and (e.at_start or e.at_end or e.every_steps > 0)


def eval_bounds(prompt_lens: list[int], max_new_tokens: int, seq_len: int) -> list[int]:
    """The tokens each held-out sequence may take: its prompt plus eval.max_new_tokens, cut to the row.
    Both sides know them before any generation, so the drafter knows how many payloads come."""
    return [max(1, min(n + max_new_tokens, seq_len)) for n in prompt_lens]


def eval_rows(spec: RunSpec, prompt_lens: list[int]) -> list[list[int]]:
    """The held-out sequences each evaluation row holds: packed first-fit by their bounds, as
    training rows are, instead of one per row (a row is several conversations long)."""
    from dflash_ds.data.packing import first_fit_rows

    bounds = eval_bounds(prompt_lens, spec.recipe.eval.max_new_tokens, spec.payload.seq_len)
    return first_fit_rows(bounds, spec.payload.seq_len)


def eval_payload_count(spec: RunSpec, data: PreparedData) -> int:
    return math.ceil(len(eval_rows(spec, [len(p) for p in data.eval_prompts])) / spec.payload.rows)


class TargetWorker:
    """The frozen target and the rows; fills payloads by micro-batch id."""

    def __init__(self, spec: RunSpec, model, rows: dict[str, np.ndarray], rank: int = 0,
                 *, eval_sequences: list[dict] | None = None):
        self.spec, self.model, self.rows, self.rank = spec, model, rows, rank
        # Greedy continuations of the held-out prompts (prompt + response ids), made before truncation.
        self.eval_sequences = eval_sequences
        self.capture = TapCapture(model, spec.drafter.target_layer_ids, final_norm=spec.payload.final_norm)
        self.tokens = 0

    @classmethod
    def load(cls, spec: RunSpec, data: PreparedData, rank: int, group, *, eval_lead: bool,
             experts=None) -> "TargetWorker":
        """The target from target.path under its engine; the held-out continuations when this rank
        produces the evaluation payloads (`eval_lead`), or must join their forwards (ZeRO-3; the
        eval lead's expert group)."""
        from dflash_ds.runtime.engines import load_target_engine

        model, kind = load_target_engine(spec.recipe, spec.plan, group, spec.device, experts=experts)
        seqs = None
        # Under ZeRO-3 every forward gathers weights from all target ranks, and the ranks of one
        # expert-parallel target gather each other's tokens, so they all generate the (identical,
        # greedy) continuations in lock-step; only the lead keeps and writes them.
        lockstep = kind == "zero3" or (kind == "expert_parallel"
                                       and spec.layout.eval_target() in spec.layout.expert_group_of(rank))
        if wants_eval(spec, data) and (eval_lead or lockstep):
            cache = Path(spec.recipe.run.output_dir) / "eval_sequences.json"
            same = model.expert_comm.same_inputs() if kind == "expert_parallel" else contextlib.nullcontext()
            with same:  # every rank of the group generates from the same prompts
                seqs = greedy_sequences(model, data.eval_prompts, spec.recipe.eval.max_new_tokens, spec.device,
                                        cache=cache, write=eval_lead)
        if not spec.payload.final_norm:  # the KL term's final-norm tap needs every layer
            truncate_after(model, max(spec.drafter.target_layer_ids))  # after generating, which needs every layer
        return cls(spec, model, data.rows, rank, eval_sequences=seqs)

    def fill(self, buf: torch.Tensor, micro_index: int) -> torch.Tensor:
        idx = self.spec.plan.rows_of(micro_index, self.spec.recipe.run.seed)
        device = self.spec.device
        ids = torch.from_numpy(self.rows["input_ids"][idx].astype(np.int64)).to(device, non_blocking=True)
        loss_mask = torch.from_numpy(self.rows["loss_mask"][idx].astype(np.int32)).to(device, non_blocking=True)
        doc_ids = torch.from_numpy(self.rows["doc_ids"][idx].astype(np.int32)).to(device, non_blocking=True)
        self._forward(buf, ids, loss_mask, doc_ids)
        self.tokens += ids.numel()
        return buf

    def _forward(self, buf, ids, loss_mask, doc_ids) -> None:
        write_meta(buf, self.spec.payload, ids, loss_mask, doc_ids=doc_ids)
        positions = position_ids_from_doc_ids(doc_ids)
        forward_taps(self.model, self.capture, ids, positions, out=taps_view(buf, self.spec.payload), doc_ids=doc_ids)

    def probe_sequences(self, n: int) -> list[dict]:
        """The first `n` conversations of the training rows as evaluation sequences (eval.train_probe):
        each one's prompt and its first supervised answer, cut to eval.max_new_tokens as the held-out
        continuations are."""
        ids, mask, docs = self.rows["input_ids"], self.rows["loss_mask"], self.rows["doc_ids"]
        limit, out = self.spec.recipe.eval.max_new_tokens, []
        for j in range(ids.shape[0]):
            row_docs = np.asarray(docs[j])
            for d in np.unique(row_docs[row_docs >= 0]):
                where = np.flatnonzero(row_docs == d)
                a = int(where[0])
                sup = np.flatnonzero(np.asarray(mask[j, a:int(where[-1]) + 1]))
                if sup.size == 0 or sup[0] == 0:
                    continue
                first = int(sup[0])
                gaps = np.flatnonzero(np.diff(sup) > 1)  # the answer ends where the supervision does
                stop = int(sup[gaps[0]] if gaps.size else sup[-1]) + 1
                out.append({"prompt_len": first, "ids": ids[j, a:a + min(stop, first + limit)].astype(np.int64).tolist()})
                if len(out) == n:
                    return out
        return out

    def eval_payloads(self, new_buffer: Callable[[], torch.Tensor], sequences: list[dict] | None = None) -> Iterator[torch.Tensor]:
        """Yield the held-out (prompt + greedy continuation) sequences, or `sequences`, packed into R rows
        per payload (eval_rows; each sequence its own document, kept apart by the packed forward).

        A generator, so a caller that sends each payload frees its buffer before the next is filled.
        """
        sequences = (self.eval_sequences or []) if sequences is None else sequences
        r, s = self.spec.payload.rows, self.spec.payload.seq_len
        device = self.spec.device
        lens = [seq["prompt_len"] for seq in sequences]
        bounds = eval_bounds(lens, self.spec.recipe.eval.max_new_tokens, s)
        rows = eval_rows(self.spec, lens)
        for i in range(0, len(rows), r):
            ids = torch.zeros(r, s, dtype=torch.long)
            loss_mask = torch.zeros(r, s, dtype=torch.int32)
            doc_ids = torch.full((r, s), -1, dtype=torch.int32)
            for j, members in enumerate(rows[i:i + r]):
                at = 0
                for d, k in enumerate(members):
                    # Cut to its bound: a continuation cached with a larger eval.max_new_tokens still fits.
                    toks = sequences[k]["ids"][:bounds[k]]
                    ids[j, at:at + len(toks)] = torch.tensor(toks)
                    loss_mask[j, at + lens[k]:at + len(toks)] = 1
                    doc_ids[j, at:at + len(toks)] = d
                    at += len(toks)
            buf = new_buffer()
            self._forward(buf, ids.to(device), loss_mask.to(device), doc_ids.to(device))
            yield buf

    def run(self, start: int, group=None) -> None:
        """The target rank's loop: evaluation payloads first, then every scheduled micro-batch from
        `start` (the step the run control decided, guard.control), sent over `group` (None: the
        default group)."""
        spec, rank = self.spec, self.rank
        r, plan, lay = spec.recipe, spec.plan, spec.layout
        sender = Sender(spec.payload, spec.device, r.topology.max_in_flight)
        if self.eval_sequences is not None:
            if rank == lay.eval_target():
                for buf in self.eval_payloads(sender.buffer):
                    sender.send(buf, dst=lay.drafter_ranks[0], group=group)
            else:
                for _ in self.eval_payloads(lambda: spec.payload.empty(spec.device)):
                    pass  # the same forwards, keeping ZeRO-3 ranks in step
        t0, tokens0, wait0 = time.perf_counter(), self.tokens, sender.wait_seconds
        # Cumulative counters (the lead drafter differences them over its log window); this first
        # report replaces any left by an earlier run in the directory before the drafter reads one.
        write_status(r.run.output_dir, rank, target_counters(rank, start, t0, 0, send_wait_s=0.0, in_flight=0, now=t0))
        profiler = StepProfiler(r, rank, "target", spec.device)
        for step in range(start, plan.total_steps):
            profiler.before(step + 1)
            for _, dst, m in lay.target_work(rank, step, plan.grad_accum):
                sender.send(self.fill(sender.buffer(), m), dst=dst, group=group)
            profiler.after(step + 1, drain=sender.flush)  # no send started in the window outlives it
            if (step + 1) % r.log.every_steps == 0 or step + 1 == plan.total_steps:
                counters = target_counters(rank, step + 1, t0, self.tokens - tokens0,
                                           send_wait_s=sender.wait_seconds - wait0, in_flight=sender.in_flight)
                write_status(r.run.output_dir, rank, counters)
        sender.flush()


def greedy_sequences(model, prompts: list[list[int]], max_new_tokens: int, device, *, cache: Path,
                     write: bool = True) -> list[dict]:
    """The target's greedy continuations of the held-out prompts, cached in the run directory."""
    if cache.is_file():
        return json.loads(cache.read_text())
    from dflash_ds.eval.generate import greedy_continuation

    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        full = greedy_continuation(model, ids, max_new_tokens=max_new_tokens)
        out.append({"prompt_len": len(p), "ids": full.reshape(-1).tolist()})
    if not write:
        return out
    write_json_atomic(cache, out)
    return out


def run_target(spec: RunSpec, data: PreparedData, rank: int, groups, *, start: int) -> None:
    """A target rank from `start` (the run control's decision) to the end."""
    is_eval_rank = rank == spec.layout.eval_target()
    TargetWorker.load(spec, data, rank, groups.target, eval_lead=is_eval_rank,
                      experts=groups.experts).run(start, groups.payload)
