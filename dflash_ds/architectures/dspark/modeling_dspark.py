"""DSpark drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`, written by dflash-ds
into every DSpark export beside `modeling_dflash.py`, whose backbone it extends (torch and transformers
only).

A DSpark export (`architectures: ["Qwen3DSparkModel"]`) loads as `Qwen3DSparkModel`: the DFlash forward
on an anchor-first block (all B slots draft), plus the Markov head and the confidence head, and
`propose(hidden, anchor_ids, lm_head)`, the Markov chain's greedy walk with each slot's confidence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_dflash import DFlashConfig, DFlashDraftModel


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: the logit bias markov_w2 @ markov_w1[prev] of the token before the
    one a slot predicts."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: proj([h ; markov_w1[prev]]), a raw logit (sigmoid = the predicted
    probability that the slot is accepted, given the slots before it were)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkConfig(DFlashConfig):
    """The DFlash fields plus DSpark's (top level, where vLLM, SGLang and llama.cpp read them)."""

    DSPARK_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                       "confidence_head_with_markov": True, "sample_from_anchor": True}

    def __init__(self, block_size=7, num_target_layers=36, dflash_config=None, is_causal=None, **kwargs):
        for name, default in self.DSPARK_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        # The top-level copies of mask_token_id and target_layer_ids (for llama.cpp's converter) are
        # dflash_config's; they only stand in for it when it is absent.
        mask_token_id, target_layer_ids = kwargs.pop("mask_token_id", None), kwargs.pop("target_layer_ids", None)
        if dflash_config is None and mask_token_id is not None and target_layer_ids is not None:
            dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids}
        super().__init__(block_size, num_target_layers, dflash_config, is_causal, **kwargs)


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark: the DFlash forward on an anchor-first block (every slot drafts: slot k of the block
    [anchor, MASK x (B-1)] proposes the token after the anchor's k-th successor), plus the Markov head
    and the confidence head. `propose(hidden, anchor_ids, lm_head)` walks the chain greedily and
    returns the drafted tokens and each slot's confidence."""

    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.markov_head_type != "vanilla":
            raise ValueError(f"markov_head_type {config.markov_head_type!r}: only the vanilla Markov head is supported")
        rank = int(config.markov_rank)
        self.markov_head = MarkovHead(config.vocab_size, rank)
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(config.hidden_size + (rank if config.confidence_head_with_markov else 0))
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [b, B], confidence [b, B] or None) from the final states [b, B, D] of every slot of a
        block and its anchor token ids [b]: slot k's token is the argmax of its logits plus
        markov_w2 @ markov_w1[prev], prev the anchor for slot 0 and the token chosen at slot k - 1."""
        head, conf = self.markov_head, self.confidence_head
        base = self.compute_logits(hidden, lm_head)
        prev, path, probs = anchor_ids.long(), [], []
        for slot in range(hidden.shape[1]):
            embedding = head.markov_w1.weight[prev]
            if conf is not None:
                features = hidden[:, slot].float()
                if self.config.confidence_head_with_markov:
                    features = torch.cat([features, embedding.float()], dim=-1)
                probs.append(torch.sigmoid(F.linear(features, conf.proj.weight.float(), conf.proj.bias.float()))[:, 0])
            prev = (base[:, slot] + F.linear(embedding.float(), head.markov_w2.weight.float())).argmax(-1)
            path.append(prev)
        return torch.stack(path, dim=1), (torch.stack(probs, dim=1) if probs else None)
