"""Faster kernels for the frozen target's forward, swapped in where transformers would fall back.

transformers runs the Gated DeltaNet short convolution of Qwen3.5/3.6 through the `causal-conv1d`
package when it is installed and a PyTorch depthwise conv1d otherwise. flash-linear-attention,
which such targets need anyway, ships a Triton kernel for the same operation; using it spares the
causal-conv1d CUDA build. Forward only (the target is frozen); numerics are checked against the
fallback by tests/test_gpu.py (`pytest -m gpu`).
"""

from __future__ import annotations

import importlib.util


def fla_short_conv_available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


def use_fla_short_conv() -> bool:
    """Route Qwen3.5/3.6's causal_conv1d_fn (dense and MoE) through fla's Triton kernel. True if patched."""
    if not fla_short_conv_available():
        return False
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        import transformers.models.qwen3_5.modeling_qwen3_5 as qwen35
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as qwen35_moe
    except ImportError:
        return False

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers hands over [B, C, S] (a transposed view of [B, S, C]); fla wants [B, S, C].
        out = causal_conv1d(hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    qwen35.causal_conv1d_fn = causal_conv1d_fn
    qwen35_moe.causal_conv1d_fn = causal_conv1d_fn
    return True


# ---------------------------------------------------------------------------------------------
# The target's elementwise work: RMSNorms computed in fp32 (5-6 kernels each, a large share of the
# target's forward time: docs/performance.md, "What each optimisation bought") and the SwiGLU
# product. Compiling just these small pure functions fuses each into one kernel; compiling whole
# decoder layers instead was slower (graph breaks around the linear-attention kernels). The math is exactly transformers', so only rounding order moves.

def _compile(fn):
    from dflash_ds.compile import compile_once

    return compile_once(fn, dynamic=False)


def _rms_zero_centered(x, weight, eps: float):
    import torch

    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _rms_gated(x, gate, weight, eps: float):
    import torch
    import torch.nn.functional as F

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


def _rms_plain(x, weight, eps: float):
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _swiglu(gate, up):
    import torch.nn.functional as F

    return F.silu(gate) * up


def _fuse_qwen35(module, prefix: str) -> None:
    getattr(module, f"{prefix}RMSNorm").forward = lambda self, x: _compile(_rms_zero_centered)(x, self.weight, self.eps)
    getattr(module, f"{prefix}RMSNormGated").forward = lambda self, x, gate: _compile(_rms_gated)(
        x, gate, self.weight, self.variance_epsilon)
    # The dense MLP, and the shared expert of the MoE classes.
    getattr(module, f"{prefix}MLP").forward = lambda self, x: self.down_proj(
        _compile(_swiglu)(self.gate_proj(x), self.up_proj(x)))


def _fuse_qwen3(module, prefix: str) -> None:
    getattr(module, f"{prefix}RMSNorm").forward = lambda self, x: _compile(_rms_plain)(x, self.weight,
                                                                                       self.variance_epsilon)
    getattr(module, f"{prefix}MLP").forward = lambda self, x: self.down_proj(
        _compile(_swiglu)(self.gate_proj(x), self.up_proj(x)))


def fuse_target_elementwise() -> list[str]:
    """Patch the norm and MLP forwards of the Qwen3 / Qwen3.5 target classes, dense and MoE (GPU only)."""
    import importlib

    import torch

    if not torch.cuda.is_available():
        return []
    patched = []
    for name, prefix, fuse in (("qwen3_5", "Qwen3_5", _fuse_qwen35), ("qwen3_5_moe", "Qwen3_5Moe", _fuse_qwen35),
                               ("qwen3", "Qwen3", _fuse_qwen3), ("qwen3_moe", "Qwen3Moe", _fuse_qwen3)):
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        fuse(module, prefix)
        patched.append(name)
    return patched
