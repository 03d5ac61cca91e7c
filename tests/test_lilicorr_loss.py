"""LiLiCorr's terms in the fused loss (dflash_ds/architectures/lilicorr/loss.py) on a tiny float64 world:
the chunked loss with them equals the cross-entropy alone plus the lattice terms computed here from the
full logits (the log-normaliser recovered from the zero-weight row term, the candidates' order, the
target's logits at the candidates), and the lattice terms alone reach every head parameter, the anchor's
path into `fc`, and with the soft value the drafted states."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_ds.architectures import lilicorr
from dflash_ds.architectures.lilicorr.loss import LatticeInputs, lattice_inputs, lattice_loss_terms
from dflash_ds.architectures.lilicorr.terms import Weights, lattice_terms, nodes, oracle
from dflash_ds.architectures.lilicorr.walk import candidates
from dflash_ds.config import DrafterConfig
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, make_blocks, slot_rows, slot_target_states
from dflash_ds.objective.drafter_loss import StepSettings
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy
from dflash_ds.resolve.drafter import drafter_shape

D, VOCAB, B, S_LEN = 32, 16, 4, 40
BASE, MARGIN = Weights(0.25, 0.0, 0.25, 2.0), Weights(0.125, 0.125, 0.25, 2.0)


def world(pkg, seed=0):
    """k = V = 16, so every gold token is in the lattice and every valid block's slots are supervised."""
    cfg = Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields = pkg.LiLiCorrFields(candidate_topk=16, head_hidden_size=16, factor_dim=16, num_heads=4)
    shape = drafter_shape(cfg, DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                             target_layer_ids=[1, 4], architecture="lilicorr",
                                             sections={"lilicorr": fields}))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(shape).double()
    with torch.no_grad():
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    g = torch.Generator().manual_seed(seed + 1)
    embed, head = (torch.randn(VOCAB, D, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.randint(0, VOCAB - 1, (2, S_LEN), generator=g)
    loss_mask = torch.ones(2, S_LEN, dtype=torch.bool)
    loss_mask[:, :4] = False
    loss_mask[1, 25] = False  # blocks reaching it are partly masked: excluded from the lattice terms
    doc_ids = torch.zeros(2, S_LEN, dtype=torch.int32)
    mb = MicroBatch(torch.randn(2, S_LEN, 2 * D, generator=g, dtype=torch.float64), ids, loss_mask, doc_ids,
                    torch.randn(2, S_LEN, D, generator=g, dtype=torch.float64))
    settings = StepSettings(shape=shape, num_anchors=6, gamma=4.0, loss_chunks=3, mask_kind="dense", seed=0)
    return DraftModel(drafter, embed, head), mb, settings


def forward(model, mb, settings):
    blocks = make_blocks(mb, settings, 0)
    ctx = model.drafter.fuse(mb.taps)
    hidden = model.drafter(model.embed_tokens(blocks.block_ids, ctx), ctx, blocks.block_positions,
                           blocks.ctx_positions, mask=blocks.mask)
    r, n = blocks.anchors.shape
    before = (blocks.anchors - 1).clamp(min=0)
    context = ctx.gather(1, before[..., None].expand(-1, -1, ctx.shape[-1])).reshape(r * n, -1)
    valid = (blocks.anchors >= 1).reshape(-1)
    target = slot_target_states(mb.final_hidden, blocks.anchors, B)
    return blocks, hidden, LatticeInputs(hidden, context, valid, target)


def chunked(model, blocks, hidden, terms, normaliser):
    loss = ChunkedLoss(terms, model.lm_head, chunks=3)
    r = blocks.labels.shape[0]
    return loss.blocks(hidden, blocks.labels.view(r, -1, B), blocks.weights.view(r, -1, B), normaliser)


@pytest.mark.parametrize("weights", [BASE, MARGIN], ids=["base", "margin"])
def test_the_fused_loss_is_the_dflash_loss_plus_the_lattice_terms(weights):
    pkg = lilicorr
    model, mb, settings = world(pkg)
    blocks, hidden, inputs = forward(model, mb, settings)
    normaliser = float(blocks.weights.sum())
    ce_only = chunked(model, blocks, hidden, [CrossEntropy()], normaliser)
    full = chunked(model, blocks, hidden, [CrossEntropy(), *lattice_loss_terms(model, blocks, inputs, weights)],
                   normaliser)
    # The lattice terms from the full logits, by hand.
    rows = slot_rows(hidden, B)
    n, s, k = rows.shape[0] // (B - 1), B - 1, 16
    found_c = candidates(rows.view(n, s, D), model.lm_head, k)
    labels, w = slot_rows(blocks.labels, B).view(n, s), slot_rows(blocks.weights, B).view(n, s)
    factors = model.drafter.lilicorr(model.embed[found_c.ids], found_c.log_probs, rows.view(n, s, D), inputs.context,
                                     valid=inputs.context_valid)
    found = oracle(found_c.ids, labels, w)
    zt = (slot_rows(inputs.target_states, B) @ model.lm_head.T).view(n, s, VOCAB).gather(-1, found_c.ids)
    sums = lattice_terms(nodes(factors, found.gold_index), found, zt, weights)
    lattice = (weights.ce * sums.ce + weights.margin_weight * sums.hinge + weights.penalty * sums.penalty) \
        / sums.supervised * (w.sum() / normaliser)
    assert int(sums.supervised) >= 6 and not found.valid.all()  # supervised slots, and an excluded block
    assert float((full.loss - ce_only.loss - lattice).detach()) == pytest.approx(0.0, abs=1e-12)
    assert float(full.sums["lilicorr_hinge_sum"]) == (0.0 if weights is BASE else pytest.approx(float(sums.hinge.detach())))
    assert float(full.sums["lilicorr_supervised"]) == float(sums.supervised)
    if weights is MARGIN:
        assert float(sums.hinge.detach()) > 0


def test_the_lattice_terms_alone_reach_the_head_and_the_backbone():
    pkg = lilicorr
    model, mb, settings = world(pkg, seed=2)
    blocks, hidden, inputs = forward(model, mb, settings)
    rows = slot_rows(hidden, B)
    q = torch.softmax(rows.detach() @ model.lm_head.T, -1)
    out = chunked(model, blocks, hidden, [CrossEntropy(0.0), *lattice_loss_terms(model, blocks, inputs, MARGIN)],
                  float(blocks.weights.sum()))
    # The soft value's q @ W comes from the chunk loop's logits, equal to the dense product.
    torch.testing.assert_close(out.expected, q @ model.lm_head, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    for name, p in model.drafter.lilicorr.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # The anchor's context row reaches fc; the pass-hidden path and the soft value the last backbone layer.
    assert model.drafter.fc.weight.grad.abs().sum() > 0
    assert model.drafter.layers[-1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_the_record_is_made_of_the_named_logs():
    pkg = lilicorr
    model, mb, settings = world(pkg, seed=3)
    blocks, hidden, inputs = forward(model, mb, settings)
    out = chunked(model, blocks, hidden, [CrossEntropy(), *lattice_loss_terms(model, blocks, inputs, MARGIN)],
                  float(blocks.weights.sum()))
    record = pkg.SPEC.logs.record
    sums = {k: float(v.detach()) for k, v in out.sums.items()}
    rec = record(sums, float(blocks.weights.sum()))
    sup, blocks_n = sums["lilicorr_supervised"], sums["lilicorr_blocks"]
    assert sup > 0 and blocks_n > 0
    assert rec["lilicorr_ce"] == pytest.approx(sums["lilicorr_ce_sum"] / sup)
    assert rec["lilicorr_margin"] == pytest.approx(sums["lilicorr_hinge_sum"] / sup)
    # k = V: every gold is in the lattice, so the oracle prefix is the whole block and covers every slot.
    assert rec["lilicorr_oracle_prefix"] == B - 1 and rec["lilicorr_slot_gt_in_lattice"] == 1.0
    assert rec["lilicorr_oracle_gap"] == pytest.approx(B - 1 - rec["lilicorr_selected_prefix"])
    assert 0 <= rec["lilicorr_top1_prefix"] <= B - 1 and rec["lilicorr_logfactor_spread"] > 0
    assert rec["accept_rate_pos_1"] == pytest.approx(sums["lilicorr_accept_sum_1"] / blocks_n)
    # Nothing to report without a valid block: the fields are left out, not NaN.
    empty = {k: 0.0 for k in sums}
    assert record(empty, 1.0) == {}


def test_lattice_inputs_take_the_context_row_before_each_anchor_in_its_document():
    pkg = lilicorr
    model, mb, settings = world(pkg, seed=4)
    mb.doc_ids[0, 20:] = 1  # a second document: an anchor at its first token has no context row
    blocks = make_blocks(mb, settings, 0)
    blocks.anchors[0, 0] = 20
    ctx = model.drafter.fuse(mb.taps)
    got = lattice_inputs(blocks, ctx, ctx=ctx, mb=mb)
    r, n = blocks.anchors.shape
    for i in range(r):
        for j in range(n):
            a = int(blocks.anchors[i, j])
            want_valid = a >= 1 and int(mb.doc_ids[i, a - 1]) == int(mb.doc_ids[i, a])
            assert bool(got.context_valid[i * n + j]) == want_valid
            if a >= 1:
                assert torch.equal(got.context[i * n + j], ctx[i, a - 1])
    assert not got.context_valid[0]
    torch.testing.assert_close(got.target_states, slot_target_states(mb.final_hidden, blocks.anchors, B))
    with pytest.raises(ValueError, match="target final-norm states"):
        lattice_inputs(blocks, ctx, ctx=ctx, mb=MicroBatch(mb.taps, mb.input_ids, mb.loss_mask, mb.doc_ids))


def test_q_at_w_read_off_the_cross_entropys_gradient_equals_the_gemm_and_so_do_the_gradients(monkeypatch):
    """With the cross-entropy the only term with a gradient, the loss reads each row's q @ W off the input
    gradient it computes anyway (g / s + W[y]) instead of a GEMM of the softmax with W: equal to the dense
    q @ W on every row of weight > 0 (0 on the others), and the whole LiLiCorr loss's gradients (the soft
    value reads it) equal those of the GEMM path."""
    from dflash_ds.objective.loss import _Call

    pkg = lilicorr
    model, mb, settings = world(pkg, seed=5)
    assert MARGIN.soft_value
    runs = {}
    for derive in (True, False):
        if not derive:
            monkeypatch.setattr(_Call, "derives_expected", lambda self: False)
        model.drafter.zero_grad(set_to_none=True)
        blocks, hidden, inputs = forward(model, mb, settings)
        out = chunked(model, blocks, hidden, [CrossEntropy(), *lattice_loss_terms(model, blocks, inputs, MARGIN)],
                      float(blocks.weights.sum()))
        out.loss.backward()
        runs[derive] = (out, hidden.detach(), slot_rows(blocks.weights, B).reshape(-1),
                        {n: p.grad.clone() for n, p in model.drafter.named_parameters() if p.grad is not None})
    (out, hidden, w, grads), (ref, _, _, ref_grads) = runs[True], runs[False]
    rows = slot_rows(hidden, B)
    dense = torch.softmax(rows @ model.lm_head.T, -1) @ model.lm_head
    on = w > 0
    assert 0 < int(on.sum()) < w.numel()  # both kinds of row
    torch.testing.assert_close(out.expected[on], dense[on], rtol=1e-10, atol=1e-12)
    assert torch.equal(out.expected[~on], torch.zeros_like(out.expected[~on]))
    torch.testing.assert_close(ref.expected, dense, rtol=1e-12, atol=1e-12)
    assert set(grads) == set(ref_grads) and "lilicorr.token_proj.weight" in grads
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)
