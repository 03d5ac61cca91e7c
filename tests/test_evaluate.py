"""Exact offline tau (docs/algorithm.md section 7) against the reference speculative-decoding loop, on a tiny Qwen3.

The drafter is trained here, single-process, with the objective's own functions on the target's
greedy continuations, so cycles that accept several drafts occur and the walk is exercised
beyond a(t) = 0.
"""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ds.config import DrafterConfig
from dflash_ds.eval.cli import main, read_prompts
from dflash_ds.eval.generate import greedy_continuation, offline_tau, target_taps
from dflash_ds.eval.specdec import draft_block, speculative_generate
from dflash_ds.eval.tau import TauReport, accept_lengths, walk
from dflash_ds.export import save_drafter
from dflash_ds.network.attention import build_mask
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import block_inputs, block_targets, sample_anchors
from dflash_ds.objective.loss import ChunkedLoss
from dflash_ds.objective.loss_terms import CrossEntropy
from dflash_ds.resolve.drafter import drafter_shape


VOCAB, MASK, B, LAYER_IDS, PROMPT_LEN, NEW = 128, 127, 8, [1, 3], 6, 40


def test_walk_on_hand_made_accept_lengths():
    # a(t) for t = first .. end-1; cycles written out by hand.
    assert walk([0, 0, 0, 0, 0, 0], 10, 16) == [1, 1, 1, 1, 1]
    # t=0 accepts 3 (4 tokens) -> t=4 accepts 2 -> t=7 -> t=8 -> stop at t=9 = end-1.
    assert walk([3, 0, 0, 0, 2, 0, 0, 0, 0, 0], 0, 10) == [4, 3, 1, 1]
    # Values at positions the walk jumps over do not matter.
    assert walk([1, 99, 0, 0], 5, 9) == [2, 1]
    # Capped so the cycle's last token (the target's own) is still inside the response.
    assert walk([7, 7, 7, 7, 7], 0, 5) == [4]
    assert walk([2, 7, 7, 7, 7, 7], 20, 26) == [3, 2]
    # A one-token response has no cycle.
    assert walk([5], 3, 4) == []
    assert walk([], 3, 3) == []
    with pytest.raises(ValueError, match="every t"):
        walk([0, 0], 0, 3)


def test_tau_report_aggregates_like_zlab():
    report = TauReport(block_size=8, cycles=[[4, 3, 1, 1], [1, 1], []])
    assert report.per_response == [2.25, 1.0, None]
    assert report.tau_mean == pytest.approx((2.25 + 1.0) / 2)
    assert report.tau_pooled == pytest.approx(11 / 6)
    assert report.histogram == [4, 0, 1, 1, 0, 0, 0, 0]
    d = json.loads(json.dumps(report.as_dict()))
    assert d["num_cycles"] == 6 and d["num_tokens"] == 11 and d["tau_per_response"] == [2.25, 1.0, None]
    assert TauReport(block_size=4, cycles=[[]]).as_dict()["tau_mean"] is None


def test_position_acceptance_hand_worked():
    # B = 4 (draft slots 1..3). Response 1 emits 3, 1, 2 tokens per cycle: cycle 1 accepts slots 1, 2
    # and rejects 3; cycle 2 rejects slot 1; cycle 3 is its response's last (cut by the end): accepts
    # slot 1, slot 2 unobserved. Response 2 emits 4, 1: cycle 1 accepts slots 1-3 (no rejection
    # possible); its last cycle accepts nothing and observes nothing.
    report = TauReport(block_size=4, cycles=[[3, 1, 2], [4, 1]])
    reached, accepted = report.position_counts()
    assert reached == [4, 2, 2] and accepted == [3, 2, 1]
    assert report.position_acceptance == pytest.approx([0.75, 1.0, 0.5])
    assert report.histogram == [2, 1, 1, 1]
    assert report.position_line().endswith("1:0.75 2:1.00 3:0.50")
    # A slot no cycle reached has no rate (not 0); a response's only cycle is censored.
    sparse = TauReport(block_size=4, cycles=[[1, 1], [2]])
    assert sparse.position_acceptance == [pytest.approx(0.5), None, None]
    assert sparse.position_line().endswith("1:0.50 2:- 3:-")
    rec = json.loads(json.dumps(report.metrics_record()))
    assert rec["tau_position_acceptance"] == pytest.approx([0.75, 1.0, 0.5])
    assert rec["tau_accept_pos_3"] == pytest.approx(0.5) and rec["tau_histogram"] == [2, 1, 1, 1]
    assert report.as_dict()["position_reached"] == [4, 2, 2]


def tiny_target():
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=1e6, tie_word_embeddings=False)
    # float64 keeps argmax ties out of the exact comparisons between differently shaped passes.
    return Qwen3ForCausalLM(cfg).double().eval().requires_grad_(False)


