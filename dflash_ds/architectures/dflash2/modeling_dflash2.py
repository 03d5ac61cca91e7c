"""DFlash2 drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`, written by dflash-ds
into every DFlash2 export beside `modeling_dflash.py`, whose backbone it extends (torch and transformers
only).

A DFlash2 export (`architectures: ["DFlash2DraftModel"]`) loads as `DFlash2DraftModel`: the DFlash
forward with every attention and MLP sublayer wrapped in a grouped dynamic convolution along each
block (Q must be a whole number of blocks), plus `propose(hidden, anchor_ids, lm_head)`, the
candidate selector's greedy walk that picks the drafted tokens from the drafting slots' states.
"""

from __future__ import annotations

import torch
from torch import nn

from .modeling_dflash import DFlashConfig, DFlashDraftModel


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        rank = int(cfg.dflash_value("selector_rank"))
        self.top_k = int(cfg.dflash_value("selector_top_k"))
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, rank))


class DFlash2Config(DFlashConfig):
    """The same fields; a class of its own so that transformers maps it to DFlash2DraftModel (a remote
    config class is registered with one model class)."""

    def __init__(self, block_size=16, num_target_layers=36, dflash_config=None, is_causal=None, **kwargs):
        super().__init__(block_size, num_target_layers, dflash_config, is_causal, **kwargs)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: the DFlash forward with block convolutions, plus the candidate selector."""

    config_class = DFlash2Config
    dflash2 = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Drafted tokens [b, L] from the final states [b, L, D] of a block's drafting slots (slots
        1 .. B-1) and its anchor token ids [b]: the unary logits' top-k per slot, rescored by
        unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[candidate]>,
        walked greedily from the anchor (prev = the token chosen at the slot before)."""
        sel = self.candidate_selector
        work = torch.promote_types(hidden.dtype, torch.float32)
        unary, candidates = torch.topk(self.compute_logits(hidden, lm_head), sel.top_k, dim=-1)
        projected = sel.hidden_projection(hidden).to(work)
        prev, path = anchor_ids.long(), []
        for slot in range(hidden.shape[1]):
            query = sel.predecessor_codebook[prev].to(work) * projected[:, slot]
            pair = (sel.successor_codebook[candidates[:, slot]].to(work) * query[:, None]).sum(-1)
            pick = (unary[:, slot].to(work) + pair).argmax(-1, keepdim=True)
            prev = candidates[:, slot].gather(1, pick).squeeze(1)
            path.append(prev)
        return torch.stack(path, dim=1)
