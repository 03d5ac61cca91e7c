"""DSpark's training step through the one fused loss, against a float64 dense reference written slot by
slot from DeepSpec's definitions: block of anchor a = [x_a, MASK x (B-1)], slot k labelled x_{a+k+1},
Markov predecessor x_{a+k}, target distribution from the target's final-norm state at a + k; loss =
(ce * sum(w CE) + l1 * sum(w ||q - p||_1) + confidence * sum(w BCE(c, 1 - TV))) / normaliser, with
the KL term added when asked. Values, every parameter's gradient, the logged sums (probabilistic
tau, per-slot acceptance, calibration) and the greedy hits of the acceptance proxy."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_ds.architectures.dspark import BINS
from dflash_ds.architectures.dspark import DSparkFields, DSparkKeys
from dflash_ds.config import DrafterConfig
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, default_gamma, make_blocks
from dflash_ds.objective.drafter_loss import StepSettings, acceptance_proxy, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape

D, VOCAB, B, S, RANK = 32, 96, 4, 40, 3
TERMS = DSparkKeys(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)


def world(kl_weight: float, **fields):
    cfg = Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    shape = drafter_shape(cfg, DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                             target_layer_ids=[1, 4], architecture="dspark",
                                             sections={"dspark": DSparkFields(markov_rank=RANK, **fields)}))
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).double()
    with torch.no_grad():  # heads large enough that the bias and the confidence matter
        for n, p in drafter.named_parameters():
            if "head" in n:
                p.normal_(0.0, 0.7)
    g = torch.Generator().manual_seed(1)
    embed, head = (torch.randn(VOCAB, D, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.randint(0, VOCAB - 1, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.bool)
    loss_mask[:, :6] = False
    loss_mask[1, 25] = False  # a hole: the blocks that reach it stop being supervised there
    doc_ids = torch.zeros(2, S, dtype=torch.int32)
    doc_ids[1, 30:] = 1
    mb = MicroBatch(torch.randn(2, S, 2 * D, generator=g, dtype=torch.float64), ids, loss_mask, doc_ids,
                    torch.randn(2, S, D, generator=g, dtype=torch.float64))
    settings = StepSettings(shape=shape, num_anchors=7, gamma=default_gamma(shape.num_drafts + 1), loss_chunks=3,
                            mask_kind="dense", seed=0, kl_weight=kl_weight, kl_temperature=1.5, keys=TERMS)
    return DraftModel(drafter, embed, head), mb, settings


def extra_of(model, out) -> tuple:
    """The architecture's sums of a loss output (its named logs), in their order."""
    return tuple(v for n, v in out.sums.items() if n not in ("ce", "kl"))


def named(out, extra) -> dict[str, float]:
    """The step's sums by the architecture's names (what the trainer hands its `logs.record`)."""
    return dict(zip((n for n in out.sums if n not in ("ce", "kl")), map(float, extra)))


def test_a_drafter_without_a_confidence_head_logs_no_confidence_field():
    """Its sums have no confidence entries and its record no confidence field (it logged "confidence MAE
    0.000", a head it does not have); the rest of DSpark's fields are those of a drafter with the head."""
    from dflash_ds.metrics import progress_line

    with_head, bare = world(0.0), world(0.0, enable_confidence_head=False)
    records = []
    for model, mb, settings in (with_head, bare):
        blocks = make_blocks(mb, settings, 0)
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings)
        assert len(extra_of(model, out)) == len(out.sums) - 1  # every sum but the cross-entropy's
        records.append(model.config.spec.logs.record(named(out, extra_of(model, out)), float(blocks.weights.sum())))
    assert {k for k in records[0] if k.startswith("confidence")} >= {"confidence_loss", "confidence_mae", "confidence_bias"}
    assert not [k for k in records[1] if k.startswith("confidence")]
    assert set(records[1]) == {k for k in records[0] if not k.startswith("confidence")}
    line = progress_line({"step": 1, "loss": 1.0, "accept_proxy": 1.0, **records[1]}, 2,
                         bare[0].config.spec.logs.progress)
    assert "tau_p" in line and "confidence" not in line


