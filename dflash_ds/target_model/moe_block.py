"""The sparse MoE block of the Qwen MoE targets as one compiled function on the GPU.

Why: once the experts' own work was fast (target_model/moe.py), a large MoE target's forward was bound
by the host: each MoE layer issued some thirty small operations (the router's softmax, top-k and
renormalisation, the shared expert and its sigmoid gate, the sort, the two grouped GEMMs and the
gathers), and the GPU waited on their launches. Traced as one function of tensors, the block becomes a
few fused kernels and the two grouped GEMMs behind a single guard check (the measurement:
docs/performance.md, "Figures behind the code").

The function is transformers' block, written over the module's tensors so that every layer of a model
shares one compiled graph (a module argument would be guarded on and recompile per layer): the same
router (softmax in float32, top k, renormalised, rounded to the logits' dtype), the same experts as
`dflash_grouped` (moe.silu_experts), the shared expert and its gate. The elementwise products run in
float32 and are rounded once, so results differ from the eager block by bf16 rounding only.

It replaces the block's forward only where it computes exactly that: on CUDA, bf16 experts through
`dflash_grouped` with SiLU, not quantized (FP8 experts keep their forward) and not split over an
expert-parallel group (whose experts forward exchanges tokens). Everywhere else the block's own
forward runs, and on the CPU the traced function runs eagerly, which is how the tests check it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.compile import compile_once
from dflash_ds.target_model.moe import CHUNK_TOKENS, OWN, silu_experts


def route_tokens(hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool):
    """transformers' Qwen MoE router: top_k of the float32 softmax of hidden @ router.T, optionally
    renormalised to sum 1, in the logits' dtype -> (weights [T, k], expert ids [T, k])."""
    logits = F.linear(hidden, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), index


class Routed(NamedTuple):
    """A block's router and routed experts: router [E, D], gate_up [E, 2I, D], down [E, D, I], the top k,
    and the experts' token chunk (moe.CHUNK_TOKENS unless the module sets chunk_tokens)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    chunk: int


class Shared(NamedTuple):
    """Qwen3.5/3.6-MoE's shared expert (SwiGLU gate / up / down) and its sigmoid gate [1, D]."""

    gate_weight: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def _routed_sum(h: torch.Tensor, routed: Routed, renormalise: bool) -> torch.Tensor:
    weights, index = route_tokens(h, routed.router, routed.top_k, renormalise)
    return silu_experts(h, index, weights, routed.gate_up, down=routed.down, chunk=routed.chunk)


def qwen35_block(x: torch.Tensor, routed: Routed, shared: Shared) -> torch.Tensor:
    """Qwen3.5/3.6-MoE: routed experts (renormalised top k) + sigmoid(x @ gate_weight.T) * the shared expert."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    out = _routed_sum(h, routed, True)
    acc = torch.promote_types(h.dtype, torch.float32)
    act = (F.silu(F.linear(h, shared.gate).to(acc)) * F.linear(h, shared.up).to(acc)).to(h.dtype)
    gated = torch.sigmoid(F.linear(h, shared.gate_weight).to(acc)) * F.linear(act, shared.down).to(acc)
    return (out.to(acc) + gated).to(h.dtype).reshape(shape)


def qwen3_block(x: torch.Tensor, routed: Routed, renormalise: bool) -> torch.Tensor:
    """Qwen3-MoE: routed experts only (renormalised when the config's norm_topk_prob says so)."""
    shape = x.shape
    return _routed_sum(x.reshape(-1, shape[-1]), routed, renormalise).reshape(shape)


def block_tensors(block: nn.Module) -> tuple[Routed, Shared | None]:
    """The tensors the traced functions read from a transformers sparse MoE block."""
    ex = block.experts
    routed = Routed(block.gate.weight, ex.gate_up_proj, ex.down_proj, int(block.gate.top_k),
                    int(getattr(ex, "chunk_tokens", CHUNK_TOKENS)))
    s = getattr(block, "shared_expert", None)
    shared = None if s is None else Shared(block.shared_expert_gate.weight, s.gate_proj.weight, s.up_proj.weight,
                                           s.down_proj.weight)
    return routed, shared


def traced_usable(block: nn.Module) -> bool:
    """The compiled function computes this block's forward (see the module's docstring)."""
    ex = getattr(block, "experts", None)
    w = getattr(ex, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.is_cuda and w.dtype == torch.bfloat16
            and "forward" not in vars(ex)  # expert parallelism shadows the experts forward per instance
            and not getattr(ex, "drops", False)
            and getattr(ex.config, "_experts_implementation", None) == OWN
            and getattr(ex.config, "hidden_act", None) == "silu")


def _qwen35_forward(original, self, hidden_states):
    if not traced_usable(self):
        return original(self, hidden_states)
    return compile_once(qwen35_block)(hidden_states, *block_tensors(self))


def _qwen3_forward(original, self, hidden_states):
    if not traced_usable(self):
        return original(self, hidden_states)
    return compile_once(qwen3_block)(hidden_states, block_tensors(self)[0], bool(self.gate.norm_topk_prob))


def _method(forward, original):
    # A plain function (not a partial) so that it binds as a method.
    return lambda self, hidden_states: forward(original, self, hidden_states)


def fuse_moe_blocks() -> list[str]:
    """Route the Qwen3.5/3.6-MoE and Qwen3-MoE sparse blocks through the compiled function where it
    applies (GPU only; idempotent). Returns the classes patched."""
    import importlib

    if not torch.cuda.is_available():
        return []
    patched = []
    for name, cls, forward in (("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", _qwen35_forward),
                               ("qwen3_moe", "Qwen3MoeSparseMoeBlock", _qwen3_forward)):
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        block = getattr(module, cls)
        original = getattr(block.forward, "dflash_original", block.forward)
        block.forward = functools.wraps(original)(_method(forward, original))
        block.forward.dflash_original = original
        patched.append(cls)
    return patched
