"""Packed rows on a hybrid target: the taps of a packed row equal the taps of each document run alone."""

import pytest
import torch

from dflash_ds.objective.blocks import position_ids_from_doc_ids
from dflash_ds.target_model.model import TapCapture, decoder_layers, forward_taps
from dflash_ds.target_model.packed import Packing, cu_seqlens_from_doc_ids, masked_causal_conv


def tiny_hybrid(dtype=torch.float32, layers=None):
    from transformers import Qwen3_5ForCausalLM

    from dflash_ds.target_model.presets import target_config

    torch.manual_seed(0)
    cfg = target_config("tiny", layers=layers)
    cfg._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(cfg).to(dtype).eval()


def packed_rows(lengths_per_row, seq_len, vocab, seed=0):
    """input_ids and doc_ids [R, S] for rows holding documents of the given lengths, padding after."""
    g = torch.Generator().manual_seed(seed)
    r = len(lengths_per_row)
    ids = torch.randint(1, vocab, (r, seq_len), generator=g)
    doc_ids = torch.full((r, seq_len), -1, dtype=torch.int32)
    for row, lengths in enumerate(lengths_per_row):
        at = 0
        for d, n in enumerate(lengths):
            doc_ids[row, at:at + n] = d
            at += n
        ids[row, at:] = 0
    return ids, doc_ids


def taps_packed(model, taps, ids, doc_ids, width):
    out = torch.full((*ids.shape, len(taps) * width), float("nan"), dtype=next(model.parameters()).dtype,
                     device=ids.device)
    cap = TapCapture(model, taps)
    try:
        forward_taps(model, cap, ids, position_ids_from_doc_ids(doc_ids), out=out, doc_ids=doc_ids)
    finally:
        cap.remove()
    return out


def taps_alone(model, taps, ids, doc_ids, width):
    """Reference: every document through the unmodified model on its own (no doc_ids given)."""
    out = torch.zeros((*ids.shape, len(taps) * width), dtype=next(model.parameters()).dtype, device=ids.device)
    cap = TapCapture(model, taps)
    try:
        for r in range(ids.shape[0]):
            for d in doc_ids[r].unique().tolist():
                if d < 0:
                    continue
                where = (doc_ids[r] == d).nonzero().squeeze(1)
                a, b = int(where[0]), int(where[-1]) + 1
                view = out[r:r + 1, a:b]
                forward_taps(model, cap, ids[r:r + 1, a:b], None, out=view)
    finally:
        cap.remove()
    return out


def test_cu_seqlens_split_rows_documents_and_padding():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    assert cu_seqlens_from_doc_ids(doc_ids).tolist() == [0, 2, 5, 6, 12]


def test_masked_conv_equals_conv_per_document():
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 5 + [1] * 2 + [2] * 6 + [-1] * 3])
    x = torch.randn(1, 16, 6, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64)
    got = masked_causal_conv(x, w, None, "silu", pack=Packing(doc_ids, 4))
    for d in range(-1, 3):
        idx = (doc_ids[0] == d).nonzero().squeeze(1)
        seg = x[:, idx].transpose(1, 2)
        want = torch.nn.functional.silu(torch.nn.functional.conv1d(seg, w.unsqueeze(1), padding=3, groups=6)[..., :len(idx)])
        assert torch.allclose(got[:, idx], want.transpose(1, 2), atol=1e-12), d


@pytest.mark.parametrize("lengths", [[[13, 1, 20, 6], [40]], [[7, 25], [3, 3, 30]]])
def test_packed_taps_equal_each_document_alone(lengths):
    model = tiny_hybrid()
    n = len(decoder_layers(model))
    taps = list(range(n))  # every layer: Gated DeltaNet and full attention alike
    ids, doc_ids = packed_rows(lengths, 48, model.config.vocab_size)
    got = taps_packed(model, taps, ids, doc_ids, model.config.hidden_size)
    want = taps_alone(model, taps, ids, doc_ids, model.config.hidden_size)
    real = (doc_ids >= 0).unsqueeze(-1)
    assert torch.isfinite(got).all()
    err = ((got - want).abs() * real).max().item()
    assert err < 1e-5, err


