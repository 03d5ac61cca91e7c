"""The drafter together with the two target matrices it reads: what the loss, tau and the
speculative loop take.

A DFlash drafter has no embedding and no lm_head of its own: block tokens are embedded with the
target's frozen `embed_tokens` and its states are read out through the target's frozen `lm_head`
(docs/algorithm.md section 1). Block size and mask id come from the drafter's config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ds.model.drafter import DFlashDrafter
from dflash_ds.model.shape import DrafterShape


@dataclass(frozen=True)
class DraftModel:
    drafter: DFlashDrafter
    embed: torch.Tensor  # [V, D] the target's input embedding, frozen
    lm_head: torch.Tensor  # [V, D] the target's output projection, frozen (never exported)

    @classmethod
    def from_target(cls, drafter: DFlashDrafter, target) -> "DraftModel":
        """Bundle `drafter` with a loaded transformers target's embedding and lm_head."""
        return cls(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)

    @property
    def config(self) -> DrafterShape:
        return self.drafter.config

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.drafter.config.mask_token_id

    @property
    def layer_ids(self) -> list[int]:
        """The target layers whose outputs the drafter reads (the taps it was trained on)."""
        return list(self.drafter.config.target_layer_ids)

    def embed_tokens(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Target embeddings of `ids`, on `like`'s device and in its dtype."""
        return F.embedding(ids.to(self.embed.device), self.embed).to(device=like.device, dtype=like.dtype)
