"""The fused loss's two lm_head GEMMs per chunk: bf16, the hand-written FP8 path, torchao's per-row float8.

    python -m dflash_ds.bench --role lm_head [--recipe R] [--steps 20] [--warmup 3]

One chunk as the fused loss cuts it at the recipe's rows (rows x anchors x (block - 1) supervised slots
over objective.loss_chunks), the geometry's lm_head [V, D] (random bf16 weights), timed in one process:

- bf16: torch.mm(h, W.T) and torch.mm(dlogits, W), what the fused loss runs without drafter.fp8.lm_head;
- fp8: quantization/fp8_head.Fp8Head (W quantized once per layout, each chunk's rows and logits'
  gradient per row, compiled), the input gradient accumulated exactly (the default);
- fp8 fast-accum grad: the same with the input gradient on the tensor cores' fast accumulator;
- torchao: two nn.Linear holding the same W and W.T, through torchao's inference quantization
  (Float8DynamicActivationFloat8WeightConfig, PerRow), compiled.

Each variant reports the median milliseconds of each GEMM (activation quantization included), the
ratio of bf16's total to its own, and the relative RMS error of the logits and of the input gradient
against float64 on the first rows. The dlogits are the CE's own gradient (softmax minus the label's
one-hot) of these logits, so their dynamic range is the loss's.
"""

from __future__ import annotations

import copy

import torch

from .setup import Setup
from .timing import StepClock, synchronize

REFERENCE_ROWS = 256


def chunk_rows(setup: Setup) -> int:
    """Rows of one fused-loss chunk: the micro-batch's supervised slots over objective.loss_chunks."""
    s = setup.run.settings
    slots = setup.payload.rows * s.num_anchors * (s.block_size - 1)
    return -(-slots // s.loss_chunks)


def inputs(setup: Setup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [V, D] (std 0.02), h [m, D] (unit RMS, as after the drafter's final norm) and the CE's gradient of
    h @ W.T for random labels, all in the run's dtype."""
    c, device, dtype = setup.drafter_config, setup.device, setup.run.dtype
    m = chunk_rows(setup)
    g = torch.Generator(device=device).manual_seed(setup.args.seed)
    weight = (torch.randn(c.vocab_size, c.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    hidden = torch.randn(m, c.hidden_size, generator=g, device=device).to(dtype)
    labels = torch.randint(0, c.vocab_size, (m,), generator=g, device=device)
    grad = torch.softmax((hidden @ weight.t()).float(), -1)
    grad[torch.arange(m, device=device), labels] -= 1.0
    return weight, hidden, (grad / m).to(dtype)


def _torchao_pair(weight: torch.Tensor):
    """(logits, input_grad) through torchao's per-row float8 inference linears of W and W.T, compiled."""
    from torch import nn
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    def linear(w):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        return torch.compile(lin, dynamic=False)

    forward, backward = linear(weight), linear(weight.t().contiguous())
    return forward, backward


def variants(weight: torch.Tensor, with_torchao: bool) -> dict:
    from dflash_ds.quantization.fp8_head import Fp8Head

    head = Fp8Head(weight)
    fast = copy.copy(head)  # the same quantized W, the other accumulator
    fast.fast_accum_grad = True
    out = {"bf16": (lambda h: torch.mm(h, weight.t()), lambda g: torch.mm(g, weight)),
           "fp8": (head.logits, head.input_grad),
           "fp8 fast-accum grad": (fast.logits, fast.input_grad)}
    if with_torchao:
        out["torchao per-row"] = _torchao_pair(weight)
    return out


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@torch.no_grad()
def run_lm_head(setup: Setup, ceiling: dict) -> dict:
    a, device = setup.args, setup.device
    weight, hidden, grad = inputs(setup)
    k = min(REFERENCE_ROWS, hidden.shape[0])
    w64 = weight.double()
    ref_logits, ref_grad = hidden[:k].double() @ w64.t(), grad[:k].double() @ w64
    del w64
    m, (v, d) = hidden.shape[0], weight.shape
    flops = 2 * m * v * d
    table = {}
    for name, (logits_fn, grad_fn) in variants(weight, device.type == "cuda").items():
        for _ in range(a.warmup):  # compiles the quantization in front of the FP8 GEMMs
            logits_fn(hidden), grad_fn(grad)
        synchronize(device)
        clock = StepClock(device)
        clock.mark()
        for _ in range(a.steps):
            logits_fn(hidden)
            clock.mark()
            grad_fn(grad)
            clock.mark()
        times = clock.intervals()
        fwd, bwd = sorted(times[0::2])[len(times[0::2]) // 2], sorted(times[1::2])[len(times[1::2]) // 2]
        table[name] = {"logits_ms": fwd * 1e3, "input_grad_ms": bwd * 1e3, "total_ms": (fwd + bwd) * 1e3,
                       "logits_tflops": flops / fwd / 1e12, "input_grad_tflops": flops / bwd / 1e12,
                       "logits_rel_rms": rel_rms(logits_fn(hidden[:k]), ref_logits),
                       "input_grad_rel_rms": rel_rms(grad_fn(grad[:k]), ref_grad)}
    base = table["bf16"]["total_ms"]
    for row in table.values():
        row["speedup_vs_bf16"] = base / row["total_ms"]
    return {"chunk_rows": m, "vocab": v, "hidden": d, "loss_chunks": setup.run.settings.loss_chunks,
            "reference_rows": k, "iterations": a.steps, "lm_head": table}
