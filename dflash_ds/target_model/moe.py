"""Mixture-of-experts targets: what a config says about its experts, and the project's experts forward.

The Qwen3-MoE and Qwen3.5/3.6-MoE classes of transformers keep each layer's routed experts as two
3-D parameters, `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I], and call them as
`experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])` through transformers' experts
interface (`config._experts_implementation`: eager, grouped_mm, batched_mm, ...). `EXPERTS` registers
one more implementation there, `grouped_experts_forward`:

  - the (token, slot) pairs are sorted by expert once (`route`, no host synchronisation), so every
    expert's tokens are one contiguous block;
  - gate_up is ONE grouped GEMM over all experts and down is another (`grouped_linear`:
    `torch._grouped_mm` on CUDA in bf16, an exact per-expert loop elsewhere, which is how CPU tests
    check it), with the SwiGLU and the routing weight applied in between (the weight commutes with
    the down projection, so it scales the narrower [P, I] activations);
  - each token gathers its k pairs' outputs through the inverse of the sort and sums them in float32
    (a gather, not a scatter: deterministic, unlike index_add_'s atomic adds, and on CUDA one
    compiled kernel that reads the pairs once and writes the [T, D] sum in the output dtype, faster
    than an index copy back into token order followed by a sum: docs/performance.md, "Figures behind
    the code");
  - the SwiGLU and the routing weight are one compiled kernel on CUDA as well (three elementwise
    passes over [P, 2I] and [P, I] otherwise);
  - tokens run in chunks of at most `chunk_tokens`, which bounds the transient memory to a few
    [chunk * k, D] buffers whatever the row length;
  - expert ids >= the module's expert count are dropped pairs: expert parallelism
    (target_model/expert_parallel.py) marks the pairs routed to another rank's experts that way;
  - with target.quantization: fp8 the expert weights are e4m3 with one scale per expert output row
    (`quantize_experts`) and both GEMMs are `torch._scaled_grouped_mm` on the GPU (the token rows
    quantized per row); off the GPU the same product is computed from the dequantized operands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.compile import compile_once

OWN = "dflash_grouped"  # the name `grouped_experts_forward` is registered under
IMPLEMENTATIONS = (OWN, "grouped_mm", "batched_mm", "eager")
CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class MoeShape:
    """The routed experts of a target config."""

    num_experts: int
    experts_per_token: int
    expert_width: int  # moe_intermediate_size
    shared_width: int  # the shared expert's width; 0 = none
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the routed mixture


def moe_shape(config) -> MoeShape | None:
    """The experts of a (text) config, or None for a dense target."""
    tc = getattr(config, "text_config", None) or config
    experts = int(getattr(tc, "num_experts", 0) or getattr(tc, "n_routed_experts", 0) or 0)
    if experts <= 0:
        return None
    n = int(tc.num_hidden_layers)
    step = int(getattr(tc, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(tc, "mlp_only_layers", None) or ())
    sparse = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    return MoeShape(experts, int(tc.num_experts_per_tok), int(tc.moe_intermediate_size),
                    int(getattr(tc, "shared_expert_intermediate_size", 0) or 0), sparse)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module: 3-D gate_up_proj / down_proj and a num_experts."""
    out = []
    for name, mod in model.named_modules():
        gu = getattr(mod, "gate_up_proj_q", None)
        gu = getattr(mod, "gate_up_proj", None) if gu is None else gu
        if hasattr(mod, "num_experts") and isinstance(gu, torch.Tensor) and gu.dim() == 3:
            out.append((name, mod))
    return out


def use_experts(model: nn.Module, name: str) -> None:
    """Route every experts module of `model` through the implementation `name` (IMPLEMENTATIONS)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown experts implementation {name!r}: one of {', '.join(IMPLEMENTATIONS)}")
    if name == OWN:
        # At load rather than in the first forward: a target laid out otherwise fails before any step.
        for _, mod in experts_modules(model):
            _check_layout(mod)
    register()
    model.set_experts_implementation(name)


def register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(OWN, grouped_experts_forward)


# ---------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs of a chunk sorted by expert; dropped pairs sit after `offsets[-1]`."""

    order: torch.Tensor  # [T*k] flat pair index (token * k + slot), sorted by expert id (stable)
    offsets: torch.Tensor  # int32 [E]: end of each expert's block in `order` (grouped_mm's offs)
    kept: int | None  # pairs routed to this module's experts; None = all (no dropped pairs)


