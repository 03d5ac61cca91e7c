"""llama.cpp's rounds from the drafts at every anchor (docs/algorithm.md section 7.3), hand-worked."""

import pytest
import torch

from dflash_ds.eval.engine_count import EngineCount, Round, accepted, engine_rounds

EOS = 2


def rows(*drafts):
    return torch.tensor(drafts)


def test_first_round_at_the_last_prompt_token_and_a_confirmed_end_token():
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23, EOS])  # prompt of 3, response 20 .. EOS
    # anchors 2 .. 7, 3 drafted slots each (B = 4); rows the walk jumps over are never read
    drafts = rows([20, 21, 99], [21, 22, 23], [0, 0, 0], [23, EOS, 50], [0, 0, 0], [0, 0, 0])
    # llama-speculative-simple: anchor 2 accepts 20, 21; anchor 5 accepts 23, and the confirmed EOS in
    # slot 2 of 3 is the target's token.
    assert accepted(engine_rounds(drafts, ids, 2, 8, budget_end=3 + 64, stop={EOS})) == [2, 1]
    # llama-server: first round at the first generated token (anchor 3), as tau's first cycle.
    assert accepted(engine_rounds(drafts[1:], ids, 3, 8, budget_end=3 + 64, stop={EOS})) == [3]


def test_an_end_token_in_the_last_drafted_slot_counts_as_accepted():
    ids = torch.tensor([10, 11, 12, 20, 21, EOS])
    assert accepted(engine_rounds(rows([21, EOS], [0, 0], [0, 0]), ids, 3, 6, budget_end=3 + 64, stop={EOS})) == [2]
    assert accepted(engine_rounds(rows([21, EOS, 7], [0, 0, 0], [0, 0, 0]), ids, 3, 6, budget_end=3 + 64,
                                  stop={EOS})) == [1]
    assert accepted(engine_rounds(rows([7, 7, 7], [EOS, 0, 0], [0, 0, 0]), ids, 3, 6, budget_end=3 + 64,
                                  stop={EOS})) == [0, 0]


def test_the_budget_cuts_the_draft_and_a_step_without_room_is_no_round():
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23])  # a budget of 4 tokens, no EOS
    assert accepted(engine_rounds(rows([21, 22, 99], [0] * 3, [0] * 3, [0] * 3), ids, 3, 7, budget_end=7,
                                  stop={EOS})) == [2]
    # anchor 3 has room for 2 drafts, anchor 4 for 1; anchor 5 has none: a plain decoding step, not a round
    drafts = rows([99] * 3, [22, 23, 0], [23, 0, 0], [0] * 3)
    assert engine_rounds(drafts, ids, 3, 7, budget_end=7, stop={EOS}) == [Round(0, 2), Round(1, 1)]
    assert accepted(engine_rounds(rows([99] * 3, [99] * 3, [23, 0, 0], [0] * 3), ids, 3, 7, budget_end=7,
                                  stop={EOS})) == [0, 0]


def test_the_confidence_cut_shortens_drafts_and_a_draft_cut_to_nothing_is_no_round():
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23, 24, EOS])
    drafts = rows([20, 21, 22], [0] * 3, [0] * 3, [0] * 3, [24, EOS, 0], [0] * 3, [0] * 3)
    # No cut: anchor 2 accepts all 3; at anchor 6 the confirmed EOS in slot 2 of 3 is the target's.
    assert engine_rounds(drafts, ids, 2, 9, budget_end=3 + 64, stop={EOS}) == [Round(3, 3), Round(1, 3)]
    # Cut to 2 at anchor 2 (22 becomes the target's); anchor 5's draft is cut to nothing, a plain
    # decoding step; anchor 6's cut to 2 puts EOS in the last verified slot, where it counts.
    served = torch.tensor([2, 3, 3, 0, 2, 3, 3])
    assert engine_rounds(drafts, ids, 2, 9, budget_end=3 + 64, stop={EOS}, served=served) == [Round(2, 2), Round(2, 2)]


def test_mean_accept_length_is_pooled():
    count = EngineCount(rounds=[[2, 1], [0, 0, 3]])
    assert count.mean_accept_length == 1 + 6 / 5
    assert EngineCount().as_dict()["mean_accept_length"] is None


# vLLM's rounds (dflash_ds/eval/vllm_count.py): first round at the first generated token, all K drafts
# verified, acceptance counted before the stop check and the budget.

def test_vllm_counts_a_confirmed_end_token_and_the_target_past_it():
    from dflash_ds.eval.vllm_count import NeedsMoreTokens, vllm_rounds

    ids = torch.tensor([10, 11, 12, 20, 21, 22, EOS])  # prompt of 3, response 20 .. EOS
    # anchor 3 accepts 21, 22, EOS (llama.cpp would stop at EOS, not in the last slot); its fourth draft
    # is compared with the target's token past the end, which the caller supplies
    drafts = rows([21, 22, EOS, 40], [0] * 4, [0] * 4)
    with pytest.raises(NeedsMoreTokens) as e:
        vllm_rounds(drafts, ids, 3, 3 + 64, stop={EOS})
    assert e.value.length == 8
    past = torch.cat([ids, torch.tensor([40, 41])])
    assert vllm_rounds(drafts, past, 3, 3 + 64, stop={EOS}) == [Round(4, 4)]
    assert vllm_rounds(drafts, torch.cat([ids, torch.tensor([41, 41])]), 3, 3 + 64, stop={EOS}) == [Round(3, 4)]
    # no match at anchor 3; anchor 4 accepts 22 and EOS, which ends the request (its third draft meets 40)
    drafts = rows([9, 9, 9, 9], [22, EOS, 0, 0], [0] * 4)
    assert vllm_rounds(drafts, past, 3, 3 + 64, stop={EOS}) == [Round(0, 4), Round(2, 4)]
    # the first generated token is a stop: no draft at all
    assert vllm_rounds(drafts, torch.tensor([10, 11, 12, EOS]), 3, 3 + 64, stop={EOS}) == []


def test_vllm_verifies_all_k_drafts_at_the_budget():
    from dflash_ds.eval.vllm_count import VllmCounts, vllm_rounds

    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23, 24, 25])  # budget 4: the response is 20 .. 23
    drafts = rows([21, 22, 23, 24], [0] * 4, [0] * 4)
    # llama.cpp would draft 2 there; vLLM verifies and counts all 4 (tokens 24 and 25 are past the budget)
    assert vllm_rounds(drafts, ids, 3, 7, stop={EOS}) == [Round(4, 4)]
    # anchor 3 accepts 21; anchor 5 accepts 23 (the budget's last token) and 24 past it
    drafts = rows([21, 9, 9, 9], [0] * 4, [23, 24, 9, 9], [0] * 4)
    assert vllm_rounds(drafts, ids, 3, 7, stop={EOS}) == [Round(1, 4), Round(2, 4)]
    count = VllmCounts(num_speculative_tokens=4, rounds=[[1, 3], [0, 4, 2]])
    assert (count.num_drafts, count.num_accepted, count.per_position) == (5, 10, [4, 3, 2, 1])
    assert count.mean_accept_length == 1 + 10 / 5
