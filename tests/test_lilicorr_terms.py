"""LiLiCorr's lattice objective (dflash_ds/architectures/lilicorr/terms.py) against a per-block, per-slot
Python loop in float64 written from the definitions (Model-Optimizer's objective): the oracle and the
supervised slots, the teacher-forced nodes, the candidate CE, the gap and hinge, the target-logit penalty,
and the logged sums; the edge cases (gold missing at slot 1, a gold back in the lattice after a miss,
k = 1, B = 2, a partly masked block); torch.autograd.gradcheck of the terms and of SoftValue, whose
gradient is held to autograd through the full log-softmax."""

import math

import pytest
import torch

from dflash_ds.architectures.lilicorr.head import Factors
from dflash_ds.architectures.lilicorr.terms import (Weights, lattice_logs, lattice_terms, nodes, oracle,
                                                     soft_log_probs)

MARGIN = Weights(ce=0.125, margin_weight=0.125, penalty=0.25, margin=2.0)


def loop_reference(start, pair, cands, gold, w, zt, margin):
    """Sums of ce, hinge, penalty, n_sup, gap, prefix lengths, one block and one slot at a time."""
    n, S, k = cands.shape
    out = dict(ce=0.0, hinge=0.0, pen=0.0, sup=0, gap=0.0, selected=0, top1=0, oracle=0, blocks=0, walk_hit=0)
    for b in range(n):
        valid = all(float(w[b, s]) > 0 for s in range(S))
        ids = [list(map(int, cands[b, s])) for s in range(S)]
        gi, alive = [], True
        walk, prev = [], None
        for s in range(S):
            row = start[b] if s == 0 else pair[b, s - 1, prev]
            best = max(range(k), key=lambda j: (float(row[j]), -j))
            walk.append(best)
            prev = best
        sel = 0
        while sel < S and ids[sel][walk[sel]] == int(gold[b, sel]):
            sel += 1
        top = 0
        while top < S and ids[top][0] == int(gold[b, top]):
            top += 1
        orc = 0
        while orc < S and int(gold[b, orc]) in ids[orc]:
            orc += 1
        if valid:
            out["blocks"] += 1
            out["selected"] += sel
            out["top1"] += top
            out["oracle"] += orc
        for s in range(S):
            g = int(gold[b, s])
            if g not in ids[s]:
                alive = False
            gi.append(ids[s].index(g) if g in ids[s] else 0)
            if not (alive and valid):
                continue
            node = start[b] if s == 0 else pair[b, s - 1, gi[s - 1]]
            lse = math.log(sum(math.exp(float(x)) for x in node))
            out["ce"] += lse - float(node[gi[s]])
            others = [float(node[j]) for j in range(k) if j != gi[s]]
            gap = float(node[gi[s]]) - max(others) if others else 0.0
            out["gap"] += gap
            if k > 1:
                out["hinge"] += max(0.0, margin - gap)
            p = [math.exp(float(x) - lse) for x in node]
            out["pen"] += sum(p[j] * max(0.0, float(zt[b, s, gi[s]]) - float(zt[b, s, j])) for j in range(k))
            out["sup"] += 1
            out["walk_hit"] += int(walk[s] == gi[s])
    return out


def case(n=24, S=5, k=4, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    cands = torch.stack([torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(S)]) for _ in range(n)])
    pick = torch.randint(0, k + 2, (n, S), generator=g)  # 2 in k + 2: the gold outside the lattice
    inside = cands.gather(-1, pick.clamp(max=k - 1)[..., None]).squeeze(-1)
    outside = torch.tensor([[next(t for t in range(V) if t not in cands[b, s]) for s in range(S)] for b in range(n)])
    gold = torch.where(pick < k, inside, outside)
    w = torch.ones(n, S, dtype=torch.float64)
    if S >= 3 and k >= 2:
        w[0, 2] = 0.0  # a partly masked block
        gold[1, 0] = outside[1, 0]  # the gold missing at slot 1
        gold[2, 1], gold[2, 2] = outside[2, 1], cands[2, 2, 1]  # the gold back in the lattice after a miss
    start = torch.randn(n, k, generator=g, dtype=torch.float64) * 3
    pair = torch.randn(n, S - 1, k, k, generator=g, dtype=torch.float64) * 3
    zt = torch.randn(n, S, k, generator=g, dtype=torch.float64) * 2
    return start, pair, cands, gold, w, zt


