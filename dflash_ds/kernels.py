"""Faster kernels for the frozen target's forward, swapped in where transformers would fall back.

transformers runs the Gated DeltaNet short convolution of Qwen3.5/3.6 through the `causal-conv1d`
package when it is installed and a PyTorch depthwise conv1d otherwise. flash-linear-attention,
which such targets need anyway, ships a Triton kernel for the same operation; using it spares the
causal-conv1d CUDA build. Forward only (the target is frozen); numerics are checked against the
fallback by scripts/gpu_checks.py.
"""

from __future__ import annotations

import importlib.util


def fla_short_conv_available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


def use_fla_short_conv() -> bool:
    """Route Qwen3.5/3.6's causal_conv1d_fn through fla's Triton kernel. Returns True if patched."""
    if not fla_short_conv_available():
        return False
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        import transformers.models.qwen3_5.modeling_qwen3_5 as qwen35
    except ImportError:
        return False

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers hands over [B, C, S] (a transposed view of [B, S, C]); fla wants [B, S, C].
        out = causal_conv1d(hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    qwen35.causal_conv1d_fn = causal_conv1d_fn
    return True