def route(top_k_index: torch.Tensor, num_experts: int, drops: bool = False) -> Routing:
    """Sort the pairs of top_k_index [T, k] by expert. With `drops`, ids >= num_experts are dropped
    pairs (another rank's experts): they sort last and are left out of every group; counting them
    costs one host synchronisation, which a plain (no-drop) forward never makes."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    # scatter_add into a fixed size, not bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat, dtype=torch.int32))
    offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    kept = int(offsets[-1]) if drops else None
    return Routing(order if kept is None else order[:kept], offsets, kept)


# ---------------------------------------------------------------------------- grouped GEMMs


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [P, K] sorted by group times each group's weight [G, N, K] transposed -> [P, N].

    Group g owns rows offsets[g-1]:offsets[g]. One grouped GEMM on CUDA in bf16 (torch._grouped_mm
    reads the [G, N, K] weight as column-major [G, K, N], no copy); elsewhere one matmul per group,
    exact in any dtype (float64 in the tests)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[g].t()
        start = end
    return out


def quantize_rows_3d(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, N, K] -> e4m3 [G, N, K] and one float32 scale per output row [G, N]: w ~ q * scale."""
    from dflash_ds.quantization.fp8 import quantize_rows

    g, n, k = w.shape
    q, scale = quantize_rows(w.reshape(g * n, k))
    return q.reshape(g, n, k), scale.reshape(g, n)


def grouped_linear_fp8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_linear with e4m3 weights [G, N, K] and row scales [G, N]; x [P, K] is quantized per row."""
    from dflash_ds.quantization.fp8 import quantize_rows

    xq, x_scale = quantize_rows(x)
    return scaled_grouped_mm(xq, x_scale, wq, w_scale, offsets=offsets, out_dtype=x.dtype)


def scaled_grouped_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                      *, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """grouped_linear of e4m3 operands: rows xq [P, K] with scales [P, 1], weights wq [G, N, K] with
    row scales [G, N] -> [P, N] in out_dtype.

    FP8 tensor cores (torch._scaled_grouped_mm) on CUDA; elsewhere the product of the dequantized
    operands through grouped_linear, so both paths share the routing and are tested on CPU."""
    from dflash_ds.quantization.fp8 import dequantize

    if xq.is_cuda:
        return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), scale_a=x_scale.reshape(-1), scale_b=w_scale,
                                        offs=offsets, out_dtype=out_dtype, use_fast_accum=True)
    xd = dequantize(xq, x_scale)
    wd = wq.float() * w_scale.float().unsqueeze(-1)
    return grouped_linear(xd, wd, offsets).to(out_dtype)


# ---------------------------------------------------------------------------- the experts forward


def _swiglu(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _silu_weighted(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # silu(gate) * up * w in at least float32, rounded once to the input's dtype.
    acc = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    return (F.silu(gate) * up * weight.to(acc).unsqueeze(-1)).to(gate_up.dtype)


def _inverse(order: torch.Tensor, pairs: int) -> torch.Tensor:
    # inverse[p]: where pair p (token * k + slot) sits among the sorted pairs (0 for pairs not in order).
    inverse = torch.zeros(pairs, dtype=order.dtype, device=order.device)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _token_sum(pairs_out: torch.Tensor, inverse: torch.Tensor, kept: torch.Tensor | None, k: int, *,
               out_dtype: torch.dtype) -> torch.Tensor:
    # Token t's output: the sum over its slots j of the pair output at inverse[t * k + j] (a pair not
    # kept, another rank's expert, adds nothing), added slot by slot in at least float32. Written as
    # k gathers rather than one gather and a sum over a [T, k, D] view: compiled, that is one pointwise
    # kernel reading each pair row once at full bandwidth, where the reduction form compiled to a much
    # slower kernel (docs/performance.md, "Figures behind the code").
    acc_dtype = torch.promote_types(pairs_out.dtype, torch.float32)
    slots = inverse.view(-1, k)
    keep = kept.view(-1, k) if kept is not None else None
    acc = None
    for j in range(k):
        row = pairs_out[slots[:, j]].to(acc_dtype)
        if keep is not None:
            row = torch.where(keep[:, j:j + 1], row, 0.0)
        acc = row if acc is None else acc + row
    return acc.to(out_dtype)


def _fused(fn, x: torch.Tensor):
    # Compiled once per process on CUDA (the token count varies between training rows and generation:
    # dynamic shapes after the first recompilation); the same function runs eagerly elsewhere (CPU tests).
    return compile_once(fn) if x.is_cuda else fn


def _activation(module: nn.Module, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """act(gate) * up * the routing weight of each pair: [P, 2I] -> [P, I]."""
    if getattr(module.config, "hidden_act", None) == "silu" and gate_up.is_cuda:
        return _fused(_silu_weighted, gate_up)(gate_up, weight)
    return _swiglu(module, gate_up) * weight.to(gate_up.dtype).unsqueeze(-1)


def _project(module: nn.Module, which: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    scale = getattr(module, f"{which}_scale", None)
    if scale is not None:
        return grouped_linear_fp8(x, getattr(module, f"{which}_q"), scale, offsets)
    return grouped_linear(x, getattr(module, which), offsets)


def _check_layout(module: nn.Module) -> None:
    # transformers' experts interface also covers transposed, biased or gate-less experts; this
    # forward implements the [E, 2I, D] / [E, D, I] SwiGLU layout of the Qwen MoE families.
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) \
            or not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"the {OWN} experts run SwiGLU experts stored as [E, 2I, D] and [E, D, I] without bias; "
                         f"{type(module).__name__} is laid out otherwise: use transformers' grouped_mm")


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output [T, D] (the registered `dflash_grouped` experts implementation)."""
    return routed_sum(self, hidden_states, top_k_index, top_k_weights, out_dtype=hidden_states.dtype)


