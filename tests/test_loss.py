"""The loss (objective/loss.py) against the float64 dense reference (tests/reference.py, dense_loss): the
loss, its sums, the hits and both gradients for even and uneven chunkings, with and without the KL
term, under a target's logit transform; the top-k candidates; slot 0 of every block skipped by shape;
two lm_head matmuls per chunk (three with the target's logits) and one chunk of logits at a time;
no_grad; the absence of host syncs and data-dependent shapes; the compiled elementwise pass."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.network.logit_transform import IDENTITY, LogitTransform
from dflash_ds.objective.blocks import slot_rows
from dflash_ds.objective.head_matmuls import SeparateMatmuls
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import (CrossEntropy, Distillation, LogitBias, Pass, RowTerm, TargetLogits, TargetRows,
                                        chunk_math)
from tests.reference import Candidates, chunked, dense_loss
from tests.test_objective import NoHostSync

N, D, V = 23, 16, 50  # 23 rows: most chunk counts are uneven
TRANSFORM = LogitTransform(0.5, 3.0)  # a target's scaling and softcap, strong enough to show when missing


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


def target_states(dtype, seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)


CHUNK_COUNTS = (1, 2, 3, 5, 7, N, N + 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("transform", [IDENTITY, TRANSFORM])
def test_matches_dense_reference(dtype, tol, weight_grad, transform):
    hidden, weight, labels, weights = case(dtype)
    norm = torch.tensor(float(weights.sum()) * 1.7)  # 0-dim tensor, a step-wide normaliser
    h_ref = hidden.to(torch.float64, copy=True).requires_grad_()
    w_ref = weight.to(torch.float64, copy=True).requires_grad_()
    loss_ref, ce_ref, _, correct_ref = dense_loss(h_ref, w_ref, labels, weights, norm.double(), None, transform)
    (2.5 * loss_ref).backward()
    # Both values of `correct` occur among supervised rows, so a wrong hit test shows.
    assert 0 < correct_ref.sum() < (weights > 0).sum()
    for num_chunks in CHUNK_COUNTS:
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(weight_grad)
        out = chunked(h, w, labels, weights, norm, num_chunks, transform=transform)
        assert out.loss.requires_grad and not out.sums["ce"].requires_grad and out.correct.dtype == torch.bool
        assert out.loss.dtype == out.sums["ce"].dtype == torch.promote_types(dtype, torch.float32)
        assert set(out.sums) == {"ce"}
        (2.5 * out.loss).backward()  # backward scales by the incoming gradient
        torch.testing.assert_close(out.loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.sums["ce"].double(), ce_ref.detach(), rtol=tol, atol=tol)
        assert torch.equal(out.correct, correct_ref), num_chunks
        torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol, atol=tol)
        if weight_grad:
            torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=tol, atol=tol)
        else:
            assert w.grad is None


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("transform", [IDENTITY, TRANSFORM])
def test_kl_term_matches_dense_reference(dtype, tol, temperature, transform):
    hidden, weight, labels, weights = case(dtype)
    kl = (0.7, temperature, target_states(dtype))
    norm = torch.tensor(float(weights.sum()) * 1.3)
    h_ref = hidden.to(torch.float64, copy=True).requires_grad_()
    loss_ref, ce_ref, kl_ref, _ = dense_loss(h_ref, weight, labels, weights, norm.double(), kl, transform)
    (2.0 * loss_ref).backward()
    assert kl_ref > 0.05 * ce_ref  # large enough for a mistake in the term to show
    for num_chunks in (1, 3, 7, N + 2):
        h = hidden.clone().requires_grad_()
        out = chunked(h, weight, labels, weights, norm, num_chunks, kl=kl[:2], target=kl[2], transform=transform)
        (2.0 * out.loss).backward()
        torch.testing.assert_close(out.loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.sums["ce"].double(), ce_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.sums["kl"].double(), kl_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol, atol=tol)
    # The KL gradient is really in there: without the term the input gradient differs.
    h = hidden.clone().requires_grad_()
    chunked(h, weight, labels, weights, norm, 3, transform=transform).loss.backward()
    assert (h.grad.double() - h_ref.grad).abs().max() > 100 * tol
    # Against itself the KL is 0; a KL term of weight 0 adds nothing to the loss or the gradient, and
    # still reports its sum.
    same = chunked(hidden, weight, labels, weights, norm, 3, kl=(0.7, temperature), target=hidden)
    assert abs(float(same.sums["kl"])) < 1e-5
    grads = []
    for how in (dict(kl=(0.0, temperature), target=kl[2]), {}):
        h = hidden.clone().requires_grad_()
        out = chunked(h, weight, labels, weights, norm, 3, **how)
        out.loss.backward()
        grads.append((out, h.grad))
    (off, off_grad), (plain, plain_grad) = grads
    assert torch.equal(off.loss, plain.loss) and torch.equal(off_grad, plain_grad)
    assert float(off.sums["kl"]) > 0 and "kl" not in plain.sums


@pytest.mark.parametrize("weight_kl", [0.7, 0.0])
def test_target_states_by_index_equal_the_gathered_rows(weight_kl):
    # TargetRows.index: a table of positions and each row's entry (rows repeat, as overlapping
    # blocks repeat positions); each chunk multiplies its distinct states once. Everything the loss
    # returns equals the run on the gathered rows, for every chunking (uneven, one row, more chunks
    # than rows), with the KL term on and, weight 0, with only a chunk term reading the logits.
    from dflash_ds.architectures.dspark.parts import l1_to_target

    hidden, weight, labels, weights = case(torch.float64)
    table = target_states(torch.float64, n=9)
    index = torch.randint(0, 9, (N,), generator=torch.Generator().manual_seed(4))
    assert len(set(index.tolist())) < N
    terms = (RowTerm("l1", 0.6, l1_to_target),) if weight_kl == 0 else ()
    kl = (weight_kl, 1.5) if weight_kl else None
    runs = []
    for target in (TargetRows(table[index]), TargetRows(table, index)):
        for num_chunks in (1, 3, 7, N + 2):
            h = hidden.clone().requires_grad_()
            out = chunked(h, weight, labels, weights, 7.0, num_chunks, kl=kl, terms=terms, target=target)
            out.loss.backward()
            runs.append((out.loss, *out.sums.values(), *out.rows.values(), out.correct, h.grad))
    assert float(runs[0][2]) > 0.01  # the target's logits matter (the KL or the L1 term)
    for got, want in zip(runs[4:], runs[:4]):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="index"):
        chunked(hidden, weight, labels, weights, 7.0, 2, kl=(0.5, 1.0), target=TargetRows(table, index[:-1]))


def test_top_k_are_the_dense_top_k_of_the_raw_logits():
    hidden, weight, labels, weights = case(torch.float64)
    logits = hidden @ weight.T
    for k, num_chunks in ((1, 1), (5, 3), (V, 4)):
        out = chunked(hidden, weight, labels, weights, 1.0, num_chunks, top_k=k, transform=TRANSFORM)
        top = logits.topk(k)
        assert torch.equal(out.candidates, top.indices) and out.candidates.dtype == torch.int64
        torch.testing.assert_close(out.candidate_logits, top.values)  # raw: before the transform
    none = chunked(hidden, weight, labels, weights, 1.0, 3)
    assert none.candidates is None and none.candidate_logits is None


def test_float_normaliser_no_grad_and_frozen_hidden():
    hidden, weight, labels, weights = case(torch.float64)
    norm = 3.25
    loss_ref, ce_ref, _, correct_ref = dense_loss(hidden, weight, labels, weights, norm)
    with torch.no_grad():
        out = chunked(hidden.clone().requires_grad_(), weight, labels, weights, norm, 4)
    assert out.loss.grad_fn is None
    torch.testing.assert_close(out.loss, loss_ref)
    torch.testing.assert_close(out.sums["ce"], ce_ref)
    assert torch.equal(out.correct, correct_ref)
    # Only the weight trains: its gradient, and none for the hidden states.
    h = hidden.detach()
    w_ref = weight.clone().requires_grad_()
    dense_loss(h, w_ref, labels, weights, norm)[0].backward()
    w = weight.clone().requires_grad_()
    chunked(h, w, labels, weights, norm, 3).loss.backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_all_zero_weights_double_backward_and_bad_arguments():
    hidden, weight, labels, _ = case(torch.float64)
    h = hidden.clone().requires_grad_()
    out = chunked(h, weight, labels, torch.zeros(N), 1.0, 3)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.sums["ce"].item() == 0.0 and not out.correct.any() and (h.grad == 0).all()
    h = hidden.clone().requires_grad_()
    loss = chunked(h, weight, labels % V, torch.ones(N), 1.0, 3).loss
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(loss, h, create_graph=True)
    for how, words in ((dict(chunks=0), "chunks"), (dict(chunks=2, top_k=V + 1), "top_k"),
                       (dict(chunks=2, kl=(0.5, 1.0)), "target's states"),
                       (dict(chunks=2, kl=(-1.0, 1.0), target=hidden), "kl term's weight"),
                       (dict(chunks=2, terms=(CrossEntropy(),)), "share a name")):
        with pytest.raises(ValueError, match=words):
            chunked(h, weight, labels, torch.ones(N), 1.0, **how)
    with pytest.raises(ValueError, match="first term"):
        ChunkedLoss([Distillation(1.0), CrossEntropy()], weight, chunks=2)


# ---------------------------------------------------------------------------------- blocks

B, ROWS, Q = 4, 2, 28  # 7 blocks per row, 14 in the batch


def block_case(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, Q, D, generator=g, dtype=torch.float64).to(dtype)
    lm_head = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (ROWS, Q), generator=g)
    labels[:, ::2] = (hidden.double() @ lm_head.double().T).argmax(-1)[:, ::2]
    weights = torch.rand(ROWS, Q, generator=g)
    weights[torch.rand(ROWS, Q, generator=g) < 0.4] = 0.0
    weights[:, ::B] = 0.0  # slot 0 of every block, as block_targets makes it
    return hidden, lm_head, labels, weights


def blocked(t):
    return t.view(ROWS, -1, B)


def block_loss(hidden, lm_head, labels, weights, norm, chunks, *, kl=None, top_k=0, transform=IDENTITY, target=None):
    terms = [CrossEntropy(), *([Distillation(*kl)] if kl is not None else []), *([Candidates(top_k)] if top_k else [])]
    return ChunkedLoss(terms, lm_head, chunks=chunks, transform=transform).blocks(
        hidden, labels, weights, norm, target=TargetRows(target) if target is not None else None)


@pytest.mark.parametrize("with_kl", [False, True])
def test_block_loss_is_the_reference_over_the_drafted_slots(with_kl):
    hidden, lm_head, labels, weights = block_case()
    g = torch.Generator().manual_seed(5)
    target = torch.randn(ROWS, Q, D, generator=g, dtype=torch.float64)
    kl = (0.4, 1.5) if with_kl else None
    norm = weights.sum() * 1.1
    h_ref = hidden.clone().requires_grad_()
    rows_kl = (0.4, 1.5, slot_rows(target, B)) if with_kl else None
    loss_ref, ce_ref, kl_ref, correct_ref = dense_loss(slot_rows(h_ref, B), lm_head, slot_rows(labels, B),
                                                       slot_rows(weights, B), norm, rows_kl, TRANSFORM)
    loss_ref.backward()
    for num_chunks in (1, 3, 100):
        h = hidden.clone().requires_grad_()
        out = block_loss(h, lm_head, blocked(labels), blocked(weights), norm, num_chunks, kl=kl, top_k=3,
                         transform=TRANSFORM, target=target if with_kl else None)
        out.loss.backward()
        kl_sum = out.sums["kl"] if with_kl else torch.zeros(())
        for got, want in ((out.loss, loss_ref), (out.sums["ce"], ce_ref), (kl_sum, kl_ref), (h.grad, h_ref.grad)):
            torch.testing.assert_close(got.double(), want.detach().double(), rtol=1e-9, atol=1e-11)
        assert out.correct.shape == (ROWS, Q) and not out.correct[:, ::B].any()
        assert torch.equal(slot_rows(out.correct, B), correct_ref)
        assert torch.equal(out.candidates, (slot_rows(hidden, B) @ lm_head.T).topk(3).indices)


def test_block_loss_skips_slot_zero_by_shape():
    # Slot 0 is never projected: a weight there cannot contribute, nor a correct argmax count.
    hidden, lm_head, labels, weights = block_case()
    labels[:, ::B] = (hidden @ lm_head.T).argmax(-1)[:, ::B]
    heavy = weights.clone()
    heavy[:, ::B] = 1.0
    out = block_loss(hidden, lm_head, blocked(labels), blocked(heavy), 1.0, 2)
    ref = block_loss(hidden, lm_head, blocked(labels), blocked(weights), 1.0, 2)
    assert torch.equal(out.loss, ref.loss) and not out.correct[:, ::B].any()


def test_block_loss_bf16_close_to_reference():
    hidden, lm_head, labels, weights = block_case(torch.bfloat16)
    out = block_loss(hidden, lm_head, blocked(labels), blocked(weights), 1.0, 4)
    ref = dense_loss(slot_rows(hidden, B), lm_head, slot_rows(labels, B), slot_rows(weights, B), 1.0)[0]
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.item()) < 0.02 * abs(ref.item())


# ----------------------------------------------------------------------------- cost and memory

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


class PeakOutput(TorchDispatchMode):
    """The largest tensor any op creates (in elements): a full-vocabulary logits tensor for all
    rows would show here."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.peak = max(self.peak, t.numel())
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
            loss = chunked(h, weight, labels, weights, torch.tensor(2.0), num_chunks).loss
            forward = (counter.count, counter.grad_w)
            loss.backward()
        # Forward: the logits and the input gradient of every chunk; backward: no matmul at all.
        assert forward == (2 * chunks, chunks if weight_grad else 0), num_chunks
        assert (counter.count, counter.grad_w) == forward
        assert counter.rows == {rows}, (num_chunks, counter.rows)  # equal chunk shapes
        with torch.no_grad(), HeadMatmuls(weight) as counter:
            chunked(h, weight, labels, weights, torch.tensor(2.0), num_chunks)
        assert (counter.count, counter.grad_w, counter.rows) == (chunks, 0, {rows})