@pytest.mark.parametrize("shape", [(24, 5, 4), (8, 1, 4), (8, 3, 1)], ids=["general", "B=2", "k=1"])
def test_terms_and_logs_equal_the_loop(shape):
    n, S, k = shape
    start, pair, cands, gold, w, zt = case(n, S, k, seed=S * 10 + k)
    found = oracle(cands, gold, w)
    f = Factors(start, pair)
    node = nodes(f, found.gold_index)
    got = lattice_terms(node, found, zt, MARGIN)
    ref = loop_reference(start, pair, cands, gold, w, zt, MARGIN.margin)
    assert ref["sup"] > 0 and int(got.supervised) == ref["sup"]
    for name, mine in (("ce", got.ce), ("hinge", got.hinge), ("pen", got.penalty)):
        assert float(mine) == pytest.approx(ref[name], abs=1e-10), name
    logs = lattice_logs(f, node, found, cands, gold=gold)
    for name, key in (("blocks", "blocks"), ("selected", "selected_sum"), ("top1", "top1_sum"),
                      ("oracle", "oracle_sum"), ("gap", "gap_sum"), ("walk_hit", "walk_hit_sum")):
        assert float(logs[key]) == pytest.approx(ref[name], abs=1e-10), name
    if k == 1:
        assert float(got.hinge) == 0 and float(logs["gap_sum"]) == 0 and float(logs["start_std_count"]) == 0
    if S == 1:
        assert float(logs["pair_std_count"]) == 0 and all(math.isfinite(float(v)) for v in logs.values())
    if shape == (24, 5, 4):
        assert not found.valid[0] and not found.supervised[1].any()  # masked block; gold missing at slot 1
        assert found.supervised[2].tolist() == [True, False, False, False, False]  # no comeback after a miss
        assert found.in_lattice[2, 2]
        # The walk's per-position acceptance: blocks reaching k over blocks reaching k - 1.
        assert float(logs["accept_count_1"]) == ref["blocks"]


def test_the_hinge_only_with_its_weight_and_the_penalty_only_with_its_weight():
    start, pair, cands, gold, w, zt = case()
    found = oracle(cands, gold, w)
    node = nodes(Factors(start, pair), found.gold_index)
    base = lattice_terms(node, found, zt, Weights(0.25, 0.0, 0.25, 2.0))
    assert float(base.hinge) == 0 and float(lattice_terms(node, found, zt, MARGIN).hinge) > 0
    assert float(lattice_terms(node, found, zt, Weights(0.25, 0.0, 0.0, 2.0)).penalty) == 0 and float(base.penalty) > 0


def test_gradcheck_of_the_terms_through_the_factors():
    start, pair, cands, gold, w, zt = case(n=6, S=4, k=3, seed=3)
    found = oracle(cands, gold, w)

    def total(s, p):
        t = lattice_terms(nodes(Factors(s, p), found.gold_index), found, zt, MARGIN)
        return t.ce + 0.7 * t.hinge + 1.3 * t.penalty

    args = (start.clone().requires_grad_(), pair.clone().requires_grad_())
    assert torch.autograd.gradcheck(total, args)


def test_soft_value_gradient_is_the_log_softmax_gradient():
    g = torch.Generator().manual_seed(5)
    r, D, V, k = 7, 6, 20, 4
    hidden = torch.randn(r, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    logits = hidden @ weight.T
    ids = logits.topk(k, dim=-1).indices.detach()
    full = torch.log_softmax(logits, -1).gather(-1, ids)
    upstream = torch.randn(r, k, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad((full * upstream).sum(), hidden)
    q = torch.softmax(logits.detach(), -1)
    mine = soft_log_probs(hidden, full.detach(), ids, weight, expected=q @ weight)
    assert torch.equal(mine, full.detach())
    (got,) = torch.autograd.grad((mine * upstream).sum(), hidden)
    assert torch.allclose(got, want, atol=1e-12)

    def fn(h):
        lp = torch.log_softmax(h.detach() @ weight.T, -1).gather(-1, ids)
        return soft_log_probs(h, lp, ids, weight, expected=torch.softmax(h.detach() @ weight.T, -1) @ weight)

    # The forward's values come from h (detached), so gradcheck's finite differences are those of the
    # true log-probs, and its analytic side is SoftValue's backward.
    assert torch.autograd.gradcheck(fn, (hidden,))
