"""Packed rows: no document sees another in any layer of the target.

A packed row [R, S] holds several documents (doc ids 0, 1, ..., -1 on padding).
`packed_documents(layers, config, doc_ids, dtype)` arranges, for the duration of one forward:

Gated DeltaNet layers (Qwen3.5/3.6 hybrids): their short causal convolution and their recurrent
state would run straight across document boundaries, so every such module's forward is swapped for
one that
  - runs the short convolution per segment (on CUDA with flash-linear-attention, its varlen
    kernel; elsewhere the taps that reach into another document masked out: exact, plain tensor
    ops), and
  - runs the gated delta rule per segment: on CUDA with flash-linear-attention, one varlen kernel
    call over the flattened rows with `cu_seqlens`; elsewhere (CPU, or no fla), the reference
    PyTorch rule once per segment, which is exact but slow and meant for tests and CPU runs.
A segment is a run of one doc id inside one row; padding runs are segments too, so padding never
feeds a document (the drafter ignores the padding's own taps).

Full-attention layers: position ids restarting per document (see data.packing) make transformers
build a block-diagonal causal mask, which is exact everywhere but costs a dense [R, 1, S, S] mask
and keeps SDPA off its flash kernel (the masked kernels ran the 27B-geometry target 5% slower on
packed rows than on full rows). On CUDA in bf16/fp16 the block switches those layers to
FlashAttention's variable-length kernel over the same segments (`varlen_attention`): no mask is
built and no attention is computed across a document boundary.

Everything else (projections, gates, norms, MLPs, decoder-layer outputs and so the tap hooks) is
the model's own code, so the taps of a packed row equal the taps of each document run alone.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def segment_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [R, S]: True where a segment starts (column 0 of every row, or a change of doc id)."""
    new = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return new


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [n + 1]: segment boundaries over the flattened rows (the FlashAttention varlen convention)."""
    starts = segment_starts(doc_ids).flatten().nonzero().squeeze(1)
    end = torch.full((1,), doc_ids.numel(), dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end])


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


class Packing:
    """Per-forward facts about the packed rows, computed once and shared by every layer."""

    def __init__(self, doc_ids: torch.Tensor, conv_kernel: int):
        self.doc_ids = doc_ids
        self.shape = tuple(doc_ids.shape)
        self.conv_kernel = conv_kernel
        self._same = None
        self._cu = None
        self._varlen = None

    @property
    def same(self) -> list[torch.Tensor]:
        """same[j-1][r, t]: position t - j is in the same row and document as t (j = 1 .. K-1).

        Only the masked convolution reads these; the fla route on CUDA never builds them."""
        if self._same is None:
            self._same = []
            for j in range(1, self.conv_kernel):
                m = torch.zeros(self.shape, dtype=torch.bool, device=self.doc_ids.device)
                m[:, j:] = self.doc_ids[:, j:] == self.doc_ids[:, :-j]
                # A run of equal ids that is interrupted in between is two documents: require every
                # step from t - j to t to stay in the document, not just equal ids at both ends.
                if self._same:
                    m &= self._same[-1]
                self._same.append(m)
        return self._same

    @property
    def cu_seqlens(self) -> torch.Tensor:
        if self._cu is None:
            self._cu = cu_seqlens_from_doc_ids(self.doc_ids)
        return self._cu

    @property
    def varlen_bounds(self) -> tuple[torch.Tensor, int]:
        """(int32 cu_seqlens, longest segment) as FlashAttention's varlen kernel takes them."""
        if self._varlen is None:
            cu = self.cu_seqlens
            self._varlen = (cu.to(torch.int32), int((cu[1:] - cu[:-1]).max()))
        return self._varlen


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, *, pack: Packing) -> torch.Tensor:
    """The Gated DeltaNet short convolution per segment: fla's varlen kernel on CUDA, else masked_causal_conv."""
    if x.is_cuda and fla_available():
        from fla.modules.causal_conv1d import causal_conv1d

        r, s = pack.shape
        out = causal_conv1d(x.reshape(1, r * s, -1), weight=weight, bias=bias, activation=activation,
                            cu_seqlens=pack.cu_seqlens)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(r, s, -1)
    return masked_causal_conv(x, weight, bias, activation, pack=pack)


def masked_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None,
                       *, pack: Packing) -> torch.Tensor:
    """Depthwise causal convolution of x [R, S, C] with weight [C, K] that never reads another document.

    Equals F.conv1d(x, weight, padding=K-1)[..., :S] run on each document alone: output t sums
    weight[:, K-1-j] * x[t-j] over the j whose position t - j lies in t's document. Plain tensor
    ops (about a dozen passes over x), so any device runs it."""
    k = weight.shape[-1]
    w = weight.to(torch.float32)
    xf = x.to(weight.dtype).to(torch.float32)
    out = xf * w[:, k - 1]
    for j in range(1, k):
        shifted = F.pad(xf[:, :-j], (0, 0, j, 0))
        out = out + shifted * pack.same[j - 1].unsqueeze(-1) * w[:, k - 1 - j]
    if bias is not None:
        out = out + bias.to(torch.float32)
    if activation is not None:
        out = _ACTIVATIONS[activation](out)
    return out.to(weight.dtype).to(x.dtype)


