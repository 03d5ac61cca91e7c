"""XPress drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`, written by dflash-ds
into every XPress export beside `modeling_dflash.py`, whose backbone it extends (torch and transformers
only).

An XPress export (`architectures: ["Qwen3XPressModel"]`) loads as `Qwen3XPressModel`: the DFlash forward
on a block [anchor, MASK x (B-1)], plus the refiner `xpress_head`, and `propose(hidden, anchor_ids,
lm_head)`: the base draft refined by `xpress_num_passes` greedy Jacobi passes over each slot's top
`xpress_topc` base candidates (0: the whole vocabulary), as vLLM 0.34 drafts it. `hidden` is every slot's
final state [b, B, D], the anchor's included: the refiner reads the whole block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_dflash import DFlashConfig, DFlashDraftModel


class XPressMixer(nn.Module):
    """Raw per-channel causal mixing matrices L [r, B, B]; the refiner adds (L * tril) x to x."""

    def __init__(self, rank: int, block_size: int):
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block_size, block_size))


class XPressRefiner(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, block_size: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = XPressMixer(rank, block_size)
        self.mlp_gate = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_up = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_down = nn.Linear(mlp_hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)

    def latent(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[b, B, r] from each slot's previous token prev [b, B] and the block's states hidden [b, B, D]."""
        mean = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        x = self.in_proj(torch.cat([self.down_h(hidden), self.down_g(mean), self.w1(prev)], dim=-1))
        folded = self.mix.L * torch.tril(torch.ones_like(self.mix.L[0])) + torch.eye(x.shape[1], dtype=x.dtype,
                                                                                      device=x.device)
        u = torch.einsum("ckj,bjc->bkc", folded, x)
        return u + self.mlp_down(F.silu(self.mlp_gate(u)) * self.mlp_up(u))


class XPressConfig(DFlashConfig):
    """The DFlash fields plus XPress's, at the top level where vLLM 0.34 reads them."""

    XPRESS_DEFAULTS = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_num_passes": 6, "xpress_topc": 512,
                       "xpress_compile_head": True, "xpress_block_size": None, "sample_from_anchor": False}

    def __init__(self, block_size=16, num_target_layers=36, dflash_config=None, is_causal=None, **kwargs):
        for name, default in self.XPRESS_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(block_size, num_target_layers, dflash_config, is_causal, **kwargs)


class Qwen3XPressModel(DFlashDraftModel):
    config_class = XPressConfig

    def __init__(self, config: XPressConfig):
        super().__init__(config)
        if config.sample_from_anchor:
            raise ValueError("sample_from_anchor true: XPress drafts in the fill-in layout only (slot 0 the anchor)")
        block = int(config.xpress_block_size or config.block_size)
        if block != int(config.block_size):
            raise ValueError(f"xpress_block_size {block} differs from block_size {config.block_size}")
        self.xpress_head = XPressRefiner(config.vocab_size, config.hidden_size, block_size=block,
                                         rank=int(config.xpress_rank), mlp_hidden=int(config.xpress_mlp_hidden))
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The draft tokens [b, B - 1] of blocks whose every slot's final states are hidden [b, B, D] and
        whose anchors are anchor_ids [b]: the base argmax, then each Jacobi pass sets every drafting slot
        to the argmax of its base logits plus the refiner's bias computed with the block as the last pass
        left it (each slot's previous token: the anchor for slots 0 and 1, then the slot before)."""
        head, cfg = self.xpress_head, self.config
        hidden = hidden.float()
        base = self.compute_logits(hidden[:, 1:], lm_head)
        tokens = base.argmax(-1)
        c = min(int(cfg.xpress_topc or 0), base.shape[-1])
        if c:
            base_c, cand = base.topk(c, dim=-1)
        anchor = anchor_ids.long().view(-1, 1)
        for _ in range(int(cfg.xpress_num_passes)):
            prev = torch.cat([anchor, anchor, tokens[:, :-1]], dim=1)
            z = head.latent(prev, hidden.to(head.w2.weight.dtype))[:, 1:].float()
            if c:
                bias = (head.w2.weight.float()[cand] * z[:, :, None, :]).sum(-1)
                tokens = cand.gather(-1, (base_c + bias).argmax(-1, keepdim=True)).squeeze(-1)
            else:
                tokens = (base + F.linear(z, head.w2.weight.float())).argmax(-1)
        return tokens
