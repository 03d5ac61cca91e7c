"""LiLiCorr's serving walk (dflash_ds/architectures/lilicorr/walk.py and `propose`) against an independent
re-implementation written from SGLang's reader (tests/lilicorr_reference.py: the export's tensors under
SGLang's names, float64 plain algebra, one-hot rows and the inverse-CDF walk): equal tokens and log-factors
on held-out anchors of a tiny drafter run on its own states, and the lowest-index rule on exact ties."""

import pytest
import torch

from dflash_ds.architectures.lilicorr.head import Factors
from dflash_ds.architectures.lilicorr.walk import greedy_path
from dflash_ds.network.draft_model import DraftModel
from tests.lilicorr_reference import ReferenceDraft
from tests.test_lilicorr import B, CONV, D, VOCAB, make_drafter, pkg  # noqa: F401  (pkg: the fixture)


def world(pkg, seed, **fields):
    """A float64 drafter with random weights, a random target embedding and lm_head, and the drafted
    states and context rows of held-out blocks from the drafter's own forward over random taps."""
    drafter = make_drafter(pkg, seed=seed, **fields).double()
    with torch.no_grad():  # a head whose scores move the walk off the backbone's argmax
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    model = DraftModel(drafter, torch.randn(VOCAB, D, generator=g, dtype=torch.float64),
                       torch.randn(VOCAB, D, generator=g, dtype=torch.float64) * 0.3)
    n = 16
    taps = torch.randn(1, 40, 3 * D, generator=g, dtype=torch.float64)
    context_rows = drafter.fuse(taps)[0]
    anchors_at = torch.randint(1, 40, (n,), generator=g)
    states = torch.randn(n, B - 1, D, generator=g, dtype=torch.float64) * 2
    return model, states, context_rows[anchors_at - 1], anchors_at


@pytest.mark.parametrize("fields", [{}, CONV, {"head_hidden_size": 0, "num_heads": 8}], ids=["plain", "conv", "full"])
def test_the_walk_equals_a_re_implementation_from_sglangs_reader(pkg, fields):
    model, states, context, anchors = world(pkg, 11, **fields)
    drafter = model.drafter
    valid = torch.ones(states.shape[0], dtype=torch.bool)
    valid[3] = False  # a block whose anchor has no row before it
    got = pkg.LILICORR.walk.propose(model, states, anchors, context=context, context_valid=valid)
    config = drafter.config.to_hf_config()
    ref = ReferenceDraft(drafter.state_dict(), config["dflash_config"], drafter.config.rms_norm_eps)
    found, factors = pkg.walk.score(model, states, context, valid)
    off_argmax = 0
    for b in range(states.shape[0]):
        uniforms = torch.rand(B - 1, generator=torch.Generator().manual_seed(b), dtype=torch.float64)
        tokens, start, pair = ref.draft(states[b], model.lm_head, model.embed, context[b] if valid[b] else None,
                                        uniforms=uniforms)
        assert got.tokens[b].tolist() == tokens, b
        assert torch.allclose(factors.start[b].double(), start, atol=1e-10, rtol=0)
        assert torch.allclose(factors.pair[b].double(), pair, atol=1e-10, rtol=0)
        off_argmax += int(got.tokens[b].tolist() != found.ids[b, :, 0].tolist())
    assert off_argmax >= 4  # the head's choices, not the backbone's argmax, are what was compared
    assert got.served.tolist() == [B - 1] * states.shape[0]


def test_ties_go_to_the_lowest_candidate_index(pkg):
    """Exact ties (every in-vector zero, so every cosine 0): both walks take rank 0, the backbone's
    argmax, at every slot; and a tie inside a row goes to the lower index."""
    model, states, context, anchors = world(pkg, 12)
    with torch.no_grad():
        model.drafter.lilicorr.in_head.weight.zero_()
        model.drafter.lilicorr.in_head.bias.zero_()
    got = pkg.LILICORR.walk.propose(model, states, anchors, context=context)
    argmax = (states @ model.lm_head.T).argmax(-1)
    assert torch.equal(got.tokens, argmax)
    drafter = model.drafter
    ref = ReferenceDraft(drafter.state_dict(), drafter.config.to_hf_config()["dflash_config"], drafter.config.rms_norm_eps)
    for b in range(3):
        tokens, _, _ = ref.draft(states[b], model.lm_head, model.embed, context[b], uniforms=torch.full((B - 1,), 0.5))
        assert tokens == argmax[b].tolist()
    start = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    pair = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 3.0], [9.0, 0.0, 0.0, 0.0], [0.0] * 4]])
    path = greedy_path(Factors(start, pair[None]))
    assert path.index.tolist() == [[1, 1]] and torch.equal(path.rows[0, 1], pair[0, 1])


