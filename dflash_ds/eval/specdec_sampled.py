"""Reference speculative decoding with sampling, verifying a DFlash block the way vLLM and SGLang do.

The cycle of `eval.specdec` (draft a block at the anchor, one cacheless target forward over the
sequence + block), with the engines' sampled verification instead of argmax matching
(`eval.sampled` states the rule): for k = 1 .. B-1, with p_k = `target_probs` at the position of
slot k and u ~ U[0, 1), accept d_k when p_k(d_k) >= u; on the first rejection emit a token drawn
from p_k without d_k (renormalised) and end the cycle; when all B-1 are accepted emit a bonus token
drawn from p_B. It draws its own coins, so it does not share randomness with the offline walk:
the two agree in distribution, which the tests check statistically.

`block=True` verifies the block jointly instead (vLLM's `rejection_sample_method: block`,
docs/algorithm.md section 7.5): `joint_thresholds` gives each prefix's acceptance threshold and
`joint_expected_accepted` the expected number of accepted drafts of one block.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_ds.network.arch_types import SampledDraft
from dflash_ds.eval.generate import eos_ids
from dflash_ds.eval.sampled import Sampling, target_probs
from dflash_ds.eval.specdec import block_states, emitted, logits_and_taps
from dflash_ds.network.draft_model import DraftModel


def draft_rows(drafts: torch.Tensor, like: torch.Tensor, draft: SampledDraft | None) -> torch.Tensor:
    """q [L, V] of the L drafts: the sampled draft's rows, or point masses on a greedy draft's tokens."""
    if draft is not None:
        return draft.q[0, :drafts.numel()].to(device=like.device, dtype=like.dtype)
    q = torch.zeros(drafts.numel(), like.shape[-1], dtype=like.dtype, device=like.device)
    q[torch.arange(drafts.numel()), drafts.to(like.device)] = 1.0
    return q


def joint_thresholds(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's thresholds of one drafted block (Sun et al., 2024): (h, ratio), each [L + 1].

    p [L + 1, V]: the target's distributions at the block's positions (row k: the position of slot
    k + 1, row L: the bonus); q [L, V]: the draft's distributions of its L slots; drafts [L].
    ratio[i] = min(1, ratio[i-1] p(d_i) / q(d_i)) is the capped joint likelihood ratio of the first i
    drafts (ratio[0] = 1). h[0] = 1, h[L] = ratio[L], and for 0 < i < L, with r_i the mass
    sum_x max(0, ratio[i] p_{i+1}(x) - q_{i+1}(x)) left at the next position,
    h[i] = r_i / (r_i + 1 - ratio[i]) (1 where that is 0 / 0). The verifier draws one u_i per i and
    accepts the first max{i : u_i <= h[i]} drafts: a later prefix can be accepted after an earlier
    one failed its coin, which is what makes the joint rule accept more than the per-token one.
    """
    L = drafts.numel()
    ratio = [torch.ones((), dtype=p.dtype, device=p.device)]
    for i, d in enumerate(drafts.tolist()):
        ratio.append(torch.clamp(ratio[-1] * p[i, d] / q[i, d], max=1.0))
    h = [torch.ones_like(ratio[0])]
    for i in range(1, L):
        residual = (ratio[i] * p[i] - q[i]).clamp(min=0.0).sum()
        denom = residual + 1.0 - ratio[i]
        h.append(residual / denom if denom > 0 else torch.ones_like(denom))
    if L:
        h.append(ratio[L])
    return torch.stack(h), torch.stack(ratio)


def joint_expected_accepted(h: torch.Tensor) -> torch.Tensor:
    """E[accepted drafts] of one block under block verification, from its thresholds `h` [L + 1]:
    the coins are independent, so P(at least k accepted) = 1 - prod_{i >= k} (1 - h[i])."""
    miss = torch.flip(torch.cumprod(torch.flip(1.0 - h[1:], [0]), 0), [0])  # miss[k-1] = prod_{i>=k} (1 - h[i])
    return (1.0 - miss).sum()


def verify_jointly(logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling,
                   generator: torch.Generator, *, draft: SampledDraft | None = None) -> list[int]:
    """The tokens one cycle emits under block verification (`joint_thresholds`): the first tau drafts,
    then a token from max(0, ratio[tau] p - q) at the next position, or the bonus from p when all L
    were accepted. Lossless like the per-token rule: the emitted text is distributed as the target's."""
    L = drafts.numel()
    p = torch.stack([target_probs(logits[k], sampling) for k in range(L + 1)])
    q = draft_rows(drafts, p, draft)
    h, ratio = joint_thresholds(p, q, drafts)
    u = torch.rand(L + 1, generator=generator, dtype=h.dtype, device=h.device)
    tau = max(i for i in range(L + 1) if u[i] <= h[i])  # h[0] = 1: i = 0 always qualifies
    row = p[L] if tau == L else (ratio[tau] * p[tau] - q[tau]).clamp(min=0.0)
    return drafts[:tau].tolist() + [int(torch.multinomial(row / row.sum(), 1, generator=generator))]


def verify_block(logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling,
                 generator: torch.Generator, *, draft: SampledDraft | None = None) -> list[int]:
    """The tokens one cycle emits: accepted drafts, then a recovered or bonus token.

    logits [B, V]: row k-1 is the target's logits for the position of slot k (row B-1: the bonus).
    `draft`: a sampled draft (its q rows); None, the greedy draft `drafts` (q a point mass on each).
    Slot k is accepted when p(d) >= u q(d); on a rejection the token comes from max(0, p - q).
    """
    out, qs = [], None
    for k, d in enumerate(drafts.tolist()):
        p = target_probs(logits[k], sampling)
        qs = draft_rows(drafts, p, draft) if qs is None else qs
        q = qs[k]
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
                       draft_generator: torch.Generator | None = None,
                       block: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Sampled speculative decoding of one prompt: (generated ids [n], tokens emitted per cycle).
    A sampled draft (LiLiCorr's) draws its walk from `draft_generator` (default: `generator`).
    `block`: verify each block jointly (`verify_jointly`, vLLM's `rejection_sample_method: block`).

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
        verify = verify_jointly if block else verify_block
        new = emitted(verify(logits[t:t + drafts.numel() + 1], drafts, sampling, generator, draft=draft),
                      max_new_tokens - len(generated), stop)
        counts.append(len(new))
        generated.extend(new)
    return torch.tensor(generated, dtype=torch.long), counts
