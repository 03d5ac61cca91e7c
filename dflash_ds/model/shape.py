"""The drafter's shape: ONE frozen structure from which everything about the drafter is derived.

`DrafterShape` is resolved once, before launch, from the recipe's `drafter` section and the
target's config (`DrafterShape.from_target`), or read back from an export (`from_hf_config`). The
drafter module (`model.drafter.DFlashDrafter`), the per-micro-batch step settings
(`model.loss.StepSettings`: block size, mask id), the payload on the wire (`runtime.transport.
PayloadLayout`: the number of taps and their width) and the exported config.json (`to_hf_config`)
all read it; none of them keeps a copy of these values of its own.

Adding a field (e.g. a per-layer window, a convolution, a selector):
  1. the recipe key in `config.DrafterConfig` (with its docstring);
  2. the field here, set in `from_target` from the recipe section (model code never imports the
     recipe: the section is read by attribute name), validated in `__post_init__`;
  3. written by `to_hf_config` and read by `from_hf_config` (the export round-trips it);
  4. listed in `COMPARED` when an export trained with another value must not be continued
     (`drafter.init_from`), with the recipe key that sets it;
  5. read where it acts (the layers in model/drafter.py, the mask in model/attention.py).

Model code: no torch.distributed, no deepspeed, no recipe import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from dflash_ds.model.attention import LayerAttention
from dflash_ds.model.logit_transform import LogitTransform, target_scales
from dflash_ds.model.taps import TAP_PRESETS, build_target_layer_ids

# Engines read these fields; anything the drafter does not honour must not be exported.
ARCHITECTURE = "DFlashDraftModel"  # the class name SGLang and vLLM dispatch on
ARCHITECTURE_V2 = "DFlash2DraftModel"  # DFlash2: the same backbone plus the convolutions and the selector
ARCHITECTURES = (ARCHITECTURE, ARCHITECTURE_V2)
# DFlash2's fields, in dflash_config order; the published shape (z-lab's) is 2, 16, 256, 16.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# dflash_config names of the target's scaling (model/logit_transform.py) and their identity values.
SCALE_DEFAULTS = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
INIT_STD = 0.02

# Drafter geometry for hybrid Qwen3.5/3.6 targets, keyed by the target hidden size. The target's
# own full-attention layers (head_dim 256, partial rotary) are not what the published drafters
# use; docs/algorithm.md section 1 gives the 27B geometry. Sizes not listed fall back to the target's values.
_QWEN35_DRAFTER_HEADS = {5120: {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}}


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


# Attention kinds a drafter layer may have, with config.json's layer_types names: full attention
# over the context and the block, or a sliding window over the context (docs/algorithm.md section 3).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def attention_layout(layer_types: Sequence[str], window: int | None, is_causal: bool | None) -> tuple[LayerAttention, ...]:
    """Every layer's attention as SGLang and vLLM run it (docs/algorithm.md section 3): a sliding layer
    has the window; causal = `is_causal` when set, else True exactly for the sliding layers."""
    out = []
    for kind in layer_types:
        sliding = kind == SLIDING_ATTENTION
        causal = sliding if is_causal is None else is_causal
        out.append(LayerAttention(window=window if sliding else None, causal=bool(causal)))
    return tuple(out)


def _check_attention_layout(layer_types: tuple[str, ...], window: int | None, block_size: int) -> None:
    sliding = SLIDING_ATTENTION in layer_types
    if sliding and window is None:
        raise ValueError("drafter.layer_types has sliding_attention layers but drafter.sliding_window is not set; "
                         "set it (2048 for the published Qwen3.6 drafters)")
    if not sliding and window is not None:
        raise ValueError(f"drafter.sliding_window={window} is set but no layer in drafter.layer_types is "
                         "sliding_attention; list the sliding layers or unset the window")
    if window is not None and window < block_size:
        raise ValueError(f"drafter.sliding_window={window} is shorter than drafter.block_size={block_size}; "
                         "the window must cover the whole block")


def _largest_top_k(width: int) -> int:
    k = 1
    while (k + 1) * (k + 2) <= width:
        k += 1
    return k


@dataclass(frozen=True)
class DrafterShape:
    """Geometry of the drafter plus what the serving engines need to run it (docs/algorithm.md sections 1 and 6).

    The single source of truth for the drafter's shape (see the module docstring for how a field
    is added). Fields after `tie_word_embeddings` have defaults so that new ones can follow them.
    """

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
    layer_types: tuple[str, ...] = ()
    """Attention kind of each layer (LAYER_TYPES); empty = full attention in every layer."""
    sliding_window: int | None = None
    """W of the sliding layers: a block query at position p sees context positions > p - W; None = no
    sliding layer."""
    is_causal: bool | None = None
    """Block slot k sees only slots <= k of its own block. None = the engines' default for a config
    without `is_causal` (sliding layers causal, full layers bidirectional); True/False = every layer.
    Exported as config.json's `is_causal` only when set."""
    # DFlash2 (docs/algorithm.md section 8): all four 0 = a v1 drafter, all four >= 1 = DFlash2.
    conv_kernel_size: int = 0
    """Taps of the block convolution around every attention and MLP sublayer."""
    conv_group_size: int = 0
    """Channels sharing one dynamic convolution coefficient."""
    selector_rank: int = 0
    """Rank of the candidate selector's pair scores."""
    selector_top_k: int = 0
    """Unary candidates the selector rescores per slot."""
    # The target's own scaling around its embedding and lm_head (model/logit_transform.py).
    output_multiplier: float = 1.0
    """Logits = output_multiplier * hidden @ lm_head.T (before any softcap)."""
    final_logit_softcapping: float | None = None
    """Logits capped to cap * tanh(logits / cap); None = uncapped."""
    input_embedding_scale: float = 1.0
    """Block token embeddings = input_embedding_scale * embed[ids]."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        kinds = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", kinds)
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
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} drafter layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"drafter layer types {unknown} are not supported; known: {list(LAYER_TYPES)}")
        _check_attention_layout(self.layer_types, self.sliding_window, self.block_size)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"drafter.head_dim must be even (rotary pairs), got {self.head_dim}")
        if not _is_default_rope(self.rope_scaling):
            raise ValueError(
                f"rope_scaling={self.rope_scaling} is not supported: the drafter is trained and "
                "served with plain RoPE; set rope_scaling to null"
            )
        object.__setattr__(self, "rope_scaling", None)  # {"rope_type": "default"} means the same
        if not (self.output_multiplier > 0 and self.input_embedding_scale > 0
                and (self.final_logit_softcapping is None or self.final_logit_softcapping > 0)):
            raise ValueError(f"output_multiplier ({self.output_multiplier}), input_embedding_scale "
                             f"({self.input_embedding_scale}) and final_logit_softcapping "
                             f"({self.final_logit_softcapping}) must be > 0 (the cap may be null)")
        self._check_dflash2()

    def _check_dflash2(self) -> None:
        values = [getattr(self, f) for f in DFLASH2_FIELDS]
        if not any(values):
            return
        if min(values) < 1:
            raise ValueError(f"a DFlash2 drafter needs drafter.{', drafter.'.join(DFLASH2_FIELDS)} >= 1, got {values}; "
                             "set drafter.architecture: dflash for a v1 drafter")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"drafter.conv_kernel_size ({self.conv_kernel_size}) must not exceed drafter.block_size "
                             f"({self.block_size}): the convolution runs inside one block")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"drafter.conv_group_size ({self.conv_group_size}) must divide the hidden size "
                             f"{self.hidden_size}; DFlash2 uses 16")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"drafter.selector_top_k ({self.selector_top_k}) exceeds the vocabulary ({self.vocab_size})")

    def serving_refusal(self) -> str | None:
        """Why a serving engine would refuse this drafter's export, or None (docs/algorithm.md section 6,
        "What the engines refuse"); the rules the module itself needs are __post_init__'s."""
        k = self.selector_top_k
        # llama.cpp returns each position's top-k candidates and their k x k transition scores in one
        # hidden-width row, and refuses a drafter whose row is too narrow for them.
        if self.dflash2 and k * (k + 1) > self.hidden_size:
            return (f"drafter.selector_top_k ({k}) needs a hidden size of at least k(k+1) = {k * (k + 1)} for "
                    f"llama.cpp to serve the export; the target's is {self.hidden_size}: set "
                    f"drafter.selector_top_k to {_largest_top_k(self.hidden_size)} or less")
        return None

    @property
    def dflash2(self) -> bool:
        """A DFlash2 drafter (block convolutions and the candidate selector)."""
        return self.selector_rank > 0

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def logit_transform(self) -> LogitTransform:
        return LogitTransform(self.output_multiplier, self.final_logit_softcapping)

    def layer_attentions(self) -> tuple[LayerAttention, ...]:
        """Each layer's window and causality, as the serving engines run this config."""
        return attention_layout(self.layer_types, self.sliding_window, self.is_causal)

    @classmethod
    def from_target(cls, target_config: Any, choices: Any) -> "DrafterShape":
        """The shape for a transformers target config (Qwen3, Qwen3.5/3.6, Llama-style) and the
        recipe's choices: `choices` is the recipe's `drafter` section (config.DrafterConfig), read
        by attribute name (num_layers, block_size, mask_token_id, target_layer_ids,
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim; None = the target's;
        layer_types, sliding_window, is_causal; None = every layer full, no window, the engines' default;
        architecture and, for dflash2, the four DFLASH2_FIELDS; a section without `architecture`
        means dflash).

        A multimodal Qwen3.5 config is reduced to its `text_config`. Head geometry defaults to the
        target's, except for Qwen3.5/3.6 targets of a listed size (see `_QWEN35_DRAFTER_HEADS`);
        the values `choices` sets always win. The drafter always uses plain full-width RoPE with the
        target's theta: it is its own model to the engines, so the target's partial rotary or
        rope scaling does not carry over.
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_layers, target_layer_ids = choices.num_layers, choices.target_layer_ids
        intermediate_size = choices.intermediate_size
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        defaults = {
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        }
        if str(getattr(text, "model_type", "")).startswith("qwen3_5"):
            defaults.update(_QWEN35_DRAFTER_HEADS.get(hidden, {}))
        num_target_layers = int(text.num_hidden_layers)
        architecture = getattr(choices, "architecture", "dflash")
        if architecture not in ("dflash", "dflash2"):
            raise ValueError(f"drafter.architecture must be dflash or dflash2, got {architecture!r}")
        if target_layer_ids is None:
            if num_layers < 1:
                raise ValueError(f"drafter.num_layers must be >= 1, got {num_layers}")
            target_layer_ids = TAP_PRESETS.get((architecture, num_target_layers, num_layers)) or \
                build_target_layer_ids(num_target_layers, num_layers)
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
        v2 = {f: int(getattr(choices, f)) if architecture == "dflash2" else 0 for f in DFLASH2_FIELDS}
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size),
            num_hidden_layers=int(num_layers),
            num_attention_heads=int(choices.num_attention_heads or defaults["num_attention_heads"]),
            num_key_value_heads=int(choices.num_key_value_heads or defaults["num_key_value_heads"]),
            head_dim=int(choices.head_dim or defaults["head_dim"]),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(text),
            rope_scaling=None,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
            vocab_size=int(text.vocab_size),
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(target_layer_ids),
            block_size=int(choices.block_size),
            mask_token_id=int(choices.mask_token_id),
            tie_word_embeddings=bool(tie),
            layer_types=tuple(choices.layer_types or ()),
            sliding_window=choices.sliding_window,
            is_causal=choices.is_causal,
            **v2,
            **target_scales(text),
        )

    def mismatches(self, other: "DrafterShape") -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for every field of COMPARED where the two differ."""
        return [(name, getattr(self, name), getattr(other, name)) for name in COMPARED
                if getattr(self, name) != getattr(other, name)]

    def to_hf_config(self) -> dict:
        """The exported config.json (docs/algorithm.md section 6): a qwen3 model with a `dflash_config` section."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.dflash2:
            # DFlash2 readers take the block size from dflash_config; v1 readers from the top level.
            dflash.update({"block_size": self.block_size, **{f: getattr(self, f) for f in DFLASH2_FIELDS}})
        dflash.update({k: v for k, v in self.scales().items() if v != SCALE_DEFAULTS[k]})
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
            "initializer_range": INIT_STD,
            # Qwen3Config keeps `sliding_window` only with use_sliding_window; max_window_layers only
            # matters without layer_types and is written as z-lab's configs write it (the layer count).
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.num_hidden_layers,
            **({} if self.is_causal is None else {"is_causal": self.is_causal}),
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> "DrafterShape":
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
            missing = [f for f in DFLASH2_FIELDS if f not in dflash]
            if missing:
                raise ValueError(f"a {ARCHITECTURE_V2} config.json needs dflash_config.{', '.join(missing)}")
        block_size = dflash.get("block_size", config.get("block_size"))
        if block_size is None:
            raise ValueError("config.json has no block_size (top level or dflash_config)")
        layer_types = tuple(config.get("layer_types") or ())
        is_causal = config.get("is_causal")
        if is_causal is None:
            is_causal = dflash.get("causal")  # vLLM's next place to look
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
            layer_types=layer_types,
            # vLLM also takes the window from dflash_config.swa_window_size when the top level has none.
            sliding_window=(config.get("sliding_window") or dflash.get("swa_window_size"))
            if SLIDING_ATTENTION in layer_types else None,
            is_causal=None if is_causal is None else bool(is_causal),
            **{f: int(dflash[f]) if v2 else 0 for f in DFLASH2_FIELDS},
            # A cap of 0 means none, as the reference reads it.
            output_multiplier=float(dflash.get("output_multiplier") or 1.0),
            final_logit_softcapping=float(dflash["final_logit_softcapping"]) if dflash.get("final_logit_softcapping") else None,
            input_embedding_scale=float(dflash.get("input_embedding_scale") or 1.0),
        )

    def scales(self) -> dict[str, float | None]:
        """The target's scaling around the embedding and lm_head, by their dflash_config names."""
        return {k: getattr(self, k) for k in SCALE_DEFAULTS}

    def replace(self, **changes: Any) -> "DrafterShape":
        return dataclasses.replace(self, **changes)




