"""Fused terms = float64 autograd, for every registered architecture and the toy of tests/toy_variant.py:
one micro-batch's `drafter_loss` (the chunked loss with its hand-written gradients, the KL term on)
against a dense reference written plainly (every logit at once, log_softmax, the architecture's
per-row term as its value function, gradients by torch.autograd.grad): the loss, every drafter
parameter's gradient and every logged sum by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_ds.architectures import VARIANTS
from dflash_ds.config import DrafterConfig, ObjectiveConfig
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, make_blocks, slot_rows, slot_target_index
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.objective.loss import LossOutput, RoundsOutput
from dflash_ds.objective.loss_terms import OutputTerm, RowTerm
from dflash_ds.resolve.drafter import drafter_shape
from tests.toy_variant import TOY, register

ARCHITECTURES = sorted(VARIANTS) + [TOY.spec.name]
D, VOCAB, B, S = 32, 96, 4, 40
KL_WEIGHT, TEMPERATURE = 0.3, 1.5


def world(name: str, dtype=torch.float64):
    """A small drafter of architecture `name` (heads large enough that their terms matter), one
    micro-batch of two rows with unsupervised stretches and a document boundary, and step settings
    with the KL term on."""
    cfg = Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    spec = VARIANTS[name].spec  # at its own small sizes (Spec.small)
    shape = drafter_shape(cfg, DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                             target_layer_ids=[1, 4], architecture=name,
                                             sections={name: spec.fields(**spec.small)}))
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).to(dtype)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if not n.startswith("layers") and "norm" not in n and "fc" not in n:
                p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(1)
    embed, head = (torch.randn(VOCAB, D, generator=g, dtype=dtype) for _ in range(2))
    ids = torch.randint(0, VOCAB - 1, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.bool)
    loss_mask[:, :6] = False
    loss_mask[1, 25] = False
    doc_ids = torch.zeros(2, S, dtype=torch.int32)
    doc_ids[1, 30:] = 1
    mb = MicroBatch(torch.randn(2, S, 2 * D, generator=g, dtype=dtype), ids, loss_mask, doc_ids,
                    torch.randn(2, S, D, generator=g, dtype=dtype))
    objective = ObjectiveConfig(kl_weight=KL_WEIGHT, kl_temperature=TEMPERATURE, num_anchors=7, loss_chunks=3,
                                anchor_last_prompt_token=False)
    settings = StepSettings.of(shape, objective, 0, torch.device("cpu"))
    return DraftModel(drafter, embed, head), mb, settings


def fused(model, mb, blocks, normaliser, settings):
    """The project's loss: (loss, the logged sums by name)."""
    out = drafter_loss(model, mb, blocks, normaliser, settings=settings)
    return out.loss, out.sums


