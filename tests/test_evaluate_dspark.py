"""A DSpark drafter's exact offline tau walks the Markov chain from the anchor-first block (B drafts
per cycle, what the engines accept), and equals the online reference speculative loop cycle for
cycle. The drafter is trained here with the project's drafter_loss (CE + L1 against the target's
distribution + the confidence BCE) so that multi-token acceptance occurs and the chain's tokens
differ from the per-slot argmax; on held-out prompts its proposals equal llama.cpp's in-graph chain
re-implemented in tests/test_dspark.py."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ds.config import DrafterConfig
from dflash_ds.eval.generate import greedy_continuation, offline_tau, target_taps
from dflash_ds.eval.specdec import speculative_generate
from dflash_ds.eval.tau import accept_lengths
from dflash_ds.model.attention import DFlashMask
from dflash_ds.model.blocks import MicroBatch, make_blocks
from dflash_ds.model.draft_model import DraftModel
from dflash_ds.model.drafter import DFlashDrafter
from dflash_ds.model.objective import StepSettings, drafter_loss
from dflash_ds.model.variants.base import argmax_tokens
from dflash_ds.model.variants.dspark_parts import DSparkTerms
from dflash_ds.resolve.drafter import drafter_shape

VOCAB, MASK, B, LAYER_IDS, PROMPT_LEN, NEW = 128, 127, 7, [1, 3], 6, 40


def final_states(target, x: torch.Tensor) -> torch.Tensor:
    """The target's final-norm states [S, D] of one sequence (what target ranks send for the L1 term)."""
    with torch.no_grad():
        return target.model(input_ids=x[None]).last_hidden_state[0]


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=1e6, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg).double().eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120, (PROMPT_LEN,), generator=gen) for _ in range(6)]
    sequences = [greedy_continuation(target, p, max_new_tokens=NEW) for p in prompts[:4]]
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=MASK, target_layer_ids=LAYER_IDS,
                            architecture="dspark", markov_rank=16)
    shape = drafter_shape(target.config, section)
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).double()
    model = DraftModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    x = torch.stack(sequences)
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    mb = MicroBatch(torch.stack([target_taps(target, s, LAYER_IDS) for s in sequences]), x, loss_mask,
                    torch.zeros_like(x, dtype=torch.int32), torch.stack([final_states(target, s) for s in sequences]))
    settings = StepSettings(shape=shape, num_anchors=24, gamma=shape.variant.default_gamma(shape), loss_chunks=2,
                            mask_kind="dense", seed=0, arch_loss=DSparkTerms())
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(120):
        blocks = make_blocks(mb, settings, step)
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings, settings.step_term(step, 120))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    drafter.eval().requires_grad_(False)
    return dict(target=target, prompts=prompts, sequences=sequences, model=model)


