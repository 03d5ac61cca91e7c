"""Which recipes with FP8 matmuls (the target's, the drafter's) are refused before launch, in one line
naming the setting (a mixture-of-experts target's routed experts included: `experts_refusal`).

The mechanisms (Fp8Linear, quantizing, reading FP8 checkpoints, the drafter's float8 layers and FP8
lm_head) are dflash_ds/quantization/'s; the policy, what the recipe may combine them with on this
machine (this rank's GPU included: `check_target_device`), is here, at the resolve step that knows the
device, the target's engine and the drafter's shape, so the rank that builds the engines only applies it. drafter.fp8's recipe-only values are
config/checks.py's.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from dflash_ds.config import RecipeError
from dflash_ds.quantization.fp8 import QuantizationError, checkpoint_fp8
from dflash_ds.target_model.moe import OWN, moe_shape

FP8_GPU = "compute capability 8.9+: H100, H200, L40S, ..."  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
FP8_CAPABILITY = (8, 9)
DRAFTER_OFF = "set drafter.fp8.layers=none and drafter.fp8.lm_head=false"


def refusal(target, device_type: str, target_kind: str, fp8_checkpoint: bool) -> str | None:
    """Why the recipe's `target` section cannot run this way (one line naming the setting), or None."""
    quantization = target.quantization
    if quantization == "fp8" and device_type != "cuda":
        return (f"target.quantization: fp8 needs an FP8 GPU ({FP8_GPU}); "
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


def experts_refusal(target, fp8_checkpoint: bool) -> str | None:
    """`refusal` for a mixture-of-experts target: what FP8 asks of its routed experts, or None."""
    if target.quantization == "fp8" and target.experts_implementation != OWN:
        return (f"target.quantization: fp8 runs the routed experts through {OWN} only, but "
                f"target.experts_implementation is {target.experts_implementation}: set "
                f"target.experts_implementation={OWN}")
    if target.expert_parallel > 1 and fp8_checkpoint:
        return (f"target.expert_parallel {target.expert_parallel} loads each rank's experts from a bf16 checkpoint, "
                "but target.path is an FP8 checkpoint: point target.path at the bf16 one (with "
                "target.quantization: fp8 every rank quantizes its experts after loading)")
    return None


def check_quantization(target, device_type: str, target_kind: str, config) -> None:
    """RecipeError for the first refusal of the checkpoint `config` describes (its quantization_config read)."""
    try:
        stored_fp8 = checkpoint_fp8(config)
    except QuantizationError as exc:
        raise RecipeError(f"target.path: {exc}") from None
    refused = refusal(target, device_type, target_kind, stored_fp8)
    if refused is None and moe_shape(config) is not None:
        refused = experts_refusal(target, stored_fp8)
    if refused:
        raise RecipeError(refused)


class Machine(NamedTuple):
    """What the drafter's refusals depend on, gathered by `machine` (tests pass their own)."""

    device_type: str
    capability: tuple[int, int] | None = None  # the GPU's compute capability; None off CUDA
    gpu_name: str = ""
    torchao: bool = False  # torchao importable (the layers' float8 training)


def machine(device: torch.device) -> Machine:
    torchao = importlib.util.find_spec("torchao") is not None
    if device.type != "cuda" or not torch.cuda.is_available():  # no GPU here: a plan drawn for one
        return Machine(device.type, torchao=torchao)
    return Machine("cuda", tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device), torchao)



def check_target_device(target, device: torch.device) -> None:
    """RecipeError when target.quantization: fp8 meets this rank's GPU without FP8 tensor cores (the
    GPU is queried only then; a plan drawn without a GPU has no capability to check)."""
    if target.quantization != "fp8":
        return
    m = machine(device)
    if m.capability is not None and m.capability < FP8_CAPABILITY:
        raise RecipeError(f"target.quantization: fp8 needs FP8 tensor cores ({FP8_GPU}), but this rank's GPU "
                          f"({m.gpu_name}) has compute capability {m.capability[0]}.{m.capability[1]}: set "
                          "target.quantization=none")

def _drafter_parts(fp8) -> str:
    on = ([f"drafter.fp8.layers={fp8.layers}"] if fp8.layers != "none" else []) + \
        (["drafter.fp8.lm_head=true"] if fp8.lm_head else [])
    return " and ".join(on)


def drafter_refusal(fp8, m: Machine, shape) -> str | None:
    """Why the recipe's `drafter.fp8` section cannot run on `m` with the drafter `shape` (a
    network.shape.DrafterShape), or None (also when it is off)."""
    what = _drafter_parts(fp8)
    if not what:
        return None
    if m.device_type != "cuda":
        return (f"{what} needs an FP8 GPU ({FP8_GPU}); run.device is {m.device_type}, where there is no FP8 "
                f"matmul: {DRAFTER_OFF}")
    if m.capability is not None and m.capability < FP8_CAPABILITY:
        cap = ".".join(map(str, m.capability))
        return (f"{what} needs FP8 tensor cores ({FP8_GPU}), but this rank's GPU ({m.gpu_name}) has compute "
                f"capability {cap}: {DRAFTER_OFF}")
    if fp8.layers != "none" and not m.torchao:
        return (f"drafter.fp8.layers={fp8.layers} trains the layers through torchao's float8 training, which is "
                "not installed: pip install 'dflash-ds[fp8]' (torchao), or set drafter.fp8.layers=none")
    if fp8.layers != "none":
        widths = {"hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
                  "num_attention_heads x head_dim": shape.num_attention_heads * shape.head_dim,
                  "num_key_value_heads x head_dim": shape.num_key_value_heads * shape.head_dim}
        odd = [f"{k} {v}" for k, v in widths.items() if v % 16]
        if odd:
            return (f"drafter.fp8.layers={fp8.layers}: FP8 GEMMs need widths that are multiples of 16, but the "
                    f"drafter has {', '.join(odd)}: set drafter.fp8.layers=none")
    if fp8.lm_head and (shape.hidden_size % 16 or shape.vocab_size % 16):
        return (f"drafter.fp8.lm_head: FP8 GEMMs need the hidden size and the vocabulary to be multiples of 16, "
                f"but they are {shape.hidden_size} and {shape.vocab_size}: set drafter.fp8.lm_head=false")
    return None


def check_drafter_quantization(fp8, device: torch.device, shape) -> None:
    """RecipeError for `drafter_refusal` on this rank's device; the GPU is queried only when drafter.fp8 is on."""
    refused = drafter_refusal(fp8, machine(device), shape) if _drafter_parts(fp8) else None
    if refused:
        raise RecipeError(refused)
