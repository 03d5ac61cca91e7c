"""LiLiCorr's head in bf16 against the same head in float32: its outputs and every gradient, eager and (on a
GPU) compiled. Used by tests/test_lilicorr.py (CPU, eager, a small shape) and tests/test_gpu.py (the
published shape, eager and compiled, timed)."""

from __future__ import annotations

import copy

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def head_errors(geometry, *, n: int, device: str, timer, compiled: bool = True) -> dict:
    """The head's outputs and gradients in bf16, eager and (with `compiled`) compiled, each against float32
    (relative errors), and the times of the bf16 steps; `timer(fn)` -> (ms, fn's last output). Per
    parameter too (`{name}_param_grad_rel`), with the worst named (`{name}_param_grad_worst`)."""
    from dflash_ds.architectures.lilicorr.head import LiLiCorrHead

    g = torch.Generator(device=device).manual_seed(0)
    s, k, hidden = geometry.slots, geometry.top_k, geometry.hidden
    torch.manual_seed(0)
    head = LiLiCorrHead(geometry).to(device).bfloat16()
    with torch.no_grad():  # away from the zero start of the embeddings and biases
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    emb = (torch.randn(n, s, k, hidden, device=device, generator=g) * 0.02).bfloat16()
    lp = torch.randn(n, s, 4096, device=device, generator=g).log_softmax(-1).topk(k, dim=-1).values
    hid = torch.randn(n, s, hidden, device=device, generator=g).bfloat16()
    context = torch.randn(n, hidden, device=device, generator=g).bfloat16()
    valid = torch.rand(n, device=device, generator=g) > 0.05
    probe = torch.randn(n, s - 1, k, k, device=device, generator=g)

    def step(fn, module, dtype):
        module.zero_grad(set_to_none=True)
        x = hid.to(dtype, copy=True).requires_grad_(True)  # a leaf of its own each call: no gradient carried over
        out = fn(emb.to(dtype), lp, x, context.to(dtype), valid=valid)
        ((out.pair.float() * probe).sum() + out.start.float().sum()).backward()
        return out.start.detach(), out.pair.detach(), x.grad.float(), {key: p.grad.float() for key, p in module.named_parameters()}

    head32 = copy.deepcopy(head).float()
    want = step(head32, head32, torch.float32)
    found = {"pair_rms": float(want[1].float().pow(2).mean().sqrt())}
    runs = {"eager": lambda: step(head, head, torch.bfloat16)}
    if compiled:
        runs["compiled"] = lambda: step(torch.compile(head, dynamic=False), head, torch.bfloat16)
    for name, fn in runs.items():
        found[f"{name}_ms"], got = timer(fn)
        found[f"{name}_start_rel"] = rel(got[0], want[0])
        found[f"{name}_pair_rel"] = rel(got[1], want[1])
        found[f"{name}_hidden_grad_rel"] = rel(got[2], want[2])
        errors = {p: rel(grad, want[3][p]) for p, grad in got[3].items()}
        worst = max(errors, key=errors.get)
        found[f"{name}_param_grad_max_rel"] = errors[worst]
        found[f"{name}_param_grad_worst"] = worst  # which parameter, so that a failure names it
        found[f"{name}_param_grad_rel"] = errors
    return found
