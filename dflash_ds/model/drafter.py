"""The DFlash drafter: a small stack of Qwen3-style layers conditioned on target hidden states.

docs/algorithm.md sections 1-3. The drafter owns no embedding and no lm_head: the caller embeds the block tokens
with the target's frozen `embed_tokens` and applies the target's frozen `lm_head` to the output.
Parameter names equal the export names (docs/algorithm.md section 6), so `state_dict()` is the checkpoint.

Model code: no torch.distributed, no deepspeed. Parallelism and activation checkpointing are
applied from outside (`checkpoint_fn`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.model.attention import DFlashMask, attend
from dflash_ds.model.dflash2 import BlockConv, CandidateSelector

# Engines read these fields; anything the drafter does not honour must not be exported.
ARCHITECTURE = "DFlashDraftModel"  # the class name SGLang and vLLM dispatch on
ARCHITECTURE_V2 = "DFlash2DraftModel"  # DFlash2: the same backbone plus the convolutions and the selector
ARCHITECTURES = (ARCHITECTURE, ARCHITECTURE_V2)
# DFlash2's published shape (z-lab's config): two taps, groups of 16 channels, rank 256, top 16.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
_DFLASH2_FIELDS = tuple(DFLASH2_DEFAULTS)
_INIT_STD = 0.02

# Drafter geometry for hybrid Qwen3.5/3.6 targets, keyed by the target hidden size. The target's
# own full-attention layers (head_dim 256, partial rotary) are not what the published drafters
# use; docs/algorithm.md section 1 gives the 27B geometry. Sizes not listed fall back to the target's values.
_QWEN35_DRAFTER_HEADS = {5120: {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}}


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Target layers whose outputs feed the drafter (docs/algorithm.md section 2).

    Id k is the output of decoder layer k, i.e. HF `output_hidden_states[k + 1]`. Python's
    `round` (half to even) is deliberate: the serving engines compute the same list with it.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_taps < 1:
        raise ValueError(f"the number of target taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


def _rope_theta(text_config: Any) -> float:
    # transformers 5 moved rope_theta into `rope_parameters`; some models key that dict by
    # layer type. Older configs keep a top-level `rope_theta`.
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        full = params.get("full_attention")
        if isinstance(full, dict) and "rope_theta" in full:
            return float(full["rope_theta"])
    theta = getattr(text_config, "rope_theta", None)
    if theta is None:
        raise ValueError(
            f"cannot find rope_theta in the target config ({type(text_config).__name__}); "
            "set it in the target's config.json"
        )
    return float(theta)


def _is_default_rope(rope_scaling: dict | None) -> bool:
    if rope_scaling is None:
        return True
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    extra = set(rope_scaling) - {"rope_type", "type", "rope_theta"}
    return kind == "default" and not extra


@dataclass(frozen=True)
class DrafterShape:
    """A recipe's `drafter` choices; None = from the target (`DrafterConfig.from_target` completes it)."""

    num_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    architecture: str = "dflash"
    """dflash (v1) or dflash2 (the convolutions and the selector below)."""
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @classmethod
    def of(cls, section: Any) -> "DrafterShape":
        """The same-named fields of a recipe's drafter section (model code does not import the recipe)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class DrafterConfig:
    """Geometry of the drafter plus what the serving engines need to run it (docs/algorithm.md sections 1 and 6)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    tie_word_embeddings: bool
    # DFlash2 (docs/algorithm.md section 9); all four 0 = a v1 drafter.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self._check_dflash2()
        if self.num_hidden_layers < 1:
            raise ValueError(
                f"drafter.num_layers must be >= 1, got {self.num_hidden_layers}; "
                "DFlash uses 5 for dense targets"
            )
        if self.block_size < 2:
            raise ValueError(
                f"drafter.block_size must be >= 2 (the anchor plus at least one drafted token), "
                f"got {self.block_size}; DFlash uses 16"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"drafter.mask_token_id={self.mask_token_id} is outside the target vocabulary "
                f"[0, {self.vocab_size}); pick a reserved id below the vocab size "
                "(Qwen3.5/3.6: 248070, Qwen3: 151669)"
            )
        if not self.target_layer_ids:
            raise ValueError("drafter.target_layer_ids must not be empty; leave it unset for the default")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"drafter.target_layer_ids {list(self.target_layer_ids)} has ids {bad} outside the "
                f"target's layers [0, {self.num_target_layers}); id k is the output of decoder layer k"
            )
        if self.num_attention_heads < 1 or self.num_key_value_heads < 1:
            raise ValueError("drafter.num_attention_heads and drafter.num_key_value_heads must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"drafter.num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"drafter.head_dim must be even (rotary pairs), got {self.head_dim}")
        if not _is_default_rope(self.rope_scaling):
            raise ValueError(
                f"rope_scaling={self.rope_scaling} is not supported: the drafter is trained and "
                "served with plain RoPE; set rope_scaling to null"
            )
        object.__setattr__(self, "rope_scaling", None)  # {"rope_type": "default"} means the same

    def _check_dflash2(self) -> None:
        values = [getattr(self, f) for f in _DFLASH2_FIELDS]
        if not all(values):
            if any(values):
                raise ValueError(f"a DFlash2 drafter needs all of {', '.join(_DFLASH2_FIELDS)} >= 1, got {values}; "
                                 "set drafter.architecture: dflash for a v1 drafter")
            return
        if min(values) < 1:
            raise ValueError(f"drafter.{', drafter.'.join(_DFLASH2_FIELDS)} must be >= 1, got {values}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"drafter.conv_kernel_size ({self.conv_kernel_size}) must not exceed drafter.block_size "
                             f"({self.block_size}): the convolution runs inside one block")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"drafter.conv_group_size ({self.conv_group_size}) must divide the hidden size "
                             f"{self.hidden_size}; DFlash2 uses 16")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"drafter.selector_top_k ({self.selector_top_k}) exceeds the vocabulary ({self.vocab_size})")

    @property
    def dflash2(self) -> bool:
        """A DFlash2 drafter (convolutions and candidate selector)."""
        return self.selector_rank > 0

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config: Any, shape: DrafterShape) -> "DrafterConfig":
        """Drafter config for a transformers target config (Qwen3, Qwen3.5/3.6, Llama-style).

        A multimodal Qwen3.5 config is reduced to its `text_config`. Head geometry defaults to the
        target's, except for Qwen3.5/3.6 targets of a listed size (see `_QWEN35_DRAFTER_HEADS`);
        the values `shape` sets always win. The drafter always uses plain full-width RoPE with the
        target's theta: it is its own model to the engines, so the target's partial rotary or
        rope scaling does not carry over.
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_layers, target_layer_ids = shape.num_layers, shape.target_layer_ids
        intermediate_size = shape.intermediate_size
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        defaults = {
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        }
        if str(getattr(text, "model_type", "")).startswith("qwen3_5"):
            defaults.update(_QWEN35_DRAFTER_HEADS.get(hidden, {}))
        num_target_layers = int(text.num_hidden_layers)
        if target_layer_ids is None:
            if num_layers < 1:
                raise ValueError(f"drafter.num_layers must be >= 1, got {num_layers}")
            target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        if intermediate_size is None:
            # MoE targets (e.g. Qwen3.5-MoE) have no dense MLP width to copy.
            intermediate_size = getattr(text, "intermediate_size", None)
            if intermediate_size is None:
                raise ValueError(
                    f"the target ({getattr(text, 'model_type', type(text).__name__)}) has no dense "
                    "intermediate_size: set drafter.intermediate_size"
                )
        tie = getattr(text, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(target_config, "tie_word_embeddings", False)
        if shape.architecture not in ("dflash", "dflash2"):
            raise ValueError(f"drafter.architecture must be dflash or dflash2, got {shape.architecture!r}")
        v2 = {f: int(getattr(shape, f)) if shape.architecture == "dflash2" else 0 for f in _DFLASH2_FIELDS}
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size),
            num_hidden_layers=int(num_layers),
            num_attention_heads=int(shape.num_attention_heads or defaults["num_attention_heads"]),
            num_key_value_heads=int(shape.num_key_value_heads or defaults["num_key_value_heads"]),
            head_dim=int(shape.head_dim or defaults["head_dim"]),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(text),
            rope_scaling=None,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
            vocab_size=int(text.vocab_size),
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(target_layer_ids),
            block_size=int(shape.block_size),
            mask_token_id=int(shape.mask_token_id),
            tie_word_embeddings=bool(tie),
            **v2,
        )

    def to_hf_config(self) -> dict:
        """The exported config.json (docs/algorithm.md section 6): a qwen3 model with a `dflash_config` section."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.dflash2:
            # DFlash2 readers take the block size from dflash_config; v1 readers from the top level.
            dflash.update({"block_size": self.block_size, **{f: getattr(self, f) for f in _DFLASH2_FIELDS}})
        return {
            "architectures": [ARCHITECTURE_V2 if self.dflash2 else ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": _INIT_STD,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> "DrafterConfig":
        """Inverse of `to_hf_config` (also reads a config re-saved by transformers 5)."""
        dflash = config.get("dflash_config") or {}
        if "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
            raise ValueError("config.json has no dflash_config with mask_token_id and target_layer_ids")
        theta = config.get("rope_theta")
        if theta is None:
            theta = (config.get("rope_parameters") or {}).get("rope_theta")
        if theta is None:
            raise ValueError("config.json has no rope_theta")
        rope_scaling = config.get("rope_scaling")
        v2 = ARCHITECTURE_V2 in (config.get("architectures") or [])
        if v2:
            missing = [f for f in _DFLASH2_FIELDS if f not in dflash]
            if missing:
                raise ValueError(f"a {ARCHITECTURE_V2} config.json needs dflash_config.{', '.join(missing)}")
            unsupported = {k: dflash[k] for k in ("output_multiplier", "final_logit_softcapping")
                           if dflash.get(k) not in (None, 1.0) and not (k == "final_logit_softcapping" and not dflash[k])}
            if unsupported:
                raise ValueError(f"dflash_config {unsupported} is not supported: this drafter trains and evaluates "
                                 "unscaled, uncapped unary logits")
        block_size = dflash.get("block_size", config.get("block_size"))
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            head_dim=int(config["head_dim"]),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config["max_position_embeddings"]),
            vocab_size=int(config["vocab_size"]),
            num_target_layers=int(config["num_target_layers"]),
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            **{f: int(dflash[f]) if v2 else 0 for f in _DFLASH2_FIELDS},
        )

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


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


