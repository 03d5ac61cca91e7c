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

from dflash_ds.network.attention import LayerAttention
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.shape import DrafterShape
from dflash_ds.objective.blocks import Blocks, MicroBatch, slot_target_index
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
    arch_loss: Any = None  # the architecture's loss settings (DrafterVariant.loss_settings of the objective)
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
        gamma = objective.gamma if objective.gamma is not None else shape.variant.default_gamma(shape)
        return cls(shape=shape, num_anchors=objective.num_anchors, gamma=gamma, loss_chunks=objective.loss_chunks,
                   mask_kind="flex" if device.type == "cuda" else "dense", seed=seed,
                   kl_weight=objective.kl_weight,
                   kl_temperature=objective.kl_temperature, arch_loss=shape.variant.loss_settings(objective),
                   anchor_prompt_end=objective.anchor_last_prompt_token)

    def step_term(self, step: int, total_steps: int) -> Any:
        """The architecture's loss settings at optimizer step `step` (0-based) of `total_steps`, for
        `drafter_loss` (DrafterVariant.step_term)."""
        return self.shape.variant.step_term(self.arch_loss, step, total_steps)


def drafter_loss(model: DraftModel, mb: MicroBatch, blocks: Blocks, normaliser, *, settings: StepSettings,
                 term: Any = None, loss_class: type = ChunkedLoss) -> LossOutput:
    """(ce_weight * sum(w * CE) [+ kl_weight * T^2 * sum(w * KL)] + the architecture's terms) / normaliser for
    one micro-batch (the caller supplies the whole step's weight). `term`: StepSettings.step_term of this
    step (None = the architecture's full weights, no warm-up). The output's `sums` holds every term's
    detached sum by name: "ce", "kl" (with the KL term) and the architecture's `log_names`. `loss_class`:
    what runs the terms (ChunkedLoss, or a class with its interface: the bench's autograd variant)."""
    variant = model.config.variant
    if term is None:
        term = variant.step_term(settings.arch_loss)
    ctx = model.drafter.fuse(mb.taps)
    block_embeds = model.embed_tokens(blocks.block_ids, ctx)
    hidden = model.drafter(block_embeds, ctx, blocks.block_positions, blocks.ctx_positions, mask=blocks.mask)
    terms = [CrossEntropy(variant.ce_weight(term))]
    if settings.kl_weight > 0:
        terms.append(Distillation(settings.kl_weight, settings.kl_temperature))
    terms += variant.loss_terms(model, blocks, term, hidden, ctx=ctx, mb=mb)
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
        target = TargetRows(mb.final_hidden.reshape(r * s_len, d).to(hidden.dtype),
                            slot_target_index(blocks.anchors, settings.block_size, s_len, variant.label_offset))
    r, b = blocks.labels.shape[0], settings.block_size
    return loss.blocks(hidden, blocks.labels.view(r, -1, b), blocks.weights.view(r, -1, b), normaliser,
                       bias=variant.logit_bias(model, blocks, hidden), target=target)


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
