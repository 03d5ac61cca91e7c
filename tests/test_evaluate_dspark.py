"""A trained DSpark drafter's proposals on held-out prompts equal llama.cpp's in-graph chain
re-implemented in tests/test_dspark.py (that the offline tau follows the Markov chain from the
anchor-first block and equals the online loop is the conformance suite's,
tests/test_conformance_walk.py). The drafter is trained here with the project's drafter_loss (CE + L1
against the target's distribution + the confidence BCE)."""

import pytest
import torch

from dflash_ds.architectures.dspark import DSparkFields, DSparkKeys
from dflash_ds.config import DrafterConfig
from dflash_ds.eval.generate import greedy_continuation, target_taps
from dflash_ds.eval.tau import anchor_proposals
from dflash_ds.network.attention import DFlashMask
from tests.eval_world import LAYER_IDS, MASK, NEW, PROMPT_LEN, trained_world

B = 7


@pytest.fixture(scope="module")
def world():
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=MASK, target_layer_ids=LAYER_IDS,
                            architecture="dspark", sections={"dspark": DSparkFields(markov_rank=16)})
    return trained_world(section, DSparkKeys(), gamma=4.0)  # default_gamma(B + 1), DeepSpec's at B = 7


def block_states(model, taps, token, t):
    """The drafter's final states [1, B, D] of the block [token, MASK x (B-1)] at positions t .. t+B-1."""
    drafter, p = model.drafter, next(model.drafter.parameters())
    block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
    block[0, 0] = token
    mask = DFlashMask(query_len=B, kv_len=t + B, dense=torch.ones(1, 1, B, t + B, dtype=torch.bool))
    with torch.no_grad():
        return drafter(model.embed_tokens(block, p), drafter.fuse(taps[None, :t]), torch.arange(t, t + B)[None],
                       torch.arange(t)[None], mask=mask)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_trained_chain_equals_llama_cpp_on_held_out_prompts(world):
    """The trained drafter's proposals at anchors of the two prompts it never saw equal llama.cpp's
    in-graph chain (`build_dspark_markov_head`, sample_from_anchor) and serving loop re-implemented
    in tests/test_dspark.py, with and without a confidence threshold."""
    from dflash_ds.architectures.dspark.parts import confident_prefix

    from .test_dspark import llama_cpp_drafts, llama_cpp_dspark

    model = world["model"]
    drafter = model.drafter
    head, conf = drafter.markov_head, drafter.confidence_head
    weights = (head.markov_w1.weight, head.markov_w2.weight, conf.proj.weight[0], conf.proj.bias[0])
    checked, cut = 0, 0
    for prompt in world["prompts"][4:]:
        x = greedy_continuation(world["target"], prompt, max_new_tokens=NEW)
        taps = target_taps(world["target"], x, LAYER_IDS)
        # The batched pass over every anchor that the engine count reads (tau.anchor_proposals).
        batched = {p_min: anchor_proposals(model, taps, x, PROMPT_LEN, end=x.numel(), p_min=p_min) for p_min in (0.0,
                                                                                                                 0.5)}
        for t in range(PROMPT_LEN, x.numel() - 1, 5):
            hidden = block_states(model, taps, int(x[t]), t)
            ours = model.draft(hidden, x[t:t + 1])
            tokens = torch.cat([x[t:t + 1], torch.full((B - 1,), MASK)])
            logits, probs = llama_cpp_dspark(tokens, hidden[0] @ model.lm_head.T, hidden[0], weights, (1, B, True))
            with torch.no_grad():
                c = conf(hidden, head.embed(torch.cat([x[t:t + 1], ours[0, :-1]])[None]))
            for p_min, proposal in batched.items():
                served = llama_cpp_drafts(logits, probs, 1, 0, p_min)[0]
                assert ours[0, :int(confident_prefix(c, p_min)[0])].tolist() == served, (t, p_min)
                i = t - PROMPT_LEN
                assert proposal.tokens[i, :int(proposal.served[i])].tolist() == served, (t, p_min)
                cut += int(len(served) < B)
            checked += 1
    assert checked >= 10 and cut > 0
