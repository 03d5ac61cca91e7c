"""What each role does with a payload: the target fills it, the drafter trains or evaluates on it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash_ds.eval.tau import TauReport, tau_from_taps
from dflash_ds.model.objective import acceptance_proxy
from dflash_ds.model.loss import MicroBatch, drafter_loss, make_blocks
from dflash_ds.target.model import TapCapture, forward_taps
from dflash_ds.runtime.transport import PayloadSpec, read_meta, taps_view, write_meta
from dflash_ds.data.packing import position_ids_from_doc_ids
from dflash_ds.runtime.watchdog import waiting_on


class TargetWorker:
    """Holds the frozen target and the rows; fills payload buffers for micro-batch ids."""

    def __init__(self, model, layer_ids, rows: dict[str, np.ndarray], plan, spec: PayloadSpec, seed: int, device):
        self.model = model
        self.capture = TapCapture(model, layer_ids)
        self.rows = rows
        self.plan = plan
        self.spec = spec
        self.seed = seed
        self.device = device
        self.tokens = 0

    def fill(self, buf: torch.Tensor, micro_index: int) -> torch.Tensor:
        idx = self.plan.rows_of(micro_index, self.seed)
        ids = torch.from_numpy(self.rows["input_ids"][idx].astype(np.int64)).to(self.device, non_blocking=True)
        loss_mask = torch.from_numpy(self.rows["loss_mask"][idx].astype(np.int32)).to(self.device, non_blocking=True)
        doc_ids = torch.from_numpy(self.rows["doc_ids"][idx].astype(np.int32)).to(self.device, non_blocking=True)
        self.run(buf, ids, loss_mask, doc_ids)
        self.tokens += ids.numel()
        return buf

    def run(self, buf, ids, loss_mask, doc_ids) -> None:
        write_meta(buf, self.spec, ids, loss_mask, doc_ids)
        positions = position_ids_from_doc_ids(doc_ids)
        forward_taps(self.model, self.capture, ids, positions, taps_view(buf, self.spec))

    def eval_payloads(self, sequences: list[dict], new_buffer):
        """Yield the held-out (prompt + greedy continuation) sequences, R per payload, padded to S.

        A generator, so a caller that sends each payload frees its buffer before the next is filled.
        """
        r, s = self.spec.rows, self.spec.seq_len
        for i in range(0, len(sequences), r):
            ids = torch.zeros(r, s, dtype=torch.long)
            loss_mask = torch.zeros(r, s, dtype=torch.int32)
            doc_ids = torch.full((r, s), -1, dtype=torch.int32)
            for j, seq in enumerate(sequences[i:i + r]):
                toks = seq["ids"][:s]
                ids[j, :len(toks)] = torch.tensor(toks)
                loss_mask[j, seq["prompt_len"]:len(toks)] = 1
                doc_ids[j, :len(toks)] = 0
            buf = new_buffer()
            self.run(buf, ids.to(self.device), loss_mask.to(self.device), doc_ids.to(self.device))
            yield buf


def unpack(payload: torch.Tensor, spec: PayloadSpec, dtype: torch.dtype) -> MicroBatch:
    ids, loss_mask, doc_ids = read_meta(payload, spec)
    return MicroBatch(taps_view(payload, spec).to(dtype), ids, loss_mask, doc_ids)


def greedy_sequences(model, prompts: list[list[int]], max_new_tokens: int, device, cache: Path,
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
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(cache)
    return out


@torch.no_grad()
def tau_of_payloads(drafter, embed, head, payloads, spec: PayloadSpec, dtype, block_size: int,
                    mask_token_id: int) -> TauReport:
    """Exact offline tau of the held-out payloads (loss_mask marks each response)."""
    was_training = drafter.training
    drafter.eval()
    cycles = []
    # Held-out sequences have many lengths: compiled layers would recompile for each, so run eager.
    with torch.compiler.set_stance("force_eager"):
        device = next(drafter.parameters()).device
        for p in payloads:
            mb = unpack(p.to(device), spec, dtype)
            for j in range(mb.input_ids.shape[0]):
                real = int((mb.doc_ids[j] >= 0).sum())
                resp = torch.nonzero(mb.loss_mask[j]).flatten()
                if real == 0 or resp.numel() == 0:
                    continue
                first = int(resp[0])
                cycles.append(tau_from_taps(drafter, embed, head, mb.taps[j, :real], mb.input_ids[j, :real], first, real,
                                            block_size=block_size, mask_token_id=mask_token_id))
    drafter.train(was_training)
    return TauReport(block_size=block_size, cycles=cycles)


@dataclass
class StepStats:
    ce_sum: torch.Tensor
    weight: torch.Tensor
    accept: torch.Tensor
    anchors: torch.Tensor


def train_step(engine, drafter, embed, head, source, settings, plan, rank: int, group, spec: PayloadSpec, dtype,
               step: int) -> StepStats:
    """One optimizer step of a drafter rank over its grad_accum payloads. No host synchronisation."""
    lay = plan.layout
    payloads = [source.get() for _ in range(plan.grad_accum)]
    mbs = [unpack(p, spec, dtype) for p in payloads]
    blocks = [make_blocks(mb, settings, lay.micro_index(step, g, plan.grad_accum, rank)) for g, mb in enumerate(mbs)]
    # Normalise by the whole step's weight (all micro-batches, all drafter ranks): the engine
    # divides by grad_accum and averages over ranks, so scale the loss back up by both.
    weight = torch.stack([b.weights.sum() for b in blocks]).sum()
    with waiting_on("the loss-weight all-reduce", plan.layout.drafter_ranks):
        dist.all_reduce(weight, group=group)
    scale = plan.grad_accum * lay.num_drafters
    ce_sum, accept, anchors = 0.0, 0.0, 0.0
    for mb, bl in zip(mbs, blocks):
        out = drafter_loss(drafter, embed, head, mb, bl, weight / scale, settings)
        engine.backward(out.loss)
        engine.step()
        w = bl.weights.view(bl.weights.shape[0], -1, settings.block_size)
        run_sum, counted = acceptance_proxy(out.correct.view_as(w), w, reduce=False)
        accept, anchors, ce_sum = accept + run_sum, anchors + counted, ce_sum + out.ce_sum
    for p in payloads:
        source.release(p)
    return StepStats(ce_sum, weight, accept, anchors)
