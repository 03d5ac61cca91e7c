"""Sampled tau's reading of a LiLiCorr draft (eval/tau.py `anchor_proposals` with a temperature): q of the
text's own next tokens at every anchor, from the states of all anchors batched with the training masks,
equals walk.text_probabilities on the states the online loop's serving call (eval/specdec.py) computes for
that anchor alone, and is 0 past the text's end; a greedy-drafting architecture gives none."""

import pytest
import torch

from dflash_ds.architectures.lilicorr.walk import text_probabilities
from dflash_ds.eval.specdec import serving_masks
from dflash_ds.eval.tau import anchor_proposals
from dflash_ds.network.draft_model import DraftModel
from tests.test_lilicorr import B, CONV, D, VOCAB, make_drafter, pkg  # noqa: F401  (pkg: the fixture)


def serving_states(model: DraftModel, taps: torch.Tensor, ids: torch.Tensor, t: int):
    """(drafting states [1, B - 1, D], context row [1, D]) of the block anchored at t, as the online loop
    drafts it: the context taps before t, the block [x_t, MASK ...] at positions t .. t + B - 1."""
    drafter = model.drafter
    ctx = drafter.fuse(taps[None, :t])
    block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
    block[0, 0] = ids[t]
    hidden = drafter(model.embed_tokens(block, next(drafter.parameters())), ctx, torch.arange(t, t + B)[None],
                     torch.arange(t)[None], mask=serving_masks(model, t, torch.device("cpu")))
    return model.drafting_states(hidden), ctx[:, t - 1]


@pytest.mark.parametrize("fields", [{}, CONV], ids=["plain", "conv"])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_tau_reads_q_of_the_text_as_the_online_draft_has_it(pkg, fields, temperature):
    drafter = make_drafter(pkg, seed=21, **fields).double()
    with torch.no_grad():  # a head whose q spreads over several candidates
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(22)
    model = DraftModel(drafter, torch.randn(VOCAB, D, generator=g, dtype=torch.float64),
                       torch.randn(VOCAB, D, generator=g, dtype=torch.float64) * 0.3)
    seq, first = 30, 6
    taps = torch.randn(seq, 3 * D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB - 1, (seq,), generator=g)
    # Make the text the greedy draft's own after some anchors, so that q is non-zero over several slots.
    for t in (8, 15):
        states, row = serving_states(model, taps, ids, t)
        ids[t + 1:t + B] = model.draft(states, ids[t:t + 1], context=row)[0]
    got = anchor_proposals(model, taps, ids, first, end=seq, batch_anchors=5, temperature=temperature)
    assert got.text_q.shape == (seq - first, B - 1) and got.text_q.dtype == torch.float64
    with torch.no_grad():
        for t in range(first, seq):
            states, row = serving_states(model, taps, ids, t)
            found, factors = pkg.walk.score(model, states, row, torch.ones(1, dtype=torch.bool))
            at = t + 1 + torch.arange(B - 1)
            following = torch.where(at < seq, ids[at.clamp(max=seq - 1)], -1)[None]
            want = text_probabilities(found, factors, following, temperature)[0]
            assert torch.allclose(got.text_q[t - first], want, atol=1e-10, rtol=0), t
    assert (got.text_q[-1] == 0).all() and (got.text_q[-2, 1:] == 0).all()  # past the text's end
    assert (got.text_q[[8 - first, 15 - first]] > 0).all()  # the greedy draft's own text: every slot reached
    assert (got.text_q > 0).sum() > 2 * (B - 1)
    assert anchor_proposals(model, taps, ids, first, end=seq).text_q is None  # temperature 0: none asked


def test_a_greedy_drafting_architecture_has_no_text_q():
    from dflash_ds.architectures.dflash import DFLASH

    assert DFLASH.walk.text_probabilities(None, torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long), 0.7) is None
