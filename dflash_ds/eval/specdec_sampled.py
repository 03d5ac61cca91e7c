"""Reference speculative decoding with sampling, verifying a DFlash block the way vLLM and SGLang do.

The cycle of `eval.specdec` (draft a block at the anchor, one cacheless target forward over the
sequence + block), with the engines' sampled verification instead of argmax matching
(`eval.sampled` states the rule): for k = 1 .. B-1, with p_k = `target_probs` at the position of
slot k and u ~ U[0, 1), accept d_k when p_k(d_k) >= u; on the first rejection emit a token drawn
from p_k without d_k (renormalised) and end the cycle; when all B-1 are accepted emit a bonus token
drawn from p_B. It draws its own coins, so it does not share randomness with the offline walk:
the two agree in distribution, which the tests check statistically.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_ds.network.arch_types import SampledDraft
from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.sampled import Sampling, target_probs
from dflash_ds.eval.specdec import block_states, emitted, logits_and_taps
from dflash_ds.network.draft_model import DraftModel


def verify_block(logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling,
                 generator: torch.Generator, *, draft: SampledDraft | None = None) -> list[int]:
    """The tokens one cycle emits: accepted drafts, then a recovered or bonus token.

    logits [B, V]: row k-1 is the target's logits for the position of slot k (row B-1: the bonus).
    `draft`: a sampled draft (its q rows); None, the greedy draft `drafts` (q a point mass on each).
    Slot k is accepted when p(d) >= u q(d); on a rejection the token comes from max(0, p - q).
    """
    out = []
    for k, d in enumerate(drafts.tolist()):
        p = target_probs(logits[k], sampling)
        if draft is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft.q[0, k].to(device=p.device, dtype=p.dtype)
        u = torch.rand((), generator=generator, device=p.device, dtype=torch.float64)
        if p[d] >= u * q[d]:
            out.append(d)
            continue
        residual = (p - q).clamp(min=0.0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    bonus = target_probs(logits[len(out)], sampling)
    out.append(int(torch.multinomial(bonus, 1, generator=generator)))
    return out


@torch.no_grad()
def speculative_sample(target, model: DraftModel, prompt_ids: torch.Tensor | Sequence[int], sampling: Sampling,
                       *, generator: torch.Generator, max_new_tokens: int, eos_token_id=None,
                       draft_generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[int]]:
    """Sampled speculative decoding of one prompt: (generated ids [n], tokens emitted per cycle).
    A sampled draft (LiLiCorr's) draws its walk from `draft_generator` (default: `generator`).

    The first token comes from the prefill (no cycle); stops after max_new_tokens tokens or an EOS.
    """
    sampling.check()
    if sampling.greedy or max_new_tokens < 1:
        raise ValueError("speculative_sample needs a temperature > 0 and max_new_tokens >= 1")
    stop = set(eos_ids(target, eos_token_id))
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu()
    logits, taps = logits_and_taps(target, prompt, model.layer_ids)
    generated = [int(torch.multinomial(target_probs(logits[-1], sampling), 1, generator=generator))]
    counts: list[int] = []
    while len(generated) < max_new_tokens and generated[-1] not in stop:
        t = prompt.numel() + len(generated) - 1  # the anchor: position of the last emitted token
        states, row = block_states(model, taps[:t], generated[-1])
        # The engines draw an architecture's sampled draft from its own distribution; others draft greedily.
        draft = model.sampled_draft(states, sampling.temperature, draft_generator or generator, context=row)
        if draft is None:
            drafts = model.draft(states, torch.tensor([generated[-1]]), context=row).cpu()[0]
        else:
            drafts = draft.tokens.cpu()[0]
        seq = torch.cat([prompt, torch.tensor(generated, dtype=torch.long), drafts])
        logits, taps = logits_and_taps(target, seq, model.layer_ids)
        new = emitted(verify_block(logits[t:t + drafts.numel() + 1], drafts, sampling, generator, draft=draft),
                      max_new_tokens - len(generated), stop)
        counts.append(len(new))
        generated.extend(new)
    return torch.tensor(generated, dtype=torch.long), counts
