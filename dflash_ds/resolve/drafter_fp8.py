"""drafter.fp8 before launch: can this machine train the recipe's FP8 drafter? One line naming the
setting and the fix when it cannot (the recipe-only conditions are config/checks.py's)."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
OFF = "set drafter.fp8.layers=none and drafter.fp8.lm_head=false"


class Machine(NamedTuple):
    """What the refusals depend on, gathered by `machine` (tests pass their own)."""

    device_type: str
    capability: tuple[int, int] | None = None  # the GPU's compute capability; None off CUDA
    gpu_name: str = ""
    torchao: bool = False  # torchao importable (the layers' float8 training)


def machine(device: torch.device) -> Machine:
    if device.type != "cuda":
        return Machine(device.type, torchao=importlib.util.find_spec("torchao") is not None)
    return Machine("cuda", tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device),
                   importlib.util.find_spec("torchao") is not None)


def _parts(fp8) -> str:
    on = ([f"drafter.fp8.layers={fp8.layers}"] if fp8.layers != "none" else []) + \
        (["drafter.fp8.lm_head=true"] if fp8.lm_head else [])
    return " and ".join(on)


def refusal(fp8, m: Machine, shape) -> str | None:
    """Why the recipe's `drafter.fp8` section cannot run on `m` with the drafter `shape` (a
    model.shape.DrafterShape), or None (also when it is off)."""
    what = _parts(fp8)
    if not what:
        return None
    if m.device_type != "cuda":
        return (f"{what} needs an FP8 GPU (compute capability 8.9+: H100, H200, L40S, ...); run.device is "
                f"{m.device_type}, where there is no FP8 matmul: {OFF}")
    if m.capability < FP8_CAPABILITY:
        cap = ".".join(map(str, m.capability))
        return (f"{what} needs FP8 tensor cores (compute capability 8.9+: H100, H200, L40S, ...), but this "
                f"rank's GPU ({m.gpu_name}) has compute capability {cap}: {OFF}")
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


def check(fp8, device: torch.device, shape) -> str | None:
    """`refusal` on this rank's device; the GPU is queried only when drafter.fp8 is on."""
    return refusal(fp8, machine(device), shape) if _parts(fp8) else None