def _reference_rule():
    """The PyTorch gated delta rule transformers ships (also when fla replaced the module-level name)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def gated_delta_rule(q, k, v, g, *, beta, pack: Packing) -> torch.Tensor:
    """Chunked gated delta rule, state reset at every segment start. q, k [R, S, H, K], v [R, S, HV, V],
    g and beta [R, S, HV]; HV a multiple of H (value head i reads query/key head i // (HV / H), as
    transformers' repeat_interleave lays them out) -> [R, S, HV, V]."""
    r, s = pack.shape
    if q.is_cuda and fla_available():
        # fla's kernel reads the shared query/key heads itself (grouped value attention): no
        # repeated copies of q and k (two [R S, HV, K] copies a layer, 4% of a 35B-A3B forward).
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        flat = [t.reshape(1, r * s, *t.shape[2:]) for t in (q, k, v, g, beta)]
        out, _ = chunk_gated_delta_rule(*flat, initial_state=None, output_final_state=False,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=pack.cu_seqlens)
        return out.reshape(r, s, *out.shape[2:])
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    rule = _reference_rule()
    bounds = pack.cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        row, lo, hi = a // s, a % s, a % s + (b - a)
        part = [t[row:row + 1, lo:hi] for t in (q, k, v, g, beta)]
        o, _ = rule(*part, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    return torch.cat(outs, dim=1).reshape(r, s, *outs[0].shape[2:])


def packed_gdn_forward(self, pack: Packing, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                       **kwargs) -> torch.Tensor:
    """Qwen3.5/3.6 Gated DeltaNet (transformers' Qwen3_5GatedDeltaNet, no cache) over packed rows."""
    if cache_params is not None:
        raise RuntimeError("packed target forwards run without a cache (use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq_len, _ = hidden_states.shape
    mixed_qkv = self.in_proj_qkv(hidden_states)
    z = self.in_proj_z(hidden_states).reshape(batch, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    mixed_qkv = short_conv(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.activation, pack=pack)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    core = gated_delta_rule(query, key, value, g, beta=beta, pack=pack)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, seq_len, -1))


# The name under which the varlen attention (and its "no mask" mask builder) is registered with
# transformers; a config carries it only inside `packed_documents`.
VARLEN = "dflash_packed_varlen"
_active: list[Packing] = []  # the Packing of the forward in progress (one at a time per process)


def varlen_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: causal FlashAttention per segment of the active Packing.

    query [B, H, S, d], key/value [B, Hkv, S, d] (grouped heads are handled by the kernel) ->
    ([B, S, H, d], None). The rows are flattened into one sequence cut at the segment starts.
    kwargs carry transformers' `scaling` (and `dropout`, zero for a frozen target)."""
    pack = _active[-1]
    b, h, s, d = query.shape
    q = query.transpose(1, 2).reshape(b * s, h, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    cu, longest = pack.varlen_bounds
    return flash_varlen(q, k, v, cu, longest=longest, scale=kwargs.get("scaling")).view(b, s, h, d), None


def flash_varlen(q, k, v, cu_seqlens, *, longest: int, scale) -> torch.Tensor:
    """Causal attention within each segment of packed q [T, H, d], k/v [T, Hkv, d] -> [T, H, d].

    The aten op behind torch.nn.attention.varlen, whose Python signature changed across releases."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True,
                                                   False, scale=scale)[0]


def _no_mask(*args, **kwargs):
    return None  # varlen_attention takes the documents from the segments, not from a mask


def _register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _no_mask)


def varlen_usable(config, dtype: torch.dtype, device: torch.device) -> bool:
    """FlashAttention varlen applies: CUDA, half precision, SDPA chosen, head dim the kernel takes,
    and no sliding-window layers (varlen_attention attends to the whole document; transformers'
    masks carry the window, so such models keep the masked route)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sliding = ("sliding_attention" in (getattr(config, "layer_types", None) or ())
               or getattr(config, "sliding_window", None) is not None)
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and not sliding
            and getattr(config, "_attn_implementation", None) == "sdpa" and head_dim <= 256 and head_dim % 8 == 0)


@contextmanager
def packed_documents(layers: nn.ModuleList, config, doc_ids: torch.Tensor, dtype: torch.dtype):
    """Within the block, the decoder `layers` (of text config `config`, run in `dtype`) keep every
    segment of doc_ids [R, S] apart.

    The caller still passes position ids restarting per document (and use_cache=False): they give
    every document its own rotary positions, and they are what keeps the full-attention layers
    inside each document where the varlen kernel does not apply. (Layers and config rather than
    the model: target.model imports this module, so this one must not import it back.)"""
    mods = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
    varlen = varlen_usable(config, dtype, doc_ids.device)
    pack = Packing(doc_ids, mods[0].conv_kernel_size if mods else 1)
    for m in mods:
        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks.
        m.forward = functools.partial(packed_gdn_forward, m, pack)
    if varlen:
        _register_varlen()
        config._attn_implementation = VARLEN
        _active.append(pack)
    try:
        yield pack
    finally:
        for m in mods:
            del m.forward
        if varlen:
            _active.pop()
            config._attn_implementation = "sdpa"
