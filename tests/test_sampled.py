"""tau under sampling (docs/algorithm.md section 7): the engines' verification rule, the offline walk on
sampled responses, its Rao-Blackwellised estimate, and the online sampled loop."""

import copy
import itertools
import math

import pytest
import torch

from dflash_ds.eval.batched import ResponseKey, response_generator
from dflash_ds.eval.benchmark_table import BenchOptions, Responder, tau_on_prompts
from dflash_ds.eval.generate import offline_tau
from dflash_ds.eval.sampled import (Sampling, draft_probabilities, mean_se, ratio_se, target_probs,
                                    walk_with_probs)
from dflash_ds.eval import specdec_sampled
from dflash_ds.eval.specdec_sampled import speculative_sample, verify_block
from dflash_ds.eval.tau import TauReport
from tests.test_evaluate import NEW, world  # noqa: F401 - the module fixture: tiny target + trained drafter



def test_target_probs_match_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen, dtype=torch.float64) * 3
    for s in (Sampling(0.7), Sampling(1.0, top_p=0.8), Sampling(1.3, top_k=7), Sampling(0.9, top_p=0.6, top_k=12)):
        ref = TemperatureLogitsWarper(s.temperature)(None, logits.clone())
        if s.top_k:
            ref = TopKLogitsWarper(s.top_k)(None, ref)
        if s.top_p < 1:
            ref = TopPLogitsWarper(s.top_p)(None, ref)
        torch.testing.assert_close(target_probs(logits, s), torch.softmax(ref, -1), rtol=0, atol=1e-12)
    p = target_probs(logits, Sampling(1.0, top_p=0.5))
    kept = (p > 0).sum(-1)
    assert (kept < 50).all() and (kept >= 1).all()  # the nucleus cuts, never to nothing
    with pytest.raises(ValueError, match="temperature > 0"):
        target_probs(logits, Sampling())
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0).check()


# --------------------------------------------------------------------------- brute force on a toy pair
# Vocabulary of 3, block size 3 (two draft slots), a one-token prompt and a fixed budget of 5 tokens:
# every sampled response and every branch of the online rejection procedure can be enumerated.
V, BS, BUDGET = 3, 3, 5


def toy_p(ctx: tuple) -> list[float]:
    """The toy target's (already filtered) next-token distribution: depends on the last two tokens."""
    a, b = (ctx[-2] if len(ctx) > 1 else 0), ctx[-1]
    w = [1.0 + ((3 * a + 5 * b + 7 * v) % 4) for v in range(V)]
    return [x / sum(w) for x in w]


def toy_drafts(ctx: tuple) -> list[int]:
    """The toy drafter's greedy block after `ctx` (the anchor included): a fixed function of it."""
    return [(ctx[-1] + 1) % V, (2 * ctx[-1] + len(ctx)) % V]


def offline_walk(x: tuple, first: int):
    end = len(x)
    drafts = torch.tensor([toy_drafts(x[:t + 1]) for t in range(first, end)])
    slot_p = torch.tensor([[toy_p(x[:t + k])[d] if t + k < end else 0.0
                            for k, d in enumerate(toy_drafts(x[:t + 1]), 1)] for t in range(first, end)],
                          dtype=torch.float64)
    # slot k of anchor t proposes position t + k, drawn from p(. | x[:t + k]) on the trajectory
    return walk_with_probs(drafts, slot_p, torch.tensor(x), first, end=end)


def online_outcomes(ctx: tuple, budget: int, prob: float, counts: tuple):
    """Every outcome of the engines' rule from `ctx` (the last token is the anchor): (prob, text, counts)."""
    if budget == 0:
        yield prob, ctx, counts
        return
    drafts = toy_drafts(ctx)

    def branch(emitted: tuple, k: int, q: float):
        if k == len(drafts):  # all accepted: the bonus
            for v, pv in enumerate(toy_p(ctx + emitted)):
                yield q * pv, emitted + (v,)
            return
        p = toy_p(ctx + emitted)
        d = drafts[k]
        yield from branch(emitted + (d,), k + 1, q * p[d])  # accepted with probability p(d)
        rest = 1.0 - p[d]
        for v in range(V):  # rejected (probability 1 - p(d)), then a token from p without d
            if v != d and rest > 0:
                yield q * rest * p[v] / rest, emitted + (v,)

    for q, emitted in branch((), 0, prob):
        emitted = emitted[:budget]
        yield from online_outcomes(ctx + emitted, budget - len(emitted), q, counts + (len(emitted),))


