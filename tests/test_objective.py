"""The DFlash objective (spec 2): anchors, labels, weights (hand-worked), chunked loss against a
float64 dense reference, lm_head matmul count under checkpointing, and the training metrics."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.objective import (
    acceptance_proxy,
    block_inputs,
    block_targets,
    chunked_loss,
    decay_weights,
    default_gamma,
    sample_anchors,
    slot_accuracy,
    valid_anchor_mask,
)

E = math.exp

# A hand-worked row (S = 10):
#   position   0  1  2  3  4  5  6  7  8  9
#   loss_mask  0  0  1  1  1  0  1  1  1  1
#   doc_ids    0  0  0  0  0  0  0  1  1  1
#   input_ids 100 ...                    109
LOSS_MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
DOC_IDS = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.int32)
INPUT_IDS = torch.arange(100, 110).view(1, 10)
POSITION_IDS = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])


def test_default_gamma_and_decay():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    gammas = [default_gamma(b) for b in range(2, 40)]
    assert gammas[0] == 1.0 and all(a < b for a, b in zip(gammas, gammas[1:]))
    w = decay_weights(5, 2.0)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, E(-0.5), E(-1.0), E(-1.5)]))
    with pytest.raises(ValueError, match=r"objective\.gamma"):
        decay_weights(4, 0.0)
    with pytest.raises(ValueError, match=r"drafter\.block_size"):
        default_gamma(1)


def test_valid_anchor_mask_hand_worked():
    # a valid iff mask[a] and mask[a+1], same document, a+1 < S: 2, 3, 7, 8 (6 -> 7 crosses documents)
    assert valid_anchor_mask(LOSS_MASK, DOC_IDS).int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1, 0]]
    padded = torch.tensor([[1, 1, 1, 1]], dtype=torch.bool)
    assert valid_anchor_mask(padded, torch.tensor([[0, 0, -1, -1]])).int().tolist() == [[1, 0, 0, 0]]


def test_block_inputs_hand_worked():
    anchors = torch.tensor([[2, 3, 8, 0]])
    ids, pos = block_inputs(INPUT_IDS, POSITION_IDS, anchors, 5, mask_token_id=7)
    assert ids.tolist() == [[102, 7, 7, 7, 7, 103, 7, 7, 7, 7, 108, 7, 7, 7, 7, 100, 7, 7, 7, 7]]
    # positions continue the anchor's in-document position (position_ids[8] = 1)
    assert pos.tolist() == [[2, 3, 4, 5, 6, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]


def test_block_targets_hand_worked():
    anchors = torch.tensor([[2, 3, 8, 0]])
    valid = torch.tensor([[True, True, True, False]])
    labels, weights = block_targets(INPUT_IDS, LOSS_MASK, DOC_IDS, anchors, valid, 5, gamma=2.0)
    # same-position labels: slot k is the token at a + k
    assert labels[0, 0].tolist() == [102, 103, 104, 105, 106]
    assert labels[0, 1].tolist() == [103, 104, 105, 106, 107]
    assert labels[0, 2, :2].tolist() == [108, 109]  # the rest is past the row (weight 0)
    expected = torch.tensor([[
        [0, 1, E(-0.5), 0, E(-1.5)],  # a=2: slot 3 (pos 5) unsupervised
        [0, 1, 0, E(-1.0), 0],        # a=3: pos 5 unsupervised, pos 7 is another document
        [0, 1, 0, 0, 0],              # a=8: pos 10, 11, 12 are past the row
        [0, 0, 0, 0, 0],              # invalid block
    ]], dtype=torch.float32)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, expected)
    _, w_default = block_targets(INPUT_IDS, LOSS_MASK, DOC_IDS, anchors, valid, 5, gamma=None)
    torch.testing.assert_close(w_default[0, 0, 2], torch.tensor(E(-1 / default_gamma(5))))


def random_rows(b=8, S=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(b, S, generator=g) < 0.7
    loss_mask[0] = False            # no valid anchor at all
    loss_mask[1] = False
    loss_mask[1, 10:14] = True      # three valid anchors: 10, 11, 12
    doc_ids = (torch.arange(S) // 20).int().expand(b, S).clone()
    doc_ids[:, -5:] = -1
    return loss_mask, doc_ids


def test_sample_anchors_properties():
    loss_mask, doc_ids = random_rows()
    valid_pos = valid_anchor_mask(loss_mask, doc_ids)
    N = 10
    anchors, valid = sample_anchors(loss_mask, doc_ids, N, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (8, N) and anchors.dtype == torch.int64 and valid.dtype == torch.bool
    for r in range(8):
        k = int(valid[r].sum())
        assert k == min(N, int(valid_pos[r].sum()))
        assert valid[r, :k].all() and not valid[r, k:].any()           # valid first, padding after
        chosen = anchors[r, :k]
        assert valid_pos[r, chosen].all()                              # only valid anchors
        assert len(set(chosen.tolist())) == k                          # distinct
        assert torch.equal(chosen, chosen.sort().values)               # sorted
        assert (anchors[r, k:] == 0).all()                             # padded at position 0
    assert valid[0].sum() == 0 and anchors[1, :3].tolist() == [10, 11, 12]
    again, _ = sample_anchors(loss_mask, doc_ids, N, torch.Generator().manual_seed(0))
    other, _ = sample_anchors(loss_mask, doc_ids, N, torch.Generator().manual_seed(1))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)


def test_sample_anchors_uniform():
    rows, S, N = 4000, 16, 3
    loss_mask = torch.zeros(rows, S, dtype=torch.bool)
    loss_mask[:, 4:13] = True                   # valid anchors 4..11 (8 of them)
    doc_ids = torch.zeros(rows, S, dtype=torch.int32)
    anchors, valid = sample_anchors(loss_mask, doc_ids, N, torch.Generator().manual_seed(123))
    assert valid.all()
    counts = torch.bincount(anchors.flatten(), minlength=S)
    p = N / 8
    sd = math.sqrt(rows * p * (1 - p))
    assert counts[:4].sum() == 0 and counts[12:].sum() == 0
    assert ((counts[4:12].double() - rows * p).abs() < 5 * sd).all(), counts.tolist()


def test_sample_anchors_errors():
    loss_mask, doc_ids = random_rows(b=2, S=16)
    with pytest.raises(ValueError, match=r"objective\.num_anchors"):
        sample_anchors(loss_mask, doc_ids, 17, torch.Generator())
    with pytest.raises(ValueError, match=r"objective\.num_anchors"):
        sample_anchors(loss_mask, doc_ids, 0, torch.Generator())


# ------------------------------------------------------------------------------ chunked loss

V, D = 50, 16


def loss_case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 24, D, generator=g, dtype=torch.float64).to(dtype)
    lm_head = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (2, 24), generator=g)
    # About half the labels are the model's argmax, so `correct` has both values.
    top = (hidden.double() @ lm_head.double().T).argmax(-1)
    labels[:, ::2] = top[:, ::2]
    weights = torch.rand(2, 24, generator=g)
    weights[torch.rand(2, 24, generator=g) < 0.4] = 0.0
    return hidden, lm_head, labels, weights


def reference_loss(hidden, lm_head, labels, weights, normaliser):
    logits = hidden.double() @ lm_head.double().T
    ce = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none").view(labels.shape)
    ce_sum = (weights.double() * ce).sum()
    correct = (logits.argmax(-1) == labels) & (weights > 0)
    return ce_sum / normaliser, ce_sum, correct


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_chunked_loss_matches_float64_reference(dtype, tol):
    hidden, lm_head, labels, weights = loss_case(dtype)
    norm = float(weights.sum()) * 1.7  # a step-wide normaliser, not this micro-batch's
    h_ref = hidden.detach().double().requires_grad_()
    w_ref = lm_head.detach().double().requires_grad_()
    loss_ref, ce_ref, correct_ref = reference_loss(h_ref, w_ref, labels, weights, norm)
    loss_ref.backward()
    assert 0 < correct_ref.sum() < (weights > 0).sum()  # the accuracy check can fail both ways
    for num_chunks in (1, 3, 7, 100):
        for ckpt in (True, False):
            h = hidden.detach().clone().requires_grad_()
            w = lm_head.detach().clone().requires_grad_()
            out = chunked_loss(h, w, labels, weights, norm, num_chunks, checkpoint=ckpt)
            out.loss.backward()
            assert out.ce_sum.requires_grad is False and out.correct.dtype == torch.bool
            torch.testing.assert_close(out.loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(out.ce_sum.double(), ce_ref.detach(), rtol=tol, atol=tol)
            assert torch.equal(out.correct, correct_ref)
            torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol * 10, atol=tol)
            torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=tol * 10, atol=tol)


def test_chunked_loss_bf16_close_to_reference():
    hidden, lm_head, labels, weights = loss_case(torch.bfloat16)
    out = chunked_loss(hidden, lm_head, labels, weights, 1.0, 4)
    loss_ref, _, _ = reference_loss(hidden, lm_head, labels, weights, 1.0)
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())


class LogitMatmuls(TorchDispatchMode):
    """Counts matmuls that produce logits (last dim V) and the largest such output."""

    def __init__(self):
        super().__init__()
        self.count, self.max_rows = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "matmul", "linear") and out.shape[-1] == V:
            self.count += 1
            self.max_rows = max(self.max_rows, out.numel() // V)
        return out


@pytest.mark.parametrize("lm_head_grad", [False, True])
def test_lm_head_runs_at_most_twice_per_chunk(lm_head_grad):
    hidden, lm_head, labels, weights = loss_case(torch.float32)
    lm_head.requires_grad_(lm_head_grad)
    supervised = int((weights > 0).sum())
    for num_chunks in (1, 4):
        for ckpt, expected in ((True, 2), (False, 1)):
            h = hidden.clone().requires_grad_()
            counter = LogitMatmuls()
            with counter:
                out = chunked_loss(h, lm_head, labels, weights, 1.0, num_chunks, checkpoint=ckpt)
                forward_count = counter.count
                out.loss.backward()
            assert forward_count == num_chunks
            assert counter.count == expected * num_chunks, (ckpt, num_chunks)
            # Only one chunk of supervised slots is ever projected at a time.
            assert counter.max_rows == math.ceil(supervised / num_chunks)


def test_chunked_loss_all_padding_and_errors():
    hidden, lm_head, labels, _ = loss_case(torch.float32)
    h = hidden.clone().requires_grad_()
    out = chunked_loss(h, lm_head, labels, torch.zeros(2, 24), 1.0, 4)
    out.loss.backward()
    assert out.loss.item() == 0.0 and not out.correct.any() and (h.grad == 0).all()
    with pytest.raises(ValueError, match=r"objective\.loss_chunks"):
        chunked_loss(h, lm_head, labels, torch.ones(2, 24), 1.0, 0)


# ---------------------------------------------------------------------------------- metrics

def test_acceptance_proxy_and_slot_accuracy_hand_worked():
    w = torch.tensor([[
        [0, 1, 1, 1],   # correct 1,1,0 -> run 2 -> 3
        [0, 1, 0, 1],   # slot 2 unsupervised stops the run -> 1 -> 2
        [0, 1, 1, 1],   # slot 1 wrong -> 0 -> 1
        [0, 0, 0, 0],   # invalid block: not counted
    ]], dtype=torch.float32)
    correct = torch.tensor([[
        [1, 1, 1, 0],
        [0, 1, 1, 1],
        [1, 0, 1, 1],
        [1, 1, 1, 1],
    ]], dtype=torch.bool)
    assert acceptance_proxy(correct, w).item() == pytest.approx((3 + 2 + 1) / 3)
    assert acceptance_proxy(correct.view(1, 16), w).item() == pytest.approx(2.0)
    total, count = acceptance_proxy(correct, w, reduce=False)
    assert (total.item(), count.item()) == (6.0, 3.0)
    assert math.isnan(acceptance_proxy(correct, torch.zeros_like(w)).item())
    acc = slot_accuracy(correct, w)
    # slot 1: 1,1,0 of 3; slot 2: 1,1 of 2 (block 1 unsupervised); slot 3: 0,1,1 of 3
    assert math.isnan(acc[0].item())
    torch.testing.assert_close(acc[1:], torch.tensor([2 / 3, 1.0, 2 / 3]))
    hits, counts = slot_accuracy(correct, w, reduce=False)
    assert hits.tolist() == [0, 2, 2, 2] and counts.tolist() == [0, 3, 2, 3]
