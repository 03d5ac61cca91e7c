"""The frozen target's linear layers in FP8 (`target.quantization: fp8`).

Two sources, one module (`Fp8Linear`):
- a bf16 checkpoint, quantized once at load: every weight row gets its own scale (e4m3, row
  amax / 448), activations are quantized per token at run time ("row-wise");
- an FP8 checkpoint as published (config.json `quantization_config` {quant_method: fp8,
  weight_block_size: [128, 128]}: float8_e4m3fn weights with one `weight_scale_inv` per 128 x 128
  block), used as stored: activations are quantized per token and per group of 128 channels, the
  numerics the serving engines run such checkpoints with.

The GEMM is `torch._scaled_mm` (cuBLAS / CUTLASS FP8 tensor cores); the activation quantization in
front of it (a row or group amax, a scale, a cast) is compiled into one kernel, and in the MLP it is
fused with the SwiGLU product that produces the down projection's input (gate and up are one GEMM).
Compiled for the training shape only (`tokens` = rows x sequence length), so there is one graph per
projection width; other shapes (generation of the held-out continuations) quantize eagerly.

What stays in bf16: the embedding, the lm_head, the norms, the Gated DeltaNet and attention kernels,
and projections whose widths are not multiples of 128 (Qwen3.5/3.6's in_proj_a / in_proj_b gates;
with 128 x 128 blocks the input width must be a multiple of 512: see block_gemm_shape).
FP8 matmuls need an FP8 GPU (compute capability 8.9+); elsewhere `scaled_matmul` computes the same
product from the dequantized operands, which is how the unit tests check the wiring on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
ROWS, BLOCKS = "rows", "blocks"
_TINY = 1e-12  # floor of an amax, so an all-zero row gets a finite scale


class QuantizationError(ValueError):
    pass


# ---------------------------------------------------------------------------- formats


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> e4m3 [M, K] and the dequantization scale [M, 1] (float32): x ~ q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> e4m3 [M, K] and one scale per 1 x 128 group, returned transposed [K/128, M]
    (contiguous: `_scaled_mm` wants these scales outer-dimension-major)."""
    m, k = x.shape
    xf = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, k)
    return q, scale.reshape(m, k // BLOCK).t().contiguous()


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> e4m3 [N, K] and one scale per 128 x 128 block [N/128, K/128]: the layout of a
    published fine-grained FP8 checkpoint (its `weight_scale_inv`)."""
    n, k = w.shape
    b = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = b.abs().amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX
    q = (b / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 `q` [N, K] under a row scale [N, 1] or a block scale [ceil(N/b), ceil(K/b)]."""
    n, k = q.shape
    if scale.shape[-1] == 1 and scale.shape[0] == n:
        return q.float() * scale.float()
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full


def scaled_matmul(xq, x_scale, wq, w_scale, *, blocks: bool, out_dtype: torch.dtype,
                  fast_accum: bool = True) -> torch.Tensor:
    """x @ w.T from their e4m3 forms: x_scale [M, 1] (rows) or [K/128, M] (groups); w_scale [1, N]
    (rows) or [N/128, K/128] (blocks). FP8 tensor cores on CUDA; elsewhere the same product from
    the dequantized operands (float32 accumulation). `fast_accum` (rows only): the tensor cores'
    own accumulator, without the periodic promotion to float32 (faster; less exact over a long K)."""
    if xq.is_cuda:
        if blocks:
            # 1 x 128 activation groups against 128 x 128 weight blocks (cuBLAS, CUDA 12.9+).
            return torch._scaled_mm(xq, wq.t(), scale_a=x_scale.t(), scale_b=w_scale.t(), out_dtype=out_dtype)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype,
                                 use_fast_accum=fast_accum)
    x = dequantize(xq, x_scale.t() if blocks else x_scale)
    w = dequantize(wq, w_scale if blocks else w_scale.t())
    return (x @ w.t()).to(out_dtype)


# ---------------------------------------------------------------------------- compiled front ends


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_rows(gate_up):
    return quantize_rows(_swiglu(gate_up))


def _swiglu_groups(gate_up):
    return quantize_groups(_swiglu(gate_up))