def _run_layer(layer: "DFlashLayer", mask: DFlashMask, x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    # The checkpointed form of `layer(x, inputs)`: the mask may be a BlockMask (not a tensor), so it
    # is bound beforehand and the checkpoint function only ever sees tensors.
    return layer(x, LayerInputs(*tensors, mask))


class DFlashAttention(nn.Module):
    """Attention whose keys/values are the context features followed by the block tokens."""

    def __init__(self, cfg: DrafterConfig):
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
        q = _apply_rope(q, inputs.cos_q, inputs.sin_q)
        k = _apply_rope(k, inputs.cos_k, inputs.sin_k)
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

    DFlash2 wraps both sublayers in a block convolution (dflash2.BlockConv): the normalised input
    is convolved before the sublayer and its output after it, with coefficients from one projection
    of that normalised input; the residual adds the convolved output.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if cfg.dflash2:
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            # Built on a side stream of random numbers: the backbone's init draws stay those of a v1 drafter.
            with torch.random.fork_rng(devices=[]):
                self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), inputs)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, after = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, inputs), after)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), after)


class DFlashDrafter(nn.Module):
    """The DFlash drafter (docs/algorithm.md section 1). Output is after its final norm, before the lm_head."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash2: read by the loss and the draft walk, not by forward (its input is the output).
        self.candidate_selector = None
        if cfg.dflash2:
            with torch.random.fork_rng(devices=[]):
                self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                            cfg.selector_top_k)
        # Set from outside: `fn(function, *tensors)` wrapping each of the first
        # `checkpoint_layers` layers (DeepSpeed's non_reentrant_checkpoint at runtime).
        self.checkpoint_fn: Callable[..., torch.Tensor] | None = None
        self.checkpoint_layers: int = cfg.num_hidden_layers
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF-style init: linears N(0, 0.02), norms 1; then DFlash2's modules their own (the
        convolutions an exact no-op, the selector adding nothing). Deterministic under
        torch.manual_seed, and a DFlash2 drafter's backbone draws the same numbers as a v1 drafter's
        of the same shape (the DFlash2 modules draw after it)."""
        extra = [m for m in self.modules() if isinstance(m, (BlockConv, CandidateSelector))]
        owned = {id(sub) for m in extra for sub in m.modules()}
        for module in self.modules():
            if id(module) in owned:
                continue
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, _INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for module in extra:
            module.reset_parameters()

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target states `[b, S, T*D]` -> context features `[b, S, D]` (computed once)."""
        return self.hidden_norm(self.fc(taps))

    def forward(
        self,
        block_embeds: torch.Tensor,
        ctx: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_positions: torch.Tensor,
        mask: DFlashMask,
    ) -> torch.Tensor:
        """block_embeds `[b, Q, D]`, ctx `[b, S, D]` (from `fuse`) -> hidden `[b, Q, D]`."""
        cfg = self.config
        dtype = block_embeds.dtype
        cos_q, sin_q = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        cos_c, sin_c = rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta, dtype)
        cos_k, sin_k = torch.cat([cos_c, cos_q], dim=1), torch.cat([sin_c, sin_q], dim=1)
        inputs = LayerInputs(ctx, cos_q, sin_q, cos_k, sin_k, mask)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            if self.checkpoint_fn is not None and i < self.checkpoint_layers and torch.is_grad_enabled():
                x = self.checkpoint_fn(functools.partial(_run_layer, layer, mask), x, *inputs[:-1])
            else:
                x = layer(x, inputs)
        return self.norm(x)
