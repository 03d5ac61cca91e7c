"""The drafter's work on one received micro-batch: anchors, blocks, mask, forward and loss.

Pure torch (no torch.distributed, no deepspeed), so the distributed runtime, the colocated mode,
the single-process reference and the bench all run exactly this code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from dflash_ds.model.attention import DFlashMask, LayerAttention, build_layer_masks
from dflash_ds.model.draft_model import DraftModel
from dflash_ds.model.shape import DrafterShape
from dflash_ds.model.variants.base import LossContext
from dflash_ds.model.objective import (KLTerm, LossOptions, block_inputs, block_targets, chunked_loss, default_gamma,
                                       sample_anchors, slot_rows)
from dflash_ds.data.packing import position_ids_from_doc_ids


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
    fused_loss: bool = True
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    arch_loss: Any = None  # the architecture's loss settings (DrafterVariant.loss_settings of the objective)

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
        gamma = objective.gamma if objective.gamma is not None else default_gamma(shape.block_size)
        return cls(shape=shape, num_anchors=objective.num_anchors, gamma=gamma, loss_chunks=objective.loss_chunks,
                   mask_kind="flex" if device.type == "cuda" else "dense", seed=seed,
                   fused_loss=objective.fused_loss, kl_weight=objective.kl_weight,
                   kl_temperature=objective.kl_temperature, arch_loss=shape.variant.loss_settings(objective))

    def step_term(self, step: int, total_steps: int) -> Any:
        """The architecture's loss settings at optimizer step `step` (0-based) of `total_steps`, for
        `drafter_loss` (DrafterVariant.step_term)."""
        return self.shape.variant.step_term(self.arch_loss, step, total_steps)


@dataclass
class MicroBatch:
    taps: torch.Tensor  # [R, S, T*D]
    input_ids: torch.Tensor  # [R, S] int64
    loss_mask: torch.Tensor  # [R, S] bool
    doc_ids: torch.Tensor  # [R, S] int32, -1 = padding
    final_hidden: torch.Tensor | None = None  # [R, S, D] target final-norm states (KL term on)


@dataclass
class Blocks:
    anchors: torch.Tensor  # [R, N]
    valid: torch.Tensor  # [R, N]
    block_ids: torch.Tensor  # [R, N*B]
    block_positions: torch.Tensor  # [R, N*B]
    ctx_positions: torch.Tensor  # [R, S]
    labels: torch.Tensor  # [R, N*B]
    weights: torch.Tensor  # [R, N*B] float32
    mask: tuple[DFlashMask, ...]  # one per drafter layer: dense boolean (CPU) or flex BlockMask (GPU)


def anchor_generator(seed: int, micro_index: int, device="cpu") -> torch.Generator:
    """Anchors depend only on (seed, micro-batch id, device type): identical in split, colocated and
    resumed runs. The generator lives on the data's device so sampling needs no host round trip."""
    digest = hashlib.blake2b(f"{seed}:{micro_index}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


@torch.no_grad()
def make_blocks(mb: MicroBatch, s: StepSettings, micro_index: int) -> Blocks:
    device = mb.input_ids.device
    anchors, valid = sample_anchors(mb.loss_mask, mb.doc_ids, s.num_anchors,
                                    anchor_generator(s.seed, micro_index, device))
    ctx_positions = position_ids_from_doc_ids(mb.doc_ids)
    block_ids, block_positions = block_inputs(mb.input_ids, ctx_positions, anchors, s.block_size, s.mask_token_id)
    labels, weights = block_targets(mb.input_ids, mb.loss_mask, mb.doc_ids, anchors, valid, s.block_size, s.gamma)
    mask = build_layer_masks(anchors, valid, mb.doc_ids, s.block_size, s.attentions, kind=s.mask_kind)
    r = anchors.shape[0]
    return Blocks(anchors, valid, block_ids, block_positions, ctx_positions,
                  labels.reshape(r, -1), weights.reshape(r, -1).float(), mask)


def drafter_loss(model: DraftModel, mb: MicroBatch, blocks: Blocks, normaliser, settings: StepSettings,
                 term: Any = None):
    """sum(w * (CE [+ KL])) / normaliser for one micro-batch (the caller supplies the whole step's weight),
    plus the architecture's terms: its chunk term inside the fused loss and its extra loss after it
    (`term`: StepSettings.step_term of this step; None = the architecture's full weights, no warm-up).
    Their detached sums are in the output's `extra` field, in the variant's `log_sums` order."""
    variant = model.config.variant
    if term is None:
        term = variant.step_term(settings.arch_loss)
    ctx = model.drafter.fuse(mb.taps)
    block_embeds = model.embed_tokens(blocks.block_ids, ctx)
    hidden = model.drafter(block_embeds, ctx, blocks.block_positions, blocks.ctx_positions, blocks.mask)
    kl = None
    if settings.kl_weight > 0 or variant.needs_target_logits:
        if mb.final_hidden is None:
            raise ValueError("the loss needs the target's final-norm states (KL term or the architecture's term) "
                             "but the payload carries none")
        kl = KLTerm(settings.kl_weight, settings.kl_temperature,
                    slot_target_states(mb.final_hidden, blocks.anchors, settings.block_size).to(hidden.dtype))
    options = LossOptions(settings.loss_chunks, settings.block_size, checkpoint=True, fused=settings.fused_loss,
                          top_k=variant.candidates(model.config), logits=settings.shape.logit_transform,
                          term=variant.chunk_term(model, blocks, term))
    out = chunked_loss(hidden, model.lm_head, blocks.labels, blocks.weights, normaliser, options, kl)
    extra = variant.extra_loss(LossContext(model, hidden, blocks, out, normaliser, term))
    if extra is None:
        return out
    return out._replace(loss=out.loss + extra.loss, extra=out.extra + extra.sums)


def slot_target_states(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, S, D] -> [R, N*B, D]: for slot k of the block at anchor a, the target's state at a+k-1,
    whose next-token distribution is the one for the token at a+k (the slot's label). Positions
    past the row are clamped; their slots have weight 0."""
    s = final_hidden.shape[1]
    pos = (anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1).clamp(0, s - 1)
    pos = pos.reshape(anchors.shape[0], -1)
    return torch.gather(final_hidden, 1, pos[..., None].expand(-1, -1, final_hidden.shape[-1]))