def reference(model, mb, blocks, hidden, normaliser, kl):
    """Float64, slot by slot: the loss, the logged sums and the greedy hits."""
    kl_weight, temperature = kl
    markov, conf = model.drafter.markov_head, model.drafter.confidence_head
    w1, w2 = markov.markov_w1.weight, markov.markov_w2.weight
    weights = blocks.weights.view(2, -1, B).double()
    ce = l1 = bce = kl_sum = 0.0
    accept = torch.zeros_like(weights)
    prob = torch.zeros_like(weights)
    hits = torch.zeros(2, weights.shape[1] * B, dtype=torch.bool)
    for r in range(2):
        for j, a in enumerate(blocks.anchors[r].tolist()):
            for k in range(B):
                w = weights[r, j, k]
                if w == 0:
                    continue
                h = hidden[r, j * B + k]
                prev, label = int(mb.input_ids[r, a + k]), int(mb.input_ids[r, a + k + 1])
                z = h @ model.lm_head.T + w2 @ w1[prev]
                tz = mb.final_hidden[r, a + k] @ model.lm_head.T
                q, p = z.softmax(-1), tz.softmax(-1)
                ce = ce + w * -torch.log_softmax(z, -1)[label]
                gap = (q - p).abs().sum()
                l1 = l1 + w * gap
                acc = (1 - 0.5 * gap.detach()).clamp(0, 1)
                c = conf.proj.weight[0] @ torch.cat([h, w1[prev]]) + conf.proj.bias[0]
                bce = bce + w * F.binary_cross_entropy_with_logits(c, acc)
                if kl_weight:
                    lq, lp = torch.log_softmax(z / temperature, -1), torch.log_softmax(tz / temperature, -1)
                    kl_sum = kl_sum + w * (lp.exp() * (lp - lq)).sum()
                accept[r, j, k], prob[r, j, k] = acc, torch.sigmoid(c.detach())
                hits[r, j * B + k] = int(z.argmax()) == label
    loss = (TERMS.ce_weight * ce + TERMS.l1_weight * l1 + TERMS.confidence_weight * bce + kl_weight * temperature ** 2 * kl_sum) / normaliser
    return loss, (l1, bce), accept, prob, hits


def dense_hidden(model, mb, blocks):
    drafter = model.drafter
    ctx = drafter.fuse(mb.taps)
    return drafter(model.embed_tokens(blocks.block_ids, ctx), ctx, blocks.block_positions, blocks.ctx_positions,
                   mask=blocks.mask)


@pytest.mark.parametrize("kl_weight", [0.0, 0.3])
def test_the_fused_step_matches_a_slot_by_slot_float64_reference(kl_weight):
    model, mb, settings = world(kl_weight)
    blocks = make_blocks(mb, settings, 0)
    weights = blocks.weights.view(2, -1, B).double()
    assert (weights[..., 0] > 0).any() and (weights == 0).any()  # slot 0 drafts; some slots are cut off
    normaliser = 1.7 * blocks.weights.sum()
    drafter = model.drafter
    params = [p for p in drafter.parameters()]
    out = drafter_loss(model, mb, blocks, normaliser, settings=settings)
    got = torch.autograd.grad(out.loss, params)
    # The reference recomputes the forward under autograd, every term dense.
    hidden = dense_hidden(model, mb, blocks)
    loss, (l1, bce), accept, prob, hits = reference(model, mb, blocks, hidden, normaliser, (kl_weight, 1.5))
    want = torch.autograd.grad(loss, params)
    torch.testing.assert_close(out.loss, loss, rtol=1e-10, atol=1e-12)
    for (name, _), a, b in zip(drafter.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12, msg=name)
    assert all(float(g.abs().sum()) > 0 for g in got)  # both heads and the backbone are trained
    # Logged sums: L1, BCE, probabilistic tau per block, calibration, per-slot acceptance.
    l1_sum, bce_sum, tau_sum, blocks_counted, abs_error, bias, *slots = (float(x) for x in extra_of(model, out))
    assert l1_sum == pytest.approx(float(l1.detach()), rel=1e-10) and bce_sum == pytest.approx(float(bce.detach()), rel=1e-10)
    on = weights > 0
    survive = torch.cumprod(accept * on, -1)
    counted = on.any(-1)
    assert blocks_counted == int(counted.sum())
    assert tau_sum == pytest.approx(float(((1 + survive.sum(-1)) * counted).sum()), rel=1e-10)
    assert abs_error == pytest.approx(float((weights * (prob - accept).abs()).sum()), rel=1e-9)
    assert bias == pytest.approx(float((weights * (prob - accept)).sum()), rel=1e-9)
    for k in range(B):
        assert slots[2 * k] == pytest.approx(float((accept[..., k] * on[..., k]).sum()), rel=1e-10)
        assert slots[2 * k + 1] == int(on[..., k].sum())
    record = model.config.spec.logs.record(named(out, extra_of(model, out)), float(blocks.weights.sum()))
    assert 1.0 <= record["tau_probabilistic"] <= B + 1 and "accept_rate_pos_4" in record
    # The greedy hits count from slot 0 (anchor-first), on the biased logits.
    assert torch.equal(out.correct, hits)
    run, n = acceptance_proxy(out.correct.view_as(weights), weights, reduce=False, first=0)
    want_run = sum(1 + int(torch.cumprod((hits.view_as(weights) & on)[r, j].int(), 0).sum())
                   for r in range(2) for j in range(weights.shape[1]) if on[r, j].any())
    assert float(run) == want_run and float(n) == int(counted.sum())


