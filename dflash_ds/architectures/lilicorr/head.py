"""LiLiCorr's head: the candidate reranker over the backbone's top-k candidates of every drafted slot.

Every module and parameter is named as the serving engines load it (the export prefix is `lilicorr.`):
Model-Optimizer's module names and packed q, k, v projection `layers.{l}.attn.in_proj_weight`, with the
feature norm and the two MLPs as vLLM's and SGLang's loaders build them (`feature_norm`,
`feature_mlp.up_proj` / `down_proj`, `layers.{l}.mlp.up_proj` / `down_proj`) rather than as
Model-Optimizer's nn.Sequential indices, which both loaders refuse (tests/fixtures/lilicorr_reader_rules.json).

Per block of S = B - 1 drafted slots and k candidates a slot, the head builds a k * S lattice of
candidate states (the candidate's target embedding, the slot's drafted state, five features of its
log-probability, a slot and a rank embedding), runs `num_layers` bidirectional layers over it with a
per-head bias by slot distance, conditions every state on the anchor's context row, and scores
`cos(out[s, i], in[s + 1, j])` between neighbouring slots and `cos(anchor_out, in[1, j])` for the
first slot. The log-factors are `logit_scale` times those cosines, in fp32.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.network.drafter import RMSNorm  # the backbone's norm: the same numerics and state-dict name

NUM_FEATURES = 5
"""log p, p, log p minus the slot's best, the rank as a fraction of k - 1, is-rank-0 (this order:
the feature norm and the first Linear read it)."""
FEATURE_NORM_EPS = 1e-5  # torch's LayerNorm default, which Model-Optimizer's feature norm keeps
LINEAR_INIT_STD = 0.01
"""Model-Optimizer draws every Linear of the head from normal(0, initializer_range); its DFlash
default configuration sets initializer_range to 0.01."""
FACTOR_INIT_STD = 0.02
"""The three factor heads are drawn again at 0.02: the scores are a product of two of them, whose
gradient would vanish at a near-zero start."""
ALIGN = 8  # ZeRO-2 alignment: every parameter's size a multiple of 8 elements (docs/architecture.md)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _padded_size(shape: tuple[int, ...]) -> int:
    return -(-_numel(shape) // ALIGN) * ALIGN


class PaddedParameters(nn.Module):
    """A module some of whose parameters are stored flat and zero-padded to a multiple of 8 elements
    (as `<name>_slots`), while the state dict holds them under `<name>` with their own shape: the
    names and shapes the engines, the export and `init_from` read. The padding's gradient is zero,
    so it stays zero under AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self._padded_shapes: dict[str, tuple[int, ...]] = {}

    def add_padded(self, name: str, shape: tuple[int, ...]) -> None:
        self._padded_shapes[name] = tuple(shape)
        self.register_parameter(name + "_slots", nn.Parameter(torch.zeros(_padded_size(shape))))

    def padded(self, name: str) -> torch.Tensor:
        shape = self._padded_shapes[name]
        flat = getattr(self, name + "_slots")
        return flat[:_numel(shape)].view(shape)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._padded_shapes:
            destination.pop(prefix + name + "_slots")
            value = self.padded(name)
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *reports):
        missing_keys, _, error_msgs = reports  # torch's lists, filled in place
        state_dict = dict(state_dict)
        renamed, wrong = {}, set()
        for name, shape in self._padded_shapes.items():
            key, slots = prefix + name, prefix + name + "_slots"
            renamed[slots] = key
            if key not in state_dict:
                continue
            value = state_dict.pop(key)
            if tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is torch.Size({list(shape)}).")
                wrong.add(slots)
                continue
            flat = value.reshape(-1)
            state_dict[slots] = torch.cat([flat, flat.new_zeros(_padded_size(shape) - flat.numel())])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *reports)
        missing_keys[:] = [renamed.get(k, k) for k in missing_keys if k not in wrong]


class FeatureNorm(PaddedParameters):
    """LayerNorm over the five candidate features (`feature_norm`), its 5-element weight and bias padded."""

    def __init__(self) -> None:
        super().__init__()
        self.add_padded("weight", (NUM_FEATURES,))
        self.add_padded("bias", (NUM_FEATURES,))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight_slots.zero_()[:NUM_FEATURES].fill_(1.0)
            self.bias_slots.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In x's dtype, the features' (fp32 for a bf16 head): five numbers a candidate, so nothing to save,
        # and in bf16 the gradient of the 5-element weight, a sum over every candidate of the block
        # (n x S x k terms that largely cancel), came out 24% off float32's (eager, CPU) against 1% for
        # the head's other weights.
        w, b = self.padded("weight").to(x.dtype), self.padded("bias").to(x.dtype)
        return F.layer_norm(x, (NUM_FEATURES,), w, b, FEATURE_NORM_EPS)