class Pairs(NamedTuple):
    """How a chunk's (token, expert) pairs become outputs: the two grouped projections
    `(x [P, K], offsets) -> [P, N]`, the activation `(gate_up [P, 2I], routing weight [P]) -> [P, I]` and
    the gather-and-sum back to tokens (`_token_sum`, compiled or not)."""

    gate_up: Callable
    act: Callable
    down: Callable
    token_sum: Callable
    num_experts: int
    drops: bool = False

    def routed_sum(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, *, chunk: int,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """The routed sum [T, D] in out_dtype, `chunk` tokens at a time (bounding the [P, 2I] activations)."""
        parts = [self._chunk_sum(hidden[a:a + chunk], index[a:a + chunk], weights[a:a + chunk], out_dtype)
                 for a in range(0, hidden.shape[0], chunk)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _chunk_sum(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """One chunk's routed sum [t, D] in out_dtype (summed in float32, float64 for float64 inputs)."""
        t, k = index.shape
        r = route(index, self.num_experts, self.drops)
        if r.kept == 0:  # every pair is another rank's
            return hidden.new_zeros(t, hidden.shape[-1], dtype=out_dtype)
        token = torch.div(r.order, k, rounding_mode="floor")
        h = self.gate_up(hidden[token], r.offsets)
        # The routing weight scales the [P, I] activations: down(w * a) = w * down(a), one pass narrower.
        y = self.down(self.act(h, weights.reshape(-1)[r.order]), r.offsets)
        kept = None
        if r.kept is not None:
            kept = torch.zeros(t * k, dtype=torch.bool, device=r.order.device)
            kept[r.order] = True
        return self.token_sum(y, _inverse(r.order, t * k), kept, k, out_dtype=out_dtype)


def routed_sum(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
               out_dtype: torch.dtype) -> torch.Tensor:
    """sum over slots of weight * expert(hidden) for hidden [T, D], in `out_dtype` [T, D]; ids past
    the module's experts contribute nothing (with module.drops set, as expert parallelism does)."""
    _check_layout(module)
    pairs = Pairs(lambda x, offsets: _project(module, "gate_up_proj", x, offsets),
                  lambda h, w: _activation(module, h, w),
                  lambda x, offsets: _project(module, "down_proj", x, offsets),
                  _fused(_token_sum, hidden), int(module.num_experts), bool(getattr(module, "drops", False)))
    chunk = int(getattr(module, "chunk_tokens", CHUNK_TOKENS))
    return pairs.routed_sum(hidden, top_k_index, top_k_weights, chunk=chunk, out_dtype=out_dtype)


def silu_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, *,
                 down: torch.Tensor, chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """The routed sum [T, D] of SwiGLU (silu) experts gate_up [E, 2I, D], down [E, D, I] for hidden [T, D],
    as a function of tensors alone (no module, no host synchronisation on CUDA): what the compiled MoE
    block traces (target_model/moe_block.py), so nothing in it is compiled on its own. The same sum as
    the `dflash_grouped` forward, returned in hidden's dtype."""
    pairs = Pairs(lambda x, offsets: grouped_linear(x, gate_up, offsets), _silu_weighted,
                  lambda x, offsets: grouped_linear(x, down, offsets), _token_sum, gate_up.shape[0])
    return pairs.routed_sum(hidden, index, weights, chunk=chunk, out_dtype=hidden.dtype)


# ---------------------------------------------------------------------------- FP8 experts


def quantize_experts(model: nn.Module) -> list[str]:
    """target.quantization: fp8 for the routed experts: each experts module's gate_up_proj and
    down_proj become e4m3 buffers `<name>_q` with row scales `<name>_scale` (quantized on the device
    they are on, the bf16 weight freed as its copy is made). Only `dflash_grouped` reads them: the
    other implementations find no weight by its old name (refused before launch, resolve/moe.py)."""
    done = []
    for name, mod in experts_modules(model):
        for which in ("gate_up_proj", "down_proj"):
            w = getattr(mod, which)
            q, s = quantize_rows_3d(w.data)
            delattr(mod, which)
            mod.register_buffer(f"{which}_q", q)
            mod.register_buffer(f"{which}_scale", s)
        done.append(name)
    return done


def experts_linear_params(model: nn.Module) -> tuple[int, int]:
    """(routed-expert weights, of which one token uses) summed over the model's experts modules:
    the active share is experts_per_token / num_experts of each module (the router's top k)."""
    total = active = 0
    for _, mod in experts_modules(model):
        shape = moe_shape(mod.config)
        n = sum(_weight(mod, w).numel() for w in ("gate_up_proj", "down_proj"))
        total += n
        active += n * shape.experts_per_token // shape.num_experts
    return total, active


def _weight(module: nn.Module, which: str) -> torch.Tensor:
    q = getattr(module, f"{which}_q", None)
    return getattr(module, which) if q is None else q