def train_drafter(target, sequences, steps, seed=0):
    """Plain single-process training with the objective's functions (dense mask, AdamW)."""
    cfg = drafter_shape(target.config, DrafterConfig(num_layers=2, block_size=B, mask_token_id=MASK,
                                                                target_layer_ids=LAYER_IDS))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).double()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    x = torch.stack(sequences)
    taps = torch.stack([target_taps(target, s, LAYER_IDS) for s in sequences])
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    doc_ids = torch.zeros_like(x, dtype=torch.int32)
    positions = torch.arange(x.shape[1]).expand_as(x)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        anchors, valid = sample_anchors(loss_mask, doc_ids, 24, gen)
        block_ids, block_pos = block_inputs(x, positions, anchors, B, mask_token_id=MASK)
        labels, weights = block_targets(x, loss_mask, doc_ids, anchors, valid=valid, block_size=B, gamma=None)
        mask = build_mask(anchors, valid, doc_ids, B, kind="dense")
        hidden = drafter(embed[block_ids], drafter.fuse(taps), block_pos, positions, mask=mask)
        out = ChunkedLoss([CrossEntropy()], head, chunks=2).blocks(hidden, labels, weights, weights.sum())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)



@pytest.fixture(scope="module")
def world():
    target = tiny_target()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120, (PROMPT_LEN,), generator=gen) for _ in range(6)]
    trained_on = prompts[:4]  # the last two are unseen: the drafter accepts less there
    sequences = [greedy_continuation(target, p, max_new_tokens=NEW) for p in trained_on]
    assert all(s.numel() == PROMPT_LEN + NEW for s in sequences)  # no EOS in this tiny model
    untrained = train_drafter(target, sequences, steps=0)
    drafter = train_drafter(target, sequences, steps=100)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    return dict(target=target, prompts=prompts, trained_on=trained_on, sequences=sequences, drafter=drafter,
                untrained=untrained, embed=embed, head=head, model=DraftModel(drafter, embed, head))


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_objective_learns_offline_tau_above_3(world):
    w = world
    args = (w["target"],)
    before = offline_tau(*args, DraftModel(w["untrained"], w["embed"], w["head"]), w["trained_on"], max_new_tokens=NEW)
    sequences = []
    after = offline_tau(*args, w["model"], w["trained_on"], max_new_tokens=NEW, sequences=sequences)
    assert [s.tolist() for s in sequences] == [s.tolist() for s in w["sequences"]]
    assert before.tau_mean < 1.5
    assert after.tau_mean > 3.0
    assert all(sum(c) == NEW - 1 for c in after.cycles)  # the walk covers each response exactly


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_accept_lengths_match_one_block_at_a_time(world):
    """The batched, chunked forward with build_mask equals drafting each anchor on its own."""
    w = world
    x = w["sequences"][1]
    taps = target_taps(w["target"], x, LAYER_IDS)
    end = x.numel()
    a = accept_lengths(w["model"], taps, x, PROMPT_LEN, end=end, batch_anchors=7)
    expected = []
    for t in range(PROMPT_LEN, end):
        drafts = draft_block(w["model"], taps[:t], int(x[t]))
        n = 0
        while n < B - 1 and t + n + 1 < end and int(drafts[n]) == int(x[t + n + 1]):
            n += 1
        expected.append(max(0, min(n, end - t - 2)))
    assert a.tolist() == expected
    assert max(expected) >= 3  # the comparison covers multi-token acceptance


def online_equals_offline(w, prompts, max_new_tokens, eos_token_id=None):
    sequences = []
    report = offline_tau(w["target"], w["model"], prompts, max_new_tokens=max_new_tokens,
                         eos_token_id=eos_token_id, sequences=sequences)
    for prompt, x, cycles in zip(prompts, sequences, report.cycles):
        ids, counts = speculative_generate(w["target"], w["model"], prompt, max_new_tokens=max_new_tokens,
                                           eos_token_id=eos_token_id)
        assert ids.tolist() == x[prompt.numel():].tolist()  # x is HF greedy generate's output
        assert counts == cycles
        assert sum(counts) == ids.numel() - 1
    return report, sequences


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_online_matches_offline_at_budget_and_eos(world):
    # A budget that ends responses inside accepted runs.
    report, sequences = online_equals_offline(world, world["prompts"], 13)
    assert all(s.numel() - p.numel() == 13 for s, p in zip(sequences, world["prompts"]))
    # An EOS token taken from the middle of a memorised response: both paths stop right after it.
    x = world["sequences"][2]
    response = x[PROMPT_LEN:].tolist()
    k = next(i for i in range(8, len(response)) if response[i] not in response[:i])
    eos = response[k]
    report, sequences = online_equals_offline(world, world["prompts"], NEW, eos_token_id=eos)
    assert sequences[2].tolist() == x[:PROMPT_LEN + k + 1].tolist()
    assert sum(report.cycles[2]) == k


def make_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(125)}
    vocab.update({"user": 125, "assistant": 126, "[M]": 127})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(path)
    return fast


