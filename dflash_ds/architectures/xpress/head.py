"""XPress's refiner head and its math (arXiv 2608.02438; vLLM 0.34's `XPressRefinerHead` is what serves it):
a causal low-rank refiner over the DFlash block whose output is a logit bias on the backbone's draft, the
block solved by K Jacobi passes.

For a block of B slots (slot 0 the anchor, slots 1..B-1 drafting) with final states h [B, D] and a
token before each slot (`prev`: slot 0 and slot 1 read the anchor, slot k >= 2 the token at slot k - 1):

    x[k] = in_proj([down_h(h[k]) ; down_g(mean_j h[j]) ; w1[prev[k]]])          rank r
    u[k] = x[k] + sum_{j <= k} L[:, k, j] * x[j]                                 per channel, causal
    z[k] = u[k] + mlp_down(silu(mlp_gate(u[k])) * mlp_up(u[k]))
    bias[k] = w2 @ z[k]                                                          [V]

Causal in the block, so a settled prefix stays settled under the passes. Slot 0's prev is the anchor
itself, as vLLM feeds it (the token before the anchor lives only in its KV cache); training does the
same, so the served head reads what it was trained on. `L` is kept raw (zeros at first: the head starts
as its residual path alone) and exported raw as `xpress_head.mix.L`: vLLM folds `L * tril + I` on loading.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02
"""speculators' init of the refiner's linears and embedding (the raw mixer starts at zero)."""


class Mixer(nn.Module):
    """The per-channel causal mixer's raw matrices `L` [r, B, B] (only the lower triangle acts)."""

    def __init__(self, rank: int, block_size: int):
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, B, r] -> x + (L * tril) x, channel by channel."""
        b = x.shape[1]
        tril = torch.ones(b, b, dtype=torch.bool, device=x.device).tril()
        mixed = torch.einsum("ckj,njc->nkc", torch.where(tril, self.L, 0).to(x.dtype), x)
        return x + mixed


class XPressHead(nn.Module):
    """The refiner; state-dict names are vLLM 0.34's (`w1`, `down_h`, `down_g`, `in_proj`, `mix.L`,
    `mlp_gate`, `mlp_up`, `mlp_down`, `w2`)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, block_size: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.rank, self.block_size = rank, block_size
        self.w1 = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = Mixer(rank, block_size)
        self.mlp_gate = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_up = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_down = nn.Linear(mlp_hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in (self.w1, self.down_h, self.down_g, self.in_proj, self.mlp_gate, self.mlp_up, self.mlp_down,
                       self.w2):
            module.weight.normal_(0.0, INIT_STD)
        self.mix.L.zero_()

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, B, D] block states -> [n, B, 2r]: the part of every pass's input that no pass changes."""
        g = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(g)], dim=-1)

    def latent(self, prev: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """z [n, B, r] from each slot's previous token `prev` [n, B] and the blocks' `hidden_cache`."""
        x = self.in_proj(torch.cat([cache, self.w1(prev).to(cache.dtype)], dim=-1))
        u = self.mix(x)
        return u + self.mlp_down(F.silu(self.mlp_gate(u)) * self.mlp_up(u))


def previous_tokens(anchors: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each slot's previous token [n, B] of blocks whose anchors are `anchors` [n] and whose drafting
    slots hold `tokens` [n, B - 1]: the anchor for slots 0 and 1, then the token one slot back."""
    a = anchors.long().view(-1, 1)
    return torch.cat([a, a, tokens[:, :-1].long()], dim=1)


def refined_bias(head: XPressHead, cache: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The drafting slots' latents [n, B - 1, r] with the block holding `tokens` (the bias is `w2` of them)."""
    return head.latent(previous_tokens(anchors, tokens), cache)[:, 1:]


@torch.no_grad()
def jacobi_walk(head: XPressHead, base: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor, *, passes: int,
                topc: int) -> torch.Tensor:
    """vLLM 0.34's greedy XPress draft [n, B - 1]: from the base logits of the drafting slots `base`
    [n, B - 1, V] and every slot's states `hidden` [n, B, D], the base argmax refined by `passes` Jacobi
    passes, each slot taking the argmax of base + bias with the block as the previous pass left it. With
    `topc` > 0 a slot chooses among its base logits' top `topc` candidates, fixed for the step (vLLM's
    default 512; 0: the whole vocabulary)."""
    cache = head.hidden_cache(hidden)
    tokens = base.argmax(-1)
    v = base.shape[-1]
    c = min(topc, v)
    if c:
        base_c, cand = base.topk(c, dim=-1)
        table = head.w2.weight[cand]  # [n, B - 1, C, r]
    for _ in range(passes):
        z = refined_bias(head, cache, anchors, tokens).to(base.dtype)
        if c:
            scores = base_c + torch.einsum("nscr,nsr->nsc", table.to(base.dtype), z)
            tokens = cand.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        else:
            tokens = (base + F.linear(z, head.w2.weight.to(base.dtype))).argmax(-1)
    return tokens