def dense(model, mb, blocks, normaliser, settings):
    """The same loss written plainly in float64: (loss, sums by name). The architecture's vocabulary
    terms by their value functions (autograd differentiates them); its output terms, which autograd
    already differentiates, read the dense loss's candidates and per-row values."""
    shape = model.config
    ctx = model.drafter.fuse(mb.taps)
    hidden = model.drafter(model.embed_tokens(blocks.block_ids, ctx), ctx, blocks.block_positions,
                           blocks.ctx_positions, mask=blocks.mask)
    own = shape.variant.objective.terms(model, mb, blocks, hidden, ctx=ctx, keys=settings.keys)
    first = shape.first_draft_slot
    h = slot_rows(hidden, B, first).double()
    w = slot_rows(blocks.weights, B, first).double()
    labels = torch.where(w > 0, slot_rows(blocks.labels, B, first), 0)
    lm_head = model.lm_head.double()
    unbiased = h @ lm_head.T
    raw = unbiased
    bias = own.bias
    if bias is not None:
        raw = raw + bias.features.double() @ bias.table.double().T
    z = shape.logit_transform.apply(raw)
    index = slot_rows(slot_target_index(blocks.anchors, B, S, shape.spec.label_offset), B, first)
    tz = shape.logit_transform.apply(mb.final_hidden.reshape(-1, D)[index].double() @ lm_head.T)

    def ce_kl(z):  # the backbone's two vocabulary terms of logits z, per row
        log_q, log_p = F.log_softmax(z / TEMPERATURE, -1), F.log_softmax(tz / TEMPERATURE, -1)
        return F.cross_entropy(z, labels, reduction="none"), (log_p.exp() * (log_p - log_q)).sum(-1)

    ce, kl = ce_kl(z)
    sums = {"ce": (w * ce).sum(), "kl": (w * kl).sum()}
    loss = own.ce_weight * sums["ce"] + KL_WEIGHT * TEMPERATURE ** 2 * sums["kl"]
    rounds = None
    if bias is not None and bias.rounds is not None:
        # Rounds of the bias (XPress's Jacobi rounds): round 0 the unbiased logits, round j the bias of
        # round j - 1's argmax, computed whole and differentiated by autograd here.
        r, found = bias.rounds, []
        raw_k = unbiased
        for k in range(r.count + 1):
            if k:
                raw_k = unbiased + r.features(k, found[-1][0], 0, h.shape[0]).double() @ bias.table.double().T
            z_k = shape.logit_transform.apply(raw_k)
            found.append((raw_k.argmax(-1).detach(), (z_k.argmax(-1) == labels) & (w > 0)))
            label = "base" if k == 0 else f"round{k}"
            ce_k, kl_k = ce_kl(z_k)
            sums[f"ce_{label}"], sums[f"kl_{label}"] = (w * ce_k).sum(), (w * kl_k).sum()
            weight_k = r.base_weight if k == 0 else r.weight
            loss = loss + weight_k * (sums[f"ce_{label}"] + KL_WEIGHT * TEMPERATURE ** 2 * sums[f"kl_{label}"])
        rounds = RoundsOutput(torch.stack([a for a, _ in found]), torch.stack([c for _, c in found]), None)
    rows = {}
    terms = own.terms
    for t in terms:
        if isinstance(t, RowTerm):
            values, _ = t.values(z.softmax(-1), tz, False)
            sums[t.name] = (w * values).sum()
            loss = loss + t.weight * sums[t.name]
            rows[t.name] = values.detach()
    loss = loss / normaliser
    k = max((t.top_k for t in terms if isinstance(t, OutputTerm)), default=0)
    top = raw.detach().topk(k, dim=-1) if k else None
    expected = z.softmax(-1).detach() @ lm_head if any(getattr(t, "reads_expected", False) for t in terms) else None
    correct = (z.argmax(-1) == labels) & (w > 0)  # in the rows' order, as the output terms see it
    base = LossOutput(loss, {}, correct, top.indices if k else None, top.values if k else None, rows, expected=expected,
                      rounds=rounds)
    for t in terms:
        if isinstance(t, OutputTerm):
            extra, logs = t.contribute(base, normaliser)
            sums.update(logs)
            loss = loss + extra
    return loss, {n: s.detach() for n, s in sums.items()}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_fused_terms_equal_float64_autograd(name, monkeypatch):
    if name == TOY.spec.name:
        register(monkeypatch)
    model, mb, settings = world(name)
    blocks = make_blocks(mb, settings, 0)
    assert (blocks.weights == 0).any() and (blocks.weights > 0).any()
    normaliser = 1.7 * blocks.weights.sum()
    params = [p for p in model.drafter.parameters() if p.requires_grad]
    loss, sums = fused(model, mb, blocks, normaliser, settings)
    got = torch.autograd.grad(loss, params)
    want_loss, want_sums = dense(model, mb, blocks, normaliser, settings)
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
    assert set(sums) == set(want_sums) and {"ce", "kl"} <= set(sums)
    for key, value in want_sums.items():
        torch.testing.assert_close(torch.as_tensor(sums[key]).double(), value.double(), rtol=1e-9, atol=1e-10,
                                   msg=key)
    assert all(float(want_sums[k]) != 0 for k in ("ce", "kl"))
    # an architecture's terms over supervised slots (LiLiCorr's lattice) have some here
    assert all(float(v) > 0 for k, v in want_sums.items() if k.endswith("_supervised"))
    for (pname, _), a, b in zip(((n, p) for n, p in model.drafter.named_parameters() if p.requires_grad), got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=pname)
