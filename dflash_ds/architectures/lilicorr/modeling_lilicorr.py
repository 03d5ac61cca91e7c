"""LiLiCorr drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

Written by dflash-ds into every LiLiCorr export next to `modeling_dflash.py`, whose backbone it extends
(transformers' remote-code loader copies that relative import along); torch and transformers only, so
the export loads without the training package. Module names equal the exported tensor names: the
DFlash backbone's, DFlash2's block convolutions when `dflash_config.conv_kernel_size` is set, and the
reranker head under `lilicorr.` with Model-Optimizer's names (torch's nn.MultiheadAttention packs q, k, v
as `attn.in_proj_weight`), its feature norm and MLPs named as vLLM's and SGLang's loaders build them
(`feature_norm`, `feature_mlp.up_proj` / `down_proj`, `layers.{l}.mlp.up_proj` / `down_proj`).

`forward` is the DFlash backbone's (modeling_dflash.py). A block's draft:

    tokens = model.propose(hidden, anchor_taps, lm_head, embed_tokens, anchor_valid=None)

- hidden [b, S, D]: the backbone's final states of the block's S = block_size - 1 drafting slots;
- anchor_taps [b, T*D]: the target's tapped hidden states at the position before each block's anchor
  token (the head reads hidden_norm(fc(taps)) there), or None where there is none (a request's first
  token); `anchor_valid` [b] marks rows without one inside a batch;
- lm_head [V, D] and embed_tokens [V, D]: the target's raw output and input embedding matrices.
The k = lilicorr_candidate_topk best raw logits of every slot are its candidates; the head scores
every pair of neighbouring slots' candidates and the draft is the greedy walk over those scores
(slot 1 the best start score, slot s the best score leaving slot s - 1's choice, the lowest index on
ties). `factors(...)` returns the candidates and the log-factors the walk reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_dflash import DFlashConfig, DFlashDraftModel, RMSNorm

NUM_FEATURES = 5  # log p, p, log p minus the slot's best, rank / (k - 1), is-rank-0: in this order


class LiLiCorrConfig(DFlashConfig):
    """The DFlash fields; LiLiCorr's are the `lilicorr_*` keys of `dflash_config`. A class of its own so
    that transformers maps it to LiLiCorrDraftModel."""

    def __init__(self, block_size=16, num_target_layers=36, dflash_config=None, is_causal=None, **kwargs):
        super().__init__(block_size, num_target_layers, dflash_config, is_causal, **kwargs)

    def lilicorr(self, name: str):
        value = self.dflash_config.get(f"lilicorr_{name}")
        if value is None:
            raise ValueError(f"config.json's dflash_config has no lilicorr_{name}: not a LiLiCorr export")
        return value


class HeadMLP(nn.Module):
    def __init__(self, width: int, inner: int, out: int):
        super().__init__()
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeLayer(nn.Module):
    def __init__(self, width: int, num_heads: int, mlp_width: int, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = nn.MultiheadAttention(width, num_heads, batch_first=True)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = HeadMLP(width, mlp_width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        # A float mask of [n * heads, L, L] is added to the attention logits, batch-major.
        mask = bias.to(h.dtype).repeat(x.shape[0], 1, 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    def __init__(self, config: LiLiCorrConfig):
        super().__init__()
        hidden = config.hidden_size
        width = int(config.lilicorr("hidden_size")) or hidden
        self.top_k = int(config.lilicorr("candidate_topk"))
        self.slots = int(config.dflash_value("block_size")) - 1
        self.scale = float(config.lilicorr("logit_scale"))
        self.vector_eps = float(config.lilicorr("vector_eps"))
        heads, factor = int(config.lilicorr("num_heads")), int(config.lilicorr("factor_dim"))
        eps = config.rms_norm_eps
        # The readers build token_proj only when the head's width differs from the drafter's.
        self.token_proj = nn.Linear(hidden, width) if width != hidden else None
        self.pass_hidden_proj = nn.Linear(hidden, width)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = HeadMLP(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * self.slots + 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(hidden, width)
        mlp = int(width * float(config.lilicorr("mlp_ratio")))
        self.layers = nn.ModuleList(LatticeLayer(width, heads, mlp, eps)
                                    for _ in range(int(config.lilicorr("num_layers"))))
        self.output_norm = RMSNorm(width, eps)
        self.anchor_norm = RMSNorm(width, eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, factor)
        self.in_head = nn.Linear(width, factor)
        self.anchor_out_head = nn.Linear(width, factor)

    def attention_bias(self) -> torch.Tensor:
        """[heads, S*k, S*k] over slot-major lattice positions: by query slot minus key slot, plus the
        same-slot bias within a slot."""
        slot = torch.arange(self.slots * self.top_k, device=self.same_slot_bias.device) // self.top_k
        distance = slot[:, None] - slot[None, :]
        return self.relative_slot_bias[:, distance + self.slots] + self.same_slot_bias[:, None, None] * (distance == 0)

    def forward(self, embeddings, log_probs, hidden, anchor_rows, *, valid):
        """(start [n, k], pair [n, S - 1, k, k]) log-factors, fp32 (or wider)."""
        dtype = self.pass_hidden_proj.weight.dtype
        lp = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
        k = lp.shape[-1]
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype)
        frac = rank / (k - 1) if k > 1 else torch.zeros_like(rank)
        features = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, frac.expand_as(lp),
                                (rank == 0).to(lp.dtype).expand_as(lp)], dim=-1)
        tokens = embeddings.to(dtype)
        x = tokens if self.token_proj is None else self.token_proj(tokens)
        x = x + self.pass_hidden_proj(hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(features.to(dtype)))
        x = (x + self.slot_embedding[0, 0] + self.rank_embedding[0, 0]).flatten(1, 2)
        bias = self.attention_bias()
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x)
        # A missing anchor row counts as zeros, after the projection too (context_proj has a bias).
        on = valid.to(dtype)[:, None]
        alpha = self.anchor_norm(self.context_proj(anchor_rows.to(dtype) * on) * on)
        a = alpha[:, None].expand_as(x)
        f = F.silu(self.factor_input_proj(torch.cat([x, a, x * a], dim=-1)))
        n, width = f.shape[0], self.top_k
        unit = lambda v: F.normalize(v, dim=-1, eps=self.vector_eps)  # noqa: E731
        out = unit(self.out_head(f)).view(n, self.slots, width, -1)
        into = unit(self.in_head(f)).view(n, self.slots, width, -1)
        start = (unit(self.anchor_out_head(alpha))[:, None] * into[:, 0]).sum(-1)
        pair = out[:, :-1] @ into[:, 1:].transpose(-1, -2)
        wide = torch.promote_types(start.dtype, torch.float32)
        return self.scale * start.to(wide), self.scale * pair.to(wide)


class LiLiCorrDraftModel(DFlashDraftModel):
    """The DFlash backbone (with DFlash2's block convolutions when the export has them) and the head."""

    config_class = LiLiCorrConfig

    @property
    def dflash2(self) -> bool:  # the backbone's layers carry the block convolutions when configured
        return bool(self.config.dflash_config.get("conv_kernel_size"))

    def __init__(self, config: LiLiCorrConfig):
        super().__init__(config)
        self.lilicorr = LiLiCorrHead(config)
        self.post_init()

    @torch.no_grad()
    def factors(self, hidden: torch.Tensor, anchor_taps: torch.Tensor | None, lm_head: torch.Tensor,
                embed_tokens: torch.Tensor, *, anchor_valid: torch.Tensor | None = None):
        """(candidate ids [b, S, k], start [b, k], pair [b, S - 1, k, k]) of the blocks (module docstring)."""
        head = self.lilicorr
        work = torch.promote_types(hidden.dtype, torch.float32)
        logits = (hidden @ lm_head.to(hidden.dtype).T).to(work)  # raw logits, in the states' dtype
        top = logits.topk(head.top_k, dim=-1)
        log_probs = top.values - logits.logsumexp(-1, keepdim=True)
        n = hidden.shape[0]
        if anchor_taps is None:
            rows = hidden.new_zeros(n, self.config.hidden_size)
            anchor_valid = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        else:
            rows = self.hidden_norm(self.fc(anchor_taps.to(hidden.dtype)))
            if anchor_valid is None:
                anchor_valid = torch.ones(n, dtype=torch.bool, device=hidden.device)
        embeddings = embed_tokens[top.indices.to(embed_tokens.device)].to(hidden.device)
        start, pair = head(embeddings, log_probs, hidden, rows, valid=anchor_valid.to(hidden.device))
        return top.indices, start, pair

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_taps: torch.Tensor | None, lm_head: torch.Tensor,
                embed_tokens: torch.Tensor, *, anchor_valid: torch.Tensor | None = None) -> torch.Tensor:
        """The drafted tokens [b, S]: the greedy walk over the head's log-factors (torch's argmax takes
        the first maximum, the lowest candidate index, as the engines' kernels do)."""
        ids, start, pair = self.factors(hidden, anchor_taps, lm_head, embed_tokens, anchor_valid=anchor_valid)
        pick = start.argmax(-1)
        path = [pick]
        for s in range(pair.shape[1]):
            pick = pair[:, s].gather(1, pick[:, None, None].expand(-1, 1, pair.shape[-1]))[:, 0].argmax(-1)
            path.append(pick)
        return ids.gather(-1, torch.stack(path, dim=1)[..., None])[..., 0]
