"""Which recipes with an FP8 target are refused before launch, in one line naming the setting.

The mechanism (Fp8Linear, quantizing, reading FP8 checkpoints) is target_model/fp8.py; the policy,
what the recipe may combine with it, is here, at the resolve step that knows the device and the
target's engine.
"""

from __future__ import annotations

from dflash_ds.config import RecipeError
from dflash_ds.target_model.fp8 import QuantizationError, checkpoint_fp8


def refusal(target, device_type: str, target_kind: str, fp8_checkpoint: bool) -> str | None:
    """Why the recipe's `target` section cannot run this way (one line naming the setting), or None."""
    quantization = target.quantization
    if quantization == "fp8" and device_type != "cuda":
        return ("target.quantization: fp8 needs an FP8 GPU (compute capability 8.9+: H100, H200, L40S, ...); "
                "run.device is cpu, where there is no FP8 matmul: set target.quantization=none")
    if target_kind == "zero3" and (quantization == "fp8" or fp8_checkpoint):
        what = "target.quantization: fp8" if quantization == "fp8" else "an FP8 checkpoint (target.path)"
        return (f"{what} needs a full target replica per GPU, but target.ds_config is a ZeRO-3 JSON; an FP8 27B "
                "target (~22 GiB) fits one GPU: use ds_configs/target_replica.json")
    if quantization == "fp8" and target.dtype != "bfloat16":
        return (f"target.quantization: fp8 computes in bfloat16 around the FP8 matmuls, but target.dtype is "
                f"{target.dtype}: set target.dtype=bfloat16 (and \"dtype\": \"bfloat16\" in target.ds_config)")
    if target.adapter and fp8_checkpoint:
        return ("target.adapter cannot be merged into the FP8 weights of target.path: point target.path at the bf16 "
                "checkpoint (the adapter is merged first, then quantized with target.quantization: fp8)")
    return None


def check_quantization(target, device_type: str, target_kind: str, config) -> None:
    """RecipeError for the first refusal of the checkpoint `config` describes (its quantization_config read)."""
    try:
        refused = refusal(target, device_type, target_kind, checkpoint_fp8(config))
    except QuantizationError as exc:
        raise RecipeError(f"target.path: {exc}") from None
    if refused:
        raise RecipeError(refused)
