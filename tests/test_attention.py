"""The DFlash mask (docs/algorithm.md section 3): dense mask vs the definition, flex BlockMask vs dense (element by
element, as the kernel reads it), flex_attention vs SDPA through the drafter, and no leakage."""

import pytest
import torch
from transformers import Qwen3Config

from dflash_ds.config import DrafterConfig
from dflash_ds.network.attention import FLEX_BLOCK, attend, build_mask
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape


def naive_layer_mask(anchors, valid, doc_ids, B, window, causal):
    """The serving rule, one element at a time: the query of slot k of the block anchored at a sits at
    position a + k; a context key at position j is visible iff the block is valid, j < a, j is in the
    anchor's document and (a + k) - j < window; an own-block key of slot m iff m <= k in a causal layer."""
    b, n = anchors.shape
    S = doc_ids.shape[1]
    Q = n * B
    m = torch.zeros(b, 1, Q, S + Q, dtype=torch.bool)
    for r in range(b):
        for q in range(Q):
            blk, k = q // B, q % B
            a = int(anchors[r, blk])
            for j in range(S):
                seen = bool(valid[r, blk]) and j < a and int(doc_ids[r, j]) == int(doc_ids[r, a])
                if window is not None:
                    seen = seen and (a + k) - j < window
                m[r, 0, q, j] = seen
            for key in range(Q):
                m[r, 0, q, S + key] = key // B == blk and (not causal or key % B <= k)
    return m


def naive_mask(anchors, valid, doc_ids, B):
    """Written from the definition, one element at a time: every layer full and bidirectional."""
    return naive_layer_mask(anchors, valid, doc_ids, B, None, False)