def test_kl_shares_the_lm_head_matmul_and_memory_stays_flat():
    hidden, weight, labels, weights = case(torch.float32)
    target = target_states(torch.float32)
    assert max(N * D, V * D) < N * V  # so the peak check below can tell one chunk of logits from all of them
    for num_chunks, (chunks, rows) in CHUNKS.items():
        h = hidden.clone().requires_grad_()
        with HeadMatmuls(weight) as counter, PeakOutput() as peak:
            loss = chunked(h, weight, labels, weights, 2.0, num_chunks, kl=(0.5, 2.0), target=target).loss
            forward = counter.count
            loss.backward()
        # Forward: one matmul for the drafter's and the target's logits of every chunk (their rows
        # stacked) and the input gradient; backward: none.
        assert (forward, counter.count) == (2 * chunks, 2 * chunks), num_chunks
        assert counter.rows == {rows, 2 * rows}, (num_chunks, counter.rows)
        assert peak.peak <= max(2 * rows * V, N * D, V * D), (num_chunks, peak.peak)
        if chunks > 1:
            assert peak.peak < N * V  # never every row's logits at once


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_host_sync(device):
    # On meta, tensors have no values: anything reading one (a Python branch, a data-dependent
    # shape) cannot run; NoHostSync also refuses syncing ops and cross-device copies.
    hidden, lm_head, labels, weights = (t.to(device) for t in block_case(torch.float32))
    h = hidden.requires_grad_()
    w = lm_head.requires_grad_()
    with NoHostSync() as mode:
        out = block_loss(h, w, blocked(labels), blocked(weights), weights.sum(), 3, top_k=2)
        forward_ops = len(mode.seen)
        out.loss.backward()
        flat = chunked(h.detach().flatten(0, 1), w, labels.flatten(), weights.flatten(), weights.sum(), 5)
        flat.loss.backward()
    assert forward_ops < len(mode.seen) and mode.seen.count("mm") >= 2 * 3
    assert h.grad.shape == hidden.shape and w.grad.shape == lm_head.shape
    if device == "cpu":
        assert out.loss.item() > 0 and h.grad.abs().sum() > 0


