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

from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.sampled import Sampling, target_probs
from dflash_ds.eval.specdec import draft_block, emitted, logits_and_taps
from dflash_ds.model.draft_model import DraftModel


def verify_block(logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling,
                 generator: torch.Generator) -> list[int]:
    """The tokens one cycle emits: accepted drafts, then a recovered or bonus token.

    logits [B, V]: row k-1 is the target's logits for the position of slot k (row B-1: the bonus).
    """
    out = []
    for k, d in enumerate(drafts.tolist()):
        p = target_probs(logits[k], sampling)
        u = torch.rand((), generator=generator, device=p.device, dtype=torch.float64)
        if p[d] >= u:
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    bonus = target_probs(logits[len(out)], sampling)
    out.append(int(torch.multinomial(bonus, 1, generator=generator)))
    return out


@torch.no_grad()
def speculative_sample(target, model: DraftModel, prompt_ids: torch.Tensor | Sequence[int], sampling: Sampling,
                       *, generator: torch.Generator, max_new_tokens: int,
                       eos_token_id=None) -> tuple[torch.Tensor, list[int]]:
    """Sampled speculative decoding of one prompt: (generated ids [n], tokens emitted per cycle).

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
        drafts = draft_block(model, taps[:t], generated[-1])
        seq = torch.cat([prompt, torch.tensor(generated, dtype=torch.long), drafts])
        logits, taps = logits_and_taps(target, seq, model.layer_ids)
        new = emitted(verify_block(logits[t:t + drafts.numel() + 1], drafts, sampling, generator),
                      max_new_tokens - len(generated), stop)
        counts.append(len(new))
        generated.extend(new)
    return torch.tensor(generated, dtype=torch.long), counts
