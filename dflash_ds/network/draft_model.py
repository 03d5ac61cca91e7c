"""The drafter together with the two target matrices it reads: what the loss, tau and the
speculative loop take.

A DFlash drafter has no embedding and no lm_head of its own: block tokens are embedded with the
target's frozen `embed_tokens` and its states are read out through the target's frozen `lm_head`
(docs/algorithm.md section 1). Block size and mask id come from the drafter's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape


@dataclass(frozen=True)
class DraftModel:
    drafter: DFlashDrafter
    embed: torch.Tensor  # [V, D] the target's input embedding, frozen
    lm_head: torch.Tensor  # [V, D] the target's output projection, frozen (never exported)
    # The training loss's lm_head matmul strategy, an object only the objective calls
    # (objective/head_matmuls.py): the trainer hands a DenseHead of its own (torch.mm; it keeps the folded
    # weight of a logit bias between steps) or a GemmHead of quantization/fp8_head.Fp8Head (FP8); None:
    # the loss makes a DenseHead per call. Drafting and evaluation always read `lm_head`.
    loss_head: Any = None

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
    def num_drafts(self) -> int:
        """Tokens one block drafts (B - 1; B when the architecture is anchor-first)."""
        return self.drafter.config.num_drafts

    @property
    def max_emitted(self) -> int:
        """The most tokens one speculative cycle emits: every draft accepted plus the target's own."""
        return self.num_drafts + 1

    @property
    def layer_ids(self) -> list[int]:
        """The target layers whose outputs the drafter reads (the taps it was trained on)."""
        return list(self.drafter.config.target_layer_ids)

    def embed_tokens(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Target embeddings of `ids`, scaled as the target scales them (`input_embedding_scale`,
        network/logit_transform.py), on `like`'s device and in its dtype."""
        out = F.embedding(ids.to(self.embed.device), self.embed)
        scale = self.drafter.config.input_embedding_scale
        if scale != 1.0:
            out = out * scale
        return out.to(device=like.device, dtype=like.dtype)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, anchors: torch.Tensor, *, context: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens the engines propose at temperature 0 from the final states `[n, num_drafts, D]`
        of the drafting slots of n blocks whose anchors (slot 0 tokens) are `anchors` [n]: the
        architecture's walk (`Walk.propose`: each slot's argmax for v1, the selector's greedy path for
        DFlash2, the Markov chain for DSpark). `context` [n, D]: each anchor's context row, the fused state
        before it (drafter.fuse), for a walk that reads it (LiLiCorr's)."""
        return self.propose(hidden, anchors, context=context).tokens

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None):
        """`draft`'s tokens and how many of each block's llama.cpp verifies under `--spec-draft-p-min
        p_min` (a network.arch_types.Proposal; `Walk.propose`: DSpark's confidence head cuts it)."""
        return self.config.variant.walk.propose(self, hidden, anchors, p_min, context=context)

    def text_probabilities(self, hidden: torch.Tensor, following: torch.Tensor, temperature: float, *,
                           context: torch.Tensor | None = None) -> torch.Tensor | None:
        """q of the text's tokens `following` [n, L] under the architecture's sampled draft, or None when
        it drafts greedily at every temperature (`Walk.text_probabilities`)."""
        return self.config.variant.walk.text_probabilities(self, hidden, following, temperature, context=context)

    def sampled_draft(self, hidden: torch.Tensor, temperature: float, generator: torch.Generator, *,
                      context: torch.Tensor | None = None):
        """The draft the engines draw at `temperature` (a network.arch_types.SampledDraft), or None when they
        verify the greedy one (`Walk.sampled_draft`; nothing is drawn then)."""
        return self.config.variant.walk.sampled_draft(self, hidden, temperature, generator, context=context)

    def drafting_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, B, D]` block states -> `[n, num_drafts, D]`, those of the slots that draft: what the walk
        reads (all B slots for a walk that reads the anchor slot too, `Spec.walk_reads_anchor_slot`)."""
        return hidden[:, 0 if self.config.spec.walk_reads_anchor_slot else self.config.first_draft_slot:]
