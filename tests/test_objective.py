"""The DFlash objective (docs/algorithm.md sections 4-5): anchors, labels, weights (hand-worked), the
training metrics, and the absence of host syncs and data-dependent shapes on the whole path from
anchors to the loss's gradient (the loss itself: tests/test_loss.py)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.objective.blocks import (block_inputs, block_targets, decay_weights, default_gamma, sample_anchors,
                                    slot_target_states, valid_anchor_mask)
from dflash_ds.objective.drafter_loss import acceptance_proxy
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy, Distillation, TargetRows

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
    with pytest.raises(ValueError, match=r"^gamma must be > 0"):
        decay_weights(4, 0.0)
    with pytest.raises(AssertionError):
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
    labels, weights = block_targets(INPUT_IDS, LOSS_MASK, DOC_IDS, anchors, valid=valid, block_size=5, gamma=2.0)
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
    _, w_default = block_targets(INPUT_IDS, LOSS_MASK, DOC_IDS, anchors, valid=valid, block_size=5, gamma=None)
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
    with pytest.raises(ValueError, match=r"^num_anchors = 17 exceeds the row length 16"):
        sample_anchors(loss_mask, doc_ids, 17, torch.Generator())
    with pytest.raises(AssertionError):
        sample_anchors(loss_mask, doc_ids, 0, torch.Generator())


B = 4  # block size of the pipeline case


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
    final = torch.randn(b, s, d, generator=g).to(device)
    mode = NoHostSync()
    with mode:
        if generator is not None:
            anchors, valid = sample_anchors(loss_mask, doc_ids, n, generator)
        else:  # no generator on this device: anchors as a static function of the shapes
            anchors = torch.arange(n, device=device).expand(b, n) * 5
            valid = torch.ones(b, n, dtype=torch.bool, device=device)
        block_inputs(input_ids, positions, anchors, B, mask_token_id=1)
        labels, weights = block_targets(input_ids, loss_mask, doc_ids, anchors, valid=valid, block_size=B, gamma=None)
        terms = [CrossEntropy(), *([Distillation(0.5, 1.0)] if kl else [])]
        target = TargetRows(slot_target_states(final, anchors, B)) if kl else None
        out = ChunkedLoss(terms, head, chunks=3).blocks(hidden, labels, weights, weights.sum(), target=target)
        forward_ops = len(mode.seen)
        out.loss.backward()
        acceptance_proxy(out.correct, weights)
        acceptance_proxy(out.correct, weights, reduce=False)
    # The mode saw the backward too: the lm_head ran twice per chunk (3 chunks) in the forward.
    assert forward_ops < len(mode.seen) and mode.seen.count("mm") >= 3 * 2
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