# The fields an export must share with the recipe to be continued by a run (`drafter.init_from`),
# and the setting that decides each on the recipe's side.
COMPARED = {
    "num_hidden_layers": "drafter.num_layers",
    "target_layer_ids": "drafter.target_layer_ids (null: spread over the target by drafter.num_layers)",
    "block_size": "drafter.block_size",
    "mask_token_id": "drafter.mask_token_id",
    "hidden_size": "target.path (the target's hidden size)",
    "intermediate_size": "drafter.intermediate_size",
    "num_attention_heads": "drafter.num_attention_heads",
    "num_key_value_heads": "drafter.num_key_value_heads",
    "head_dim": "drafter.head_dim",
    "layer_types": "drafter.layer_types (null: every layer full attention)",
    "sliding_window": "drafter.sliding_window",
    "is_causal": "drafter.is_causal",
    "vocab_size": "target.path (the target's vocabulary)",
    "num_target_layers": "target.path (the target's layer count)",
    "conv_kernel_size": "drafter.architecture / drafter.conv_kernel_size",
    "conv_group_size": "drafter.architecture / drafter.conv_group_size",
    "selector_rank": "drafter.architecture / drafter.selector_rank",
    "selector_top_k": "drafter.architecture / drafter.selector_top_k",
    "output_multiplier": "target.path (the target's logit scaling)",
    "final_logit_softcapping": "target.path (the target's logit softcap)",
    "input_embedding_scale": "target.path (the target's embedding scaling)",
}