def block_states(model, taps, token, t):
    """The drafter's final states [1, B, D] of the block [token, MASK x (B-1)] at positions t .. t+B-1."""
    drafter, p = model.drafter, next(model.drafter.parameters())
    block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
    block[0, 0] = token
    mask = DFlashMask(query_len=B, kv_len=t + B, dense=torch.ones(1, 1, B, t + B, dtype=torch.bool))
    with torch.no_grad():
        return drafter(model.embed_tokens(block, p), drafter.fuse(taps[None, :t]), torch.arange(t, t + B)[None],
                       torch.arange(t)[None], mask)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_dspark_online_loop_matches_the_offline_markov_walk(world):
    w = world
    sequences = []
    report = offline_tau(w["target"], w["model"], w["prompts"], max_new_tokens=NEW, sequences=sequences)
    assert report.block_size == B + 1  # every slot drafts: a cycle emits up to B + 1 tokens
    for prompt, x, cycles in zip(w["prompts"], sequences, report.cycles):
        ids, counts = speculative_generate(w["target"], w["model"], prompt, max_new_tokens=NEW)
        assert ids.tolist() == x[prompt.numel():].tolist()
        assert counts == cycles
    accepted = [c - 1 for cycles in report.cycles for c in cycles]
    assert max(accepted) >= 3 and report.tau_mean > 2.0


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_offline_acceptance_follows_the_markov_chain_from_slot_0(world):
    """a(t) of the batched offline pass equals a step-by-step reference: slot k's token is the argmax
    of its lm_head logits plus markov_w2 @ markov_w1[prev], prev the anchor for slot 0 and the token
    chosen at slot k - 1 after; slot k proposes x[t + k + 1]. At some anchors the chain differs from
    the per-slot argmax."""
    w = world
    model = w["model"]
    x = w["sequences"][1]
    taps = target_taps(w["target"], x, LAYER_IDS)
    end = x.numel()
    a = accept_lengths(model, taps, x, PROMPT_LEN, end, batch_anchors=7)
    w1, w2 = model.drafter.markov_head.markov_w1.weight, model.drafter.markov_head.markov_w2.weight
    expected, differs = [], 0
    for t in range(PROMPT_LEN, end):
        hidden = block_states(model, taps, int(x[t]), t)[0]
        prev, chain = int(x[t]), []
        for k in range(B):
            prev = int((hidden[k] @ model.lm_head.T + w2 @ w1[prev]).argmax())
            chain.append(prev)
        n = 0
        while n < B and t + n + 1 < end and chain[n] == int(x[t + n + 1]):
            n += 1
        expected.append(max(0, min(n, end - t - 2)))
        differs += int(chain != argmax_tokens(hidden, model.lm_head).tolist())
    assert a.tolist() == expected
    assert differs > 0


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_trained_chain_equals_llama_cpp_on_held_out_prompts(world):
    """The trained drafter's proposals at anchors of the two prompts it never saw equal llama.cpp's
    in-graph chain (`build_dspark_markov_head`, sample_from_anchor) and serving loop re-implemented
    in tests/test_dspark.py, with and without a confidence threshold."""
    from dflash_ds.model.variants.dspark_parts import confident_prefix

    from .test_dspark import llama_cpp_drafts, llama_cpp_dspark

    model = world["model"]
    drafter = model.drafter
    head, conf = drafter.markov_head, drafter.confidence_head
    weights = (head.markov_w1.weight, head.markov_w2.weight, conf.proj.weight[0], conf.proj.bias[0])
    checked = 0
    for prompt in world["prompts"][4:]:
        x = greedy_continuation(world["target"], prompt, max_new_tokens=NEW)
        taps = target_taps(world["target"], x, LAYER_IDS)
        for t in range(PROMPT_LEN, x.numel() - 1, 5):
            hidden = block_states(model, taps, int(x[t]), t)
            ours = model.draft(hidden, x[t:t + 1])
            tokens = torch.cat([x[t:t + 1], torch.full((B - 1,), MASK)])
            logits, probs = llama_cpp_dspark(tokens, hidden[0] @ model.lm_head.T, hidden[0], weights, (1, B, True))
            with torch.no_grad():
                c = conf(hidden, head.embed(torch.cat([x[t:t + 1], ours[0, :-1]])[None]))
            for p_min in (0.0, 0.5):
                served = llama_cpp_drafts(logits, probs, 1, 0, p_min)[0]
                assert ours[0, :int(confident_prefix(c, p_min)[0])].tolist() == served, (t, p_min)
            checked += 1
    assert checked >= 10


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_dspark_sampled_walk_equals_online_with_coupled_draws(world, monkeypatch):
    """Under sampling the offline walk follows the chain's B drafts too: with the coupled verifier of
    tests/test_sampled.py (the engines' rule, one draw per position) both paths give the same text
    and cycles."""
    import copy

    from dflash_ds.eval import specdec_sampled
    from dflash_ds.eval.benchmark_table import BenchOptions, Responder
    from tests.test_sampled import LOGIT_SCALE, SAMPLING, coupled_verify

    target = copy.deepcopy(world["target"])
    target.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    monkeypatch.setattr(specdec_sampled, "verify_block", coupled_verify)
    accepted = []
    for seed, prompt in enumerate(world["prompts"][:4]):
        responder = Responder(target, world["model"], SAMPLING, BenchOptions(NEW, seed=seed))
        response = responder.respond(prompt.tolist())
        ids, counts = specdec_sampled.speculative_sample(target, world["model"], prompt, SAMPLING,
                                                         torch.Generator().manual_seed(seed), max_new_tokens=NEW)
        assert ids.tolist() == response and counts == responder.result.report.cycles[0]
        accepted += [c - 1 for c in counts]
    assert max(accepted) >= 2
