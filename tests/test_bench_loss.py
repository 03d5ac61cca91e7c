"""The bench's per-chunk autograd loss (bench/chunk_autograd.py, torchtitan's way) equals the fused loss
(objective/loss.py, hand-written gradients): value, every logged sum, per-row values, hits, candidates and
every input gradient, for the terms and inputs of every architecture (CE alone, KL, a row term on a
folded bias read from the target's states by index, the candidates of an output term), and one
drafter step through `drafter_loss` of each registered architecture."""

import pytest
import torch

from dflash_ds.architectures import VARIANTS
from dflash_ds.architectures.dspark.parts import l1_to_target
from dflash_ds.bench.chunk_autograd import PerChunkBackwardLoss
from dflash_ds.network.logit_transform import IDENTITY
from dflash_ds.objective.blocks import make_blocks
from dflash_ds.objective.drafter_loss import drafter_loss
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, LogitBias, RowTerm, TargetRows
from tests.reference import Candidates
from tests.test_loss import TRANSFORM, case, target_states
from tests.test_loss_terms import world

N, V = 23, 50


def run(cls, terms, transform, inputs, tensors):
    h, f, t = (x.clone().requires_grad_() for x in tensors)
    weight, labels, weights = inputs
    bias = LogitBias(f, t)
    target = TargetRows(target_states(torch.float64, n=9), torch.arange(N) % 9)
    out = cls(terms, weight, chunks=4, transform=transform).rows(h, labels, weights, 3.5, bias=bias, target=target)
    (1.5 * out.loss).backward()
    return out, (h.grad, f.grad, t.grad)


@pytest.mark.parametrize("transform", [IDENTITY, TRANSFORM])
@pytest.mark.parametrize("which", ["ce", "ce+kl", "ce+kl+row+candidates"])
def test_per_chunk_autograd_equals_the_fused_loss(which, transform):
    hidden, weight, labels, weights = case(torch.float64)
    g = torch.Generator().manual_seed(2)
    tensors = (hidden, torch.randn(N, 3, generator=g, dtype=torch.float64), torch.randn(V, 3, generator=g,
                                                                                       dtype=torch.float64))
    terms = [CrossEntropy(0.3), Distillation(0.7, 1.5), RowTerm("l1", 0.6, l1_to_target), Candidates(4)]
    terms = terms[:{"ce": 1, "ce+kl": 2, "ce+kl+row+candidates": 4}[which]]
    fused, fused_grads = run(ChunkedLoss, terms, transform, (weight, labels, weights), tensors)
    plain, plain_grads = run(PerChunkBackwardLoss, terms, transform, (weight, labels, weights), tensors)
    torch.testing.assert_close(plain.loss, fused.loss, rtol=1e-12, atol=1e-12)
    assert plain.sums.keys() == fused.sums.keys() == {t.name for t in terms if t.name != "candidates"}
    for name in fused.sums:
        torch.testing.assert_close(plain.sums[name], fused.sums[name], rtol=1e-12, atol=1e-12, msg=name)
    assert plain.rows.keys() == fused.rows.keys()
    for name in fused.rows:
        torch.testing.assert_close(plain.rows[name], fused.rows[name], rtol=1e-12, atol=1e-12, msg=name)
    assert torch.equal(plain.correct, fused.correct) and fused.correct.any()
    assert (plain.candidates is None) == (fused.candidates is None)
    if fused.candidates is not None:
        assert torch.equal(plain.candidates, fused.candidates)
        torch.testing.assert_close(plain.candidate_logits, fused.candidate_logits)
    for a, b in zip(plain_grads, fused_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert float(b.abs().sum()) > 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_drafter_step_of_every_architecture_is_the_same_with_either_loss(name):
    runs = []
    for cls in (ChunkedLoss, PerChunkBackwardLoss):
        model, mb, settings = world(name)
        blocks = make_blocks(mb, settings, 0)
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings, loss_class=cls)
        out.loss.backward()
        runs.append((out, [p.grad for p in model.drafter.parameters() if p.requires_grad]))
    (fused, fused_grads), (plain, plain_grads) = runs
    torch.testing.assert_close(plain.loss, fused.loss, rtol=1e-10, atol=1e-12)
    assert plain.sums.keys() == fused.sums.keys()
    for key in fused.sums:
        torch.testing.assert_close(plain.sums[key], fused.sums[key], rtol=1e-9, atol=1e-10, msg=key)
    for a, b in zip(plain_grads, fused_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)
