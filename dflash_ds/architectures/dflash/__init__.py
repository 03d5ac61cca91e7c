"""DFlash (v1): the backbone alone, the argmax of every slot (docs/algorithm.md sections 1-7), and the parts
every other architecture extends.

Every architecture shares the DFlash backbone (fused taps, KV injection, the block mask, the target's
embedding and lm_head) and is four parts (network/contract.py): its `Spec` (data: names, recipe
sections, label offset, logs, card, remote code), its `Modules` (what it adds to the backbone and their
tensors), its `Objective` (its part of every micro-batch's loss) and its `Walk` (how the engines draft
with it). DFlash's modules add nothing, its objective is the cross-entropy alone and its walk the argmax
of every slot: another architecture subclasses the parts it changes and registers its `Architecture`.
docs/architecture.md ("How to add a drafter architecture") is the contract.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_ds.network.arch_types import Card, Proposal, RemoteCode, SampledDraft, Serving, StepSizes, Wrappers
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.registry import register
from dflash_ds.network.shape import Tensor

if TYPE_CHECKING:  # for the annotations only
    from torch import nn

    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.objective.blocks import Blocks, MicroBatch

MODELING = Path(__file__).parent / "modeling_dflash.py"
"""transformers' remote code of the DFlash backbone (torch and transformers only), copied verbatim into
every published architecture's export (beside its own file for DFlash2, DSpark and LiLiCorr)."""


class DFlashModules:
    """The backbone alone: no wrapper, no head, no tensor of its own."""

    def wrappers(self, shape: DrafterShape) -> Wrappers | None:
        return None

    def heads(self, shape: DrafterShape) -> dict[str, nn.Module]:
        return {}

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        return {}

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        return 0

    def extra_activation_bytes(self, shape: DrafterShape, step: StepSizes) -> int:
        return 0

    def backbone_from(self, shape: DrafterShape, exported: DrafterShape) -> str | None:
        # By default no export of another architecture starts this one's backbone.
        return f"is a {exported.architecture} export and the drafter a {shape.architecture}"


class DFlashObjective:
    """The cross-entropy alone, weight 1 (the KL term, when the recipe sets one, is every architecture's)."""

    def terms(self, model: DraftModel, mb: MicroBatch, blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor,
              keys: Any, step: int | None = None, total_steps: int = 0) -> StepTerms:
        return StepTerms()


class DFlashWalk:
    """Each slot's argmax (the target's logit transform is monotonic, so it does not change the argmax),
    the greedy draft at every temperature."""

    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None) -> Proposal:
        # llama.cpp's --spec-draft-p-min cuts a draft at its first slot whose confidence is below p_min;
        # a DFlash slot's is the draft sampler's probability of its top candidate among the top 10
        # (DFlash2's: the selector's), which is not modelled: only p_min 0, no cut.
        tokens = argmax_tokens(hidden, model.lm_head)
        if p_min > 0:
            raise ValueError(f"llama.cpp's --spec-draft-p-min cut of a {model.config.spec.title} draft is not "
                             "modelled; predict its rounds with p_min 0")
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))

    def sampled_draft(self, model: DraftModel, hidden: torch.Tensor, temperature: float, generator: torch.Generator,
                      *, context: torch.Tensor | None = None) -> SampledDraft | None:
        return None

    def text_probabilities(self, model: DraftModel, hidden: torch.Tensor, following: torch.Tensor, temperature: float,
                           *, context: torch.Tensor | None = None) -> torch.Tensor | None:
        return None


def card(shape: DrafterShape) -> Card:
    """No rows of its own; SGLang counts the anchor, vLLM and llama.cpp the drafts."""
    b = shape.block_size
    return Card((), Serving("DFLASH", b, "dflash", b - 1, "draft-dflash", b - 1))


def argmax_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Greedy tokens of drafter states [..., D] through the target lm_head, in chunks of rows so
    the [rows, vocab] logits of a 248K vocabulary stay small."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head.to(device=flat.device, dtype=flat.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = (flat[i:i + chunk] @ w.T).argmax(-1)
    return out.view(hidden.shape[:-1])


SPEC = Spec(name="dflash", class_name="DFlashDraftModel", title="DFlash", card=card,
            remote_code=RemoteCode(MODELING, MODELING.name, {"AutoConfig": "modeling_dflash.DFlashConfig",
                                                              "AutoModel": "modeling_dflash.DFlashDraftModel"}))
DFLASH = register(Architecture(SPEC, DFlashModules(), DFlashObjective(), DFlashWalk()))
