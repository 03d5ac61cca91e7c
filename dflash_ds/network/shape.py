"""The drafter's shape: ONE frozen structure from which everything about the drafter is derived.

`DrafterShape` is resolved once, before launch, from the recipe's `drafter` section and the
target's config (`resolve.drafter.drafter_shape`), or read back from an export (`from_hf_config`). The
drafter module (`network.drafter.DFlashDrafter`), the per-micro-batch step settings
(`objective.drafter_loss.StepSettings`: block size, mask id), the payload on the wire (`runtime.transport.
PayloadLayout`: the number of taps and their width) and the exported config.json (`to_hf_config`)
all read it; none of them keeps a copy of these values of its own.

A field of one drafter architecture only (a convolution, a selector) belongs to that architecture's
`fields` dataclass in architectures/ (held here as `arch_fields`), not here. Adding a field every
drafter has (e.g. a per-layer window):
  1. the recipe key in `config.DrafterConfig` (with its docstring);
  2. the field here, validated in `__post_init__` (a FieldError naming the field, in words that hold
     for a recipe and an export alike), set by `resolve.drafter.drafter_shape` from the recipe;
  3. written by `to_hf_config` and read by `from_hf_config` (the export round-trips it);
  4. its recipe key in `resolve.drafter.RECIPE_KEYS` (error messages, `drafter.init_from`, resumes);
  5. read where it acts (the layers in network/drafter.py, the mask in network/attention.py).

The architecture a shape names is looked up in the registry (network/registry.py), which the
architectures fill from above (`dflash_ds.architectures`); this module imports none of them.

Model code: no torch.distributed, no deepspeed, no recipe import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from dflash_ds.network.attention import LayerAttention
from dflash_ds.network.logit_transform import LogitTransform
from dflash_ds.network.registry import DEFAULT_NAME, variant, variant_of_classes

# dflash_config names of the target's scaling (network/logit_transform.py) and their identity values.
SCALE_DEFAULTS = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
INIT_STD = 0.02


class FieldError(ValueError):
    """A shape field whose value does not fit: `field` names it (the recipe's `drafter.<field>` sets an
    architecture's field), `problem` says why, in words that hold wherever the value came from."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


class Tensor(NamedTuple):
    """One tensor of the drafter's inventory: its shape, and how a training step uses it (the FLOP rule)."""

    shape: tuple[int, ...]
    use: str = "elementwise"
    """"block": a weight multiplying every block token (6 x numel FLOPs per token, forward and backward);
    "context+block": the same over the context tokens too (the k and v projections); "context": a weight
    applied to the context tokens only, whose input needs no gradient (4 x numel, the tap fusion);
    "elementwise" or "table" (rows gathered, not multiplied): no matmul FLOPs."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

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
        raise FieldError("sliding_window", "is not set but layer_types has sliding_attention layers; set it (2048 for "
                         "the published Qwen3.6 drafters)")
    if not sliding and window is not None:
        raise FieldError("sliding_window", f"= {window} is set but no layer in layer_types is sliding_attention; "
                         "list the sliding layers or unset the window")
    if window is not None and window < block_size:
        raise FieldError("sliding_window", f"= {window} is shorter than the block size {block_size}: the window must "
                         "cover the whole block")


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
    architecture: str = DEFAULT_NAME
    """The drafter architecture (architectures/): what it adds to the backbone, how it drafts and trains."""
    arch_fields: Any = None
    """The architecture's own shape fields: a frozen dataclass of its `fields` type (None = its defaults)."""
    # The target's own scaling around its embedding and lm_head (network/logit_transform.py).
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
            raise FieldError("num_hidden_layers", f"must be >= 1, got {self.num_hidden_layers}; DFlash uses 5 for "
                             "dense targets")
        if self.block_size < 2:
            raise FieldError("block_size", f"must be >= 2 (the anchor plus at least one drafted token), got "
                             f"{self.block_size}; DFlash uses 16")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise FieldError("mask_token_id", f"= {self.mask_token_id} is outside the target vocabulary "
                             f"[0, {self.vocab_size}); use the target's reserved MASK id (Qwen3.5/3.6: 248070, "
                             "Qwen3: 151669)")
        if not self.target_layer_ids:
            raise FieldError("target_layer_ids", "must not be empty (null gives the default spread)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise FieldError("target_layer_ids", f"{list(self.target_layer_ids)} has ids {bad} outside the target's "
                             f"layers [0, {self.num_target_layers}); id k is the output of decoder layer k")
        if self.num_attention_heads < 1 or self.num_key_value_heads < 1:
            raise FieldError("num_attention_heads", f"= {self.num_attention_heads} and num_key_value_heads = "
                             f"{self.num_key_value_heads} must both be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError("num_attention_heads", f"= {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads = {self.num_key_value_heads}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise FieldError("layer_types", f"lists {len(self.layer_types)} layers for {self.num_hidden_layers} "
                             "drafter layers; give one type per layer")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise FieldError("layer_types", f"has {unknown}; each entry must be one of {', '.join(LAYER_TYPES)}")
        _check_attention_layout(self.layer_types, self.sliding_window, self.block_size)
        if self.head_dim < 2 or self.head_dim % 2:
            raise FieldError("head_dim", f"must be even (rotary pairs), got {self.head_dim}")
        if not _is_default_rope(self.rope_scaling):
            raise FieldError("rope_scaling", f"= {self.rope_scaling} is not supported: the drafter is trained and "
                             "served with plain RoPE; set it to null")
        object.__setattr__(self, "rope_scaling", None)  # {"rope_type": "default"} means the same
        if not (self.output_multiplier > 0 and self.input_embedding_scale > 0
                and (self.final_logit_softcapping is None or self.final_logit_softcapping > 0)):
            raise FieldError("output_multiplier", f"({self.output_multiplier}), input_embedding_scale "
                             f"({self.input_embedding_scale}) and final_logit_softcapping "
                             f"({self.final_logit_softcapping}) must be > 0 (the cap may be null)")
        fields = variant(self.architecture).spec.fields
        if self.arch_fields is None:
            object.__setattr__(self, "arch_fields", fields())
        if type(self.arch_fields) is not fields:
            raise ValueError(f"arch_fields of a {self.architecture} drafter must be {fields.__name__}, "
                             f"got {type(self.arch_fields).__name__}")
        self.arch_fields.check_shape(self)  # the engines' own rules: resolve.drafter.check_servable, before a run

    @property
    def variant(self):
        """The architecture (network.contract.Architecture: its spec, modules, objective and walk), from the
        registry. Code outside architectures/ reads its spec here (`spec`) and its modules through the
        methods below; only the drafter, the draft model and the loss call its parts."""
        return variant(self.architecture)

    @property
    def spec(self):
        """The architecture's data (network.contract.Spec: names, sections, label offset, logs, card, remote code)."""
        return self.variant.spec

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the drafter by its export name (docs/algorithm.md section 6), the
        architecture's (`Modules.tensors`) after the backbone's: the export's expected shapes,
        the parameter count and the FLOP count (bench/flops.py) are all read from here."""
        return {**self.backbone_tensors(), **self.variant.modules.tensors(self)}

    def extra_flops(self, draft_tokens: int) -> int:
        """Matmul FLOPs of a step that no tensor accounts for (`Modules.extra_flops`), `draft_tokens` being
        the drafting slots' rows of the loss."""
        return self.variant.modules.extra_flops(self, draft_tokens)

    def extra_activation_bytes(self, step) -> int:
        """Bytes the architecture's wrappers and heads hold at a step's peak beyond the backbone's
        (`Modules.extra_activation_bytes`), `step` an `arch_types.StepSizes`."""
        return self.variant.modules.extra_activation_bytes(self, step)

    def backbone_from(self, exported: "DrafterShape") -> str | None:
        """Why an export of another architecture, `exported`, cannot start this drafter's backbone, its heads
        fresh (`Modules.backbone_from`, `drafter.init_from`); None when it can."""
        return self.variant.modules.backbone_from(self, exported)

    def backbone_tensors(self) -> dict[str, Tensor]:
        """The tensors every architecture has: the layers, the tap fusion and the norms."""
        d, hd, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = {
            "self_attn.q_proj.weight": Tensor((q_out, d), "block"),
            "self_attn.k_proj.weight": Tensor((kv_out, d), "context+block"),
            "self_attn.v_proj.weight": Tensor((kv_out, d), "context+block"),
            "self_attn.o_proj.weight": Tensor((d, q_out), "block"),
            "self_attn.q_norm.weight": Tensor((hd,)),
            "self_attn.k_norm.weight": Tensor((hd,)),
            "mlp.gate_proj.weight": Tensor((inter, d), "block"),
            "mlp.up_proj.weight": Tensor((inter, d), "block"),
            "mlp.down_proj.weight": Tensor((d, inter), "block"),
            "input_layernorm.weight": Tensor((d,)),
            "post_attention_layernorm.weight": Tensor((d,)),
        }
        out = {f"layers.{i}.{name}": t for i in range(self.num_hidden_layers) for name, t in per_layer.items()}
        out["fc.weight"] = Tensor((d, self.num_taps * d), "context")
        out["hidden_norm.weight"] = Tensor((d,))
        out["norm.weight"] = Tensor((d,))
        return out

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors().values())

    @property
    def first_draft_slot(self) -> int:
        """The first slot of a block that drafts a token: 1 (slot 0 is the anchor), 0 for an
        anchor-first architecture (`Spec.label_offset`)."""
        return 1 - self.spec.label_offset

    @property
    def num_drafts(self) -> int:
        """Tokens a block drafts: B - 1, or B anchor-first."""
        return self.block_size - self.first_draft_slot

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def logit_transform(self) -> LogitTransform:
        return LogitTransform(self.output_multiplier, self.final_logit_softcapping)

    def layer_attentions(self) -> tuple[LayerAttention, ...]:
        """Each layer's window and causality, as the serving engines run this config."""
        return attention_layout(self.layer_types, self.sliding_window, self.is_causal)

    def flat(self) -> dict[str, Any]:
        """Every field by name, the architecture's own fields in place of `arch_fields`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "arch_fields"}
        out.update(dataclasses.asdict(self.arch_fields))
        return out

    def mismatches(self, other: "DrafterShape", names=None) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for every field of `names` (`flat` names; None: all)
        where the two differ; an architecture's own fields only where both shapes have them."""
        mine, theirs = self.flat(), other.flat()
        return [(name, mine[name], theirs[name]) for name in (mine if names is None else names)
                if name in mine and name in theirs and mine[name] != theirs[name]]

    def to_hf_config(self) -> dict:
        """The exported config.json (docs/algorithm.md section 6): a qwen3 model with a `dflash_config` section."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        dflash.update(self.arch_fields.config_entries(self))
        dflash.update({k: v for k, v in self.scales().items() if v != SCALE_DEFAULTS[k]})
        return {
            "architectures": [self.spec.class_name],
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
            **self.arch_fields.top_level_entries(self),
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
        arch = variant_of_classes(config.get("architectures")) or variant(DEFAULT_NAME)
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
            architecture=arch.spec.name,
            arch_fields=arch.spec.fields.from_config(dflash, class_name=arch.spec.class_name),
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
