"""References the tests compare against: a single-process trainer and the dense float64 loss.

`reference_losses` computes, in one process and in schedule order, exactly what the split runtime
computes across ranks: the same micro-batches (rows of the same micro-batch ids), the same anchors,
one loss normalised over the whole step, plain torch AdamW with the same schedule and clipping. The
launcher tests compare the distributed runs' losses against it; it is also the simplest reading of
the method. `dense_loss` is objective/loss.py's loss the plain way: every logit at once in float64,
gradients by autograd.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.logit_transform import IDENTITY
from dflash_ds.objective.blocks import make_blocks
from dflash_ds.objective.drafter_loss import drafter_loss
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, OutputTerm, TargetRows
from dflash_ds.resolve.payload import unpack
from dflash_ds.resolve.plan import lr_factor
from dflash_ds.resolve.run import RunSpec
from dflash_ds.runtime.target_worker import TargetWorker


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
        for mb, bl in zip(mbs, blocks):
            out = drafter_loss(model, mb, bl, weight, settings=settings, step=step, total_steps=plan.total_steps)
            out.loss.backward()
            total += float(out.sums["ce"])
        norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), o.grad_clip)
        if grad_norms is not None:
            grad_norms.append(float(norm))
        opt.step()
        sched.step()
        losses.append(total / float(weight))
    worker.capture.remove()
    return losses


def recipe_reference_losses(recipe_path: str, overrides: list[str], out_dir, steps: int) -> list[float]:
    """`reference_losses` of a recipe as the launcher tests run it split over 2 ranks (float32, CPU):
    its data, run spec, target and a drafter built as a drafter rank builds it."""
    from dflash_ds.config import load_recipe
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.resolve.run import resolve_run
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model.model import embed_and_head, load_target

    recipe = load_recipe(recipe_path, [*overrides, f"run.output_dir={out_dir}"])
    data = load_training_data(recipe)
    spec = resolve_run(recipe, world_size=2).with_rows(data.num_rows)
    target = load_target(recipe.target.path, dtype="float32")
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    return reference_losses(spec, target, DraftModel(build_drafter(spec), embed, head), data.rows, steps=steps)


class Candidates(OutputTerm):
    """An output term that only asks the loss for each row's top-k candidates (and adds nothing)."""

    name, weight = "candidates", 0.0

    def __init__(self, k: int):
        self.top_k = k

    def contribute(self, out, normaliser):
        return 0.0, {}


def chunked(hidden, weight, labels, weights, normaliser, chunks, *, kl=None, terms=(), top_k=0, transform=IDENTITY,
            target=None, bias=None, head=None):
    """objective/loss.py's loss of rows with the CE (weight 1), the KL term when `kl` = (weight, T) is given,
    then `terms`; `target`: the target's states [n, D] (or an objective.loss_terms.TargetRows)."""
    all_terms = [CrossEntropy(), *([Distillation(*kl)] if kl is not None else []), *terms,
                 *([Candidates(top_k)] if top_k else [])]
    if target is not None and not isinstance(target, TargetRows):
        target = TargetRows(target)
    return ChunkedLoss(all_terms, weight, chunks=chunks, transform=transform, head=head).rows(
        hidden, labels, weights, normaliser, bias=bias, target=target)


def dense_loss(hidden, weight, labels, weights, normaliser, kl=None, transform=IDENTITY):
    """(loss, sum(w * CE), sum(w * KL), correct) of rows `hidden [n, D]` through `weight [V, D]`, in
    float64, every logit materialised: loss = (sum(w * CE) + kl_weight * T^2 * sum(w * KL(p_T || q_T)))
    / normaliser, both distributions through the target's logit `transform` (`kl`: (kl_weight, T, the
    target's states), constant). Unsupervised rows (weight 0) add nothing, whatever their label."""
    z = transform.apply(hidden.double() @ weight.double().T)
    w = weights.double()
    sup = w > 0
    ce_sum = (w * F.cross_entropy(z, torch.where(sup, labels, 0), reduction="none")).sum()
    kl_sum = torch.zeros((), dtype=torch.float64)
    total = ce_sum
    if kl is not None and kl[0] > 0:
        kl_weight, t, states = kl
        target = transform.apply(states.double() @ weight.double().T).detach()
        log_q, log_p = F.log_softmax(z / t, -1), F.log_softmax(target / t, -1)
        kl_sum = (w * (log_p.exp() * (log_p - log_q)).sum(-1)).sum()
        total = total + kl_weight * t * t * kl_sum
    return total / normaliser, ce_sum, kl_sum, (z.argmax(-1) == labels) & sup