def test_a_walk_without_the_anchor_row_or_with_a_cut_is_refused(pkg):
    model, states, context, anchors = world(pkg, 13)
    with pytest.raises(ValueError, match="pass context"):
        pkg.LILICORR.walk.propose(model, states, anchors)
    with pytest.raises(ValueError, match="p_min 0"):
        pkg.LILICORR.walk.propose(model, states, anchors, 0.5, context=context)


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_the_sampled_walk_equals_sglangs_inverse_cdf_walk(pkg, temperature):
    from dflash_ds.architectures.lilicorr.walk import sampled_path

    model, states, context, anchors = world(pkg, 14)
    drafter = model.drafter
    ref = ReferenceDraft(drafter.state_dict(), drafter.config.to_hf_config()["dflash_config"], drafter.config.rms_norm_eps)
    found, factors = pkg.walk.score(model, states, context, torch.ones(states.shape[0], dtype=torch.bool))
    uniforms = torch.rand(states.shape[0], B - 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    path = sampled_path(factors, temperature, uniforms)
    greedy = greedy_path(factors).index
    assert not torch.equal(path.index, greedy)  # the draws move off the greedy path somewhere
    for b in range(states.shape[0]):
        want = ref.walk(factors.start[b].detach(), factors.pair[b].detach(), uniforms[b], temperature)
        assert path.index[b].tolist() == want, b
    assert torch.allclose(path.rows.sum(-1), torch.ones_like(path.rows[..., 0]))
    with pytest.raises(ValueError, match="use greedy_path"):
        sampled_path(factors, 0.0, uniforms)


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_the_text_probabilities_are_the_sampled_walks_own(pkg, temperature):
    """q_s of the text (walk.text_probabilities) along a sampled walk's own tokens is the q row it drew
    from at the index it took; over every path of a block the products sum to 1 (a distribution), and
    a token outside its slot's candidates zeroes its slot and every later one."""
    from dflash_ds.architectures.lilicorr.walk import chosen, sampled_path, text_probabilities

    model, states, context, _ = world(pkg, 15)
    found, factors = pkg.walk.score(model, states, context, torch.ones(states.shape[0], dtype=torch.bool))
    uniforms = torch.rand(states.shape[0], B - 1, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    path = sampled_path(factors, temperature, uniforms)
    got = text_probabilities(found, factors, chosen(found, path), temperature)
    want = path.rows.gather(-1, path.index[..., None]).squeeze(-1)
    assert torch.equal(got, want)
    # Every path of block 0 (k ** S of them), its probability the product of its slots' q.
    k, slots = found.ids.shape[-1], B - 1
    grid = torch.cartesian_prod(*[torch.arange(k)] * slots)
    paths = found.ids[0].gather(1, grid.T).T  # [k ** S, S] tokens
    n = paths.shape[0]
    rep = lambda t: t[:1].expand(n, *t.shape[1:])  # noqa: E731
    block = type(found)(rep(found.ids), rep(found.log_probs))
    q = text_probabilities(block, type(factors)(rep(factors.start), rep(factors.pair)), paths, temperature)
    total = q.prod(-1).sum()
    assert torch.allclose(total, torch.ones_like(total), atol=1e-10, rtol=0)
    assert (q > 0).all()
    # A token no candidate holds at slot 1: slot 1 and every later slot get 0; the slots before keep theirs.
    text = chosen(found, path).clone()
    outside = next(v for v in range(VOCAB) if v not in found.ids[0, 1].tolist())
    text[0, 1] = outside
    cut = text_probabilities(found, factors, text, temperature)
    assert cut[0, 0] == got[0, 0] and (cut[0, 1:] == 0).all() and torch.equal(cut[1:], got[1:])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        text_probabilities(found, factors, text, 0.0)