def test_engine_rule_equals_the_walk_on_sampled_text_brute_force():
    prompt = (2,)
    online = {}
    for first_tok, p0 in enumerate(toy_p(prompt)):  # the prefill token
        for q, text, counts in online_outcomes(prompt + (first_tok,), BUDGET - 1, p0, ()):
            online[(text, counts)] = online.get((text, counts), 0.0) + q
    assert sum(online.values()) == pytest.approx(1.0, abs=1e-12)
    texts = {}
    for (text, counts), q in online.items():
        texts.setdefault(text, []).append((counts, q))
    exp_tau_online = exp_tau_offline = exp_rb_tokens = 0.0
    for rest in itertools.product(range(V), repeat=BUDGET):
        x = prompt + rest
        px = math.prod(toy_p(x[:i])[x[i]] for i in range(len(prompt), len(x)))
        # The engines' output text is distributed as the target's own samples ...
        assert sum(q for _, q in texts[x]) == pytest.approx(px, abs=1e-12)
        # ... and, given the text, the cycles are the walk's (one outcome per text).
        cycles, probs = offline_walk(x, len(prompt))
        assert [c for c, _ in texts[x]] == [tuple(cycles)]
        exp_tau_online += sum(q * sum(c) / len(c) for c, q in texts[x])
        exp_tau_offline += px * sum(cycles) / len(cycles)
        exp_rb_tokens += px * sum(1 + sum(p) for p in probs)
    assert exp_tau_offline == pytest.approx(exp_tau_online, abs=1e-12)
    assert exp_tau_offline > 1.3  # the toy accepts drafts often enough for the comparison to mean something
    # The Rao-Blackwellised cycle sums are unbiased for the emitted tokens (a fixed budget).
    assert exp_rb_tokens == pytest.approx(BUDGET - 1, abs=1e-12)


@pytest.mark.parametrize("verify", ["per_token", "jointly"])
def test_verify_block_follows_the_rule(verify):
    """Per token, and jointly (rejection_sample_method=block): with a greedy draft both give the same
    outcomes with the same probabilities."""
    from dflash_ds.eval.specdec_sampled import verify_jointly

    fn = verify_block if verify == "per_token" else verify_jointly
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]], dtype=torch.float64))
    drafts = torch.tensor([0, 2])
    s = Sampling(1.0)
    gen = torch.Generator().manual_seed(0)
    outs = [tuple(fn(logits, drafts, s, gen)) for _ in range(20000)]
    freq = {o: outs.count(o) / len(outs) for o in set(outs)}
    exact = {(0, 2, v): 0.7 * 0.8 * [0.3, 0.3, 0.4][v] for v in range(3)}
    exact.update({(1,): 0.2, (2,): 0.1, (0, 0): 0.7 * 0.1, (0, 1): 0.7 * 0.1})
    assert set(freq) == set(exact)
    for o, p in exact.items():
        assert abs(freq[o] - p) < 4 * math.sqrt(p * (1 - p) / len(outs)), (o, freq[o], p)


def test_draft_probabilities_index_the_slot_positions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 9, generator=gen, dtype=torch.float64)
    first, end, s = 3, 12, Sampling(0.8, top_p=0.9)
    drafts = torch.randint(0, 9, (end - first, 4), generator=gen)
    got = draft_probabilities(logits, drafts, first, end, sampling=s, chunk=2)
    for i, t in enumerate(range(first, end)):
        for k in range(1, 5):  # slot k of anchor t proposes position t + k: logits row t + k - 1
            want = target_probs(logits[t + k - 1], s)[drafts[i, k - 1]] if t + k < end else 0.0
            assert float(got[i, k - 1]) == pytest.approx(float(want), abs=1e-12)


