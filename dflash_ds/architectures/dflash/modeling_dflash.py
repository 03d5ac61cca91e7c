"""DFlash drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

Written by dflash-ds into every export and self-contained (torch and transformers only), so the
export loads without the training package. Module names equal the exported tensor names
(`layers.{i}.*`, `fc`, `hidden_norm`, `norm`), the same names SGLang and vLLM read.

The drafter has no embedding and no lm_head: the caller embeds the block tokens with the target's
`embed_tokens` and applies the target's `lm_head` to the output (the target's final norm is not
applied). One forward drafts one or more blocks:

    hidden = model(noise_embedding, target_hidden, position_ids, attention_mask=None)

- noise_embedding [b, Q, D]: target embeddings of the block tokens, [anchor token, MASK x (B-1)]
  per block (Q = number of blocks x block_size);
- target_hidden [b, S, T*D]: the target's hidden states at the taps `dflash_config.target_layer_ids`
  (the output of decoder layer k, i.e. transformers' hidden_states[k + 1]), concatenated in
  that order, for the S context tokens;
- position_ids [b, S + Q]: absolute positions of the context tokens, then of the block tokens;
- attention_mask: bool [b, 1, Q, S + Q], True = attend. None means one block that sees every
  context token and itself (the serving case: the context is the verified prefix before the
  anchor).
Each layer then narrows the mask as SGLang and vLLM run that layer, from the positions: a
`sliding_attention` layer (config `layer_types`) lets the query at position p see a key at
position q only when p - q < `sliding_window`; a causal layer only when q <= p. A layer is causal
when config `is_causal` says so and, without it, exactly when it is a sliding layer. The window
must cover the block (sliding_window >= block_size), as dflash-ds's own loader requires: shorter
windows are refused.
Returns the drafter's final-norm hidden states [b, Q, D]; `compute_logits(hidden, lm_head)` gives
the logits. A target that scales its embeddings or its logits (Gemma, Granite, Cohere) has the same
scaling in `dflash_config` (`input_embedding_scale`: multiply the block token embeddings by it;
`output_multiplier` and `final_logit_softcapping`: applied by `compute_logits`); absent = identity.

The published architectures built on this backbone ship their own file beside it, which imports it
relatively: DFlash2 (modeling_dflash2.py: the block convolutions, whose layer is this file's, and the
candidate selector), DSpark (modeling_dspark.py) and LiLiCorr (modeling_lilicorr.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashConfig(Qwen3Config):
    """Qwen3 fields plus the DFlash ones. config.json keeps model_type "qwen3" because SGLang and
    vLLM read the drafter as a qwen3 model (and, without trust_remote_code, still get a plain
    Qwen3Config); with trust_remote_code the auto_map's AutoConfig entry routes here."""

    model_type = "qwen3"

    def __init__(self, block_size=16, num_target_layers=36, dflash_config=None, is_causal=None, **kwargs):
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dflash_config or {"mask_token_id": 0, "target_layer_ids": [1]}
        self.is_causal = is_causal
        super().__init__(**kwargs)

    def layer_window_and_causal(self, i: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal) of layer i, the way the serving engines read this config."""
        sliding = (self.layer_types or ["full_attention"] * self.num_hidden_layers)[i] == "sliding_attention"
        window = self.sliding_window if sliding else None
        if sliding and window is None:
            raise ValueError(f"layer {i} is sliding_attention but the config has no sliding_window "
                             "(use_sliding_window must be true)")
        # A window shorter than the block cuts into the block itself, which the engines do not cut alike
        # (llama.cpp limits only the keys before a query, vLLM and SGLang both sides of a non-causal
        # one); dflash-ds neither trains nor loads such a drafter, and neither does this code.
        if window is not None and window < self.block_size:
            raise ValueError(f"sliding_window={window} is shorter than block_size={self.block_size}: the "
                             "engines apply such a window differently; the window must cover the whole block")
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return window, causal

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def mask_token_id(self) -> int:
        return int(self.dflash_config["mask_token_id"])

    def dflash_value(self, name: str, default=None):
        """A DFlash field: dflash_config first, then the top level (v1 keeps block_size there)."""
        return self.dflash_config.get(name, getattr(self, name, default))

    @property
    def rope_base(self) -> float:
        # transformers 5 keeps rope_theta inside rope_parameters; older releases at the top level.
        params = getattr(self, "rope_parameters", None) or {}
        return float(params.get("rope_theta", getattr(self, "rope_theta", 1e6)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) fp32, cast back, then scale: the order the drafter was trained with.
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim))
    angles = positions.to(work).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block tokens; keys/values from [context features ; block tokens] with the
    same k/v projections and k_norm (KV injection)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, h, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        b, q_len, _ = x.shape
        d = self.head_dim
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.num_kv_heads, d).transpose(1, 2)
        q, k = _rotate(q, *rope_q), _rotate(k, *rope_k)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockConv(nn.Module):
    """DFlash2's convolution around one sublayer. Tap t of block slot k reads slot k - t of the same
    block (zeros before slot 0) with weight base_kernel[side, t, c] + dynamic[t, c // group_size];
    the dynamic coefficients of both sides come from one projection of the sublayer's input."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden // group_size, block_size
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _convolve(self, x, dynamic, base):
        b, q, d = x.shape
        n = q // self.block_size
        if n * self.block_size != q:
            raise ValueError(f"DFlash2 runs whole blocks: {q} block tokens is not a multiple of {self.block_size}")
        xs = x.view(b, n, self.block_size, self.groups, d // self.groups)
        w = base.to(x.dtype).view(self.taps, self.groups, -1) + dynamic.reshape(
            b, n, self.block_size, self.taps, self.groups, 1)
        out = w[..., 0, :, :] * xs
        for t in range(1, self.taps):
            out = out + w[..., t, :, :] * F.pad(xs[:, :, :-t], (0, 0, 0, 0, t, 0))
        return out.view(b, q, d)

    def prepare(self, x):
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x, dynamic):
        return self._convolve(x, dynamic, self.base_kernel[1])


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, dflash2: bool = False):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if dflash2:
            conv = (cfg.hidden_size, int(cfg.dflash_value("conv_kernel_size")),
                    int(cfg.dflash_value("conv_group_size")), int(cfg.dflash_value("block_size")))
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, after = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_q, rope_k, mask), after)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), after)