class LatticeAttention(nn.Module):
    """Bidirectional multi-head attention over the lattice with an additive bias: torch's
    nn.MultiheadAttention's parameters (packed q, k, v `in_proj_weight` [3h, h] and `in_proj_bias`,
    `out_proj`), computed through scaled_dot_product_attention so the bias rides along."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, p, width = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(n, p, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(n, p, width))


class HeadMLP(nn.Module):
    """Ungated SiLU MLP, down_proj(silu(up_proj(x))), both with a bias."""

    def __init__(self, width: int, inner: int, out: int):
        super().__init__()
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeLayer(nn.Module):
    """Pre-norm: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)) with an ungated SiLU MLP."""

    def __init__(self, width: int, num_heads: int, mlp_width: int, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = HeadMLP(width, mlp_width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class Geometry(NamedTuple):
    """The head's sizes (section `drafter.lilicorr:` resolved against the drafter's width)."""

    hidden: int  # H, the drafter's (and target's) width
    width: int  # h, the head's
    factor_dim: int
    num_layers: int
    num_heads: int
    mlp_width: int
    slots: int  # S = B - 1
    top_k: int
    eps: float  # the backbone's rms_norm_eps
    logit_scale: float
    vector_eps: float


class Factors(NamedTuple):
    """A block's log-factors, fp32: `start` [n, k] the first slot's, `pair` [n, S - 1, k, k] from
    candidate i of slot s to candidate j of slot s + 1."""

    start: torch.Tensor
    pair: torch.Tensor


def candidate_features(log_probs: torch.Tensor) -> torch.Tensor:
    """The five features [..., k, 5] of candidates whose full-vocabulary log-probs are `log_probs`
    [..., k] (rank order), in fp32 (float64 log-probs, of reference checks, stay float64)."""
    lp = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
    k = lp.shape[-1]
    rank = torch.arange(k, device=lp.device, dtype=lp.dtype)
    frac = rank / (k - 1) if k > 1 else torch.zeros_like(rank)
    return torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, frac.expand_as(lp),
                        (rank == 0).to(lp.dtype).expand_as(lp)], dim=-1)


class LiLiCorrHead(PaddedParameters):
    """The reranker (module docstring); `token_proj` only when its width differs from the drafter's."""

    def __init__(self, geometry: Geometry):
        super().__init__()
        g = self.geometry = geometry
        h = g.width
        self.token_proj = nn.Linear(g.hidden, h) if h != g.hidden else None
        self.pass_hidden_proj = nn.Linear(g.hidden, h)
        self.feature_norm = FeatureNorm()
        self.feature_mlp = HeadMLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, g.slots, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, g.top_k, h))
        # nh scalars a signed slot distance (-(B-1) .. B-1) and nh for "same slot": sizes rarely a
        # multiple of 8, hence padded.
        self.add_padded("relative_slot_bias", (g.num_heads, 2 * g.slots + 1))
        self.add_padded("same_slot_bias", (g.num_heads,))
        self.context_proj = nn.Linear(g.hidden, h)
        self.layers = nn.ModuleList(LatticeLayer(h, g.num_heads, g.mlp_width, g.eps) for _ in range(g.num_layers))
        self.output_norm = RMSNorm(h, g.eps)
        self.anchor_norm = RMSNorm(h, g.eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, g.factor_dim)
        self.in_head = nn.Linear(h, g.factor_dim)
        self.anchor_out_head = nn.Linear(h, g.factor_dim)
        self.reset_parameters()

    def compile_units(self) -> list[nn.Module]:
        """Under `drafter.compile` the whole head is one graph: its norms, activations, features, bias and
        cosines run over every [n, S * k, h] lattice state, each a pass over memory when run eager."""
        return [self]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Model-Optimizer's starting point: every Linear N(0, 0.01) with zero bias, then the factor heads
        N(0, 0.02); the packed q, k, v Xavier-uniform (torch's MultiheadAttention) with zero bias; norms
        1; the embeddings and attention biases 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, LINEAR_INIT_STD)
                module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, FeatureNorm):
                module.reset_parameters()
            elif isinstance(module, LatticeAttention):
                nn.init.xavier_uniform_(module.in_proj_weight)
                module.in_proj_bias.zero_()
        for linear in (self.out_head, self.in_head, self.anchor_out_head):
            linear.weight.normal_(0.0, FACTOR_INIT_STD)
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias_slots, self.same_slot_bias_slots):
            p.zero_()

    def attention_bias(self, slots: int | None = None) -> torch.Tensor:
        """[nh, kS', kS']: relative_slot_bias by query slot minus key slot, plus same_slot_bias within a slot
        (positions slot-major: p = s * k + r), for the first S' = `slots` slots (default all S)."""
        g = self.geometry
        slots = g.slots if slots is None else slots
        slot = torch.arange(slots * g.top_k, device=self.slot_embedding.device) // g.top_k
        distance = slot[:, None] - slot[None, :]
        # Gathered in (at least) fp32: the gradient of each of the nh x (2S + 1) scalars is a sum over the
        # (kS)^2 lattice pairs at its distance, which a bf16 gather's backward accumulates in bf16.
        dtype = torch.promote_types(self.slot_embedding.dtype, torch.float32)
        bias = self.padded("relative_slot_bias").to(dtype)[:, distance + g.slots]
        return bias + self.padded("same_slot_bias").to(dtype)[:, None, None] * (distance == 0)

    def lattice(self, embeddings: torch.Tensor, log_probs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The lattice states [n, S' * k, h] (slot-major) from the candidates' target embeddings
        [n, S', k, H], their log-probs [n, S', k] and the drafted slots' states [n, S', H]. S' <= S: an
        engine serving fewer speculative tokens runs a shorter block, whose lattice takes the first S'
        slot embeddings and the same bias by slot distance (vLLM's and SGLang's smaller lattice)."""
        slots = hidden.shape[1]
        if not 1 <= slots <= self.geometry.slots:
            raise ValueError(f"a block of {slots} drafted slots: the head was built for 1 to {self.geometry.slots}")
        dtype = self.pass_hidden_proj.weight.dtype
        tokens = embeddings.to(dtype)
        x = (tokens if self.token_proj is None else self.token_proj(tokens))
        x = x + self.pass_hidden_proj(hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(candidate_features(log_probs)).to(dtype))
        x = x + self.slot_embedding[0, 0, :slots] + self.rank_embedding[0, 0]
        x = x.flatten(1, 2)
        bias = self.attention_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        return self.output_norm(x)

    def anchor(self, context: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """alpha [n, h] from the anchor's context rows [n, H] (hidden_norm(fc(taps)) of the position before
        the anchor) and whether each exists [n]: an invalid row counts as zeros, after the projection too
        (context_proj has a bias)."""
        dtype = self.context_proj.weight.dtype
        on = valid.to(dtype)[:, None]
        return self.anchor_norm(self.context_proj(context.to(dtype) * on) * on)

    def cosines(self, states: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(start [n, k], pair [n, S - 1, k, k]) cosines in the head's dtype, as the engines form them."""
        g = self.geometry
        a = alpha[:, None].expand_as(states)
        f = F.silu(self.factor_input_proj(torch.cat([states, a, states * a], dim=-1)))
        unit = lambda v: F.normalize(v, dim=-1, eps=g.vector_eps)  # noqa: E731
        slots = states.shape[1] // g.top_k
        out = unit(self.out_head(f)).view(f.shape[0], slots, g.top_k, -1)
        into = unit(self.in_head(f)).view(f.shape[0], slots, g.top_k, -1)
        anchor_out = unit(self.anchor_out_head(alpha))
        start = (anchor_out[:, None] * into[:, 0]).sum(-1)
        pair = out[:, :-1] @ into[:, 1:].transpose(-1, -2)
        return start, pair

    def forward(self, embeddings: torch.Tensor, log_probs: torch.Tensor, hidden: torch.Tensor,
                context: torch.Tensor, *, valid: torch.Tensor) -> Factors:
        """The log-factors (at least fp32) of n blocks: `logit_scale` times the cosines."""
        start, pair = self.cosines(self.lattice(embeddings, log_probs, hidden), self.anchor(context, valid))
        # fp32 for bf16 heads, as the engines scale them; a float64 head (reference checks) stays float64.
        dtype, scale = torch.promote_types(start.dtype, torch.float32), self.geometry.logit_scale
        return Factors(scale * start.to(dtype), scale * pair.to(dtype))