def packed_case(S=37, B=4):
    doc_ids = torch.tensor([[0] * 10 + [1] * 15 + [2] * 8 + [-1] * (S - 33),
                            [5] * 20 + [6] * (S - 20)], dtype=torch.int32)
    anchors = torch.tensor([[1, 9, 10, 11, 24, 30, 0], [0, 3, 19, 20, 21, 35, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    return anchors, valid, doc_ids, B


def test_dense_mask_equals_definition():
    anchors, valid, doc_ids, B = packed_case()
    dense = build_mask(anchors, valid, doc_ids, B, kind="dense").dense
    assert dense.dtype == torch.bool and dense.shape == (2, 1, 28, 37 + 28)
    assert torch.equal(dense, naive_mask(anchors, valid, doc_ids, B))
    # spot checks written out by hand: block 4 of row 0 (anchor 24, doc 1 = positions 10..24)
    row = dense[0, 0, 4 * B]
    assert row[:37].nonzero().flatten().tolist() == list(range(10, 24))
    assert row[37:].nonzero().flatten().tolist() == [16, 17, 18, 19]
    # invalid block: its own block only
    assert dense[0, 0, 6 * B, :37].sum() == 0 and dense[0, 0, 6 * B, 37:].sum() == B


def emulate_block_mask(bm, q_len, kv_len, use_q_side=False):
    """The element mask a flex kernel applies: full tiles as-is, partial tiles through mask_mod."""
    q_pad, kv_pad = bm.seq_lengths
    bsz = bm.kv_num_blocks.shape[0]
    n_qb, n_kb = q_pad // FLEX_BLOCK, kv_pad // FLEX_BLOCK
    partial = torch.zeros(bsz, n_qb, n_kb, dtype=torch.bool)
    full = torch.zeros_like(partial)
    if not use_q_side:
        layout = ((partial, bm.kv_num_blocks, bm.kv_indices), (full, bm.full_kv_num_blocks, bm.full_kv_indices))
        for flags, num, idx in layout:
            for r in range(bsz):
                for qb in range(n_qb):
                    for t in range(int(num[r, 0, qb])):
                        flags[r, qb, int(idx[r, 0, qb, t])] = True
    else:  # the transposed layout the backward kernel reads
        layout = ((partial, bm.q_num_blocks, bm.q_indices), (full, bm.full_q_num_blocks, bm.full_q_indices))
        for flags, num, idx in layout:
            for r in range(bsz):
                for kb in range(n_kb):
                    for t in range(int(num[r, 0, kb])):
                        flags[r, int(idx[r, 0, kb, t]), kb] = True
    assert not (partial & full).any()
    qi = torch.arange(q_pad).view(1, -1, 1)
    ki = torch.arange(kv_pad).view(1, 1, -1)
    bi = torch.arange(bsz).view(-1, 1, 1)
    mod = bm.mask_mod(bi, torch.zeros_like(bi), qi, ki)
    expand = lambda t: t.repeat_interleave(FLEX_BLOCK, 1).repeat_interleave(FLEX_BLOCK, 2)  # noqa: E731
    element = expand(full) | (expand(partial) & mod)
    assert not element[:, q_len:].any() and not element[:, :, kv_len:].any()  # padding attends nowhere
    return element[:, :q_len, :kv_len], partial, full


@pytest.mark.parametrize("S, B, anchors_row0", [
    (37, 4, None),                                  # everything inside one or two tiles, padded lengths
    # Query tile 0: anchors at the tile edge (tile 0 of the context is all-but-one visible for
    # most rows: must stay partial); query tile 1 sees context tile 0 whole (a "full" tile).
    (300, 16, [127, 127, 128, 127, 127, 127, 127, 127, 137, 136, 135, 134, 133, 132, 131, 130]),
    (256, 128, [150, 3]),                           # B = tile size, aligned: own-block tiles are full
])
def test_flex_block_mask_equals_dense(S, B, anchors_row0):
    if anchors_row0 is None:
        anchors, valid, doc_ids, B = packed_case(S, B)
    else:
        n = len(anchors_row0)
        g = torch.Generator().manual_seed(S)
        doc_ids = torch.zeros(2, S, dtype=torch.int32)
        doc_ids[0, 140:] = 1
        doc_ids[1, S // 2:] = 3
        doc_ids[1, S - 7:] = -1
        anchors = torch.stack([torch.tensor(anchors_row0),
                               torch.randint(0, S - 8, (n,), generator=g).sort().values])
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, -1] = False
        valid[1, 0] = False
    Q = anchors.shape[1] * B
    dense = build_mask(anchors, valid, doc_ids, B, kind="dense").dense[:, 0]
    flex = build_mask(anchors, valid, doc_ids, B, kind="flex")
    assert (flex.query_len, flex.kv_len) == (Q, S + Q)
    for q_side in (False, True):
        element, partial, full = emulate_block_mask(flex.block_mask, Q, S + Q, use_q_side=q_side)
        assert torch.equal(element, dense)
    if S == 300:  # the case must exercise all three tile kinds
        assert partial.any() and full.any() and (~partial & ~full).any()
    if B == 128:
        assert full.any()


def tiny_model(block_size=4, seed=0):
    tgt = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=50, rope_theta=1e4)
    shape = DrafterConfig(num_layers=2, block_size=block_size, mask_token_id=49, target_layer_ids=[1, 4])
    cfg = drafter_shape(tgt, shape)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg).eval()


def drafter_inputs(model, anchors, doc_ids, seed=0):
    B, D = model.config.block_size, model.config.hidden_size
    b, S = doc_ids.shape
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, S, D, generator=g)
    block = torch.randn(b, anchors.shape[1] * B, D, generator=g)
    ctx_pos = torch.arange(S).expand(b, S)
    block_pos = (anchors[..., None] + torch.arange(B)).view(b, -1)
    return ctx, block, block_pos, ctx_pos