def test_standard_errors_hand_worked():
    m, se = mean_se([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and se == pytest.approx(math.sqrt(5 / 3 / 4))
    r, se = ratio_se([4.0, 2.0, 6.0], [2, 2, 2])  # equal denominators: the mean of the ratios
    assert r == 2.0 and se == pytest.approx(mean_se([2.0, 1.0, 3.0])[1])
    assert math.isnan(mean_se([1.0])[1]) and math.isnan(ratio_se([], [])[0])


# --------------------------------------------------------------------------- the tiny Qwen3 and its drafter
# The tiny random target is nearly uniform; its logits scaled by LOGIT_SCALE give a peaked distribution
# with the same argmax, so the drafter trained on its greedy text still has something to match.
LOGIT_SCALE, SAMPLING, SAMPLES = 60.0, Sampling(1.0, top_k=20), 8


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_online_sampled_loop_agrees_with_offline_within_error(world):
    w = world
    model, prompts = w["model"], w["trained_on"]
    target = copy.deepcopy(w["target"])
    target.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    off = tau_on_prompts(Responder(target, model, SAMPLING, BenchOptions(NEW, samples=SAMPLES, seed=0)), prompts)
    gen = torch.Generator().manual_seed(1)  # independent coins: agreement in distribution, not draw for draw
    on = TauReport(block_size=model.block_size)
    for prompt in prompts:
        for _ in range(SAMPLES):
            ids, counts = speculative_sample(target, model, prompt, SAMPLING, generator=gen, max_new_tokens=NEW)
            assert sum(counts) == ids.numel() - 1
            on.cycles.append(counts)
    off_mean, off_se = mean_se(off.report.per_response)
    on_mean, on_se = mean_se(on.per_response)
    err = math.hypot(off_se, on_se)
    assert abs(off_mean - on_mean) < 3 * err, (off_mean, on_mean, err)
    off_pooled = ratio_se([sum(c) for c in off.report.cycles], [len(c) for c in off.report.cycles])
    on_pooled = ratio_se([sum(c) for c in on.cycles], [len(c) for c in on.cycles])
    assert abs(off_pooled[0] - on_pooled[0]) < 3 * math.hypot(off_pooled[1], on_pooled[1])
    # The Rao-Blackwellised pooled tau agrees with the realized one, with no more spread.
    pooled, pooled_se = ratio_se([sum(c) for c in off.report.cycles], [len(c) for c in off.report.cycles])
    num, den = off.expected_sums()
    rb, rb_se = ratio_se(num, den)
    assert abs(rb - pooled) < 3 * pooled_se and rb_se <= pooled_se * 1.05
    # Sampling changes tau measurably, so agreeing with the sampled number is not agreeing with greedy.
    greedy = offline_tau(target, model, prompts, max_new_tokens=NEW)
    assert greedy.tau_mean - off_mean > 3 * err
    assert off_mean > 1.1  # drafts are still accepted under sampling
    # Seeded: the same call gives the same responses.
    again = tau_on_prompts(Responder(target, model, SAMPLING, BenchOptions(NEW, samples=2, seed=0)), prompts[:1])
    assert again.report.cycles == off.report.cycles[:2]


def coupled_verify(logits, drafts, sampling, generator, *, draft=None):
    """The same rule drawn differently: each verified position's token comes from p, and the draft is
    accepted when they are equal (probability p(d); otherwise a token from p without d). It makes one
    draw per position in order, as the offline sampler does, so equal seeds give equal text."""
    assert draft is None, "a sampled draft is verified by coupled_sampled_verifier"
    out = []
    for k, d in enumerate(drafts.tolist()):
        tok = int(torch.multinomial(target_probs(logits[k], sampling), 1, generator=generator))
        out.append(tok)
        if tok != d:
            return out
    out.append(int(torch.multinomial(target_probs(logits[len(out)], sampling), 1, generator=generator)))
    return out


def couple_sampled_drafts(monkeypatch, target, model, prompt: torch.Tensor, coins: torch.Tensor,
                          generator: torch.Generator) -> None:
    """Patch the online sampled loop (eval/specdec_sampled.py) so that it draws as the offline walk
    (eval.sampled.tau_of_trajectory) does: at each drafted slot the verified position's token x from p
    (`generator`, one draw a position in order), accepted when the coin of its position is below
    min(1, q(x) / p(x)), q the architecture's sampled draft along the text; the draft is the accepted
    tokens, so the target's verification pass is conditioned as the engine's would be. A greedy draft is
    verified as `coupled_verify` does."""
    from dflash_ds.network.arch_types import SampledDraft
    from dflash_ds.eval import specdec_sampled
    from dflash_ds.eval.specdec import logits_and_taps

    state = {"seq": prompt.tolist(), "reject": None}
    states_of, sampled_of = specdec_sampled.block_states, type(model).sampled_draft  # a frozen dataclass

    def block_states(m, context_taps, anchor_token):
        if len(state["seq"]) == context_taps.shape[0]:  # the prefill's token, drawn before any cycle
            state["seq"].append(int(anchor_token))
        assert len(state["seq"]) == context_taps.shape[0] + 1
        return states_of(m, context_taps, anchor_token)

    def sampled_draft(self, hidden, temperature, _generator, *, context=None):
        real = sampled_of(self, hidden, temperature, torch.Generator(), context=context)
        if real is None:
            return None
        slots, t, d = hidden.shape[1], len(state["seq"]) - 1, []
        for k in range(slots):
            p = target_probs(logits_and_taps(target, torch.tensor(state["seq"] + d), model.layer_ids)[0][-1],
                             SAMPLING)
            tok = int(torch.multinomial(p, 1, generator=generator))
            q = float(real.text_q(torch.tensor(d + [tok] + [-1] * (slots - k - 1))[None])[0, k])
            pos = t + 1 + k  # past the response's budget the loop cuts the token: rejected
            if pos < coins.numel() and float(coins[pos]) < min(1.0, q / float(p[tok])):
                d.append(tok)
                continue
            state["reject"] = (k, tok)
            d += [tok] * (slots - k)
            break
        return SampledDraft(torch.tensor([d]), real.q, real.text_q)

    def verify(logits, drafts, sampling, gen, *, draft=None):
        if draft is None:
            out = coupled_verify(logits, drafts, sampling, gen)
        elif state["reject"] is not None:
            k, tok = state["reject"]
            out = drafts[:k].tolist() + [tok]
        else:
            out = drafts.tolist() + [int(torch.multinomial(target_probs(logits[len(drafts)], sampling), 1,
                                                           generator=gen))]
        state["seq"] += out
        state["reject"] = None
        return out

    monkeypatch.setattr(specdec_sampled, "block_states", block_states)
    monkeypatch.setattr(type(model), "sampled_draft", sampled_draft)
    monkeypatch.setattr(specdec_sampled, "verify_block", verify)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_online_loop_with_coupled_draws_reproduces_the_offline_walk_exactly(world, monkeypatch):
    """Cycle for cycle: the plumbing of both paths (draft positions, logit rows, the budget) agrees."""
    w = world
    target = copy.deepcopy(w["target"])
    target.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    monkeypatch.setattr(specdec_sampled, "verify_block", coupled_verify)
    accepted = []
    for seed, prompt in enumerate(w["trained_on"] * 2):
        responder = Responder(target, w["model"], SAMPLING, BenchOptions(NEW, seed=seed))
        response = responder.respond(prompt.tolist(), ResponseKey())
        ids, counts = speculative_sample(target, w["model"], prompt, SAMPLING,
                                         generator=response_generator(seed, ResponseKey()),
                                         max_new_tokens=NEW)
        assert ids.tolist() == response
        assert counts == responder.result.report.cycles[0]
        accepted += [c - 1 for c in counts]
    assert max(accepted) >= 3 and min(accepted) == 0  # multi-token acceptance and rejections both occur