def _front(fn, x: torch.Tensor, compiled: bool):
    if compiled:
        from dflash_ds.compile import compile_once

        return compile_once(fn, dynamic=False)(x)
    return fn(x)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    # FP8 GEMMs want the token count in multiples of 16 (generation runs single tokens).
    pad = -x.shape[0] % 16
    return F.pad(x, (0, 0, 0, pad)) if pad and x.is_cuda else x


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 (row or 128 x 128 block scales) and x quantized on the fly."""

    def __init__(self, weight_q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, blocks: bool,
                 *, out_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        self.blocks, self.out_dtype = blocks, out_dtype
        self.tokens: int | None = None  # the token count the input quantization is compiled for (compile_for)
        self.register_buffer("weight", weight_q)
        # rows: stored [1, N] as _scaled_mm reads it; blocks: [N/128, K/128] as checkpoints store it.
        self.register_buffer("weight_scale", scale.float() if blocks else scale.float().reshape(1, -1).contiguous())
        self.register_buffer("bias", bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scales={'128x128 blocks' if self.blocks else 'rows'}"

    def compiled_for(self, x2: torch.Tensor) -> bool:
        return x2.is_cuda and self.tokens is not None and x2.shape[0] == self.tokens

    def quantize_input(self, x2: torch.Tensor, front=None):
        front = front or (quantize_groups if self.blocks else quantize_rows)
        return _front(front, x2, self.compiled_for(x2))

    def matmul(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        out = scaled_matmul(xq, x_scale, self.weight, self.weight_scale, blocks=self.blocks, out_dtype=self.out_dtype)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, m = x.shape[:-1], x.shape[:-1].numel()
        x2 = pad_rows(x.reshape(m, self.in_features))
        out = self.matmul(*self.quantize_input(x2))
        return out[:m].reshape(*lead, self.out_features)


def fused_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP with gate and up as one FP8 GEMM and SwiGLU + quantization as one kernel."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    lead, m = x.shape[:-1], x.shape[:-1].numel()
    x2 = pad_rows(x.reshape(m, gate_up.in_features))
    h = gate_up.matmul(*gate_up.quantize_input(x2))
    hq, hs = down.quantize_input(h, _swiglu_groups if down.blocks else _swiglu_rows)
    return down.matmul(hq, hs)[:m].reshape(*lead, down.out_features)


# ---------------------------------------------------------------------------- the model


@dataclass
class Quantized:
    """What a conversion did, by module name."""

    fp8: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # linear layers left in high precision
    fused_mlps: list[str] = field(default_factory=list)


def eligible(linear: nn.Linear, blocks: bool = False) -> bool:
    return block_gemm_shape(linear.out_features, linear.in_features) if blocks else \
        linear.in_features % BLOCK == 0 and linear.out_features % BLOCK == 0


def block_gemm_shape(n: int, k: int) -> bool:
    """Widths the 128 x 128-block GEMM takes: multiples of 128, and the input width a multiple of
    512: with K/128 = 1 or 2 and N > 128 cuBLAS's block-scaled GEMM returned wrong results
    (docs/performance.md, "Figures behind the code"), most likely the alignment of the scale rows
    [N/128, K/128] (4 float32 = 16 bytes)."""
    return n % BLOCK == 0 and k % (4 * BLOCK) == 0


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def quantize_model(model: nn.Module, scheme: str = ROWS) -> Quantized:
    """Quantize, in place, every nn.Linear of the decoder layers (model.model.layers, or
    model.layers) whose widths are multiples of 128.

    `scheme` rows (per-row weight scales, per-token activations) or blocks (128 x 128 weight blocks,
    1 x 128 activation groups: what a published FP8 checkpoint holds). Weights are quantized once,
    on the device they are on; each bf16 weight is freed as its FP8 copy is made."""
    assert scheme in (ROWS, BLOCKS), scheme
    report = Quantized()
    # model.model.layers of a causal LM (target.model.decoder_layers, which imports this module).
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise QuantizationError(f"cannot find the decoder layers of {type(model).__name__} to quantize: this "
                                "target cannot run in FP8")
    for i, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            if type(mod) is not nn.Linear:
                continue
            full = f"layers.{i}.{name}"
            if not eligible(mod, scheme == BLOCKS):
                report.kept.append(full)
                continue
            w = mod.weight.data
            q, s = quantize_blocks(w) if scheme == BLOCKS else quantize_rows(w)
            bias = None if mod.bias is None else mod.bias.data
            _replace(layer, name, Fp8Linear(q, s, bias, scheme == BLOCKS, out_dtype=w.dtype))
            report.fp8.append(full)
            del w, mod
    fuse_mlps(model, report)
    return report


def _fp8_linear_class():
    try:
        from transformers.integrations.finegrained_fp8 import FP8Linear
    except ImportError:  # a transformers without fine-grained FP8 cannot have loaded such a checkpoint
        return None
    return FP8Linear


def convert_checkpoint_linears(model: nn.Module, keep_fp8: bool, dtype: torch.dtype) -> Quantized:
    """The FP8 linears transformers made from a fine-grained FP8 checkpoint -> Fp8Linear (its stored
    e4m3 weights and 128 x 128 scales, used as they are) when `keep_fp8`, else nn.Linear holding the
    dequantized weights in `dtype`. Blocks other than 128 x 128, or widths not a multiple of 128,
    are dequantized either way."""
    cls = _fp8_linear_class()
    report = Quantized()
    if cls is None:
        return report
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, cls):
            continue
        w, s = mod.weight.data, mod.weight_scale_inv.data
        bias = None if mod.bias is None else mod.bias.data.to(dtype)
        if w.dtype != FP8:
            new = _linear(w.to(dtype), bias)  # a layer the checkpoint kept in high precision
            report.kept.append(name)
        elif keep_fp8 and list(mod.block_size or ()) == [BLOCK, BLOCK] and block_gemm_shape(*w.shape):
            new = Fp8Linear(w, s, bias, True, out_dtype=dtype)
            report.fp8.append(name)
        else:
            new = _linear(dequantize(w, s.reshape(1, 1) if s.numel() == 1 else s).to(dtype), bias)
            report.kept.append(name)
        _replace(model, name, new)
    if keep_fp8:
        fuse_mlps(model, report)
    return report


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def fuse_mlps(model: nn.Module, report: Quantized) -> None:
    """gate_proj + up_proj -> one Fp8Linear `gate_up_proj` (rows of both, scales concatenated), and
    the MLP's forward -> fused_mlp_forward. Only where all three projections are Fp8Linear alike."""
    for name, mlp in list(model.named_modules()):
        gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if not all(isinstance(m, Fp8Linear) for m in (gate, up, down)) or gate.bias is not None \
                or up.bias is not None or not gate.blocks == up.blocks == down.blocks:
            continue
        q = torch.cat([gate.weight, up.weight])
        s = torch.cat([gate.weight_scale, up.weight_scale], dim=0 if gate.blocks else 1)
        mlp.gate_up_proj = Fp8Linear(q, s if gate.blocks else s.reshape(-1, 1), None, gate.blocks,
                                     out_dtype=gate.out_dtype)
        del mlp.gate_proj, mlp.up_proj
        # An instance attribute shadows the class's forward (patched or not); hooks still run.
        mlp.forward = functools.partial(fused_mlp_forward, mlp)
        report.fused_mlps.append(name)


