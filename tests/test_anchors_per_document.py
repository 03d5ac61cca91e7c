"""Anchors per document in packed rows: proportional sharing, exact totals, uniform draws, boundary rule."""

import math

import pytest
import torch

from dflash_ds.objective.blocks import anchor_quota, block_targets, sample_anchors, valid_anchor_mask


def packed(lengths, s, supervised_from=None):
    """doc_ids / loss_mask [1, s] for documents of `lengths` (padding after); all tokens supervised
    unless supervised_from[d] says where document d's response starts."""
    doc_ids = torch.full((1, s), -1, dtype=torch.int32)
    loss_mask = torch.zeros(1, s, dtype=torch.bool)
    at = 0
    for d, n in enumerate(lengths):
        doc_ids[0, at:at + n] = d
        start = (supervised_from or [0] * len(lengths))[d]
        loss_mask[0, at + start:at + n] = True
        at += n
    return doc_ids, loss_mask


def per_doc(anchors, valid, doc_ids):
    d = torch.gather(doc_ids.long(), 1, anchors)[valid]
    return torch.bincount(d, minlength=int(doc_ids.max()) + 1).tolist()


def test_quota_hand_worked_with_a_tie():
    # Valid anchors per document 10, 5, 1 (C = 16), N = 8: exact shares 5, 2.5, 0.5 -> floors 5, 2, 0;
    # one anchor left; remainders 0, 8, 8 tie and the earlier document (1) gets it.
    doc_ids, loss_mask = packed([11, 6, 2], 24)
    valid = valid_anchor_mask(loss_mask, doc_ids)
    assert anchor_quota(valid, doc_ids, 8)[0, :3].tolist() == [5, 3, 0]
    anchors, ok = sample_anchors(loss_mask, doc_ids, 8, torch.Generator().manual_seed(0))
    assert per_doc(anchors, ok, doc_ids) == [5, 3, 0] and ok.all()


def test_quota_total_is_exact_and_proportional():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        s = 96
        lengths = []
        while sum(lengths) < s - 20:
            lengths.append(int(torch.randint(2, 30, (1,), generator=g)))
        doc_ids, _ = packed(lengths, s)
        loss_mask = (torch.rand(1, s, generator=g) < 0.7) & (doc_ids >= 0)
        valid = valid_anchor_mask(loss_mask, doc_ids)
        n_anchors = int(torch.randint(1, 40, (1,), generator=g))
        q = anchor_quota(valid, doc_ids, n_anchors)[0]
        c = torch.bincount(doc_ids[valid].long(), minlength=s)
        total = int(c.sum())
        n = min(n_anchors, total)
        assert int(q.sum()) == n
        assert (q <= c).all() and (q >= 0).all()
        if total:
            exact = n * c.double() / total
            assert ((q.double() - exact).abs() < 1).all()  # largest remainder: within one of the exact share
        anchors, ok = sample_anchors(loss_mask, doc_ids, n_anchors, torch.Generator().manual_seed(trial))
        assert int(ok.sum()) == n
        assert per_doc(anchors, ok, doc_ids) == q[: len(lengths)].tolist()
        chosen = anchors[ok]
        assert valid[0, chosen].all() and len(set(chosen.tolist())) == n
        assert torch.equal(chosen, chosen.sort().values) and (anchors[~ok] == 0).all()


def test_draws_are_uniform_within_each_document():
    rows = 3000
    doc_ids, loss_mask = packed([9, 5], 16)  # 8 and 4 valid anchors
    doc_ids, loss_mask = doc_ids.expand(rows, -1), loss_mask.expand(rows, -1)
    anchors, ok = sample_anchors(loss_mask, doc_ids, 3, torch.Generator().manual_seed(5))  # quota 2 and 1
    assert ok.all()
    counts = torch.bincount(anchors.flatten(), minlength=16).double()
    for positions, p in ((range(0, 8), 2 / 8), (range(9, 13), 1 / 4)):
        sd = math.sqrt(rows * p * (1 - p))
        assert ((counts[list(positions)] - rows * p).abs() < 5 * sd).all(), counts.tolist()
    assert counts[8] == 0 and counts[13:].sum() == 0


def test_one_document_rows_sample_as_before():
    # With one document per row the rule is plain uniform sampling: the N largest keys of the
    # valid positions, the keys being the generator's first draw.
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.rand(4, 50, generator=g) < 0.6
    doc_ids = torch.zeros(4, 50, dtype=torch.int32)
    doc_ids[:, 45:] = -1
    anchors, ok = sample_anchors(loss_mask, doc_ids, 7, torch.Generator().manual_seed(9))
    keys = torch.rand(4, 50, generator=torch.Generator().manual_seed(9))
    keys = keys.masked_fill(~valid_anchor_mask(loss_mask, doc_ids), -1.0)
    top = keys.topk(7, dim=1)
    want = torch.where(top.values >= 0, top.indices, 50).sort(dim=1).values
    assert torch.equal(torch.where(ok, anchors, 50), want)


@pytest.mark.parametrize("anchor", [7, 8, 9])
def test_no_block_runs_past_its_document(anchor):
    # Documents [0, 10) and [10, 20); blocks of 6 near the end of document 0.
    b = 6
    doc_ids, loss_mask = packed([10, 10], 24)
    input_ids = torch.arange(100, 124).unsqueeze(0)
    anchors = torch.tensor([[anchor]])
    labels, weights = block_targets(input_ids, loss_mask, doc_ids, anchors, valid=torch.ones(1, 1, dtype=torch.bool),
                                    block_size=b,
                                    gamma=None)
    inside = 10 - anchor  # slots 0 .. inside-1 are in document 0
    assert (weights[0, 0, 1:inside] > 0).all() and (weights[0, 0, inside:] == 0).all()
    assert labels[0, 0, :inside].tolist() == list(range(100 + anchor, 100 + 10))
    assert (labels[0, 0, inside:] == 0).all()
    # And at the end of the row (the block would leave the row): the same rule.
    labels, weights = block_targets(input_ids, torch.ones(1, 24, dtype=torch.bool), torch.zeros(1, 24, dtype=torch.int32),
                                    torch.tensor([[21]]), valid=torch.ones(1, 1, dtype=torch.bool), block_size=b,
                                    gamma=None)
    assert (weights[0, 0, 3:] == 0).all() and (labels[0, 0, 3:] == 0).all() and (weights[0, 0, 1:3] > 0).all()
