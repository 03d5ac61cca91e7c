"""The target's side of tau: greedy continuations, teacher-forced taps, and the whole offline measurement."""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_ds.eval.tau import DEFAULT_BATCH_ANCHORS, TauReport, tau_from_taps
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.target_model.model import TapCapture, forward_taps, text_config


def eos_ids(target, eos_token_id=None) -> list[int]:
    """The stop tokens: the explicit argument, else the target's generation config."""
    if eos_token_id is None:
        gen = getattr(target, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)]


@torch.no_grad()
def greedy_continuation(target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """prompt + the target's greedy response (HF generate, do_sample False), as [S] on the CPU.

    A fresh GenerationConfig keeps a checkpoint's sampling defaults (temperature, repetition
    penalty) out of it: tau is defined for plain greedy decoding.
    """
    from transformers import GenerationConfig

    eos = eos_ids(target, eos_token_id)
    device = next(target.parameters()).device
    ids = prompt_ids.reshape(1, -1).to(device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                           pad_token_id=eos[0] if eos else 0)
    # Every prompt length and decode step is a new shape. The target's compiled kernels have fixed
    # shapes: they would recompile per shape and, past Dynamo's recompile limit, run eager for the
    # training shape too (docs/performance.md, "Figures behind the code"). Generation is rare and
    # short, so it runs eager.
    with torch.compiler.set_stance("force_eager"):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0].cpu()


@torch.no_grad()
def target_taps(target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """The target's tapped states [S, T*D] over input_ids [S], teacher-forced, no lm_head."""
    p = next(target.parameters())
    d = text_config(target.config).hidden_size
    ids = input_ids.reshape(1, -1).to(p.device)
    out = torch.empty(1, ids.shape[1], len(layer_ids) * d, dtype=p.dtype, device=p.device)
    capture = TapCapture(target, layer_ids)
    try:
        forward_taps(target, capture, ids, None, out=out)
    finally:
        capture.remove()
    return out[0]


@torch.no_grad()
def offline_tau(target, model: DraftModel, prompts: Sequence[torch.Tensor | Sequence[int]], *, max_new_tokens: int,
                eos_token_id=None, batch_anchors: int = DEFAULT_BATCH_ANCHORS, sequences: list | None = None) -> TauReport:
    """Exact greedy tau of `model` on `prompts` (token ids): greedy response, one teacher-forced
    tap pass over the drafter's tap layers, a(t) for every response position, the walk.
    `sequences`, when a list, receives each prompt + response."""
    report = TauReport(block_size=model.max_emitted)
    for prompt in prompts:
        prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        x = greedy_continuation(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        if sequences is not None:
            sequences.append(x)
        taps = target_taps(target, x, model.layer_ids)
        report.cycles.append(tau_from_taps(model, taps, x, prompt.numel(), end=x.numel(), batch_anchors=batch_anchors))
    return report
