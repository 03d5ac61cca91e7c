"""LiLiCorr at every draft length an engine serves (1 <= N <= B - 1 speculative tokens): the shorter block's
smaller lattice (the first N slot embeddings, the same bias by slot distance), walked, equals the
independent re-implementation of tests/lilicorr_reference.py at that length on held-out anchors, and the
evaluator's vLLM count at N is the walk at N (issue 60: below B - 1 the count raised a RuntimeError)."""

import pytest
import torch

from dflash_ds.eval.tau import anchor_drafts
from dflash_ds.eval.vllm_count import VllmCounts, vllm_rounds, with_block
from tests.lilicorr_reference import ReferenceDraft
from tests.test_lilicorr import B, VOCAB, pkg  # noqa: F401  (pkg: the fixture)
from tests.test_lilicorr_walk import world


def reference(model) -> ReferenceDraft:
    drafter = model.drafter
    return ReferenceDraft(drafter.state_dict(), drafter.config.to_hf_config()["dflash_config"],
                          drafter.config.rms_norm_eps)


@pytest.mark.parametrize("n", range(1, B))
def test_the_walk_of_a_shorter_block_equals_the_reference_at_that_length(pkg, n):
    model, states, context, anchors = world(pkg, 21)
    got = pkg.LILICORR.walk.propose(model, states[:, :n], anchors, context=context)
    ref = reference(model)
    found, factors = pkg.walk.score(model, states[:, :n], context, torch.ones(states.shape[0], dtype=torch.bool))
    assert got.tokens.shape == (states.shape[0], n) and got.served.tolist() == [n] * states.shape[0]
    for b in range(states.shape[0]):
        tokens, start, pair = ref.draft(states[b, :n], model.lm_head, model.embed, context[b],
                                        uniforms=torch.zeros(n, dtype=torch.float64))
        assert got.tokens[b].tolist() == tokens, b
        assert torch.allclose(factors.start[b], start, atol=1e-10, rtol=0)
        assert torch.allclose(factors.pair[b], pair, atol=1e-10, rtol=0)


def test_a_block_longer_than_the_trained_one_is_refused(pkg):
    model, states, context, anchors = world(pkg, 21)
    longer = torch.cat([states, states[:, :1]], dim=1)
    with pytest.raises(ValueError, match=rf"a block of {B} drafted slots: the head was built for 1 to {B - 1}"):
        pkg.LILICORR.walk.propose(model, longer, anchors, context=context)


@pytest.mark.parametrize("n", range(1, B))
def test_the_vllm_count_at_every_length_is_the_reference_walk_at_that_length(pkg, n, monkeypatch):
    """The drafts vLLM's count reads at N speculative tokens (the shorter block's states through the
    head) are the reference's walk over those very states, anchor by anchor, and its rounds follow."""
    model, _, _, _ = world(pkg, 22)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB - 1, (40,), generator=g)
    taps = torch.randn(40, 3 * model.drafter.config.hidden_size, generator=g, dtype=torch.float64)
    seen = []
    propose = pkg.LiLiCorrWalk.propose

    def spy(self, m, hidden, anchors, p_min=0.0, *, context=None, context_valid=None):
        seen.append((hidden.clone(), context.clone(), None if context_valid is None else context_valid.clone()))
        return propose(self, m, hidden, anchors, p_min, context=context, context_valid=context_valid)

    monkeypatch.setattr(pkg.LiLiCorrWalk, "propose", spy)
    p, end = 8, 39
    drafts = anchor_drafts(with_block(model, n), taps, ids, p, end=end)
    assert drafts.shape == (end - p, n)
    ref, row = reference(model), 0
    for hidden, context, valid in seen:
        assert hidden.shape[1] == n  # the shorter block's slots, not the trained block's
        for b in range(hidden.shape[0]):
            anchor = context[b] if valid is None or valid[b] else None
            tokens, _, _ = ref.draft(hidden[b], model.lm_head, model.embed, anchor,
                                     uniforms=torch.zeros(n, dtype=torch.float64))
            assert drafts[row].tolist() == tokens, (n, row)
            row += 1
    assert row == end - p

    counts = VllmCounts(n, stop=(), extend=lambda x, length: torch.cat([x, x.new_zeros(length - x.numel())]))
    rounds = counts.add(model, taps, ids, prompt_len=p, budget=end - p)
    padded = torch.cat([ids, ids.new_zeros(2 * B)])
    assert [r.accepted for r in rounds] == [r.accepted for r in vllm_rounds(drafts, padded, p, end, stop=())]
    assert counts.as_dict()["num_speculative_tokens"] == n and all(r.drafted == n for r in rounds)


def test_the_evaluator_counts_vllm_at_the_speculative_tokens_it_is_given(tmp_path, capsys):
    """`python -m dflash_ds.eval --num-speculative-tokens N` reports vLLM's count at N for a LiLiCorr
    export (a shorter block); a count the block cannot serve is one line, exit 2."""
    import json

    from dflash_ds.eval.cli import main
    from tests.lilicorr_exports import distinct_export

    export = distinct_export(tmp_path / "export")
    common = ["--target", "assets/tiny-target", "--drafter", str(export), "--prompts", "assets/tiny_eval.jsonl",
              "--limit", "2", "--max-new-tokens", "12"]
    out = tmp_path / "tau.json"
    assert main(common + ["--num-speculative-tokens", "1", "--out", str(out)]) == 0
    assert "vLLM mean acceptance length (num_speculative_tokens 1): " in capsys.readouterr().out
    vllm = json.loads(out.read_text())["vllm"]
    assert vllm["num_speculative_tokens"] == 1 and vllm["num_draft_tokens"] == vllm["num_drafts"] > 0
    assert main(common + ["--num-speculative-tokens", "9"]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[dflash]")]
    assert len(said) == 1 and "--num-speculative-tokens: num_speculative_tokens 9: vLLM drafts 1 to 3 tokens" in said[0]
