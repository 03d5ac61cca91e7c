"""LiLiCorr's remote code (modeling_lilicorr.py, carried by every LiLiCorr export beside modeling_dflash.py):
AutoModel with trust_remote_code loads a tiny export with the drafter's tensors, its backbone computes
the drafter's states, and its reranked draft equals the project's `propose` on held-out anchors (plain,
with the block convolution, full width)."""

import json

import pytest
import torch

from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.draft_model import DraftModel
from tests.remote_case import block_case, serving_call
from tests.test_lilicorr import B, CONV, D, VOCAB, make_drafter, pkg  # noqa: F401  (pkg: the fixture)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fields", [{}, CONV, {"head_hidden_size": 0, "num_heads": 8}], ids=["plain", "conv", "full"])
def test_automodel_loads_lilicorr_and_its_draft_equals_propose(pkg, tmp_path, fields):
    from transformers import AutoModel

    drafter = make_drafter(pkg, seed=7, **fields)
    with torch.no_grad():  # a head whose scores move the walk off the backbone's argmax
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_lilicorr.LiLiCorrDraftModel"
    assert (out / "modeling_lilicorr.py").exists() and (out / "modeling_dflash.py").exists()
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ours = load_drafter(out, dtype=torch.float32)  # its class and tensors: the conformance suite's

    # The backbone's serving call: one block after the whole context, as the engines run it.
    case = block_case(D, B, two_docs=False, generator=torch.Generator().manual_seed(1))
    hidden_remote, hidden = serving_call(model, ours, case, B)
    torch.testing.assert_close(hidden_remote, hidden, rtol=1e-5, atol=1e-5)

    # Held-out anchors: drafted states, the target's taps before each anchor, one without a row.
    g = torch.Generator().manual_seed(2)
    embed, lm_head = torch.randn(VOCAB, D, generator=g), torch.randn(VOCAB, D, generator=g) * 0.3
    n = 16
    states = torch.randn(n, B - 1, D, generator=g) * 2
    taps = torch.randn(n, 3 * D, generator=g)
    valid = torch.ones(n, dtype=torch.bool)
    valid[5] = False
    dm = DraftModel(ours, embed, lm_head)
    with torch.no_grad():
        context = ours.fuse(taps[None])[0]
    want = pkg.LILICORR.walk.propose(dm, states, torch.zeros(n, dtype=torch.long), context=context, context_valid=valid)
    got = model.propose(states, taps, lm_head, embed, anchor_valid=valid)
    assert torch.equal(got, want.tokens)
    found, factors = pkg.walk.score(dm, states, context, valid)
    ids, start, pair = model.factors(states, taps, lm_head, embed, anchor_valid=valid)
    assert torch.equal(ids, found.ids)
    torch.testing.assert_close(start, factors.start, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pair, factors.pair, rtol=1e-5, atol=1e-5)
    # The comparison sees the head: its choices differ from the backbone's argmax on several blocks.
    assert (got != found.ids[..., 0]).any(-1).sum() >= 3
    # No row before the anchor is the same as a row marked invalid.
    none = model.propose(states[5:6], None, lm_head, embed)
    assert torch.equal(none, want.tokens[5:6])
