"""The target's scaling around its embedding and lm_head (network/logit_transform.py): read from the
target's config, applied by the loss (with and without the KL term), the
selector, the greedy walk, the block embeddings and the exported remote code, each against a
float64 computation of the transformed logits."""

import pytest
import torch
import torch.nn.functional as F
from transformers import CohereConfig, Gemma2Config, GraniteConfig, Qwen3Config

from dflash_ds.architectures.dflash2 import DFlash2Fields
from dflash_ds.architectures.dflash2.parts import CandidateSelector, SelectorRows, SelectorTerm, greedy_path, selector_loss
from dflash_ds.config import DrafterConfig
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.logit_transform import IDENTITY, LogitTransform, target_scales
from dflash_ds.objective.blocks import slot_rows
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, TargetRows
from dflash_ds.resolve.drafter import drafter_shape
from tests.reference import dense_loss
from tests.test_dflash2 import reference_selector_loss
from tests.test_selector_kernels import selector_case

TRANSFORM = LogitTransform(0.5, 3.0)  # strong enough that a missing or misplaced transform shows


def small(cls, **kw):
    return cls(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512, **kw)


def test_scales_are_read_from_the_target_families_that_use_them():
    assert target_scales(small(Qwen3Config)) == {"output_multiplier": 1.0, "final_logit_softcapping": None,
                                                 "input_embedding_scale": 1.0}
    gemma = target_scales(small(Gemma2Config, final_logit_softcapping=30.0))
    assert gemma == {"output_multiplier": 1.0, "final_logit_softcapping": 30.0, "input_embedding_scale": 8.0}
    granite = target_scales(small(GraniteConfig, logits_scaling=4.0, embedding_multiplier=12.0))
    assert granite == {"output_multiplier": 0.25, "final_logit_softcapping": None, "input_embedding_scale": 12.0}
    assert target_scales(small(CohereConfig, logit_scale=0.0625))["output_multiplier"] == 0.0625


def test_transform_and_its_slope():
    x = torch.linspace(-20, 20, 41, dtype=torch.float64, requires_grad=True)
    z = TRANSFORM.apply(x)
    torch.testing.assert_close(z, 3.0 * torch.tanh(0.5 * x / 3.0))
    (grad,) = torch.autograd.grad(z.sum(), x)
    torch.testing.assert_close(TRANSFORM.slope(z.detach()), grad)
    assert IDENTITY.identity and not TRANSFORM.identity and IDENTITY.apply(x) is x


@pytest.mark.parametrize("with_kl", [False, True])
def test_loss_applies_the_transform_to_the_drafter_and_the_target_logits(with_kl):
    g = torch.Generator().manual_seed(0)
    b, q, d, v, bs = 2, 12, 16, 50, 4
    hidden = torch.randn(b, q, d, generator=g, dtype=torch.float64) * 3
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (b, q), generator=g)
    weights = torch.rand(b, q, generator=g, dtype=torch.float64)
    weights.view(b, -1, bs)[..., 0] = 0  # slot 0 of every block is never supervised
    target_hidden = torch.randn(b, q, d, generator=g, dtype=torch.float64) * 3
    terms = [CrossEntropy(), *([Distillation(0.7, 2.0)] if with_kl else [])]
    target = TargetRows(target_hidden) if with_kl else None
    results = {}
    for transform in (TRANSFORM, IDENTITY):
        h = hidden.clone().requires_grad_()
        out = ChunkedLoss(terms, weight, chunks=3, transform=transform).blocks(
            h, labels.view(b, -1, bs), weights.view(b, -1, bs), 5.0, target=target)
        (grad,) = torch.autograd.grad(out.loss, h)
        href = hidden.clone().requires_grad_()
        rows_kl = (0.7, 2.0, slot_rows(target_hidden, bs)) if with_kl else None
        ref = dense_loss(slot_rows(href, bs), weight, slot_rows(labels, bs), slot_rows(weights, bs), 5.0, rows_kl,
                         transform)[0]
        (ref_grad,) = torch.autograd.grad(ref, href)
        torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        results[transform] = float(out.loss.detach())
    assert abs(results[TRANSFORM] - results[IDENTITY]) > 0.1  # the transform is not a no-op here


