"""Block verification (vLLM's `rejection_sample_method: block`, docs/algorithm.md section 7.5), as
`eval.specdec_sampled` restates it: at temperature 0 it accepts exactly the longest matching prefix
(the greedy tau); with a greedy (point-mass) draft its accepted count has the per-token rule's
distribution at any temperature; with a sampled draft it stays lossless and accepts at least as many
drafts as the per-token rule, sometimes more."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash_ds.eval.specdec_sampled import joint_expected_accepted, joint_thresholds

V, L = 3, 2


def tau_distribution(h: torch.Tensor) -> torch.Tensor:
    """P(tau = k), k = 0 .. L: the largest i with u_i <= h[i], the coins independent (h[0] = 1)."""
    return torch.stack([h[k] * torch.prod(1.0 - h[k + 1:]) for k in range(h.numel())])


def leading_matches(drafts: torch.Tensor, tokens: torch.Tensor) -> int:
    """The greedy walk's a(t) of one block: the leading drafts equal to the target's tokens."""
    return int(torch.cumprod((drafts == tokens).long(), 0).sum())


def one_hot(tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, V).double()


@pytest.mark.parametrize("seed", range(20))
def test_at_temperature_0_it_accepts_the_longest_matching_prefix(seed):
    """The greedy target as a point mass on its argmax and a greedy draft: every threshold is 0 or 1,
    and tau is the matched prefix with certainty (vLLM runs the per-token argmax comparison for a
    request at temperature 0 in any case: the joint rule is the same count there)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (L + 1,), generator=gen)
    drafts = torch.where(torch.rand(L, generator=gen) < 0.6, target[:L], torch.randint(0, V, (L,), generator=gen))
    h, _ = joint_thresholds(one_hot(target), one_hot(drafts), drafts)
    assert set(h.tolist()) <= {0.0, 1.0}
    dist = tau_distribution(h)
    assert int(dist.argmax()) == leading_matches(drafts, target[:L]) and float(dist.max()) == 1.0


def random_rows(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(n, V, generator=gen, dtype=torch.float64), -1)


@pytest.mark.parametrize("seed", range(10))
def test_with_a_greedy_draft_the_count_is_the_per_token_rules(seed):
    """P(tau >= k) = prod_{j <= k} p_j(d_j) exactly: the correction token is never d_{tau+1}, so tau is
    the matched prefix of a text distributed as the target's, as under the per-token rule."""
    gen = torch.Generator().manual_seed(100 + seed)
    p, drafts = random_rows(gen, L + 1), torch.randint(0, V, (L,), generator=gen)
    h, _ = joint_thresholds(p, one_hot(drafts), drafts)
    at_least = torch.flip(torch.cumsum(torch.flip(tau_distribution(h), [0]), 0), [0])
    per_token = torch.cumprod(p[torch.arange(L), drafts], 0)
    torch.testing.assert_close(at_least[1:], per_token, rtol=0, atol=1e-12)
    assert float(joint_expected_accepted(h)) == pytest.approx(float(per_token.sum()), abs=1e-12)


def toy(seed: int):
    """A target and a sampled draft over 3 tokens whose rows depend on the prefix (tuple -> row)."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [()] + [(a,) for a in range(V)] + [(a, b) for a in range(V) for b in range(V)]
    target = {x: random_rows(gen, 1)[0] for x in prefixes}
    draft = {x: random_rows(gen, 1)[0] for x in prefixes if len(x) < L}
    return target, draft


@pytest.mark.parametrize("seed", range(5))
def test_with_a_sampled_draft_it_is_lossless_and_accepts_at_least_the_per_token_count(seed):
    """Every branch enumerated (the draft's block, tau, the correction or bonus token, then the target's
    own tokens to 3): the text's distribution is the target's to 1e-12, and the expected accepted drafts
    are >= the per-token rule's, where the rule accepts slot k with min(1, p/q) after slots < k."""
    target, draft = toy(seed)
    text = {}
    expected_block = expected_token = 0.0
    for d in itertools.product(range(V), repeat=L):
        weight = math.prod(float(draft[d[:i]][d[i]]) for i in range(L))
        p = torch.stack([target[d[:i]] for i in range(L + 1)])
        q = torch.stack([draft[d[:i]] for i in range(L)])
        h, ratio = joint_thresholds(p, q, torch.tensor(d))
        expected_block += weight * float(joint_expected_accepted(h))
        expected_token += weight * sum(math.prod(min(1.0, float(p[j, d[j]] / q[j, d[j]])) for j in range(k))
                                       for k in range(1, L + 1))
        for tau, p_tau in enumerate(tau_distribution(h).tolist()):
            row = p[L] if tau == L else (ratio[tau] * p[tau] - q[tau]).clamp(min=0.0)
            if p_tau == 0:
                continue
            for y in range(V):
                head = d[:tau] + (y,)
                prob = weight * p_tau * float(row[y] / row.sum())
                for tail in itertools.product(range(V), repeat=L + 1 - len(head)):
                    x = head + tail
                    more = math.prod(float(target[x[:i]][x[i]]) for i in range(len(head), L + 1))
                    text[x] = text.get(x, 0.0) + prob * more
    for x in itertools.product(range(V), repeat=L + 1):
        want = math.prod(float(target[x[:i]][x[i]]) for i in range(L + 1))
        assert text.get(x, 0.0) == pytest.approx(want, abs=1e-12), x
    assert expected_block >= expected_token - 1e-12


def test_a_sampled_draft_can_accept_more_jointly():
    """On one of the toys the joint rule accepts strictly more drafts in expectation."""
    gains = []
    for seed in range(5):
        target, draft = toy(seed)
        gain = 0.0
        for d in itertools.product(range(V), repeat=L):
            weight = math.prod(float(draft[d[:i]][d[i]]) for i in range(L))
            p = torch.stack([target[d[:i]] for i in range(L + 1)])
            q = torch.stack([draft[d[:i]] for i in range(L)])
            h, _ = joint_thresholds(p, q, torch.tensor(d))
            token = sum(math.prod(min(1.0, float(p[j, d[j]] / q[j, d[j]])) for j in range(k)) for k in range(1, L + 1))
            gain += weight * (float(joint_expected_accepted(h)) - token)
        gains.append(gain)
    assert max(gains) > 1e-3, gains
