"""Reference greedy speculative decoding with a DFlash drafter, for dense targets (Qwen3, Llama).

Clarity over speed: the target runs without a cache over the whole sequence once per cycle (so
it also works for targets whose cache cannot be cropped). Its output equals plain greedy
decoding, and its per-cycle counts equal the offline walk of `dflash_ds.eval.tau` (whose module
docstring states the convention): the tests hold both to that.

One cycle, anchored at the position t of the last emitted token (the bonus):
  1. draft: the drafter reads the target's tapped states of positions < t and the block
     [bonus, MASK x (B-1)] at positions t .. t+B-1; slots 1 .. B-1 give d_1 .. d_{B-1};
  2. verify: one target forward over the sequence followed by [bonus, d_1 .. d_{B-1}] gives the
     target's greedy token g_k for every position t+k (k = 1 .. B);
  3. accept the longest prefix with d_k == g_k (a drafts), then the target's own g_{a+1}; a + 1
     tokens are emitted (fewer when the budget or an EOS ends the response inside them).
The taps of that verify pass at positions <= t + a were computed from accepted tokens only, so
they are the next cycle's context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_ds.eval.generate import eos_ids
from dflash_ds.network.attention import DFlashMask
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.target_model.model import TapCapture, text_config


@torch.no_grad()
def logits_and_taps(target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits [S, V] and tapped states [S, T*D] of one cacheless, teacher-forced forward
    (the verification forward of both online loops, greedy and sampled)."""
    p = next(target.parameters())
    d = text_config(target.config).hidden_size
    ids = input_ids.reshape(1, -1).to(p.device)
    taps = torch.empty(1, ids.shape[1], len(layer_ids) * d, dtype=p.dtype, device=p.device)
    capture = TapCapture(target, layer_ids)
    capture.out = taps
    try:
        logits = target(input_ids=ids, use_cache=False).logits
    finally:
        capture.out = None
        capture.remove()
    return logits[0], taps[0]


def emitted(new: list[int], room: int, stop) -> list[int]:
    """What a cycle emits of the tokens it verified: at most `room` (the token budget left), and
    nothing after the first stop token (both loops end a response where the engines do)."""
    new = new[:room]
    for i, tok in enumerate(new):
        if tok in stop:
            return new[:i + 1]
    return new


def serving_masks(model: DraftModel, t: int, device) -> tuple[DFlashMask, ...]:
    """Per-layer masks of one block at positions t .. t+B-1 over the context 0 .. t-1, written from
    the engines' rule by position (docs/algorithm.md section 3): query p sees key q iff p - q < W
    (sliding layers) and, in a causal layer, q <= p. Deliberately not `build_mask`, which the
    offline path uses, so the two paths check each other."""
    block_size = model.block_size
    q_pos = torch.arange(t, t + block_size, device=device).view(-1, 1)
    k_pos = torch.arange(t + block_size, device=device).view(1, -1)
    masks = []
    for att in model.config.layer_attentions():
        allowed = torch.ones(block_size, t + block_size, dtype=torch.bool, device=device)
        if att.window is not None:
            allowed &= q_pos - k_pos < att.window
        if att.causal:
            allowed &= k_pos <= q_pos
        masks.append(DFlashMask(query_len=block_size, kv_len=t + block_size, dense=allowed[None, None], attention=att))
    return tuple(masks)


@torch.no_grad()
def draft_block(model: DraftModel, context_taps: torch.Tensor, anchor_token: int) -> torch.Tensor:
    """The drafted tokens (B - 1, or B anchor-first) of one block anchored right after `context_taps` [t, T*D]: the block
    sees the context (within each layer's window) and itself (`serving_masks`)."""
    states, row = block_states(model, context_taps, anchor_token)
    return model.draft(states, torch.tensor([anchor_token]), context=row).cpu()[0]


@torch.no_grad()
def block_states(model: DraftModel, context_taps: torch.Tensor, anchor_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the drafting slots' states [1, L, D], the anchor's context row [1, D]) of `draft_block`'s block."""
    drafter, block_size = model.drafter, model.block_size
    p = next(drafter.parameters())
    t = context_taps.shape[0]
    ctx = drafter.fuse(context_taps[None].to(device=p.device, dtype=p.dtype))
    block = torch.full((block_size,), model.mask_token_id, dtype=torch.long)
    block[0] = anchor_token
    embeds = model.embed_tokens(block[None], p)
    block_pos = torch.arange(t, t + block_size, device=p.device)[None]
    ctx_pos = torch.arange(t, device=p.device)[None]
    hidden = drafter(embeds, ctx, block_pos, ctx_pos, mask=serving_masks(model, t, p.device))
    # The anchor's context row, the fused state before it (t >= 1: the prompt's last token at least).
    return model.drafting_states(hidden), ctx[:, t - 1]


@torch.no_grad()
def speculative_generate(target, model: DraftModel, prompt_ids: torch.Tensor | Sequence[int], *, max_new_tokens: int,
                         eos_token_id=None) -> tuple[torch.Tensor, list[int]]:
    """Greedy speculative decoding of one prompt.

    Returns (generated token ids [n] without the prompt, tokens emitted per cycle). The prefill
    token is not a cycle, so sum(counts) == n - 1. Stops after max_new_tokens tokens or after an
    EOS (kept, as HF generate keeps it); eos_token_id defaults to the target's generation config.
    The target is tapped at the drafter's layers (`model.layer_ids`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    layer_ids = model.layer_ids
    stop = set(eos_ids(target, eos_token_id))
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu()
    logits, taps = logits_and_taps(target, prompt, layer_ids)
    greedy = logits.argmax(-1)
    generated = [int(greedy[-1])]
    counts: list[int] = []
    while len(generated) < max_new_tokens and generated[-1] not in stop:
        t = prompt.numel() + len(generated) - 1  # position of the bonus token, the anchor
        drafts = draft_block(model, taps[:t], generated[-1])
        seq = torch.cat([prompt, torch.tensor(generated, dtype=torch.long), drafts])
        logits, taps = logits_and_taps(target, seq, layer_ids)
        greedy = logits.argmax(-1)
        verified = greedy[t:t + drafts.numel() + 1].cpu()  # verified[k - 1] = target's token at t + k
        a = int((drafts == verified[:-1]).long().cumprod(0).sum())
        new = emitted(drafts[:a].tolist() + [int(verified[a])], max_new_tokens - len(generated), stop)
        counts.append(len(new))
        generated.extend(new)
    return torch.tensor(generated, dtype=torch.long), counts