def compile_for(model: nn.Module, tokens: int) -> int:
    """Compile the input quantization of every Fp8Linear for forwards of `tokens` tokens (rows x
    sequence length: the training shape). Returns how many modules there are (0: not quantized)."""
    mods = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in mods:
        m.tokens = tokens
    return len(mods)


# ---------------------------------------------------------------------------- checkpoints and checks


def checkpoint_fp8(config) -> bool:
    """True when the checkpoint's config.json declares fine-grained FP8 weights this module reads
    (quant_method fp8, 128 x 128 blocks, dynamic activations); False when it declares no
    quantization. Any other quantization stops with one line naming it."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        tc = getattr(config, "text_config", None)
        qc = getattr(tc, "quantization_config", None) if tc is not None else None
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", ""))
    if method != "fp8":
        raise QuantizationError(f"the target is quantized with {method!r}; only bf16 checkpoints and fine-grained "
                                "FP8 ones (quant_method fp8, weight_block_size [128, 128]) are supported")
    block = list(qc.get("weight_block_size") or [])
    if block != [BLOCK, BLOCK] or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"the target is an FP8 checkpoint with weight_block_size {block or None} and "
                                f"activation_scheme {qc.get('activation_scheme')!r}; only [128, 128] blocks with "
                                "dynamic activations are supported")
    return True

