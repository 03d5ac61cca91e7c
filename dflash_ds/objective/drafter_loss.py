"""The training objective of one micro-batch: the step settings, the drafter's loss (docs/algorithm.md
sections 4-5) and the acceptance proxy logged beside it.

Pure torch (no torch.distributed, no deepspeed), so the distributed runtime, the colocated mode,
the single-process reference and the bench all run exactly this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dflash_ds.config.architectures import section_of
from dflash_ds.network.attention import LayerAttention
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.shape import DrafterShape
from dflash_ds.objective.blocks import Blocks, MicroBatch, default_gamma, slot_target_index
from dflash_ds.objective.loss import ChunkedLoss, LossOutput
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, TargetRows


@dataclass(frozen=True)
class StepSettings:
    """What `make_blocks` and `drafter_loss` need besides the micro-batch: the drafter's shape (block
    size and mask id come from it, nowhere else) and the objective's knobs, which are not shape."""

    shape: DrafterShape
    num_anchors: int
    gamma: float
    loss_chunks: int
    mask_kind: str  # "dense" (CPU, SDPA) or "flex" (GPU, compiled flex_attention)
    seed: int
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    keys: Any = None  # the architecture's `objective.<name>:` section (Spec.objective_keys), None without one
    anchor_prompt_end: bool = False  # the last prompt token of each turn anchors a block too

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def mask_token_id(self) -> int:
        return self.shape.mask_token_id

    @property
    def attentions(self) -> tuple[LayerAttention, ...]:
        """Every drafter layer's attention; one mask is built per distinct one."""
        return self.shape.layer_attentions()

    @classmethod
    def of(cls, shape: DrafterShape, objective, seed: int, device: torch.device) -> "StepSettings":
        """The settings of a run: `objective` is the recipe's objective section (read by attribute name)."""
        # The default decay is the paper's for the block's drafting slots plus the anchor: default_gamma(B)
        # for DFlash's B - 1 drafts, DeepSpec's default_gamma(B + 1) for B drafts anchor-first.
        gamma = objective.gamma if objective.gamma is not None else default_gamma(shape.num_drafts + 1)
        spec = shape.spec
        keys = section_of(objective, spec.name, spec.objective_keys) if spec.objective_keys is not None else None
        if keys is not None:
            keys.check()  # a section read from attributes, not from a recipe, is checked here
        return cls(shape=shape, num_anchors=objective.num_anchors, gamma=gamma, loss_chunks=objective.loss_chunks,
                   mask_kind="flex" if device.type == "cuda" else "dense", seed=seed,
                   kl_weight=objective.kl_weight, kl_temperature=objective.kl_temperature, keys=keys,
                   anchor_prompt_end=objective.anchor_last_prompt_token)


def drafter_loss(model: DraftModel, mb: MicroBatch, blocks: Blocks, normaliser, *, settings: StepSettings,
                 step: int | None = None, total_steps: int = 0, loss_class: type = ChunkedLoss) -> LossOutput:
    """(ce_weight * sum(w * CE) [+ kl_weight * T^2 * sum(w * KL)] + the architecture's terms) / normaliser for
    one micro-batch (the caller supplies the whole step's weight), at optimizer step `step` (0-based) of
    `total_steps` (None = the architecture's full weights, after any warm-up). The output's `sums` holds
    every term's detached sum by name: "ce", "kl" (with the KL term) and the architecture's named logs.
    `loss_class`: what runs the terms (ChunkedLoss, or a class with its interface: the bench's autograd
    variant)."""
    ctx = model.drafter.fuse(mb.taps)
    block_embeds = model.embed_tokens(blocks.block_ids, ctx)
    hidden = model.drafter(block_embeds, ctx, blocks.block_positions, blocks.ctx_positions, mask=blocks.mask)
    own = model.config.variant.objective.terms(model, mb, blocks, hidden, ctx=ctx, keys=settings.keys, step=step,
                                               total_steps=total_steps)
    terms = [CrossEntropy(own.ce_weight)]
    if settings.kl_weight > 0:
        terms.append(Distillation(settings.kl_weight, settings.kl_temperature))
    terms += own.terms
    loss = loss_class(terms, model.lm_head, chunks=settings.loss_chunks, transform=settings.shape.logit_transform,
                       head=model.loss_head, first_slot=settings.shape.first_draft_slot)
    target = None
    if loss.reads_target:
        if mb.final_hidden is None:
            raise ValueError("the loss needs the target's final-norm states (KL term or the architecture's term) "
                             "but the payload carries none")
        # The states by position (a table and each slot's row of it): the loss multiplies each
        # chunk's distinct positions once, where overlapping blocks would repeat them.
        r, s_len, d = mb.final_hidden.shape
        index = slot_target_index(blocks.anchors, settings.block_size, s_len, model.config.spec.label_offset)
        target = TargetRows(mb.final_hidden.reshape(r * s_len, d).to(hidden.dtype), index)
    r, b = blocks.labels.shape[0], settings.block_size
    return loss.blocks(hidden, blocks.labels.view(r, -1, b), blocks.weights.view(r, -1, b), normaliser,
                       bias=own.bias, target=target)


def acceptance_proxy(correct: torch.Tensor, weights: torch.Tensor, reduce: bool = True, first: int = 1):
    """Mean over valid blocks of (leading run of correct supervised drafting slots `first`..B-1) + 1.

    The run stops at the first slot that is wrong or unsupervised. `correct` may be `[b, Q]` or
    `[b, N, B]`; `weights` is `[b, N, B]`. With `reduce=False` returns (sum, count) so callers can
    aggregate across micro-batches and ranks; the mean of no blocks is NaN.
    This is a cheap training signal, not the acceptance length tau (docs/algorithm.md section 7).
    """
    correct = correct.reshape(weights.shape)
    ok = (correct.bool() & (weights > 0))[..., first:]
    run = torch.cumprod(ok.to(torch.int32), dim=-1).sum(-1).float() + 1.0
    block_valid = (weights > 0).any(-1)
    total = (run * block_valid).sum()
    count = block_valid.sum().float()
    if not reduce:
        return total, count
    # torch.where, not a Python `if count > 0`: that would wait for the device.
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))