@pytest.mark.parametrize("inject_gold", [False, True])
def test_selector_scores_transformed_logits(inject_gold):
    sel, lm_head, hidden, top, labels, prev, w = selector_case(1, head_scale=2.0)
    stats = selector_loss(sel, lm_head, SelectorRows(hidden, top.indices, labels, prev, w, top.values),
                          SelectorTerm(1.0, inject_gold), transform=TRANSFORM)
    (grad,) = torch.autograd.grad(stats.loss_sum, hidden)
    # Reference: the candidates' transformed logits from the full logits, autograd through everything.
    href = hidden.detach().clone().requires_grad_()
    total = reference_selector_loss(sel, lm_head, href, labels, prev, w, inject_gold, TRANSFORM)
    (ref_grad,) = torch.autograd.grad(total, href)
    torch.testing.assert_close(stats.loss_sum, total, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_greedy_walk_uses_transformed_unary_scores():
    g = torch.Generator().manual_seed(2)
    sel = CandidateSelector(8, 40, 6, 8).double()
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 1.0, generator=g)
        sel.predecessor_codebook.normal_(0, 1.0, generator=g)
    lm_head = torch.randn(40, 8, generator=g, dtype=torch.float64) * 3
    hidden = torch.randn(64, 3, 8, generator=g, dtype=torch.float64)
    anchors = torch.randint(0, 40, (64,), generator=g)

    def brute(transform):
        z = transform.apply(hidden @ lm_head.T)
        unary, cand = z.topk(8)
        prev, out = anchors, []
        for k in range(3):
            q = sel.predecessor_codebook[prev] * (hidden[:, k] @ sel.hidden_projection.weight.T)
            s = unary[:, k] + (sel.successor_codebook[cand[:, k]] * q[:, None]).sum(-1)
            prev = cand[:, k].gather(1, s.argmax(-1, keepdim=True)).squeeze(1)
            out.append(prev)
        return torch.stack(out, 1)

    with torch.no_grad():
        capped, plain = greedy_path(sel, hidden, lm_head, anchors, transform=TRANSFORM), greedy_path(sel, hidden,
                                                                                                     lm_head, anchors)
        assert torch.equal(capped, brute(TRANSFORM)) and torch.equal(plain, brute(IDENTITY))
    assert not torch.equal(capped, plain)


def gemma_like_drafter(architecture):
    target = small(Gemma2Config, final_logit_softcapping=3.0)
    section = DrafterConfig(num_layers=2, block_size=4, mask_token_id=127, target_layer_ids=[1, 3, 5],
                             architecture=architecture, sections={"dflash2": DFlash2Fields(selector_rank=6, selector_top_k=8)})
    torch.manual_seed(0)
    return DFlashDrafter(drafter_shape(target, section))


def test_a_scaled_target_gives_a_scaled_drafter_that_embeds_and_exports_the_same(tmp_path):
    from transformers import AutoModel

    from dflash_ds.export import load_drafter, save_drafter

    drafter = gemma_like_drafter("dflash2")
    shape = drafter.config
    assert (shape.final_logit_softcapping, shape.input_embedding_scale, shape.output_multiplier) == (3.0, 8.0, 1.0)
    embed = torch.randn(128, 64)
    model = DraftModel(drafter, embed, torch.randn(128, 64))
    ids = torch.tensor([[3, 127, 127, 127]])
    torch.testing.assert_close(model.embed_tokens(ids, embed), 8.0 * embed[ids])
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    assert load_drafter(out).config == shape
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    hidden, lm_head = torch.randn(2, 3, 64, generator=g), torch.randn(128, 64, generator=g) * 0.5
    with torch.no_grad():
        sel = drafter.candidate_selector
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.normal_(0, 1.0, generator=g)
        remote.candidate_selector.load_state_dict(sel.state_dict())
        torch.testing.assert_close(remote.compute_logits(hidden, lm_head), shape.logit_transform.apply(hidden @ lm_head.T))
        anchors = torch.tensor([5, 9])
        want = DraftModel(drafter, embed, lm_head).draft(hidden, anchors)
        assert torch.equal(remote.propose(hidden, anchors, lm_head), want)
        # The cap changes the walk here: a remote code without it would propose other tokens.
        assert not torch.equal(want, greedy_path(sel, hidden, lm_head, anchors))
