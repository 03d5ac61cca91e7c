"""Float64 references for the FP8 experts' grouped GEMMs, built from the very operands the experts
forward gave them (CPU tests and the GPU tier share these).

Comparing a whole FP8 experts forward on two devices measures the re-quantization of its intermediate,
not the kernels: act(gate) * up is rounded to e4m3 (3 mantissa bits) before the down projection, and
bf16-sized differences in the first GEMM flip some of those roundings (relative RMS about
sqrt(bf16 step * e4m3 step), 1-2%). So each GEMM is recorded as the forward runs it and held against the
float64 product of its own e4m3 operands; whatever differs is the kernel's accumulation and its bf16
output rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_ds.target_model import moe

# The pairs the skewed routing gives a few experts exactly: single rows, and sizes either side of 16 and
# of 128 rows (tile heights), so groups start and end inside tiles.
RARE_SIZES = (1, 2, 3, 7, 15, 16, 17, 129)


@dataclass(frozen=True)
class Fp8Gemm:
    """One moe.scaled_grouped_mm call: its operands and what it returned."""

    xq: torch.Tensor
    x_scale: torch.Tensor
    wq: torch.Tensor
    w_scale: torch.Tensor
    offsets: torch.Tensor
    out: torch.Tensor


def record_fp8_gemms(monkeypatch) -> list[Fp8Gemm]:
    """Every FP8 grouped GEMM the experts forward runs from now on, in call order (gate_up, down per chunk)."""
    calls, real = [], moe.scaled_grouped_mm

    def recording(xq, x_scale, wq, w_scale, *, offsets, out_dtype):
        out = real(xq, x_scale, wq, w_scale, offsets=offsets, out_dtype=out_dtype)
        calls.append(Fp8Gemm(xq, x_scale, wq, w_scale, offsets, out))
        return out

    monkeypatch.setattr(moe, "scaled_grouped_mm", recording)
    return calls


def dequantized_product(call: Fp8Gemm) -> torch.Tensor:
    """The call's product in float64 from its e4m3 operands (their dequantization is exact in float64:
    4 x 24 significant bits)."""
    x = call.xq.double() * call.x_scale.double()
    w = call.wq.double() * call.w_scale.double().unsqueeze(-1)
    return moe.grouped_linear(x, w, call.offsets)  # one float64 matmul per expert: the same groups


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gemm_errors(call: Fp8Gemm) -> dict:
    """rel: the call's relative RMS error against its float64 product; floor: that of the float64
    product rounded to bf16 (what any kernel with an exact accumulator would show); worst_row: the
    largest relative error of one output row (a row given another expert's weights or scale is ~1)."""
    ref = dequantized_product(call)
    err = (call.out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return {"rel": rel(call.out, ref), "floor": rel(ref.to(call.out.dtype), ref), "worst_row": float(err.max()),
            "rows": ref.shape[0]}


def unrouted_sum(pairs_out: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """[P, D] outputs of the pairs sorted by expert -> [T, D]: each token's sum over its k slots, in float64."""
    pairs = pairs_out.new_zeros(order.numel(), pairs_out.shape[-1], dtype=torch.float64)
    pairs[order] = pairs_out.double()
    return pairs.view(-1, k, pairs.shape[-1]).sum(dim=1)


def skewed_routing(tokens: int, experts: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [T, k] and normalised top_k_weights [T, k] (float32) from random router logits,
    skewed so the groups are as uneven as routing gets: no pair for the first, the last and a run of
    middle experts; three experts in almost every token's top k; and experts 2, 3, ... each in
    exactly RARE_SIZES[i] tokens (the last slot of tokens of their own)."""
    rare = list(range(2, 2 + len(RARE_SIZES)))
    empty = [0, experts - 1, *range(experts // 2, experts // 2 + experts // 16)]
    if tokens < sum(RARE_SIZES) or experts < 32 or experts - len(rare) - len(empty) < k:
        raise ValueError(f"skewed routing needs >= {sum(RARE_SIZES)} tokens, >= 32 experts and k routable ones")
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, [1, experts - 3, experts - 2]] += 4.0  # top-k in nearly every token
    logits[:, rare + empty] = float("-inf")
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    start = 0
    for e, n in zip(rare, RARE_SIZES):
        index[start:start + n, -1] = e  # never in a top k (-inf), so never twice in a token
        start += n
    return index, weights / weights.sum(-1, keepdim=True)


def group_sizes(offsets: torch.Tensor) -> list[int]:
    ends = offsets.tolist()
    return [b - a for a, b in zip([0] + ends[:-1], ends)]