def test_without_document_boundaries_the_recurrent_state_leaks():
    # The reason for target.packed: the stock forward on the same packed row differs from each
    # document alone after the first document, even with restarting positions.
    model = tiny_hybrid()
    taps = [len(decoder_layers(model)) - 1]
    ids, doc_ids = packed_rows([[10, 30]], 48, model.config.vocab_size)
    width = model.config.hidden_size
    stock = torch.zeros(1, 48, width)
    cap = TapCapture(model, taps)
    forward_taps(model, cap, ids, position_ids_from_doc_ids(doc_ids), out=stock)
    cap.remove()
    want = taps_alone(model, taps, ids, doc_ids, width)
    assert torch.allclose(stock[:, :10], want[:, :10], atol=1e-5)
    assert (stock[:, 10:40] - want[:, 10:40]).abs().max() > 1e-3


def test_forward_is_restored_after_a_packed_call():
    model = tiny_hybrid(layers=4)
    ids, doc_ids = packed_rows([[5, 11]], 16, model.config.vocab_size)
    taps_packed(model, [0], ids, doc_ids, model.config.hidden_size)
    assert all("forward" not in vars(layer.linear_attn) for layer in decoder_layers(model) if hasattr(layer, "linear_attn"))


def segment_attention(q, k, v, cu_seqlens, *, longest, scale):
    """Stand-in for FlashAttention varlen on CPU: causal SDPA over each segment, grouped heads repeated."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    assert cu_seqlens.dtype == torch.int32 and longest == max(b - a for a, b in zip(bounds, bounds[1:]))
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def tiny_dense(layers=3):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [tiny_hybrid, tiny_dense], ids=["hybrid", "dense"])
def test_varlen_attention_route_equals_each_document_alone(monkeypatch, make):
    """The CUDA route for full-attention layers (the varlen kernel, no mask), with the kernel replaced by
    per-segment SDPA: the model switches to it for the packed forward only, gets no mask, and its taps
    equal each document alone; afterwards the config is back on SDPA."""
    from dflash_ds.target_model import packed

    calls, masks = [], []
    real = packed.varlen_attention

    def spy(module, query, key, value, attention_mask, **kw):
        masks.append(attention_mask)
        return real(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(packed, "varlen_usable", lambda config, dtype, device: True)
    monkeypatch.setattr(packed, "varlen_attention", spy)
    monkeypatch.setattr(packed, "flash_varlen", lambda *a, **k: calls.append(1) or segment_attention(*a, **k))
    model = make()
    taps = list(range(len(decoder_layers(model))))
    ids, doc_ids = packed_rows([[13, 1, 20, 6], [7, 25]], 48, model.config.vocab_size)
    got = taps_packed(model, taps, ids, doc_ids, model.config.hidden_size)
    full_layers = sum(not hasattr(layer, "linear_attn") for layer in decoder_layers(model))
    assert len(calls) == full_layers > 0 and all(m is None for m in masks)
    assert model.config._attn_implementation == "sdpa"
    want = taps_alone(model, taps, ids, doc_ids, model.config.hidden_size)
    assert len(calls) == full_layers  # the documents alone ran the stock SDPA path
    err = ((got - want).abs() * (doc_ids >= 0).unsqueeze(-1)).max().item()
    assert err < 1e-5, err


def test_varlen_applies_only_to_half_precision_sdpa_on_cuda_without_sliding_windows():
    from dflash_ds.target_model.packed import varlen_usable

    cfg = tiny_dense().config
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert varlen_usable(cfg, torch.bfloat16, cuda)
    assert not varlen_usable(cfg, torch.float32, cuda)
    assert not varlen_usable(cfg, torch.bfloat16, cpu)
    cfg._attn_implementation = "eager"
    assert not varlen_usable(cfg, torch.bfloat16, cuda)
    from transformers import MistralConfig

    mistral = MistralConfig(hidden_size=64, num_attention_heads=4, head_dim=16, attn_implementation="sdpa")
    assert mistral.sliding_window is not None and not varlen_usable(mistral, torch.bfloat16, cuda)
    mistral.sliding_window = None
    assert varlen_usable(mistral, torch.bfloat16, cuda)
