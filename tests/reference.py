"""A single-process reference trainer: no DeepSpeed, no process groups, no transport.

It computes, in one process and in schedule order, exactly what the split runtime computes across
ranks: the same micro-batches (rows of the same micro-batch ids), the same anchors, one loss
normalised over the whole step, plain torch AdamW with the same schedule and clipping. Tests
compare the distributed runs' losses against it; it is also the simplest reading of the method.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_ds.model.draft_model import DraftModel
from dflash_ds.model.loss import drafter_loss, make_blocks
from dflash_ds.resolve.run import RunSpec
from dflash_ds.resolve.plan import lr_factor
from dflash_ds.runtime.target_worker import TargetWorker
from dflash_ds.resolve.payload import unpack


def reference_losses(spec: RunSpec, target, model: DraftModel, rows: dict[str, np.ndarray], steps: int,
                     grad_norms: list[float] | None = None) -> list[float]:
    """Per-step losses sum(w * CE) / sum(w) over every micro-batch of every drafter rank (on CPU); each
    step's gradient norm before clipping is appended to `grad_norms` when given."""
    assert spec.device.type == "cpu" and spec.dtype == torch.float32, "the reference runs in float32 on the CPU"
    o, plan, drafter = spec.recipe.optim, spec.plan, model.drafter
    settings = spec.settings
    # The same row selection and tap capture as a target rank, minus the sending.
    worker = TargetWorker(spec, target, rows)
    opt = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, plan, o.min_lr_ratio))
    lay = plan.layout
    losses = []
    for step in range(steps):
        ids = [lay.micro_index(step, g, plan.grad_accum, d) for d in lay.drafter_ranks for g in range(plan.grad_accum)]
        mbs = [unpack(worker.fill(spec.payload.empty("cpu"), m), spec.payload, spec.dtype) for m in ids]
        blocks = [make_blocks(mb, settings, m) for mb, m in zip(mbs, ids)]
        weight = torch.stack([b.weights.sum() for b in blocks]).sum()
        opt.zero_grad()
        total = 0.0
        term = settings.step_term(step, plan.total_steps)
        for mb, bl in zip(mbs, blocks):
            out = drafter_loss(model, mb, bl, weight, settings, term)
            out.loss.backward()
            total += float(out.ce_sum)
        norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), o.grad_clip)
        if grad_norms is not None:
            grad_norms.append(float(norm))
        opt.step()
        sched.step()
        losses.append(total / float(weight))
    worker.capture.remove()
    return losses
