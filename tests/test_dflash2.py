"""DFlash2's modules (docs/algorithm.md section 9): the block convolution against a float64 loop
reference and the public reference's formula, its exact no-op at initialisation, the selector's walk
against brute force over every candidate path and against a re-implementation of SGLang's lattice
walk, the selector loss and its gradient against a float64 full-vocabulary reference, and the
top-k the base loss hands over."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_ds.architectures.dflash2 import DFlash2Fields, DFlash2Keys
from dflash_ds.architectures.dflash2.parts import (BlockConv, CandidateSelector, SelectorRows, SelectorTerm, block_conv,
                                     greedy_path, selector_alpha, selector_loss, unary_top_k)
from dflash_ds.config import DrafterConfig
from dflash_ds.network.attention import build_mask
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.logit_transform import IDENTITY
from dflash_ds.objective.blocks import Blocks, MicroBatch, block_inputs, block_targets
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape

D, VOCAB, B = 64, 300, 4


def target_config():
    return Qwen3Config(hidden_size=D, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def drafter(architecture="dflash2", seed=0, dtype=torch.float64, **kw):
    shape = DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 4, 6],
                         architecture=architecture, sections={"dflash2": DFlash2Fields(
                             conv_group_size=kw.pop("conv_group_size", 8), selector_rank=kw.pop("selector_rank", 12),
                             selector_top_k=kw.pop("selector_top_k", 5), **kw)})
    torch.manual_seed(seed)
    return DFlashDrafter(drafter_shape(target_config(), shape)).to(dtype)


def inputs(model, seed=0, n_blocks=3):
    g = torch.Generator().manual_seed(seed)
    S = 20
    anchors = torch.tensor([[2, 9, 15][:n_blocks]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    doc_ids = torch.zeros(1, S, dtype=torch.int32)
    ctx_pos = torch.arange(S)[None]
    block_pos = (anchors[..., None] + torch.arange(B)).view(1, -1)
    taps = torch.randn(1, S, 3 * D, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, n_blocks * B, D, generator=g, dtype=torch.float64)
    mask = build_mask(anchors, valid, doc_ids, B, kind="dense")
    return embeds, model.fuse(taps.to(next(model.parameters()).dtype)), block_pos, ctx_pos, mask


# ---------------------------------------------------------------------------------- convolution

def loop_conv(x, dynamic, base, block_size):
    """out[k, c] = sum_t (base[t, c] + dynamic[k, t, c // group]) x[k - t, c], slots before the block's
    start taken as 0: one element at a time, in float64."""
    b, q, d = x.shape
    taps, groups = dynamic.shape[-2:]
    group = d // groups
    out = torch.zeros(b, q, d, dtype=torch.float64)
    for i in range(b):
        for k in range(q):
            slot = k % block_size
            for t in range(taps):
                if slot - t < 0:
                    continue
                for c in range(d):
                    w = float(base[t, c]) + float(dynamic[i, k, t, c // group])
                    out[i, k, c] += w * float(x[i, k - t, c])
    return out


def zlab_style_conv(x, dynamic, base, group_size, block_size):
    """The public reference's formula (z-lab dflash/model.py `_grouped_dynamic_convolve`: base kernel
    times the shifted input plus the dynamic coefficient times it), applied to each block on its own
    as the serving engines apply it to one block per request."""
    outs = []
    for blk in x.split(block_size, dim=1):
        j = len(outs)
        dyn = dynamic[:, j * block_size:(j + 1) * block_size]
        b, n, d = blk.shape
        groups = d // group_size
        xs = blk.view(b, n, groups, group_size)
        acc = torch.zeros_like(xs)
        for off in range(base.shape[0]):
            vals = xs if off == 0 else F.pad(xs[:, :-off], (0, 0, 0, 0, off, 0))
            acc = acc + base[off].view(1, 1, groups, group_size) * vals
            acc = torch.addcmul(acc, dyn[:, :, off].unsqueeze(-1), vals)
        outs.append(acc.view(b, n, d))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("taps", [1, 2, 3])
def test_block_conv_matches_loop_and_public_formula(taps):
    g = torch.Generator().manual_seed(taps)
    d, group, q = 8, 4, 3 * B
    x = torch.randn(2, q, d, generator=g, dtype=torch.float64)
    dynamic = torch.randn(2, q, taps, d // group, generator=g, dtype=torch.float64)
    base = torch.randn(taps, d, generator=g, dtype=torch.float64)
    out = block_conv(x, dynamic, base, B)
    torch.testing.assert_close(out, loop_conv(x, dynamic, base, B), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, zlab_style_conv(x, dynamic, base, group, B), rtol=1e-12, atol=1e-12)
    if taps > 1:
        # A convolution that ran across the block boundary (one flat sequence) differs.
        flat = loop_conv(x, dynamic, base, q)
        assert not torch.allclose(out, flat)


def test_block_conv_never_crosses_a_block_and_mixes_the_anchor():
    g = torch.Generator().manual_seed(0)
    conv = BlockConv(8, 2, 4, B).double()
    with torch.no_grad():
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(generator=g)
    x = torch.randn(1, 2 * B, 8, generator=g, dtype=torch.float64)
    y, after = conv.prepare(x)
    x2 = x.clone()
    x2[0, B - 1] += 1.0  # the last slot of block 0
    y2, _ = conv.prepare(x2)
    assert torch.equal(y[0, B:], y2[0, B:])  # block 1 does not see block 0
    x3 = x.clone()
    x3[0, 0] += 1.0  # the anchor slot of block 0
    y3, _ = conv.prepare(x3)
    assert not torch.allclose(y[0, 1], y3[0, 1])  # slot 1 reads the anchor slot
    assert torch.equal(y[0, 2:], y3[0, 2:])  # two taps: slot k reads slots k and k - 1 only
    assert after.shape == (1, 2 * B, 2, 2)


def test_conv_is_an_exact_no_op_at_init_and_the_v1_drafter_is_reproduced_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        v1, v2 = drafter("dflash", dtype=dtype), drafter("dflash2", dtype=dtype)
        common = v1.state_dict()
        for name, t in common.items():
            assert torch.equal(t, v2.state_dict()[name]), name  # the same backbone draws
        extra = set(v2.state_dict()) - set(common)
        assert extra and all(".attention_conv." in n or ".mlp_conv." in n or n.startswith("candidate_selector.")
                             for n in extra)
        with torch.no_grad():
            args = inputs(v1)
            out1 = v1(args[0].to(dtype), *args[1:4], mask=args[4])
            out2 = v2(args[0].to(dtype), *args[1:4], mask=args[4])
        assert torch.equal(out1, out2)
        # A non-zero projection moves the output: the comparison can fail.
        with torch.no_grad():
            v2.layers[1].mlp_conv.kernel_projection.weight.normal_(0, 0.1)
            out3 = v2(args[0].to(dtype), *args[1:4], mask=args[4])
        assert not torch.equal(out1, out3)


def test_conv_parameters_receive_gradients_and_the_layer_uses_both_sides():
    m = drafter("dflash2")
    with torch.no_grad():
        for layer in m.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0, 0.05)
            layer.mlp_conv.kernel_projection.weight.normal_(0, 0.05)
    args = inputs(m)
    m(*args[:4], mask=args[4]).square().sum().backward()
    for layer in m.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.base_kernel.grad[0].abs().sum() > 0 and conv.base_kernel.grad[1].abs().sum() > 0
            assert conv.kernel_projection.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------- selector walk

def trained_like_selector(vocab=12, d=6, rank=5, top_k=4, seed=0):
    torch.manual_seed(seed)
    sel = CandidateSelector(d, vocab, rank, top_k).double()
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 1.0)
        sel.predecessor_codebook.normal_(0, 1.0)
        sel.hidden_projection.weight.normal_(0, 1.0)
    return sel


def step_score(sel, lm_head, h, prev, tok):
    """The score of token `tok` at a slot with state h after `prev`, from the full-vocabulary logits."""
    unary = float(h @ lm_head[tok])
    pair = float((sel.predecessor_codebook[prev] * sel.hidden_projection(h)) @ sel.successor_codebook[tok])
    return unary + pair


def test_greedy_path_equals_brute_force_over_every_candidate_path():
    """The engines' walk is greedy: slot by slot, the best candidate given the token picked before.
    Over all top_k^L candidate paths, that is the path whose per-slot scores are lexicographically
    largest; the test enumerates every path and scores it from the full-vocabulary logits."""
    vocab, d, L, k = 12, 6, 4, 4
    for seed in range(5):
        sel = trained_like_selector(vocab, d, 5, k, seed)
        g = torch.Generator().manual_seed(100 + seed)
        lm_head = torch.randn(vocab, d, generator=g, dtype=torch.float64)
        hidden = torch.randn(3, L, d, generator=g, dtype=torch.float64)
        anchors = torch.randint(0, vocab, (3,), generator=g)
        path = greedy_path(sel, hidden, lm_head, anchors)
        argmax_path = (hidden @ lm_head.T).argmax(-1)
        for i in range(3):
            cands = [(hidden[i, s] @ lm_head.T).topk(k).indices.tolist() for s in range(L)]
            best = None
            with torch.no_grad():
                for p in itertools.product(*cands):
                    prev, key = int(anchors[i]), []
                    for s, tok in enumerate(p):
                        key.append(step_score(sel, lm_head, hidden[i, s], prev, tok))
                        prev = tok
                    if best is None or key > best[0]:
                        best = (key, p)
            assert path[i].tolist() == list(best[1])
        if seed == 0:
            assert not torch.equal(path, argmax_path)  # the selector changes the path here


def test_zero_successor_codebook_keeps_the_argmax_path():
    sel = trained_like_selector()
    with torch.no_grad():
        sel.successor_codebook.zero_()
    g = torch.Generator().manual_seed(0)
    lm_head = torch.randn(12, 6, generator=g, dtype=torch.float64)
    hidden = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)
    assert torch.equal(greedy_path(sel, hidden, lm_head, torch.zeros(5, dtype=torch.long)),
                       (hidden @ lm_head.T).argmax(-1))


def sglang_lattice_walk(sel, hidden, lm_head, anchors):
    """Written from SGLang's DFlash2 selection (PR #35371 `CandidateSelector.build_lattice` and the
    greedy branch of `sample_path`): score[b, e, p, c] = unary[b, e, c] + <A[pred[b, e, p]] * proj(h[b, e]),
    B[cand[b, e, c]]> with pred = cand[b, e - 1] (the anchor for e = 0); the first index is the argmax
    of score[:, 0, 0]; then each slot maps every predecessor index to its argmax and the path follows
    the maps. An independent formulation: all K x K transitions at once, then a table walk."""
    logits = hidden @ lm_head.T
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)  # sorted, as flashinfer's top_k(sorted=True)
    proj = hidden @ sel.hidden_projection.weight.T
    keys = sel.successor_codebook[cand]  # [b, e, c, r]
    pred_ids = torch.cat([anchors[:, None, None].expand(-1, 1, sel.top_k), cand[:, :-1]], dim=1)
    preds = sel.predecessor_codebook[pred_ids]  # [b, e, p, r]
    scores = unary[:, :, None] + torch.einsum("blpr,blcr->blpc", preds * proj[:, :, None], keys)
    index = scores[:, 0, 0].argmax(-1)
    maps = scores[:, 1:].argmax(-1)  # [b, e - 1, p]
    path = [index]
    for e in range(maps.shape[1]):
        index = maps[:, e].gather(-1, index[:, None])[:, 0]
        path.append(index)
    return cand.gather(-1, torch.stack(path, 1).unsqueeze(-1))[..., 0]


def test_selection_equals_sglang_lattice_walk_on_held_out_anchors():
    m = drafter("dflash2", selector_top_k=7)
    sel = m.candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.5)
        sel.predecessor_codebook.normal_(0, 0.5)
        sel.hidden_projection.weight.normal_(0, 0.5)
    g = torch.Generator().manual_seed(7)
    lm_head = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    model = DraftModel(m, torch.randn(VOCAB, D, generator=g, dtype=torch.float64), lm_head)
    # Held-out anchors: drafter states of blocks the selector never saw.
    args = inputs(m, seed=3)
    with torch.no_grad():
        hidden = m(*args[:4], mask=args[4]).view(3, B, D)[:, 1:]
    anchors = torch.tensor([5, 17, 230])
    ours = model.draft(hidden, anchors)
    with torch.no_grad():
        theirs = sglang_lattice_walk(sel, hidden, lm_head, anchors)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, (hidden @ lm_head.T).argmax(-1))
    # A walk that conditioned every slot on the anchor instead of the token chosen before differs.
    with torch.no_grad():
        unary, cand = torch.topk(hidden @ lm_head.T, sel.top_k, dim=-1)
        proj = hidden @ sel.hidden_projection.weight.T
        query = sel.predecessor_codebook[anchors][:, None] * proj
        pick = (unary + torch.einsum("ber,becr->bec", query, sel.successor_codebook[cand])).argmax(-1)
        wrong = cand.gather(-1, pick.unsqueeze(-1))[..., 0]
    assert not torch.equal(wrong, theirs)


def test_unary_top_k_is_chunked_and_sorted():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 5, 8, generator=g), torch.randn(50, 8, generator=g)
    v, i = unary_top_k(h, w, 6, chunk=3)
    ref = torch.topk(h @ w.T, 6)
    assert torch.equal(i, ref.indices)
    torch.testing.assert_close(v, ref.values)


# ---------------------------------------------------------------------------------- selector loss

def reference_selector_loss(sel, lm_head, hidden, labels, prev, weights, inject_gold, transform=IDENTITY):
    """float64, from the full-vocabulary logits (through the target's logit `transform`): top-k, strict or
    gold-injected k-way CE."""
    logits = transform.apply(hidden @ lm_head.T)
    cand = logits.topk(sel.top_k).indices
    total = hidden.new_zeros(())
    for i in range(hidden.shape[0]):
        c = cand[i].tolist()
        gold = int(labels[i])
        if gold not in c:
            if not inject_gold:
                continue
            c[-1] = gold
        proj = sel.hidden_projection.weight @ hidden[i]
        s = torch.stack([logits[i, t] + (sel.predecessor_codebook[prev[i]] * proj) @ sel.successor_codebook[t]
                         for t in c])
        total = total + weights[i] * (torch.logsumexp(s, 0) - s[c.index(gold)])
    return total


@pytest.mark.parametrize("inject_gold", [False, True])
def test_selector_loss_and_gradient_match_a_float64_reference(inject_gold):
    sel = trained_like_selector(vocab=40, d=8, rank=6, top_k=5, seed=1)
    g = torch.Generator().manual_seed(2)
    lm_head = torch.randn(40, 8, generator=g, dtype=torch.float64)
    hidden = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    logits = hidden.detach() @ lm_head.T
    labels = torch.where(torch.rand(30, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, 40, (30,), generator=g))
    prev = torch.randint(0, 40, (30,), generator=g)
    weights = torch.rand(30, generator=g, dtype=torch.float64) * (torch.rand(30, generator=g) > 0.2)
    cand = logits.topk(5).indices
    covered = (cand == labels[:, None]).any(1)
    assert 0 < int(covered.sum()) < 30  # both kinds of rows are present
    rows = SelectorRows(hidden, cand, labels, prev, weights)
    stats = selector_loss(sel, lm_head, rows, SelectorTerm(1.0, inject_gold, False, chunk_bytes=7 * 5 * 8 * 8))
    params = [hidden, sel.hidden_projection.weight, sel.predecessor_codebook, sel.successor_codebook]
    grads = torch.autograd.grad(stats.loss_sum, params)
    ref = reference_selector_loss(sel, lm_head, hidden, labels, prev, weights, inject_gold)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(stats.loss_sum, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(stats.covered, (weights * covered).sum())
    # Teacher-forced accuracy: over covered rows, the gold is the best rescored candidate.
    with torch.no_grad():
        proj = hidden @ sel.hidden_projection.weight.T
        pair = ((sel.predecessor_codebook[prev] * proj)[:, None] * sel.successor_codebook[cand]).sum(-1)
        best = cand.gather(1, (logits.gather(1, cand) + pair).argmax(1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(stats.correct, (weights * (covered & (best == labels))).sum())
    assert 0 < float(stats.correct) < float(stats.covered)
    # Strict and injected differ where the gold is missing: the reference can tell them apart.
    other = reference_selector_loss(sel, lm_head, hidden, labels, prev, weights, not inject_gold)
    assert not torch.allclose(ref, other)
    # detach: no gradient reaches the states, the selector's own parameters still learn.
    hidden.grad = None
    sel.zero_grad()
    selector_loss(sel, lm_head, rows, SelectorTerm(1.0, inject_gold, True, 7 * 5 * 8 * 8)).loss_sum.backward()
    assert hidden.grad is None and sel.successor_codebook.grad.abs().sum() > 0


def test_selector_weight_schedule():
    # 1000 steps, warm-up 0.1 (100 steps at 0), ramp 0.2 (200 steps up to alpha).
    a = [selector_alpha(s, 1000, 2.0, 0.1, ramp_ratio=0.2) for s in range(1000)]
    assert a[:100] == [0.0] * 100
    assert a[100] == pytest.approx(2.0 / 200) and a[199] == pytest.approx(1.0)
    assert a[299] == 2.0 and a[999] == 2.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert selector_alpha(0, 10, 1.0, 0.0, ramp_ratio=0.0) == 1.0


def micro_batch(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = 24
    ids = torch.randint(0, VOCAB - 1, (1, S), generator=g)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    loss_mask[0, :4] = False
    doc_ids = torch.zeros(1, S, dtype=torch.int32)
    mb = MicroBatch(torch.randn(1, S, 3 * D, generator=g, dtype=torch.float64), ids, loss_mask, doc_ids)
    anchors = torch.tensor([[4, 7, 12, 18, 21]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    pos = torch.arange(S)[None]
    block_ids, block_pos = block_inputs(ids, pos, anchors, B, mask_token_id=VOCAB - 1)
    labels, weights = block_targets(ids, loss_mask, doc_ids, anchors, valid=valid, block_size=B, gamma=None)
    mask = build_mask(anchors, valid, doc_ids, B, kind="dense")
    return mb, Blocks(anchors, valid, block_ids, block_pos, pos, labels.reshape(1, -1), weights.reshape(1, -1), mask)


@pytest.mark.parametrize("inject,kl", [(False, 0.0), (True, 0.0), (False, 0.5), (True, 0.5)])
def test_drafter_loss_adds_alpha_times_the_selector_term(inject, kl):
    """The total is the base loss (CE, or CE + KL) plus alpha times the float64 reference selector term;
    the candidates come from the base loss's logits."""
    # A wide top-k: random labels must land among the candidates of some slots for the strict loss.
    m = drafter("dflash2", selector_top_k=8 if inject else 96)
    with torch.no_grad():
        m.candidate_selector.successor_codebook.normal_(0, 0.3)
    g = torch.Generator().manual_seed(5)
    embed, head = torch.randn(VOCAB, D, generator=g, dtype=torch.float64), torch.randn(VOCAB, D, generator=g,
                                                                                          dtype=torch.float64)
    model = DraftModel(m, embed, head)
    mb, bl = micro_batch(m)
    if kl:
        mb.final_hidden = torch.randn(1, mb.input_ids.shape[1], D, generator=g, dtype=torch.float64)
    settings = StepSettings(shape=m.config, num_anchors=5, gamma=4.0, loss_chunks=3, mask_kind="dense", seed=0,
                            kl_weight=kl)
    w = float(bl.weights.sum())
    keys = DFlash2Keys(selector_alpha=0.7, selector_inject_gold=inject)  # at its full weight (step None)
    out = drafter_loss(model, mb, bl, w, settings=dataclasses.replace(settings, keys=keys))
    base = drafter_loss(DraftModel(drafter("dflash"), embed, head), mb, bl, w, settings=settings)
    # Reference: the states of every supervised slot, float64, full-vocabulary top-k.
    with torch.no_grad():
        ctx = m.fuse(mb.taps)
        hidden = m(F.embedding(bl.block_ids, embed), ctx, bl.block_positions, bl.ctx_positions, mask=bl.mask)
        blocks = hidden.view(-1, B, D)[:, 1:].reshape(-1, D)
        labels = bl.labels.view(-1, B)
        prev = labels[:, :-1].reshape(-1)
        ref = reference_selector_loss(m.candidate_selector, head, blocks, labels[:, 1:].reshape(-1), prev,
                                      bl.weights.view(-1, B)[:, 1:].reshape(-1).double(), inject)
    torch.testing.assert_close(out.loss, base.loss + 0.7 * ref / w, rtol=1e-9, atol=1e-9)
    assert ("kl" in out.sums) == (kl > 0) and (kl == 0 or float(out.sums["kl"]) > 0)
    torch.testing.assert_close(out.sums["selector_loss_sum"], ref, rtol=1e-9, atol=1e-9)
    assert float(ref) > 0 and (inject or float(out.sums["selector_covered"]) > 0)
    out.loss.backward()
    assert m.candidate_selector.predecessor_codebook.grad.abs().sum() > 0


def test_selector_adds_no_lm_head_pass_and_no_vocab_by_rank_tensor():
    """Forward + backward of a DFlash2 micro-batch multiplies by the lm_head exactly as often as v1's (the
    candidates come from the base loss's logits), and no op creates a tensor of [rows, V, r] size."""
    from .test_loss import HeadMatmuls, PeakOutput

    g = torch.Generator().manual_seed(5)
    embed = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    counts, peaks = {}, {}
    for arch in ("dflash", "dflash2"):
        m = drafter(arch)
        mb, bl = micro_batch(m)
        settings = StepSettings(shape=m.config, num_anchors=5, gamma=4.0, loss_chunks=3, mask_kind="dense", seed=0)
        with HeadMatmuls(head) as counter, PeakOutput() as peak:
            out = drafter_loss(DraftModel(m, embed, head), mb, bl, float(bl.weights.sum()), settings=settings)
            out.loss.backward()
        counts[arch], peaks[arch] = counter.count, peak.peak
        rows = bl.weights.numel() // B * (B - 1)
    assert counts["dflash2"] == counts["dflash"] > 0
    r = 12
    assert peaks["dflash2"] <= max(VOCAB * D, 16 * 3 * D * 4) < rows * VOCAB * r
