"""speculators 0.9's XPress checkpoints in vLLM 0.34's names: what a checkpoint of the only other XPress
trainer (`speculators/models/xpress/`) becomes as this project's export, which vLLM loads as it is.

speculators writes the DFlash backbone under the names vLLM and this project use (`layers.*`, `fc`,
`hidden_norm`, `norm`) and the refiner as `refiner_head.*` with three names of its own; its config.json
is a speculators config (`speculators_model_type: xpress`, `architectures: ["XPressSpeculator"]`, the
layer shape in `transformer_layer_config`, `aux_hidden_state_layer_ids`, `xpress_mlp_ratio`,
`num_jacobi_passes`), none of whose XPress keys vLLM reads. Tensors the target provides or that
vLLM does not read (`embed_tokens`, `verifier_norm`, `verifier_lm_head`, a full-vocabulary `lm_head`,
`t2d` / `d2t`) are dropped; a reduced draft vocabulary is refused (vLLM's XPress needs the target's).
"""

from __future__ import annotations

from typing import Any

from dflash_ds.architectures.xpress import XPressFields

REFINER = {"token_embed.weight": "w1.weight", "mix_l": "mix.L", "readout.weight": "w2.weight",
           "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight", "in_proj.weight": "in_proj.weight",
           "mlp_gate.weight": "mlp_gate.weight", "mlp_up.weight": "mlp_up.weight", "mlp_down.weight": "mlp_down.weight"}
"""speculators' `refiner_head.<name>` -> vLLM's `xpress_head.<name>` (the raw mixer stays raw: both fold
L * tril + I the same way, speculators in its forward, vLLM on loading)."""
DROPPED = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight", "t2d", "d2t")
BACKBONE = ("layers.", "fc.weight", "hidden_norm.weight", "norm.weight")


def vllm_name(name: str) -> str | None:
    """A speculators XPress tensor's name in the export (vLLM's), None for one that is dropped; ValueError
    naming a tensor that is neither."""
    if name in DROPPED:
        return None
    if name.startswith("refiner_head."):
        sub = name[len("refiner_head."):]
        if sub not in REFINER:
            raise ValueError(f"speculators tensor {name!r} is no part of the XPress refiner vLLM 0.34 loads")
        return "xpress_head." + REFINER[sub]
    if name.startswith(BACKBONE[0]) or name in BACKBONE[1:]:
        return name
    raise ValueError(f"speculators tensor {name!r} is neither the DFlash backbone nor the XPress refiner")


def check_config(config: dict[str, Any]) -> None:
    """ValueError naming the key where a speculators config.json is not an XPress drafter vLLM serves."""
    if config.get("speculators_model_type") != "xpress":
        raise ValueError(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'xpress'")
    if config.get("sample_from_anchor", False):
        raise ValueError("sample_from_anchor is true: vLLM serves XPress in the fill-in layout only")
    layer = config.get("transformer_layer_config") or {}
    vocab, draft = layer.get("vocab_size"), config.get("draft_vocab_size") or layer.get("vocab_size")
    if draft != vocab:
        raise ValueError(f"draft_vocab_size {draft} differs from the vocabulary {vocab}: vLLM's XPress needs the "
                         "target's whole vocabulary")


def fields(config: dict[str, Any]) -> XPressFields:
    """The `drafter.xpress:` fields of a speculators XPress config.json (its hidden width is rank x ratio;
    top-C and compiling are vLLM's, which speculators does not set: their defaults)."""
    rank = int(config.get("xpress_rank", 256))
    return XPressFields(xpress_rank=rank, xpress_mlp_hidden=rank * int(config.get("xpress_mlp_ratio", 2)),
                        xpress_num_passes=int(config.get("num_jacobi_passes", 6)))


def backbone(config: dict[str, Any]) -> dict[str, Any]:
    """The drafter section's backbone keys (config.DrafterConfig's names) of a speculators config.json."""
    layer = config["transformer_layer_config"]
    out = {"num_layers": int(layer["num_hidden_layers"]), "block_size": int(config["block_size"]),
           "mask_token_id": int(config["mask_token_id"]),
           "target_layer_ids": [int(i) for i in config["aux_hidden_state_layer_ids"]],
           "num_attention_heads": int(layer["num_attention_heads"]),
           "num_key_value_heads": int(layer["num_key_value_heads"]), "head_dim": int(layer["head_dim"]),
           "intermediate_size": int(layer["intermediate_size"])}
    if layer.get("layer_types"):
        out["layer_types"] = list(layer["layer_types"])
        out["sliding_window"] = layer.get("sliding_window")
    return out
