"""The DFlash drafter: a small stack of Qwen3-style layers conditioned on target hidden states.

docs/algorithm.md sections 1-3. The drafter owns no embedding and no lm_head: the caller embeds the block tokens
with the target's frozen `embed_tokens` and applies the target's frozen `lm_head` to the output.
State-dict names equal the export names (docs/algorithm.md section 6), so `state_dict()` is the checkpoint
(DSpark's confidence bias is the one parameter stored padded; architectures/dspark/parts.py `Projection`).

Model code: no torch.distributed, no deepspeed. Parallelism and activation checkpointing are
applied from outside (`checkpoint_fn`).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.network.attention import DFlashMask, attend
from dflash_ds.network.shape import INIT_STD, DrafterShape


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, cast back, then scale (the order matters in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # fp32 for bf16/fp16 inputs (as HF Qwen3); float64 stays float64 for reference checks.
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin `[b, L, head_dim]` for absolute positions, full rotary, half-split layout (HF).

    Angles in fp32 (as HF) or float64 for a float64 model; the result is cast to `dtype`.
    """
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim))
    angles = positions.to(work).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [b, h, L, d]; cos/sin [b, L, d]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LayerInputs(NamedTuple):
    """What every layer of one forward shares: context features, RoPE tables of the block queries
    (`*_q`, `[b, Q, head_dim]`) and of the keys (`*_k`, context then block, `[b, S+Q, head_dim]`), mask."""

    ctx: torch.Tensor
    cos_q: torch.Tensor
    sin_q: torch.Tensor
    cos_k: torch.Tensor
    sin_k: torch.Tensor
    mask: DFlashMask

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the block queries and on the keys (context then block), `[b, h, L, d]` each."""
        return _apply_rope(q, self.cos_q, self.sin_q), _apply_rope(k, self.cos_k, self.sin_k)


def _run_layer(layer: "DFlashLayer", mask: DFlashMask, x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    # The checkpointed form of `layer(x, inputs)`: the mask may be a BlockMask (not a tensor), so it
    # is bound beforehand and the checkpoint function only ever sees tensors.
    return layer(x, LayerInputs(*tensors, mask))


class DFlashAttention(nn.Module):
    """Attention whose keys/values are the context features followed by the block tokens."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        d, h, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, xn: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        ctx = inputs.ctx
        b, q_len, _ = xn.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(xn).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        # Same projection for context and block tokens; projecting each and concatenating the
        # (narrower) results avoids materialising [ctx ; xn] at width D.
        k = torch.cat([self.k_proj(ctx), self.k_proj(xn)], dim=1)
        v = torch.cat([self.v_proj(ctx), self.v_proj(xn)], dim=1)
        kv_len = k.shape[1]
        k = self.k_norm(k.view(b, kv_len, self.num_kv_heads, d)).transpose(1, 2)
        v = v.view(b, kv_len, self.num_kv_heads, d).transpose(1, 2)
        q, k = inputs.rotate(q, k)
        out = attend(q, k, v, inputs.mask, scale=1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer with KV injection: only block tokens are queries and go through the MLP.

    An architecture may wrap both sublayers (`Modules.wrappers`, e.g. DFlash2's block
    convolution): the wrapper's `prepare` turns the normalised input into the sublayer's input and
    its `finish` the sublayer's output into what the residual adds.
    """

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wrapped: tuple[str, str] | None = None  # the wrappers' names (attention side, MLP side)
        # Built on a side stream of random numbers: the backbone's init draws stay those of a v1 drafter.
        with torch.random.fork_rng(devices=[]):
            wrappers = cfg.variant.modules.wrappers(cfg)
        if wrappers is not None:
            (a_name, a_mod), (m_name, m_mod) = wrappers
            self.add_module(a_name, a_mod)
            self.add_module(m_name, m_mod)
            self.wrapped = (a_name, m_name)

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        if self.wrapped is None:
            x = x + self.self_attn(self.input_layernorm(x), inputs)
            return x + self.mlp(self.post_attention_layernorm(x))
        attention_wrap, mlp_wrap = (getattr(self, n) for n in self.wrapped)
        h, after = attention_wrap.prepare(self.input_layernorm(x))
        x = x + attention_wrap.finish(self.self_attn(h, inputs), after)
        h, after = mlp_wrap.prepare(self.post_attention_layernorm(x))
        return x + mlp_wrap.finish(self.mlp(h), after)

    def variant_modules(self) -> list[nn.Module]:
        return [getattr(self, n) for n in self.wrapped] if self.wrapped is not None else []


class DFlashDrafter(nn.Module):
    """The DFlash drafter (docs/algorithm.md section 1). Output is after its final norm, before the lm_head."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The architecture's heads: read by the loss and the draft walk, not by forward (their input is its output).
        with torch.random.fork_rng(devices=[]):
            heads = cfg.variant.modules.heads(cfg)
        for name, module in heads.items():
            self.add_module(name, module)
        self.head_names = tuple(heads)
        # Set from outside: `fn(function, *tensors)` wrapping each of the first
        # `checkpoint_layers` layers (DeepSpeed's non_reentrant_checkpoint at runtime).
        self.checkpoint_fn: Callable[..., torch.Tensor] | None = None
        self.checkpoint_layers: int = cfg.num_hidden_layers
        self.reset_parameters()

    def compile_units(self) -> list[nn.Module]:
        """What `drafter.compile` compiles, one graph each on static shapes: every layer, then the modules
        a head names by its own `compile_units()` (a head without one runs eager)."""
        units: list[nn.Module] = list(self.layers)
        for name in self.head_names:
            units += list(getattr(getattr(self, name), "compile_units", tuple)())
        return units

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF-style init: linears N(0, 0.02), norms 1; then the architecture's modules their own
        (DFlash2: the convolutions an exact no-op, the selector adding nothing). Deterministic under
        torch.manual_seed, and the backbone draws the same numbers whatever the architecture (its
        modules draw after it, layers' wrappers first, then the heads)."""
        extra = [m for layer in self.layers for m in layer.variant_modules()]
        extra += [getattr(self, n) for n in self.head_names]
        owned = {id(sub) for m in extra for sub in m.modules()}
        for module in self.modules():
            if id(module) in owned:
                continue
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for module in extra:
            module.reset_parameters()

    def layer_masks(self, mask: DFlashMask | Sequence[DFlashMask]) -> tuple[DFlashMask, ...]:
        """The mask of every layer, each checked against the layer's attention: a mask built for
        another window or causality would train a drafter the engines do not run."""
        attentions = self.config.layer_attentions()
        masks = (mask,) * len(attentions) if isinstance(mask, DFlashMask) else tuple(mask)
        if len(masks) != len(attentions):
            raise ValueError(f"{len(masks)} masks for {len(attentions)} drafter layers")
        for i, (m, att) in enumerate(zip(masks, attentions)):
            if m.attention != att:
                raise ValueError(f"layer {i} attends with {att} but its mask was built for {m.attention}; "
                                 "build the masks with build_layer_masks(..., drafter.config.layer_attentions())")
        return masks

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target states `[b, S, T*D]` -> context features `[b, S, D]` (computed once)."""
        return self.hidden_norm(self.fc(taps))

    def forward(
        self,
        block_embeds: torch.Tensor,
        ctx: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_positions: torch.Tensor,
        *,
        mask: DFlashMask | Sequence[DFlashMask],
    ) -> torch.Tensor:
        """block_embeds `[b, Q, D]`, ctx `[b, S, D]` (from `fuse`) -> hidden `[b, Q, D]`.

        `mask`: one mask per layer (`attention.build_layer_masks` with `config.layer_attentions()`),
        or one mask for every layer when they all attend alike.
        """
        cfg = self.config
        dtype = block_embeds.dtype
        masks = self.layer_masks(mask)
        cos_q, sin_q = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        cos_c, sin_c = rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta, dtype)
        cos_k, sin_k = torch.cat([cos_c, cos_q], dim=1), torch.cat([sin_c, sin_q], dim=1)
        tensors = (ctx, cos_q, sin_q, cos_k, sin_k)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            if self.checkpoint_fn is not None and i < self.checkpoint_layers and torch.is_grad_enabled():
                x = self.checkpoint_fn(functools.partial(_run_layer, layer, masks[i]), x, *tensors)
            else:
                x = layer(x, LayerInputs(*tensors, masks[i]))
        return self.norm(x)
