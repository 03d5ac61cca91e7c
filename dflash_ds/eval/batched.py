"""The target's continuations of many prompts at once, and the per-response seeds that make sampled
ones independent of how the prompts are batched.

`batched_continuations` answers a batch of prompts with one target forward per new token for the
whole batch: the prompts are left-padded (attention mask, positions counted from each prompt's first
real token) and decoded with the model's own KV cache. Each response stops at its own EOS (kept) or
its token budget, exactly as the per-prompt references (`generate.greedy_continuation`,
`sampled.sampled_continuation`) stop, and is returned as prompt + response, [S] on the CPU. In float32
on the CPU the responses equal the references' token for token (tests/test_benchmark_batch.py); in
bf16 a batch's kernels may round differently from one prompt's, so a near-tie can resolve the other way.

A sampled response draws its tokens from a generator of its own (`response_generator`), seeded from
(run seed, item, sample, turn): which other prompts share its batch, and in what order the responses
are produced, then change none of its draws.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.sampled import Sampling, target_probs


@dataclass(frozen=True)
class ResponseKey:
    """Which response: `item` (prompt or conversation index in its set), `sample` (0 .. samples-1),
    `turn` (the user turn it answers; 0 for single prompts)."""

    item: int = 0
    sample: int = 0
    turn: int = 0


def response_seed(seed: int, key: ResponseKey) -> int:
    """A 63-bit seed mixed from (seed, item, sample, turn). Hashed rather than added, so that the
    streams of neighbouring run seeds do not coincide with shifted items or samples."""
    text = f"{seed}/{key.item}/{key.sample}/{key.turn}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def response_generator(seed: int, key: ResponseKey, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one response's draws (see `response_seed`)."""
    return torch.Generator(device=device).manual_seed(response_seed(seed, key))


def _keeps_last_logits(target) -> bool:
    # Logits of the last position only: a batch of long prompts times a large vocabulary would
    # otherwise hold [B, S, V] floats at prefill.
    try:
        return "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def _next_tokens(logits: torch.Tensor, alive: list[bool], *, sampling: Sampling | None,
                 generators: Sequence[torch.Generator] | None) -> list[int]:
    """The next token of every row still decoding (-1 for the finished rows)."""
    if sampling is None or sampling.greedy:
        best = logits.float().argmax(-1).tolist()
        return [t if a else -1 for t, a in zip(best, alive)]
    # Row by row with each response's own generator: the same call, on the same distribution, as
    # the per-prompt loop makes.
    return [int(torch.multinomial(target_probs(logits[i], sampling), 1, generator=generators[i])) if a else -1
            for i, a in enumerate(alive)]


@torch.no_grad()
def batched_continuations(target, prompts: Sequence[torch.Tensor | Sequence[int]], *, max_new_tokens: int,
                          sampling: Sampling | None = None, generators: Sequence[torch.Generator] | None = None,
                          eos_token_id=None) -> list[torch.Tensor]:
    """prompt + the target's response for every prompt, [S_i] each on the CPU (module docstring).

    Greedy when `sampling` is None or greedy; else sampled with `sampling`, row i drawing from
    `generators[i]`.
    """
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    sampled = sampling is not None and not sampling.greedy
    if sampled and (generators is None or len(generators) != len(prompts)):
        raise ValueError(f"a sampled batch needs one generator per prompt ({len(prompts)})")
    if not prompts:
        return []
    stop = set(eos_ids(target, eos_token_id))
    device = next(target.parameters()).device
    width = max(p.numel() for p in prompts)
    pad = 0  # any id the embedding holds: padded positions are masked, finished rows' outputs ignored
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        mask[i, width - p.numel():] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if _keeps_last_logits(target) else {}
    responses: list[list[int]] = [[] for _ in prompts]
    alive = [max_new_tokens > 0] * len(prompts)
    # Every step is a new shape: run eager, as the per-prompt references do.
    with torch.compiler.set_stance("force_eager"):
        out = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        while any(alive):
            tokens = _next_tokens(out.logits[:, -1], alive, sampling=sampling, generators=generators)
            for i, tok in enumerate(tokens):
                if alive[i]:
                    responses[i].append(tok)
                    alive[i] = tok not in stop and len(responses[i]) < max_new_tokens
            if not any(alive):
                break
            # Finished rows keep decoding a pad token (their output is ignored) so the batch keeps
            # one cache; shrinking it would save little at eval's short budgets.
            step = torch.tensor([[t if t >= 0 else pad] for t in tokens], device=device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = target(input_ids=step, attention_mask=mask, position_ids=positions,
                         past_key_values=out.past_key_values, use_cache=True, **extra)
    return [torch.cat([p, torch.tensor(r, dtype=torch.long)]) for p, r in zip(prompts, responses)]


class SharedResponses:
    """The target's responses kept across Responders, so that several drafters measured against one target
    in one process (`python -m lab evaluate`) have each response generated once.

    A response is what `batched_continuations` gives for (prompt, sampling, budget) and, when sampled, the
    response's own seed (`response_seed`): the drafter plays no part in it. Greedy responses ignore the
    seed, so runs of other seeds share them too."""

    def __init__(self):
        self._kept: dict[tuple, torch.Tensor] = {}
        self.generated = 0  # responses generated (not found kept): what the sharing saves is visible

    @staticmethod
    def key(prompt: torch.Tensor, sampling: Sampling, *, budget: int, seed: int, response: ResponseKey) -> tuple:
        drawn = None if sampling.greedy else (sampling.temperature, sampling.top_p, sampling.top_k, response_seed(seed, response))
        return tuple(prompt.tolist()), budget, drawn

    def continuations(self, target, prompts: Sequence[torch.Tensor | Sequence[int]], keys: Sequence[ResponseKey], *,
                      max_new_tokens: int, sampling: Sampling, seed: int, generators=None) -> list[torch.Tensor]:
        """`batched_continuations` of the prompts, the responses not kept generated together (as one batch)."""
        prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        ids = [self.key(p, sampling, budget=max_new_tokens, seed=seed, response=k) for p, k in zip(prompts, keys)]
        todo = [i for i, k in enumerate(ids) if k not in self._kept]
        if todo:
            made = batched_continuations(target, [prompts[i] for i in todo], max_new_tokens=max_new_tokens,
                                         sampling=sampling, generators=None if generators is None else
                                         [generators[i] for i in todo])
            for i, x in zip(todo, made):
                self._kept[ids[i]] = x
            self.generated += len(todo)
        return [self._kept[k] for k in ids]
