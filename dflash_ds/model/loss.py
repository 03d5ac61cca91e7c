"""The drafter's work on one received micro-batch: anchors, blocks, mask, forward and loss.

Pure torch (no torch.distributed, no deepspeed), so the distributed runtime, the colocated mode,
the single-process reference and the bench all run exactly this code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dflash_ds.model.attention import DFlashMask, LayerAttention, build_layer_masks
from dflash_ds.model.dflash2 import SelectorRows, SelectorTerm, selector_alpha, selector_loss
from dflash_ds.model.draft_model import DraftModel
from dflash_ds.model.shape import DrafterShape
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
    selector: SelectorSchedule | None = None  # DFlash2 drafters only
    anchor_prompt_end: bool = False  # objective.anchor_last_prompt_token

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
                   kl_temperature=objective.kl_temperature,
                   selector=SelectorSchedule.of(objective) if shape.dflash2 else None,
                   anchor_prompt_end=objective.anchor_last_prompt_token)

    def selector_term(self, step: int, total_steps: int) -> SelectorTerm | None:
        """The selector loss at optimizer step `step` (0-based) of `total_steps`; None without a selector."""
        sel = self.selector
        if sel is None:
            return None
        alpha = selector_alpha(step, total_steps, sel.alpha, sel.warmup_ratio, sel.ramp_ratio)
        return SelectorTerm(alpha, sel.inject_gold, sel.detach)


@dataclass(frozen=True)
class SelectorSchedule:
    """objective.selector_* of a DFlash2 recipe."""

    alpha: float = 1.0
    inject_gold: bool = False
    detach: bool = False
    warmup_ratio: float = 0.0
    ramp_ratio: float = 0.0

    @classmethod
    def of(cls, objective) -> "SelectorSchedule":
        """objective.selector_* of the recipe's objective section (read by attribute name)."""
        o = objective
        return cls(o.selector_alpha, o.selector_inject_gold, o.selector_detach, o.selector_warmup_ratio,
                   o.selector_ramp_ratio)


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
                                    anchor_generator(s.seed, micro_index, device), s.anchor_prompt_end)
    ctx_positions = position_ids_from_doc_ids(mb.doc_ids)
    block_ids, block_positions = block_inputs(mb.input_ids, ctx_positions, anchors, s.block_size, s.mask_token_id)
    labels, weights = block_targets(mb.input_ids, mb.loss_mask, mb.doc_ids, anchors, valid, s.block_size, s.gamma)
    mask = build_layer_masks(anchors, valid, mb.doc_ids, s.block_size, s.attentions, kind=s.mask_kind)
    r = anchors.shape[0]
    return Blocks(anchors, valid, block_ids, block_positions, ctx_positions,
                  labels.reshape(r, -1), weights.reshape(r, -1).float(), mask)


def drafter_loss(model: DraftModel, mb: MicroBatch, blocks: Blocks, normaliser, settings: StepSettings,
                 selector: SelectorTerm | None = None):
    """sum(w * (CE [+ KL])) / normaliser for one micro-batch (the caller supplies the whole step's weight).

    A DFlash2 drafter adds selector.alpha * sum(w * selector CE) / normaliser (`selector`, from
    StepSettings.selector_term; None = the full selector_alpha, no warm-up); its detached sums are
    in the output's `selector` field. The selector's candidates are the base loss's top-k."""
    ctx = model.drafter.fuse(mb.taps)
    block_embeds = model.embed_tokens(blocks.block_ids, ctx)
    hidden = model.drafter(block_embeds, ctx, blocks.block_positions, blocks.ctx_positions, blocks.mask)
    kl = None
    if settings.kl_weight > 0:
        if mb.final_hidden is None:
            raise ValueError("objective.kl_weight > 0 but the payload carries no target final-norm states")
        kl = KLTerm(settings.kl_weight, settings.kl_temperature,
                    slot_target_states(mb.final_hidden, blocks.anchors, settings.block_size).to(hidden.dtype))
    head = model.drafter.candidate_selector
    options = LossOptions(settings.loss_chunks, settings.block_size, checkpoint=True, fused=settings.fused_loss,
                          top_k=head.top_k if head is not None else 0, logits=settings.shape.logit_transform)
    out = chunked_loss(hidden, model.lm_head, blocks.labels, blocks.weights, normaliser, options, kl)
    if head is None:
        return out
    if selector is None:
        sched = settings.selector or SelectorSchedule()
        selector = SelectorTerm(sched.alpha, sched.inject_gold, sched.detach)
    b = settings.block_size
    labels = blocks.labels.view(blocks.labels.shape[0], -1, b)
    # Teacher forcing: slot k's predecessor is the gold token at slot k - 1 (slot 0's label is the anchor).
    predecessors = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).flatten(1)
    rows = SelectorRows(slot_rows(hidden, b), out.candidates, slot_rows(blocks.labels, b), slot_rows(predecessors, b),
                        slot_rows(blocks.weights, b), out.candidate_logits)
    stats = selector_loss(head, model.lm_head, rows, selector, settings.shape.logit_transform)
    loss = out.loss + (selector.alpha / normaliser) * stats.loss_sum
    return out._replace(loss=loss, selector=(stats.loss_sum.detach(), stats.covered, stats.correct))


def slot_target_states(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, S, D] -> [R, N*B, D]: for slot k of the block at anchor a, the target's state at a+k-1,
    whose next-token distribution is the one for the token at a+k (the slot's label). Positions
    past the row are clamped; their slots have weight 0."""
    s = final_hidden.shape[1]
    pos = (anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1).clamp(0, s - 1)
    pos = pos.reshape(anchors.shape[0], -1)
    return torch.gather(final_hidden, 1, pos[..., None].expand(-1, -1, final_hidden.shape[-1]))