def test_read_prompts_renders_messages_and_prompts(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t9"}]}),
        json.dumps({"prompt": "t1 t2 t3"}),
        "",
        json.dumps({"prompt": "t4"}),
    ]))
    assert read_prompts(str(f), tok) == [[125, 5, 6, 126], [1, 2, 3], [4]]
    assert read_prompts(str(f), tok, limit=1) == [[125, 5, 6, 126]]
    f.write_text(json.dumps({"text": "t1"}))
    with pytest.raises(ValueError, match="'messages' list or a 'prompt' string"):
        read_prompts(str(f), tok)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_cli_reports_tau_and_names_bad_flags(world, tmp_path, capsys):
    from dflash_ds.export import load_drafter

    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    world["target"].float().save_pretrained(target_dir)
    world["target"].double()
    make_tokenizer(target_dir)
    save_drafter(world["drafter"], drafter_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{int(i)}" for i in p)})
                                 for p in world["prompts"][:3]))
    out = tmp_path / "tau.json"
    rc = main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts),
               "--max-new-tokens", "20", "--limit", "2", "--online", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_responses"] == 2 and result["online"]["responses_matching_offline"] == 2

    # The same numbers as offline_tau on the same (float32 target, bf16-exported drafter) objects.
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_drafter(drafter_dir).float()
    expected = offline_tau(target, DraftModel.from_target(drafter, target), world["prompts"][:2], max_new_tokens=20)
    assert result["cycles"] == expected.cycles
    assert result["tau_mean"] == pytest.approx(expected.tau_mean)
    assert f"tau_mean {expected.tau_mean:.3f}" in printed
    assert expected.position_line() in printed
    assert result["position_acceptance"] == [pytest.approx(p) if p is not None else None
                                             for p in expected.position_acceptance]
    # llama-server's rounds are tau's cycles less their bonus token, without the last cycle when it
    # has no room for a draft (a plain decoding step there; no EOS in this model, docs/algorithm.md 7.3).
    end = PROMPT_LEN + 20
    for cycles, rounds in zip(expected.cycles, result["llama_cpp"]["llama_server"]["rounds"]):
        starts = [PROMPT_LEN + sum(cycles[:i]) for i in range(len(cycles))]
        assert rounds == [c - 1 for c, t in zip(cycles, starts) if end - t - 2 > 0]
    assert len(result["llama_cpp"]["llama_speculative_simple"]["rounds"][0]) >= 1
    drafts = result["block_size"] - 1  # a cycle's most tokens, less the target's: llama.cpp's --spec-draft-n-max
    assert result["llama_cpp"]["spec_draft_n_max"] == drafts
    assert f"llama.cpp mean acc len (--spec-draft-n-max {drafts}): llama-server" in printed
    # vLLM's drafts are tau's cycles less their bonus token, but the last one verifies all its drafts past
    # the budget (docs/algorithm.md 7.4), so it accepts at least as many as the cycle kept.
    vllm = result["vllm"]
    for cycles, rounds in zip(expected.cycles, vllm["rounds"]):
        assert len(rounds) == len(cycles) and rounds[:-1] == [c - 1 for c in cycles[:-1]]
        assert rounds[-1] >= cycles[-1] - 1
    assert vllm["num_drafts"] == expected.num_cycles and vllm["num_speculative_tokens"] == drafts
    assert f"vLLM mean acceptance length (num_speculative_tokens {drafts}): {vllm['mean_accept_length']:.3f}" in printed

    # A target directory passed as the drafter, and an unreachable target.
    assert main(["--target", str(target_dir), "--drafter", str(target_dir), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "not a DFlash drafter export" in err
    missing = tmp_path / "no_such_model"
    assert main(["--target", str(missing), "--drafter", str(drafter_dir), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "--target" in err and str(missing) in err


def test_greedy_generation_leaves_compiled_target_kernels_alone():
    """Generation's many shapes must not use up the recompile budget of the target's fixed-shape
    compiled kernels (past it they stay eager for the training shape too)."""
    from dflash_ds.target_model.model import TapCapture, forward_taps

    from .test_target import tiny_qwen3

    torch._dynamo.reset()
    model = tiny_qwen3()
    calls = {"n": 0}

    def mlp(x, gate, up, down):
        calls["n"] += 1
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    compiled = torch.compile(mlp, backend="eager", dynamic=False)
    for layer in model.model.layers:
        layer.mlp.forward = lambda x, m=layer.mlp: compiled(x, m.gate_proj, m.up_proj, m.down_proj)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    plain = [greedy_continuation(model, torch.tensor([3, 4, 5][:n]), max_new_tokens=4, eos_token_id=[]) for n in (1, 2, 3)]
    assert calls["n"] > 0 and torch._dynamo.utils.counters["frames"]["ok"] == frames  # ran, never compiled
    # The training shape still compiles.
    out = torch.empty(1, 7, 32)
    forward_taps(model, TapCapture(model, [1]), torch.arange(7)[None], None, out=out)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames
    assert all(p.numel() == n + 4 for p, n in zip(plain, (1, 2, 3)))
    torch._dynamo.reset()