def test_elementwise_traces_as_one_graph():
    # On CUDA the chunk's elementwise pass is compiled with fullgraph=True: every combination of its
    # parts (gradient or not, the KL term, an architecture's vocab term) must trace without
    # graph breaks and give the eager results.
    from dflash_ds.architectures.dspark.parts import l1_to_target

    hidden, weight, labels, weights = case(torch.float32)
    logits = hidden @ weight.T
    t_logits = torch.roll(logits, 1, 0)
    lab = torch.where(weights > 0, labels, 0)
    scale = weights / 3.0
    ce, kl, l1 = CrossEntropy(), Distillation(0.3, 1.5), RowTerm("l1", 0.7, l1_to_target)
    scales = (scale * 0.5, scale * 0.3, scale * 0.7)
    # The target's logits by index: a table of fewer rows, rows repeated.
    t_rows = torch.randint(0, 5, (logits.shape[0],), generator=torch.Generator().manual_seed(3))
    table = t_logits[:5].contiguous()
    for transform in (IDENTITY, TRANSFORM):
        by_row = TargetLogits(t_logits)
        for target, sc, terms in ((None, (scale,), (ce,)), (None, None, (ce,)), (by_row, scales[:2], (ce, kl)),
                                  (by_row, scales[:2], (ce, l1)), (by_row, None, (ce, kl, l1)),
                                  (TargetLogits(table, t_rows), scales, (ce, kl, l1))):
            args = (logits, target, lab, weights)
            how = Pass(terms, transform)
            torch._dynamo.reset()
            traced = torch.compile(chunk_math, dynamic=False, fullgraph=True, backend="eager")
            got, want = traced(*args, scales=sc, how=how), chunk_math(*args, scales=sc, how=how)
            flat_got, flat_want = [*got[0], got[1], *got[2], got[3]], [*want[0], want[1], *want[2], want[3]]
            assert [a is None for a in flat_got] == [b is None for b in flat_want]
            for a, b in zip(flat_got, flat_want):
                if b is not None:
                    torch.testing.assert_close(a, b)


