"""linear_cross_entropy against a float64 dense reference (loss, sums, hits, both gradients) for
even and uneven chunkings, its lm_head matmul count (forward + input gradient, nothing in
backward), no_grad, the absence of host syncs and data-dependent shapes, and
chunked_loss with LossOptions(fused=True) against the unfused chunked_loss."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.model.linear_ce import _ce_forward, _ce_forward_and_grad, linear_cross_entropy
from dflash_ds.model.logit_transform import IDENTITY, LogitTransform
from dflash_ds.model.objective import KLTerm, LossOptions, chunked_loss
from tests.test_objective import B, NoHostSync, Q, ROWS, loss_case

N, D, V = 23, 16, 50  # 23 rows: most chunk counts are uneven


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::2] = (hidden.double() @ weight.double().T).argmax(-1)[::2]  # half the rows are hits
    weights = torch.rand(N, generator=g) + 0.1
    zero = torch.rand(N, generator=g) < 0.3
    zero[:2] = True
    weights[zero] = 0.0
    # Unsupervised rows: arbitrary labels, even out of the vocabulary, must not matter...
    labels[zero] = torch.randint(V, 10 * V, (int(zero.sum()),), generator=g)
    # ...nor count as hits: row 0 predicts token 0 and row 1 its own label.
    hidden[0] = (3 * weight[0].double()).to(dtype)
    labels[1] = (hidden[1].double() @ weight.double().T).argmax()
    return hidden, weight, labels, weights


def reference(hidden, weight, labels, weights, normaliser):
    logits = hidden.double() @ weight.double().T
    sup = weights > 0
    ce = F.cross_entropy(logits, torch.where(sup, labels, 0), reduction="none")
    ce_sum = (weights.double() * ce).sum()
    correct = (logits.argmax(-1) == labels) & sup
    return ce_sum / normaliser, ce_sum, correct


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_matches_dense_reference(dtype, tol, weight_grad):
    hidden, weight, labels, weights = case(dtype)
    norm = torch.tensor(float(weights.sum()) * 1.7)  # 0-dim tensor, a step-wide normaliser
    h_ref = hidden.to(torch.float64, copy=True).requires_grad_()
    w_ref = weight.to(torch.float64, copy=True).requires_grad_()
    loss_ref, ce_ref, correct_ref = reference(h_ref, w_ref, labels, weights, norm.double())
    (2.5 * loss_ref).backward()
    # Both values of `correct` occur among supervised rows, so a wrong hit test shows.
    assert 0 < correct_ref.sum() < (weights > 0).sum()
    logits = hidden.double() @ weight.double().T
    assert weights[:2].sum() == 0 and logits[0].argmax() == 0 and logits[1].argmax() == labels[1]
    for num_chunks in (1, 2, 3, 5, 7, N, N + 4):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(weight_grad)
        loss, ce_sum, correct = linear_cross_entropy(h, w, labels, weights, norm, num_chunks)
        assert loss.requires_grad and not ce_sum.requires_grad and correct.dtype == torch.bool
        assert loss.dtype == ce_sum.dtype == torch.promote_types(dtype, torch.float32)
        (2.5 * loss).backward()  # backward scales by the incoming gradient
        torch.testing.assert_close(loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(ce_sum.double(), ce_ref.detach(), rtol=tol, atol=tol)
        assert torch.equal(correct, correct_ref), num_chunks
        torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol, atol=tol)
        if weight_grad:
            torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=tol, atol=tol)
        else:
            assert w.grad is None


def test_float_normaliser_no_grad_and_frozen_hidden():
    hidden, weight, labels, weights = case(torch.float64)
    norm = 3.25
    loss_ref, ce_ref, correct_ref = reference(hidden, weight, labels, weights, norm)
    with torch.no_grad():
        loss, ce_sum, correct = linear_cross_entropy(hidden.clone().requires_grad_(), weight, labels, weights, norm, 4)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(ce_sum, ce_ref)
    assert torch.equal(correct, correct_ref)
    # Only the weight trains: its gradient, and none for the hidden states.
    h = hidden.detach()
    w_ref = weight.clone().requires_grad_()
    reference(h, w_ref, labels, weights, norm)[0].backward()
    w = weight.clone().requires_grad_()
    linear_cross_entropy(h, w, labels, weights, norm, 3)[0].backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_all_zero_weights_and_double_backward():
    hidden, weight, labels, _ = case(torch.float64)
    h = hidden.clone().requires_grad_()
    loss, ce_sum, correct = linear_cross_entropy(h, weight, labels, torch.zeros(N), 1.0, 3)
    loss.backward()
    assert loss.item() == 0.0 and ce_sum.item() == 0.0 and not correct.any() and (h.grad == 0).all()
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels % V, torch.ones(N), 1.0, 3)[0]
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(ValueError, match=r"objective\.loss_chunks"):
        linear_cross_entropy(h, weight, labels, torch.ones(N), 1.0, 0)


class HeadMatmuls(TorchDispatchMode):
    """Counts matmuls with the lm_head weight (any view of its storage) as an operand, the row
    counts they see, and the weight-gradient matmuls (output shaped like the weight)."""

    def __init__(self, weight):
        super().__init__()
        self.ptr = weight.untyped_storage().data_ptr()
        self.shape = weight.shape
        self.count, self.grad_w, self.rows = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "matmul", "linear", "addmm_"):
            ops = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() == self.ptr for t in ops):
                self.count += 1
                self.rows.update(t.shape[0] for t in ops if t.untyped_storage().data_ptr() != self.ptr)
            elif out.shape == self.shape:
                self.grad_w += 1
        return out


# num_chunks -> (chunks, rows per chunk) for 23 rows: 23/3 -> 8, 8, 7 + 1 padding row.
CHUNKS = {1: (1, 23), 3: (3, 8), 4: (4, 6), 7: (6, 4), 30: (23, 1)}


@pytest.mark.parametrize("weight_grad", [False, True])
def test_two_head_matmuls_per_chunk(weight_grad):
    hidden, weight, labels, weights = case(torch.float32)
    weight.requires_grad_(weight_grad)
    for num_chunks, (chunks, rows) in CHUNKS.items():
        h = hidden.clone().requires_grad_()
        counter = HeadMatmuls(weight)
        with counter:
            loss = linear_cross_entropy(h, weight, labels, weights, torch.tensor(2.0), num_chunks)[0]
            forward = (counter.count, counter.grad_w)
            loss.backward()
        # Forward: the logits and the input gradient of every chunk; backward: no matmul at all.
        assert forward == (2 * chunks, chunks if weight_grad else 0), num_chunks
        assert (counter.count, counter.grad_w) == forward
        assert counter.rows == {rows}, (num_chunks, counter.rows)  # equal chunk shapes
        with torch.no_grad(), HeadMatmuls(weight) as counter:
            linear_cross_entropy(h, weight, labels, weights, torch.tensor(2.0), num_chunks)
        assert (counter.count, counter.grad_w, counter.rows) == (chunks, 0, {rows})


@pytest.mark.parametrize("weight_grad", [False, True])
def test_fused_chunked_loss_matches_unfused(weight_grad):
    hidden, lm_head, labels, weights = loss_case(torch.float64)
    norm = weights.sum() * 1.3
    for block_size in (B, None):
        for num_chunks in (1, 3, 4, 100):
            outs = []
            for fused in (False, True):
                h = hidden.clone().requires_grad_()
                w = lm_head.clone().requires_grad_(weight_grad)
                out = chunked_loss(h, w, labels, weights, norm, LossOptions(num_chunks, block_size, fused=fused))
                (3.0 * out.loss).backward()
                outs.append((out, h.grad, w.grad))
            (ref, h_ref, w_ref), (got, h_got, w_got) = outs
            assert got.correct.shape == (ROWS, Q) and got.correct.any()
            assert torch.equal(got.correct, ref.correct), (block_size, num_chunks)
            for a, b in ((got.loss, ref.loss), (got.ce_sum, ref.ce_sum), (got.kl_sum, ref.kl_sum), (h_got, h_ref)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
            if weight_grad:
                torch.testing.assert_close(w_got, w_ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"objective\.kl_weight"):
        chunked_loss(hidden, lm_head, labels, weights, 1.0, LossOptions(2, B, fused=True),
                     KLTerm(0.5, target_logits_fn=lambda idx: torch.zeros(idx.shape[0], lm_head.shape[0])))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_host_sync(device):
    # On meta, tensors have no values: anything reading one (a Python branch, a data-dependent
    # shape) cannot run; NoHostSync also refuses syncing ops and cross-device copies.
    hidden, lm_head, labels, weights = (t.to(device) for t in loss_case(torch.float32))
    h = hidden.requires_grad_()
    w = lm_head.requires_grad_()
    with NoHostSync() as mode:
        out = chunked_loss(h, w, labels, weights, weights.sum(), LossOptions(3, B, fused=True))
        forward_ops = len(mode.seen)
        out.loss.backward()
        flat = linear_cross_entropy(h.detach().flatten(0, 1), w, labels.flatten(), weights.flatten(),
                                    weights.sum(), 5)
        flat[0].backward()
    assert forward_ops < len(mode.seen) and mode.seen.count("mm") >= 2 * 3
    assert h.grad.shape == hidden.shape and w.grad.shape == lm_head.shape
    if device == "cpu":
        assert out.loss.item() > 0 and h.grad.abs().sum() > 0


def test_elementwise_traces_as_one_graph():
    # On CUDA the elementwise functions are compiled with fullgraph=True: they must trace
    # without graph breaks and give the eager results.
    hidden, weight, labels, weights = case(torch.float32)
    logits = hidden @ weight.T
    lab = torch.where(weights > 0, labels, 0)
    scale = weights / 3.0
    for transform in (IDENTITY, LogitTransform(0.5, 3.0)):  # identity; a target's scaling and softcap
        for fn, args in ((_ce_forward_and_grad, (logits, lab, weights, scale, transform)),
                         (_ce_forward, (logits, lab, weights, transform))):
            torch._dynamo.reset()
            traced = torch.compile(fn, dynamic=False, fullgraph=True, backend="eager")
            for a, b in zip(traced(*args), fn(*args)):
                torch.testing.assert_close(a, b)