def test_flex_attention_matches_sdpa_through_the_drafter():
    # S and Q not multiples of 128 (attend pads), several documents, overlapping and invalid blocks.
    S, B = 150, 4
    doc_ids = torch.zeros(2, S, dtype=torch.int32)
    doc_ids[0, 60:] = 1
    doc_ids[0, 130:] = -1
    doc_ids[1, 90:] = 7
    anchors = torch.tensor([[3, 40, 59, 60, 61, 100, 128, 0, 0],
                            [10, 11, 80, 89, 90, 91, 120, 145, 0]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[0, -2:] = False
    valid[1, -1] = False
    model = tiny_model(B)
    ctx, block, block_pos, ctx_pos = drafter_inputs(model, anchors, doc_ids)
    with torch.no_grad():
        dense = model(block, ctx, block_pos, ctx_pos, mask=build_mask(anchors, valid, doc_ids, B, kind="dense"))
        flex = model(block, ctx, block_pos, ctx_pos, mask=build_mask(anchors, valid, doc_ids, B, kind="flex"))
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_attend_gqa_matches_explicit_softmax():
    torch.manual_seed(0)
    anchors, valid, doc_ids, B = packed_case()
    mask = build_mask(anchors, valid, doc_ids, B, kind="dense")
    Q, KV = mask.query_len, mask.kv_len
    q = torch.randn(2, 4, Q, 8, dtype=torch.float64)
    k = torch.randn(2, 2, KV, 8, dtype=torch.float64)
    v = torch.randn(2, 2, KV, 8, dtype=torch.float64)
    out = attend(q, k, v, mask, scale=0.3)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask.dense, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ vv)


@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_no_leakage(kind):
    B = 4
    doc_ids = torch.tensor([[0] * 18 + [1] * 18 + [-1] * 4], dtype=torch.int32)
    anchors = torch.tensor([[5, 24, 25, 30, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    model = tiny_model(B)
    ctx, block, block_pos, ctx_pos = drafter_inputs(model, anchors, doc_ids)
    g = torch.Generator().manual_seed(1)
    target = 1  # anchor 24 in document 1 (positions 18..35)

    # Every perturbation is one row of a single batch (one forward per mask kind).
    variants = {"base": (ctx, block)}

    def perturb_ctx(name, positions):
        c = ctx.clone()
        c[0, positions] += torch.randn(len(positions), ctx.shape[-1], generator=g)
        variants[name] = (c, block)

    perturb_ctx("at_or_after_anchor", list(range(24, 40)))
    perturb_ctx("exactly_anchor", [24])                 # `<`, not `<=`
    perturb_ctx("just_before", [23])
    perturb_ctx("doc_start", [18])
    perturb_ctx("other_doc", list(range(0, 18)))
    perturb_ctx("all", list(range(40)))
    x = block.clone()
    x[0, 2 * B:3 * B] += 1.0                            # the overlapping neighbour block (anchor 25)
    x[0, 0:B] += 1.0
    variants["other_blocks"] = (ctx, x)
    x = block.clone()
    x[0, target * B + B - 1] += 1.0                     # own last slot
    variants["own_last_slot"] = (ctx, x)

    names = list(variants)
    n = len(names)
    mask = build_mask(anchors.expand(n, -1), valid.expand(n, -1), doc_ids.expand(n, -1), B, kind=kind)
    with torch.no_grad():
        out = model(torch.cat([variants[k][1] for k in names]), torch.cat([variants[k][0] for k in names]),
                    block_pos.expand(n, -1), ctx_pos.expand(n, -1), mask=mask)
    out = dict(zip(names, out.view(n, anchors.shape[1], B, -1)))
    assert torch.isfinite(torch.stack(list(out.values()))).all()

    def same(name, blk=target):
        return torch.equal(out[name][blk], out["base"][blk])

    assert same("at_or_after_anchor") and same("exactly_anchor")
    assert not same("just_before") and not same("doc_start")
    assert same("other_doc") and not same("other_doc", blk=0)  # block 0 (doc 0) does see it
    assert same("all", blk=4)                           # invalid block: no context at all
    assert same("other_blocks")
    assert not torch.equal(out["own_last_slot"][target, 0], out["base"][target, 0])  # not causal


def test_mask_errors():
    anchors, valid, doc_ids, B = packed_case()
    with pytest.raises(ValueError, match="dense"):
        build_mask(anchors, valid, doc_ids, B, kind="sparse")
    with pytest.raises(AssertionError):
        build_mask(anchors, valid, doc_ids, 1)
