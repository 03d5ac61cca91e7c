"""The DFlash objective (docs/algorithm.md sections 4-5): anchors, labels, weights (hand-worked), chunked loss (with and
without the optional KL term) against a float64 dense reference, lm_head matmul count and equal
chunk shapes under checkpointing, the training metrics, and the absence of host syncs and
data-dependent shapes on the whole path (forward and backward)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.model.objective import (
    KLTerm,
    LossOptions,
    acceptance_proxy,
    block_inputs,
    block_targets,
    chunked_loss,
    decay_weights,
    default_gamma,
    sample_anchors,
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
    # anchor_last_prompt_token: also the token before each supervised span of a document (1 and 5; 6 -> 7
    # still crosses documents), never padding.
    assert valid_anchor_mask(LOSS_MASK, DOC_IDS, prompt_end=True).int().tolist() == [[0, 1, 1, 1, 0, 1, 0, 1, 1, 0]]
    assert valid_anchor_mask(padded, torch.tensor([[0, 0, -1, -1]]), prompt_end=True).int().tolist() == [[1, 0, 0, 0]]
    prompt = torch.tensor([[0, 0, 0, 1, 1, 0, 1]], dtype=torch.bool)  # two turns of one document
    assert valid_anchor_mask(prompt, torch.zeros(1, 7, dtype=torch.int32), True).int().tolist() == [[0, 0, 1, 1, 0, 1, 0]]
    assert valid_anchor_mask(prompt, torch.zeros(1, 7, dtype=torch.int32)).int().tolist() == [[0, 0, 0, 1, 0, 0, 0]]


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
    assert labels[0, 1].tolist() == [103, 104, 105, 106, 0]  # pos 7 is another document: label 0
    assert labels[0, 2].tolist() == [108, 109, 0, 0, 0]  # the rest is past the row (label and weight 0)
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
B = 4            # block size of the loss cases: Q = 28 = 7 blocks, 14 blocks in the batch
ROWS, Q = 2, 28


def loss_case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, Q, D, generator=g, dtype=torch.float64).to(dtype)
    lm_head = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (ROWS, Q), generator=g)
    # About half the labels are the model's argmax, so `correct` has both values.
    top = (hidden.double() @ lm_head.double().T).argmax(-1)
    labels[:, ::2] = top[:, ::2]
    weights = torch.rand(ROWS, Q, generator=g)
    weights[torch.rand(ROWS, Q, generator=g) < 0.4] = 0.0
    weights[:, ::B] = 0.0  # slot 0 of every block, as block_targets makes it
    # Labels of unsupervised slots are arbitrary: out-of-vocabulary ones must not matter.
    labels[weights == 0] = torch.randint(V, 10 * V, (int((weights == 0).sum()),), generator=g)
    return hidden, lm_head, labels, weights


def reference_loss(hidden, lm_head, labels, weights, normaliser, target_logits=None, kl_weight=0.0):
    """Dense float64: every logit at once, unsupervised slots dropped by their weight."""
    logits = hidden.double() @ lm_head.double().T
    logp = torch.log_softmax(logits, -1)
    sup = weights > 0
    ce = -torch.gather(logp, -1, torch.where(sup, labels, 0).unsqueeze(-1)).squeeze(-1)
    ce_sum = (weights.double() * ce).sum()
    kl_sum = torch.zeros((), dtype=torch.float64)
    if target_logits is not None:
        logq = torch.log_softmax(target_logits.double(), -1)
        kl = (logq.exp() * (logq - logp)).sum(-1)  # KL(p_target || p_drafter) per slot
        kl_sum = (weights.double() * kl).sum()
    correct = (logits.argmax(-1) == labels) & sup
    return (ce_sum + kl_weight * kl_sum) / normaliser, ce_sum, kl_sum, correct


def check_against_reference(dtype, tol, block_size, kl_weight=0.0, chunk_counts=(1, 3, 4, 100)):
    hidden, lm_head, labels, weights = loss_case(dtype)
    g = torch.Generator().manual_seed(5)
    target = torch.randn(ROWS, Q, V, generator=g, dtype=torch.float64) * 2 if kl_weight else None
    norm = float(weights.sum()) * 1.7  # a step-wide normaliser, not this micro-batch's
    h_ref = hidden.detach().double().requires_grad_()
    w_ref = lm_head.detach().double().requires_grad_()
    loss_ref, ce_ref, kl_ref, correct_ref = reference_loss(h_ref, w_ref, labels, weights, norm, target, kl_weight)
    loss_ref.backward()
    assert 0 < correct_ref.sum() < (weights > 0).sum()  # the accuracy check can fail both ways
    kwargs = {}
    if kl_weight:
        assert kl_ref > 0.1 * ce_ref  # the KL term is large enough for a mistake in it to show
        target_param = target.to(dtype).requires_grad_()  # must receive no gradient
        kwargs = dict(kl=KLTerm(kl_weight, target_logits_fn=lambda idx: target_param.view(-1, V).index_select(0, idx)))
    for num_chunks in chunk_counts:
        for ckpt in (True, False):
            h = hidden.detach().clone().requires_grad_()
            w = lm_head.detach().clone().requires_grad_()
            options = LossOptions(num_chunks, block_size, checkpoint=ckpt)
            out = chunked_loss(h, w, labels, weights, norm, options, **kwargs)
            out.loss.backward()
            assert out.ce_sum.requires_grad is False and out.kl_sum.requires_grad is False
            assert out.correct.dtype == torch.bool and out.correct.shape == (ROWS, Q)
            torch.testing.assert_close(out.loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(out.ce_sum.double(), ce_ref.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(out.kl_sum.double(), kl_ref, rtol=tol, atol=tol)
            assert torch.equal(out.correct, correct_ref)
            torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol * 10, atol=tol)
            torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=tol * 10, atol=tol)
    if kl_weight:
        assert target_param.grad is None


@pytest.mark.parametrize("block_size", [None, B])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_chunked_loss_matches_float64_reference(dtype, tol, block_size):
    check_against_reference(dtype, tol, block_size)


@pytest.mark.parametrize("block_size", [None, B])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_chunked_loss_kl_term_matches_float64_reference(dtype, tol, block_size):
    check_against_reference(dtype, tol, block_size, kl_weight=0.3, chunk_counts=(1, 3, 100))


def test_kl_term_asks_for_the_selected_slots_and_vanishes_against_itself():
    hidden, lm_head, labels, weights = loss_case(torch.float64)
    own = hidden @ lm_head.T  # the drafter's own logits as the "target": KL must be 0
    asked = []

    def target_fn(idx):
        asked.append(idx.clone())
        return own.view(-1, V).index_select(0, idx)

    out = chunked_loss(hidden, lm_head, labels, weights, 1.0, LossOptions(3, B),
                       KLTerm(2.0, target_logits_fn=target_fn))
    plain = chunked_loss(hidden, lm_head, labels, weights, 1.0, LossOptions(3, B))
    assert abs(out.kl_sum.item()) < 1e-12
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-12, atol=1e-12)
    # 14 blocks in chunks of 5: 15 rows each, the last one padded with index 0.
    assert [len(a) for a in asked] == [15, 15, 15]
    slots = torch.arange(ROWS * Q)
    assert torch.equal(torch.cat(asked)[:42], slots[slots % B != 0]) and (torch.cat(asked)[42:] == 0).all()


@pytest.mark.parametrize("block_size", [None, B])
def test_chunked_loss_bf16_close_to_reference(block_size):
    hidden, lm_head, labels, weights = loss_case(torch.bfloat16)
    out = chunked_loss(hidden, lm_head, labels, weights, 1.0, LossOptions(4, block_size))
    loss_ref, _, _, _ = reference_loss(hidden, lm_head, labels, weights, 1.0)
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())


def test_block_size_skips_slot_zero_by_shape():
    # With block_size, slot 0 is never projected: its weight cannot contribute (block_targets
    # always makes it 0); without, it is a slot like any other.
    hidden, lm_head, labels, weights = loss_case(torch.float64)
    labels = labels % V
    labels[:, ::B] = (hidden @ lm_head.T).argmax(-1)[:, ::B]  # slot 0 would count as correct
    heavy = weights.clone()
    heavy[:, ::B] = 1.0
    skipped = chunked_loss(hidden, lm_head, labels, heavy, 1.0, LossOptions(2, B))
    generic = chunked_loss(hidden, lm_head, labels, heavy, 1.0, LossOptions(2))
    ref, _, _, _ = reference_loss(hidden, lm_head, labels, weights, 1.0)
    torch.testing.assert_close(skipped.loss, ref, rtol=1e-12, atol=1e-12)
    assert generic.loss > skipped.loss + 1.0
    assert not skipped.correct[:, ::B].any() and generic.correct[:, ::B].any()


class LogitMatmuls(TorchDispatchMode):
    """Counts matmuls that produce logits (last dim V) and the row counts they produce."""

    def __init__(self):
        super().__init__()
        self.count, self.rows = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "matmul", "linear") and out.shape[-1] == V:
            self.count += 1
            self.rows.add(out.numel() // V)
        return out


# (block_size, num_chunks) -> (chunks, rows per chunk). Units: 14 blocks of 3 slots, or 56 slots.
# Non-divisible cases: 14 blocks / 3 -> 5, 5, 4 + 1 padding; 56 slots / 3 -> 19, 19, 18 + 1.
CHUNKING = {(B, 1): (1, 42), (B, 3): (3, 15), (B, 4): (4, 12), (B, 100): (14, 3),
            (None, 1): (1, 56), (None, 3): (3, 19), (None, 5): (5, 12)}


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("lm_head_grad", [False, True])
def test_lm_head_runs_at_most_twice_per_chunk(lm_head_grad, kl):
    hidden, lm_head, labels, weights = loss_case(torch.float32)
    lm_head.requires_grad_(lm_head_grad)
    # The target's logits come from a table, so every counted matmul is the drafter's lm_head.
    table = torch.randn(ROWS * Q, V)
    kwargs = dict(kl=KLTerm(0.5, target_logits_fn=lambda idx: table.index_select(0, idx))) if kl else {}
    for (block_size, num_chunks), (chunks, rows) in CHUNKING.items():
        for ckpt, expected in ((True, 2), (False, 1)):
            h = hidden.clone().requires_grad_()
            counter = LogitMatmuls()
            with counter:
                options = LossOptions(num_chunks, block_size, checkpoint=ckpt)
                out = chunked_loss(h, lm_head, labels, weights, 1.0, options, **kwargs)
                forward_count = counter.count
                out.loss.backward()
            assert forward_count == chunks
            assert counter.count == expected * chunks, (ckpt, num_chunks)
            # Only one chunk is ever projected at a time, and every chunk has the same shape.
            assert counter.rows == {rows}, (block_size, num_chunks, counter.rows)


def test_chunked_loss_all_padding_and_errors():
    hidden, lm_head, labels, _ = loss_case(torch.float32)
    for block_size in (None, B):
        h = hidden.clone().requires_grad_()
        out = chunked_loss(h, lm_head, labels, torch.zeros(ROWS, Q), 1.0, LossOptions(4, block_size))
        out.loss.backward()
        assert out.loss.item() == 0.0 and not out.correct.any() and (h.grad == 0).all()
    labels = labels % V
    with pytest.raises(ValueError, match=r"objective\.loss_chunks"):
        chunked_loss(h, lm_head, labels, torch.ones(ROWS, Q), 1.0, LossOptions(0))
    with pytest.raises(ValueError, match=r"drafter\.block_size"):
        chunked_loss(h, lm_head, labels, torch.ones(ROWS, Q), 1.0, LossOptions(2, 5))
    with pytest.raises(ValueError, match=r"objective\.kl_weight"):
        chunked_loss(h, lm_head, labels, torch.ones(ROWS, Q), 1.0, LossOptions(2), KLTerm(0.1))
    with pytest.raises(ValueError, match=r"objective\.kl_weight"):
        chunked_loss(h, lm_head, labels, torch.ones(ROWS, Q), 1.0, LossOptions(2),
                     KLTerm(-1.0, target_logits_fn=lambda i: i))


# ---------------------------------------------------------------------------------- metrics

def test_acceptance_proxy_hand_worked():
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


# ------------------------------------------------------------------- no host synchronisation

aten = torch.ops.aten
# Ops that wait for the device (a value read back to the host) or whose output shape depends on
# tensor values; any of them on the training path stalls the GPU and defeats static shapes.
SYNC_OPS = {getattr(aten, n) for n in (
    "nonzero", "nonzero_numpy", "argwhere", "item", "_local_scalar_dense", "masked_select", "unique",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal",
    "is_nonzero", "allclose", "repeat_interleave", "masked_scatter", "_assert_async",
) if hasattr(aten, n)}
INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Fails on any op that syncs with the host or has a data-dependent output shape: the ops
    above, indexing with a bool mask, and copies between devices (e.g. a host-built constant
    moved to the data's device; on CUDA a blocking copy)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            raise HostSyncError(f"{func} syncs with the host or has a data-dependent shape")
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if packet in INDEX_OPS and any(t.dtype in (torch.bool, torch.uint8) for t in tensors[1:]):
            raise HostSyncError(f"{func} with a bool mask has a data-dependent shape")
        out = func(*args, **kwargs)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors + outs if t.dim() > 0 or t.device.type != "cpu"}
        if len(devices) > 1:
            raise HostSyncError(f"{func} moves data between {sorted(map(str, devices))}")
        self.seen.append(packet.__name__)
        return out


def test_no_host_sync_detector_catches_syncs():
    x = torch.tensor([0.0, 1.0, -2.0, 3.0])
    offenders = [
        lambda: torch.nonzero(x), lambda: x[x > 0], lambda: x.sum().item(),
        lambda: bool(x.sum() > 0), lambda: torch.unique(x), lambda: x.masked_select(x > 0),
        lambda: x.clone().__setitem__(x > 0, 0.0), lambda: torch.where(x > 0),
        lambda: torch.ones(3).to("meta"),
    ]
    for fn in offenders:
        with pytest.raises(HostSyncError), NoHostSync():
            fn()
    with NoHostSync() as mode:  # and lets static-shape work through
        torch.where(x > 0, x, 0.0).topk(2).indices.sort()
    assert "topk" in mode.seen


def pipeline(device, generator=None, kl=False):
    """The drafter-side objective as the training step runs it, on `device`."""
    g = torch.Generator().manual_seed(3)
    b, s, n, v, d = 2, 40, 6, 30, 8
    input_ids = torch.randint(0, v, (b, s), generator=g).to(device)
    loss_mask = (torch.rand(b, s, generator=g) < 0.8).to(device)
    doc_ids = (torch.arange(s) // 15).int().expand(b, s).contiguous().to(device)
    positions = torch.arange(s).expand(b, s).contiguous().to(device)
    hidden = torch.randn(b, n * B, d, generator=g).to(device).requires_grad_()
    head = torch.randn(v, d, generator=g).to(device).requires_grad_()
    table = torch.randn(b * n * B, v, generator=g).to(device)
    mode = NoHostSync()
    with mode:
        if generator is not None:
            anchors, valid = sample_anchors(loss_mask, doc_ids, n, generator)
        else:  # no generator on this device: anchors as a static function of the shapes
            anchors = torch.arange(n, device=device).expand(b, n) * 5
            valid = torch.ones(b, n, dtype=torch.bool, device=device)
        block_inputs(input_ids, positions, anchors, B, mask_token_id=1)
        labels, weights = block_targets(input_ids, loss_mask, doc_ids, anchors, valid, B, None)
        kw = dict(kl=KLTerm(0.5, target_logits_fn=lambda idx: table.index_select(0, idx))) if kl else {}
        out = chunked_loss(hidden, head, labels.flatten(1), weights.flatten(1), weights.sum(),
                           LossOptions(3, B, checkpoint=True), **kw)
        forward_ops = len(mode.seen)
        out.loss.backward()
        acceptance_proxy(out.correct, weights)
        acceptance_proxy(out.correct, weights, reduce=False)
    # The mode saw the backward too: the lm_head ran in forward (3 chunks) and again in backward.
    assert forward_ops < len(mode.seen) and mode.seen.count("mm") >= 3 * 4
    assert generator is None or "topk" in mode.seen
    return out, hidden.grad, head.grad


@pytest.mark.parametrize("kl", [False, True])
def test_objective_has_no_host_sync_and_no_dynamic_shapes(kl):
    out, h_grad, w_grad = pipeline("cpu", torch.Generator().manual_seed(0), kl=kl)
    assert out.loss.item() > 0 and h_grad.abs().sum() > 0 and w_grad.abs().sum() > 0


def test_objective_runs_without_data():
    # On the meta device tensors have shapes but no values: an op that reads a value (to decide
    # a shape or a Python branch) cannot run, and a host-built constant would be a cross-device copy.
    out, h_grad, w_grad = pipeline("meta", kl=True)
    assert out.loss.device.type == "meta" and out.correct.shape == (2, 6 * B)
    assert h_grad.shape == (2, 6 * B, 8) and w_grad.shape == (30, 8)
