"""The recipe's drafter section and the target's config -> the drafter's shape (`drafter_shape`).

This is the boundary where recipe values become a `network.shape.DrafterShape`: the shape checks its
own rules (a `FieldError` naming the field) and this module names the recipe setting behind the
field (`RECIPE_KEYS`), so every rule has one check and one message, and model code speaks no recipe
vocabulary. `RECIPE_KEYS` is also what a continued export (`drafter.init_from`) and a resume
(resolve/contract.py) are compared on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_ds.architectures import DEFAULT, names, spec_of
from dflash_ds.network.logit_transform import target_scales
from dflash_ds.network.shape import DrafterShape, FieldError
from dflash_ds.network.taps import build_target_layer_ids

# Drafter geometry for hybrid Qwen3.5/3.6 targets, keyed by the target hidden size. The target's
# own full-attention layers (head_dim 256, partial rotary) are not what the published drafters
# use; docs/algorithm.md section 1 gives the 27B geometry. Sizes not listed fall back to the target's values.
_QWEN35_DRAFTER_HEADS = {5120: {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
                         # the 35B-A3B MoE width: the heads of Qwen3's 2048-wide models (32 x 128, 4 KV)
                         2048: {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}}
# A mixture-of-experts target has no dense MLP width to copy: its drafter's MLP is this many times
# its width (Qwen3's dense ratio, e.g. 6144 at 2048).
MOE_DRAFTER_MLP_RATIO = 3

# Every field of the shape (DrafterShape.flat names) and the setting that decides it on the recipe's
# side: an export must share them with the recipe to be continued by a run (`drafter.init_from`).
RECIPE_KEYS = {
    "architecture": "drafter.architecture",
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
    "output_multiplier": "target.path (the target's logit scaling)",
    "final_logit_softcapping": "target.path (the target's logit softcap)",
    "input_embedding_scale": "target.path (the target's embedding scaling)",
}


def _owners(field: str) -> list[str]:
    return [name for name in names() if field in {f.name for f in dataclasses.fields(spec_of(name).fields)}]


def is_architecture_field(field: str) -> bool:
    """Whether shape field `field` is one of an architecture's own (a key of its `drafter.<name>:` section)."""
    return bool(_owners(field))


def setting_of(field: str, architecture: str | None = None) -> str:
    """The recipe key behind a shape field: an architecture's own field is a key of its section,
    `drafter.<architecture>.<field>` (the drafter's architecture's, or the one that declares it)."""
    if field in RECIPE_KEYS:
        return RECIPE_KEYS[field].split()[0]
    owners = _owners(field)
    return f"drafter.{architecture if architecture in owners or not owners else owners[0]}.{field}"


def recipe_keys(shape: DrafterShape) -> dict[str, str]:
    """RECIPE_KEYS with the shape's architecture's own fields at their section (drafter.<name>.<field>)."""
    own = {f.name: setting_of(f.name, shape.architecture) for f in dataclasses.fields(shape.spec.fields)}
    return {**RECIPE_KEYS, **own}


def check_servable(shape: DrafterShape) -> None:
    """ValueError naming the setting when an engine would refuse the shape's export."""
    try:
        shape.arch_fields.check_shape(shape, serving=True)
    except FieldError as exc:
        raise ValueError(f"{setting_of(exc.field, shape.architecture)} {exc.problem}") from None


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
        raise ValueError(f"target.path: cannot find rope_theta in the target config ({type(text_config).__name__}); "
                         "set it in the target's config.json")
    return float(theta)


def drafter_shape(target_config: Any, choices: Any) -> DrafterShape:
    """The shape for a transformers target config (Qwen3, Qwen3.5/3.6, Llama-style) and the recipe's
    choices: `choices` is the recipe's `drafter` section (config.DrafterConfig), read by attribute
    name (num_layers, block_size, mask_token_id, target_layer_ids, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim; None = the target's; layer_types,
    sliding_window, is_causal; None = every layer full, no window, the engines' default;
    architecture and the architecture's own fields (its fields' `from_recipe`); a section without
    `architecture` means plain DFlash). A value that breaks a rule raises ValueError naming its key.

    A multimodal Qwen3.5 config is reduced to its `text_config`. Head geometry defaults to the
    target's, except for Qwen3.5/3.6 targets of a listed size (see `_QWEN35_DRAFTER_HEADS`); the
    values `choices` sets always win. The drafter always uses plain full-width RoPE with the target's
    theta: it is its own model to the engines, so the target's partial rotary or rope scaling does
    not carry over.
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
    try:
        arch = spec_of(getattr(choices, "architecture", DEFAULT.spec.name))
    except ValueError as exc:
        raise ValueError(f"drafter.architecture: {exc}") from None
    if target_layer_ids is None:
        # Without layers there is nothing to spread the taps over: the shape names num_layers.
        target_layer_ids = arch.tap_presets.get((num_target_layers, num_layers)) or \
            (build_target_layer_ids(num_target_layers, num_layers) if num_layers >= 1 else ())
    if intermediate_size is None:
        # MoE targets (e.g. Qwen3.5-MoE) have no dense MLP width to copy.
        intermediate_size = getattr(text, "intermediate_size", None)
        if intermediate_size is None and int(getattr(text, "num_experts", 0) or 0) > 0:
            intermediate_size = MOE_DRAFTER_MLP_RATIO * hidden
        if intermediate_size is None:
            raise ValueError(f"the target ({getattr(text, 'model_type', type(text).__name__)}) has no dense "
                             "intermediate_size: set drafter.intermediate_size")
    tie = getattr(text, "tie_word_embeddings", None)
    if tie is None:
        tie = getattr(target_config, "tie_word_embeddings", False)
    try:
        return DrafterShape(
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
            architecture=arch.name,
            arch_fields=arch.fields.from_recipe(choices, arch.name),
            **target_scales(text),
        )
    except FieldError as exc:
        raise ValueError(f"{setting_of(exc.field, arch.name)} {exc.problem}") from None
