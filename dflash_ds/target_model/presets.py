"""Named model geometries: transformers configs built in code, so benches need no download.

A geometry is the target's shape (layer count, widths, heads, vocabulary) plus the drafter
choices that go with it (drafter layers, MASK id). Weights are random: speed does not depend on
them. `target_config(name, layers=N)` shortens the target for quick runs; the tapped layers are
then recomputed from N by the caller (build_target_layer_ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from transformers import PretrainedConfig


@dataclass(frozen=True)
class NamedGeometry:
    name: str
    description: str
    make: Callable[[int | None], PretrainedConfig]  # layers override -> transformers config
    drafter_layers: int
    mask_token_id: int


def _hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    # Qwen3.5/3.6: every `interval`-th layer is full attention, the others Gated DeltaNet.
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}


def _qwen35_text(n: int) -> dict:
    # What the published Qwen3.5/3.6 text towers, dense and MoE, share.
    return dict(vocab_size=248320, num_hidden_layers=n, head_dim=256, linear_num_key_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                layer_types=_hybrid_layer_types(n), max_position_embeddings=262144, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_parameters=dict(QWEN35_ROPE))


def _qwen36_27b(layers: int | None):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen35_text(layers or 64), hidden_size=5120, intermediate_size=17408,
                             num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)


QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


def _qwen3_text(n: int) -> dict:
    # What the published Qwen3 models, dense and MoE, share.
    return dict(vocab_size=151936, num_hidden_layers=n, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=dict(QWEN3_ROPE))


def _qwen3_8b(layers: int | None):
    from transformers import Qwen3Config

    return Qwen3Config(**_qwen3_text(layers or 36), hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                       num_key_value_heads=8)


def _qwen35_moe(layers: int | None, default_layers: int, **shape):
    # Qwen3.5/3.6 MoE text towers (Qwen3_5MoeTextConfig): the hybrid layout above, every MLP a routed
    # mixture (softmax top-k, renormalised) plus one gated shared expert. Values from the published configs.
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_qwen35_text(layers or default_layers), num_key_value_heads=2, **shape)


def _qwen36_35b_a3b(layers: int | None):
    # Qwen3.5/3.6-35B-A3B: Qwen3_5MoeTextConfig's own defaults are this geometry (D 2048, 16 query heads,
    # 32 Gated DeltaNet value heads, 256 experts of width 512, 8 routed + 1 shared); only the rotary
    # settings and the context length are the published checkpoint's rather than the class defaults.
    return _qwen35_moe(layers, 40, hidden_size=2048, num_attention_heads=16, linear_num_value_heads=32,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
                       num_experts_per_tok=8)


def _qwen35_122b_a10b(layers: int | None):
    return _qwen35_moe(layers, 48, hidden_size=3072, num_attention_heads=32, linear_num_value_heads=64,
                       moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=256,
                       num_experts_per_tok=8)


def _qwen35_397b_a17b(layers: int | None):
    return _qwen35_moe(layers, 60, hidden_size=4096, num_attention_heads=32, linear_num_value_heads=64,
                       moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=512,
                       num_experts_per_tok=10)


def _qwen3_30b_a3b(layers: int | None):
    # The plain Qwen3-MoE family: full attention in every layer, 128 experts, no shared expert.
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_qwen3_text(layers or 48), hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True)


def _toy_qwen35(n: int) -> dict:
    # The hybrid layout of Qwen3.5/3.6 at toy width (the same classes run on CPU).
    return dict(hidden_size=64, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, layer_types=_hybrid_layer_types(n), max_position_embeddings=4096,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=dict(QWEN35_ROPE))


def _tiny(layers: int | None):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_toy_qwen35(layers or 8), vocab_size=512, intermediate_size=128, head_dim=32)


def _toy_qwen3(n: int) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(QWEN3_ROPE))


def _tiny_qwen3(layers: int | None):
    from transformers import Qwen3Config

    return Qwen3Config(**_toy_qwen3(layers or 6), vocab_size=512)


def _tiny_moe(layers: int | None):
    # 4 experts, top 2; 6 layers, so that 2 drafter layers tap two distinct ones.
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_toy_qwen35(layers or 6), vocab_size=1024, head_dim=16, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _tiny_qwen3_moe(layers: int | None):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_toy_qwen3(layers or 6), vocab_size=1024, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True)


GEOMETRIES: dict[str, NamedGeometry] = {
    g.name: g
    for g in (
        NamedGeometry("qwen3.6-27b", "Qwen3.6-27B text tower: 64 layers (16 x 3 Gated DeltaNet + 1 full attention), "
                      "D 5120, vocab 248320", _qwen36_27b, drafter_layers=5, mask_token_id=248070),
        NamedGeometry("qwen3-8b", "Qwen3-8B: 36 dense layers, D 4096, vocab 151936", _qwen3_8b,
                      drafter_layers=5, mask_token_id=151669),
        NamedGeometry("qwen3.6-35b-a3b", "Qwen3.5/3.6-35B-A3B text tower: 40 layers (10 x 3 Gated DeltaNet + 1 full "
                      "attention), D 2048, 256 experts (8 routed + 1 shared, width 512), vocab 248320",
                      _qwen36_35b_a3b, drafter_layers=5, mask_token_id=248070),
        NamedGeometry("qwen3.5-122b-a10b", "Qwen3.5-122B-A10B text tower (planning): 48 layers, D 3072, 256 experts "
                      "(8 routed + 1 shared, width 1024)", _qwen35_122b_a10b, drafter_layers=5, mask_token_id=248070),
        NamedGeometry("qwen3.5-397b-a17b", "Qwen3.5-397B-A17B text tower (planning): 60 layers, D 4096, 512 experts "
                      "(10 routed + 1 shared, width 1024)", _qwen35_397b_a17b, drafter_layers=5, mask_token_id=248070),
        NamedGeometry("qwen3-30b-a3b", "Qwen3-30B-A3B: 48 full-attention MoE layers, D 2048, 128 experts (8 routed, "
                      "width 768), vocab 151936", _qwen3_30b_a3b, drafter_layers=5, mask_token_id=151669),
        NamedGeometry("tiny", "toy hybrid Qwen3.5-style target (8 layers, D 64) for CPU smoke runs", _tiny,
                      drafter_layers=2, mask_token_id=5),
        NamedGeometry("tiny-qwen3", "toy dense Qwen3 target (6 layers, D 64) for CPU smoke runs", _tiny_qwen3,
                      drafter_layers=2, mask_token_id=5),
        NamedGeometry("tiny-moe", "toy hybrid Qwen3.5-MoE target (6 layers, D 64, 4 experts, top 2) for CPU runs",
                      _tiny_moe, drafter_layers=2, mask_token_id=5),
        NamedGeometry("tiny-qwen3-moe", "toy Qwen3-MoE target (6 layers, D 64, 4 experts, top 2) for CPU runs",
                      _tiny_qwen3_moe, drafter_layers=2, mask_token_id=5),
    )
}


# The hub ids of the published models whose geometry is built in, for a plan drawn where the hub is
# out of reach (--dry-run): the shapes the plan needs are these configs' own.
PUBLISHED = {"Qwen/Qwen3.6-27B": "qwen3.6-27b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3.6-35B-A3B": "qwen3.6-35b-a3b",
             "Qwen/Qwen3.5-35B-A3B": "qwen3.6-35b-a3b", "Qwen/Qwen3.5-122B-A10B": "qwen3.5-122b-a10b",
             "Qwen/Qwen3.5-397B-A17B": "qwen3.5-397b-a17b", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b"}


def published_config(hub_id: str) -> PretrainedConfig | None:
    """The built-in config of a published model by its hub id, None for any other."""
    name = PUBLISHED.get(hub_id)
    return get_geometry(name).make(None) if name else None


def get_geometry(name: str) -> NamedGeometry:
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose one of {', '.join(GEOMETRIES)} (--geometry)")
    return GEOMETRIES[name]


def target_config(name: str, layers: int | None = None):
    """The transformers config of a named target geometry, optionally with `layers` decoder layers."""
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    return get_geometry(name).make(layers)
