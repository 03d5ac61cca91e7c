"""The two kernels under DFlash2's selector step: the two-stage top-k (objective/top_k.py) against
`torch.topk`, and `take_rows` (network/gather.py) against autograd's gradient of `table[index]`."""

import pytest
import torch

from dflash_ds.architectures.dflash2.parts import CandidateSelector, SelectorRows, SelectorTerm, candidate_logits, selector_loss
from dflash_ds.network.gather import segment_sum_rows, take_rows
from dflash_ds.objective.top_k import block_top_k


# ------------------------------------------------------------------------------------- two-stage top-k

@pytest.mark.parametrize("k,group", [(1, 8), (5, 8), (16, 16), (3, 4)])
def test_block_top_k_equals_torch_topk(k, group):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(33, 4096, generator=g)  # float32 normal: no ties
    # Put the winners in few groups and in many, the hard and the easy case for the group stage.
    x[0, :k] += 10.0
    x[1, ::group][:k] += 10.0
    values, ids = block_top_k(x, k, group)
    ref = torch.topk(x, k, dim=-1, sorted=True)
    assert torch.equal(ids, ref.indices)
    assert torch.equal(values, ref.values)


def test_block_top_k_with_ties_returns_the_k_largest_values():
    # bf16 logits tie often (8 bits of mantissa): the values must be the k largest, and every id
    # must hold its value, whichever of the tied ids is returned.
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 2048, generator=g) * 3).round().to(torch.bfloat16)
    values, ids = block_top_k(x, 16, 16)
    ref = torch.topk(x, 16, dim=-1)
    assert torch.equal(values, ref.values)
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == 16 for row in ids.tolist())  # no id twice


def test_block_top_k_falls_back_where_groups_do_not_help():
    g = torch.Generator().manual_seed(2)
    for v, group in ((1000, 128), (512, 128), (90, 8)):  # not a multiple; too few groups; too few groups
        x = torch.randn(7, v, generator=g)
        values, ids = block_top_k(x, 6, group)
        ref = torch.topk(x, 6)
        assert torch.equal(ids, ref.indices) and torch.equal(values, ref.values)


def test_a_wrong_group_stage_would_be_caught():
    # The test above can fail: keeping only the k best groups' first entries (a plausible slip)
    # misses winners that share a group.
    x = torch.zeros(1, 1024)
    x[0, 3], x[0, 5] = 9.0, 8.0  # two winners in group 0
    values, ids = block_top_k(x, 2, 8)
    assert ids.tolist() == [[3, 5]] and values.tolist() == [[9.0, 8.0]]


# -------------------------------------------------------------------------------------- take_rows

def test_take_rows_gradient_equals_autograds_with_hot_rows():
    g = torch.Generator().manual_seed(3)
    table = torch.randn(5000, 6, generator=g, dtype=torch.float64, requires_grad=True)
    # Hot rows: a few tokens are most of the index, as common tokens among the candidates.
    index = torch.where(torch.rand(40, 16, generator=g) < 0.7, torch.randint(0, 3, (40, 16), generator=g),
                        torch.randint(0, 5000, (40, 16), generator=g))
    up = torch.randn(40, 16, 6, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad((take_rows(table, index) * up).sum(), table)[0]
    ref = torch.autograd.grad((table[index] * up).sum(), table)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(take_rows(table, index), table[index])
    untouched = torch.ones(5000, dtype=torch.bool)
    untouched[index.flatten()] = False
    assert untouched.any() and (ours[untouched] == 0).all()


def test_take_rows_casts_to_the_table_dtype_and_is_bit_reproducible():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(300, 8, generator=g).to(torch.bfloat16).requires_grad_()
    index = torch.randint(0, 20, (5000,), generator=g)
    up = torch.randn(5000, 8, generator=g).to(torch.bfloat16)
    a = torch.autograd.grad((take_rows(table, index, torch.float32) * up).sum(), table)[0]
    b = torch.autograd.grad((take_rows(table, index, torch.float32) * up).sum(), table)[0]
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # Summed in float32 from the float32 gradient and rounded once: the exact total, rounded.
    exact = torch.zeros(300, 8, dtype=torch.float64).index_add_(0, index, up.double())
    torch.testing.assert_close(a.double(), exact.to(torch.bfloat16).double(), rtol=8e-3, atol=1e-6)
    assert (a.double() - exact).abs().max() <= (exact.to(torch.bfloat16).double() - exact).abs().max() * 2 + 1e-6


def test_segment_sum_rows_edge_cases():
    assert segment_sum_rows(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), 4).shape == (4, 3)
    out = segment_sum_rows(torch.tensor([2, 2, 2]), torch.tensor([[1.0], [2.0], [4.0]]), 3)
    assert out.flatten().tolist() == [0.0, 0.0, 7.0]
    out = segment_sum_rows(torch.tensor([0, 3, 0, 1]), torch.tensor([[1.0], [2.0], [4.0], [8.0]]), 4)
    assert out.flatten().tolist() == [5.0, 8.0, 0.0, 2.0]


# ----------------------------------------------------------------------- selector with given logits

def selector_case(seed: int, head_scale: float = 1.0):
    """A float64 selector (vocabulary 40, width 8, rank 6, top 5) with a non-zero successor codebook, and
    30 slots: states (requiring grad), lm_head, the states' top-5 (ids and raw logits), gold labels (half
    of them the argmax), predecessors and weights."""
    g = torch.Generator().manual_seed(seed)
    sel = CandidateSelector(8, 40, 6, 5).double()
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.5, generator=g)
    lm_head = torch.randn(40, 8, generator=g, dtype=torch.float64) * head_scale
    hidden = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    logits = hidden.detach() @ lm_head.T
    top = logits.topk(5)
    labels = torch.where(torch.rand(30, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, 40, (30,), generator=g))
    prev = torch.randint(0, 40, (30,), generator=g)
    w = torch.rand(30, generator=g, dtype=torch.float64)
    return sel, lm_head, hidden, top, labels, prev, w


@pytest.mark.parametrize("inject_gold", [False, True])
def test_selector_loss_with_the_base_losss_logits_equals_computing_them(inject_gold):
    sel, lm_head, hidden, top, labels, prev, w = selector_case(5)
    torch.testing.assert_close(candidate_logits(hidden.detach(), lm_head, top.indices, chunk_bytes=64), top.values)
    params = [hidden, sel.hidden_projection.weight, sel.predecessor_codebook, sel.successor_codebook]
    results = []
    for unary in (None, top.values):
        stats = selector_loss(sel, lm_head, SelectorRows(hidden, top.indices, labels, prev, w, unary),
                              SelectorTerm(1.0, inject_gold))
        results.append((stats, torch.autograd.grad(stats.loss_sum, params)))
    (a, ga), (b, gb) = results
    assert float(a.loss_sum.detach()) > 0
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