def test_the_ce_weight_scales_only_the_ce_term():
    """ce 1 with the other terms off is the plain DFlash objective on the anchor-first rows."""
    model, mb, settings = world(0.0)
    blocks = make_blocks(mb, settings, 0)
    norm = blocks.weights.sum()
    only_ce = [dataclasses.replace(settings, keys=DSparkKeys(ce_weight=w, l1_weight=0.0, confidence_weight=0.0))
               for w in (1.0, 0.25)]
    a, b = (drafter_loss(model, mb, blocks, norm, settings=s) for s in only_ce)
    torch.testing.assert_close(a.loss, a.sums["ce"] / norm, rtol=1e-12, atol=0)
    torch.testing.assert_close(b.loss, 0.25 * a.sums["ce"] / norm, rtol=1e-12, atol=0)
    assert torch.equal(a.sums["ce"], b.sums["ce"])  # the logged "loss" is the unweighted CE


def test_the_logged_reliability_bins_match_a_float64_reference():
    """The confidence head's reliability bins (pooled over the slots) in the step's logged sums and in
    its log record, against bins counted slot by slot from the reference's confidence, 1 - TV and weights."""
    model, mb, settings = world(0.0)
    blocks = make_blocks(mb, settings, 0)
    norm = blocks.weights.sum()
    out = drafter_loss(model, mb, blocks, norm, settings=settings)
    with torch.no_grad():
        _, _, accept, prob, _ = reference(model, mb, blocks, dense_hidden(model, mb, blocks), norm, (0.0, 1.5))
    weights = blocks.weights.view(2, -1, B).double()
    want = torch.zeros(3, BINS, dtype=torch.float64)
    for p, t, w in zip(prob.flatten().tolist(), accept.flatten().tolist(), weights.flatten().tolist()):
        i = min(int(p * BINS), BINS - 1)
        want[:, i] += torch.tensor([w, w * p, w * t], dtype=torch.float64)
    assert int((want[0] > 0).sum()) >= 3  # the predictions spread over several bins
    got = torch.tensor([float(x) for x in extra_of(model, out)[-3 * BINS:]], dtype=torch.float64).view(3, BINS)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    record_of, total = model.config.spec.logs.record, float(norm)
    record = record_of(named(out, extra_of(model, out)), float(norm))
    for row, name in zip(want, ("weight", "pred", "target")):
        assert record[f"confidence_bin_{name}"] == pytest.approx((row / total).tolist(), rel=1e-10, abs=1e-14)
    ece = float((want[1] - want[2]).abs().sum() / want[0].sum())
    assert record["confidence_ece"] == pytest.approx(ece, rel=1e-10)
    # The bins partition the slots: the bias is the bins' signed gap, and |bias| <= ECE <= MAE.
    assert record["confidence_bias"] == pytest.approx(float((want[1] - want[2]).sum()) / total, rel=1e-9)
    assert abs(record["confidence_bias"]) <= record["confidence_ece"] <= record["confidence_mae"] + 1e-12
    # Empty bins (no confidence head) log no reliability fields.
    bare = record_of(named(out, [float(x) for x in extra_of(model, out)[:-3 * BINS]] + [0.0] * (3 * BINS)), float(norm))
    assert "accept_rate_pos_1" in bare and not any(k.startswith(("confidence_bin", "confidence_ece")) for k in bare)