def test_fresh_terms_with_new_weights_compile_the_pass_once():
    # drafter_loss builds its terms anew every micro-batch and a warm-up changes their weights between
    # steps: the compiled pass (traced once per run on CUDA) must not be traced again for that.
    from dflash_ds.architectures.dspark.parts import l1_to_target

    hidden, weight, labels, weights = case(torch.float32)
    logits, lab = hidden @ weight.T, torch.where(weights > 0, labels, 0)
    traced = []

    def backend(gm, inputs):
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(chunk_math, dynamic=False, fullgraph=True, backend=backend)
    for step in range(4):
        terms = (CrossEntropy(0.1 + step), Distillation(0.2 * step, 1.5), RowTerm("l1", 1.0 / (step + 1), l1_to_target))
        fn(logits, TargetLogits(torch.roll(logits, 1, 0)), lab, weights, scales=tuple(weights * 0.5 for _ in terms),
           how=Pass(terms, TRANSFORM))
    assert len(traced) == 1


def test_a_logit_bias_is_the_loss_of_the_stacked_operands():
    # A LogitBias's features @ table.T folded into the lm_head matmul: the loss and every gradient
    # equal the dense loss of [hidden | features] through [weight | table]; the folded weight the
    # DenseHead keeps between calls follows the table and any change of the weight (in place, or
    # another tensor).
    from dflash_ds.objective.head_matmuls import DenseHead

    hidden, weight, labels, weights = case(torch.float64)
    g = torch.Generator().manual_seed(9)
    features, table = torch.randn(N, 3, generator=g, dtype=torch.float64), torch.randn(V, 3, generator=g,
                                                                                      dtype=torch.float64)
    head = DenseHead()
    for step in range(4):
        if step == 1:
            table.add_(0.5)  # the table trains between calls
        if step == 2:
            weight.mul_(1.5)  # an in-place change of the weight
        if step == 3:
            weight = weight.clone() + 0.25  # another weight
        h, f, t = (x.clone().requires_grad_() for x in (hidden, features, table))
        out = chunked(h, weight, labels, weights, 3.0, 3, bias=LogitBias(f, t), head=head)
        out.loss.backward()
        stacked = torch.cat([hidden, features], 1).requires_grad_()
        w_ref = torch.cat([weight, table], 1).requires_grad_()
        ref = dense_loss(stacked, w_ref, labels, weights, 3.0)
        ref[0].backward()
        torch.testing.assert_close(out.loss, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.cat([h.grad, f.grad], 1), stacked.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(t.grad, w_ref.grad[:, D:], rtol=1e-10, atol=1e-12)
        assert torch.equal(out.correct, ref[3])
    with pytest.raises(ValueError, match="features"):
        chunked(hidden, weight, labels, weights, 1.0, 2, bias=LogitBias(features[:-1], table))


class _PlainHead:
    """A head of the frozen weight as plain matmuls: the FP8 head's strategy, exact in float64."""

    def __init__(self, weight):
        self.weight, self.calls = weight, 0

    def matmuls(self, rows):
        return SeparateMatmuls(rows, self)

    def logits(self, hidden):
        self.calls += 1
        return hidden @ self.weight.T

    def input_grad(self, grad_logits):
        return grad_logits @ self.weight


@pytest.mark.parametrize("by_index", [False, True])
def test_a_head_of_its_own_gives_the_folded_losses(by_index):
    # With a head of its own (FP8 on the GPU) the drafter's logits, the bias and the target's
    # logits are matmuls of their own instead of one stacked matmul: every output and gradient equal.
    from dflash_ds.architectures.dspark.parts import l1_to_target

    hidden, weight, labels, weights = case(torch.float64)
    g = torch.Generator().manual_seed(11)
    features, table = torch.randn(N, 3, generator=g, dtype=torch.float64), torch.randn(V, 3, generator=g,
                                                                                      dtype=torch.float64)
    states = target_states(torch.float64, n=9)
    index = torch.randint(0, 9, (N,), generator=g)
    target = TargetRows(states, index) if by_index else TargetRows(states[index])
    runs = []
    for head in (None, _PlainHead(weight)):
        h, f, t = (x.clone().requires_grad_() for x in (hidden, features, table))
        out = chunked(h, weight, labels, weights, 5.0, 3, terms=(RowTerm("l1", 0.6, l1_to_target),), target=target,
                      bias=LogitBias(f, t), head=head)
        out.loss.backward()
        runs.append((out.loss, out.sums["ce"], out.sums["l1"], out.rows["l1"], h.grad, f.grad, t.grad))
        assert head is None or head.calls == 3
    assert float(runs[0][2].sum()) > 0.01
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