class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    dflash2 = False

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        for i in range(config.num_hidden_layers):  # refuses what no engine runs alike, at load
            config.layer_window_and_causal(i)
        n_taps = len(config.target_layer_ids)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, self.dflash2) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(n_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        # Only used for tensors missing from the checkpoint (none in a complete export).
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        dtype = noise_embedding.dtype
        q_len, s_len = noise_embedding.shape[1], target_hidden.shape[1]
        if position_ids.shape[-1] != s_len + q_len:
            raise ValueError(f"position_ids must cover the {s_len} context and {q_len} block tokens, "
                             f"got length {position_ids.shape[-1]}")
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(noise_embedding.shape[0], -1)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        rope_k = _rope(position_ids, cfg.head_dim, cfg.rope_base, dtype)
        rope_q = tuple(t[:, :, s_len:] for t in rope_k)
        base = attention_mask
        if base is None:
            base = torch.ones(1, 1, q_len, s_len + q_len, dtype=torch.bool, device=noise_embedding.device)
        # Query minus key position, [b, 1, Q, S + Q]: the engines' window and causality act on it.
        distance = (position_ids[:, s_len:, None] - position_ids[:, None, :]).unsqueeze(1)
        masks = {}
        x = noise_embedding
        for i, layer in enumerate(self.layers):
            kind = cfg.layer_window_and_causal(i)
            if kind not in masks:
                window, causal = kind
                mask = base
                if window is not None:
                    mask = mask & (distance < window)
                if causal:
                    mask = mask & (distance >= 0)
                masks[kind] = mask
            x = layer(x, ctx, rope_q, rope_k, masks[kind])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Logits of final states through the target's lm_head `[V, D]`, scaled and capped as the
        target scales and caps its own (dflash_config output_multiplier, final_logit_softcapping)."""
        logits = (hidden @ lm_head.to(hidden.dtype).T).float()
        multiplier = float(self.config.dflash_config.get("output_multiplier") or 1.0)
        cap = float(self.config.dflash_config.get("final_logit_softcapping") or 0.0)
        if multiplier != 1.0:
            logits = logits * multiplier
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
