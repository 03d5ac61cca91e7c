"""The frozen lm_head's two matmuls of the fused loss in FP8 (`drafter.fp8.lm_head`).

The fused loss (objective/loss.py) multiplies by the target's lm_head W [V, D] twice per chunk of
rows: the logits h @ W.T and the input gradient dlogits @ W. W never changes during training, so it
is quantized once, in the two layouts those GEMMs read: one e4m3 scale per row of W (the logits'
output columns) and one per column of W (the gradient's output columns), each stored as the
row-major operand `_scaled_mm` takes transposed. Each chunk's rows, and each chunk's logits'
gradient, are quantized per row at run time (compiled on CUDA, one graph per chunk shape).

CPU has no FP8 tensor cores: there `scaled_matmul` multiplies the dequantized operands, which
rounds the inputs exactly as the GPU does, so the quantization and the scales are testable
without a GPU.
"""

from __future__ import annotations

import torch

from dflash_ds.quantization.fp8 import FP8, pad_rows, quantize_rows, scaled_matmul

_CHUNK_ELEMENTS = 1 << 26  # quantized at a time while W is converted: bounds the float32 temporaries


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a [N, K] matrix (a transposed view is fine) a few thousand rows at a time:
    e4m3 [N, K] (contiguous) and the scales laid out as `_scaled_mm`'s scale_b, [1, N]."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8, device=w.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    rows = max(1, _CHUNK_ELEMENTS // k)
    for i in range(0, n, rows):
        q[i:i + rows], scale[i:i + rows] = quantize_rows(w[i:i + rows])
    return q, scale.reshape(1, n).contiguous()


def _quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from dflash_ds.compile import compile_once

        return compile_once(quantize_rows, dynamic=False)(x)
    return quantize_rows(x)


class Fp8Head:
    """`logits(h)` = h @ W.T and `input_grad(g)` = g @ W for a frozen W [V, D], through e4m3 GEMMs.

    `fast_accum_grad`: the input gradient's GEMM (K = V, a long reduction) on the tensor cores' fast
    accumulator too; the logits' (K = D) always is, as the FP8 target's linears are."""

    def __init__(self, weight: torch.Tensor, fast_accum_grad: bool = False):
        w = weight.detach()
        self.vocab_size, self.hidden_size = w.shape
        self.fast_accum_grad = fast_accum_grad
        self.w_rows, self.w_rows_scale = quantize_weight_rows(w)  # logits: scale per row of W
        self.w_cols, self.w_cols_scale = quantize_weight_rows(w.t())  # gradient: scale per column of W

    def _gemm(self, x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, fast: bool) -> torch.Tensor:
        m = x.shape[0]
        xq, x_scale = _quantize_input(pad_rows(x))
        return scaled_matmul(xq, x_scale, wq, w_scale, blocks=False, out_dtype=x.dtype, fast_accum=fast)[:m]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, V] in hidden's dtype."""
        return self._gemm(hidden, self.w_rows, self.w_rows_scale, True)

    def input_grad(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """[n, V] -> [n, D] in the gradient's dtype."""
        return self._gemm(grad_logits, self.w_cols, self.w_cols_scale, self.fast_accum_grad)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_rows, self.w_rows_scale, self.w_cols,
                                                          self.w_cols_scale))
