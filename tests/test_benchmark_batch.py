"""The benchmark table's batched responses and resumable rows: the batched continuations against the
per-prompt references (greedy, and sampled under the per-response seeding rule), the table's rows
against the per-prompt Responder, and a table cut after a row resumed by a rerun."""

import json
from pathlib import Path

import pytest
import torch

from dflash_ds.eval.batched import ResponseKey, batched_continuations, response_generator, response_seed
from dflash_ds.eval.generate import greedy_continuation
from dflash_ds.eval.sampled import Sampling, sampled_continuation

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-target"
BENCH_DIR = str(ROOT / "assets" / "bench")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    chats = [json.loads(line)["messages"] for line in (ROOT / "assets" / "tiny_chat.jsonl").read_text().splitlines()]
    # First turns and, for variety of lengths, whole conversations up to a later user turn.
    convs = [c[:1] for c in chats[:6]] + [c[:3] for c in chats[6:10] if len(c) >= 3]
    prompts = [torch.tensor(tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                      add_special_tokens=False)["input_ids"]) for m in convs]
    assert len({p.numel() for p in prompts}) > 2  # left padding is exercised
    return target, prompts


@pytest.mark.parametrize("budget, eos", [(48, None), (9, None), (20, -1)])
def test_batched_greedy_continuations_equal_the_per_prompt_ones(tiny, budget, eos):
    target, prompts = tiny
    ref = [greedy_continuation(target, p, max_new_tokens=budget, eos_token_id=eos) for p in prompts]
    got = batched_continuations(target, prompts, max_new_tokens=budget, eos_token_id=eos)
    assert [x.tolist() for x in got] == [x.tolist() for x in ref]
    lengths = {x.numel() - p.numel() for x, p in zip(ref, prompts)}
    if budget == 48:  # some responses stop at their own EOS, before the budget, at different lengths
        assert max(lengths) <= budget and len(lengths) > 1 and min(lengths) < budget
    else:
        assert lengths == {budget}


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_p=0.9, top_k=20)])
def test_batched_sampled_continuations_equal_the_per_prompt_ones_under_the_seeding_rule(tiny, sampling):
    target, prompts = tiny
    keys = [ResponseKey(item=i, sample=s) for i in range(len(prompts)) for s in range(2)]
    ref = [sampled_continuation(target, prompts[k.item], sampling, response_generator(7, k), max_new_tokens=32)
           for k in keys]
    # A different batching and order of the same responses draws the same tokens.
    order = keys[::-1]
    got = batched_continuations(target, [prompts[k.item] for k in order], max_new_tokens=32, sampling=sampling,
                                generators=[response_generator(7, k) for k in order])
    assert [x.tolist() for x in got[::-1]] == [x.tolist() for x in ref]
    # The two samples of a prompt differ: each response has its own draws.
    assert any(ref[2 * i].tolist() != ref[2 * i + 1].tolist() for i in range(len(prompts)))
    with pytest.raises(ValueError, match="one generator per prompt"):
        batched_continuations(target, prompts, max_new_tokens=4, sampling=sampling, generators=None)


def test_response_seeds_are_deterministic_and_distinct():
    keys = [ResponseKey(item=i, sample=s, turn=t) for i in range(4) for s in range(3) for t in range(2)]
    seeds = [response_seed(seed, k) for seed in (0, 1) for k in keys]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2 ** 63 for s in seeds)
    assert response_seed(0, ResponseKey(item=1)) == response_seed(0, ResponseKey(item=1, sample=0, turn=0))
    # Neighbouring run seeds do not share a stream shifted by one sample.
    assert response_seed(1, ResponseKey(sample=0)) != response_seed(0, ResponseKey(sample=1))


def test_the_batch_setting_is_checked():
    from dflash_ds.config import RecipeError, load_recipe

    assert load_recipe("recipes/tiny.yaml", []).eval.bench_batch == 32
    with pytest.raises(RecipeError, match="eval.bench_batch must be >= 1"):
        load_recipe("recipes/tiny.yaml", ["eval.bench_batch=0"])


def _recipe(tmp_path, *extra):
    from dflash_ds.config import load_recipe

    return load_recipe("recipes/tiny.yaml", [f"run.output_dir={tmp_path}", "eval.benchmarks=[gsm8k,mt_bench]",
                                             f"eval.bench_dir={BENCH_DIR}", "eval.bench_limit=3",
                                             "eval.max_new_tokens=10", "eval.samples=2", *extra])


def _export(tmp_path, recipe):
    from dflash_ds.export import save_drafter
    from dflash_ds.export.card import card_info
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.resolve.run import resolve_run

    torch.manual_seed(0)
    save_drafter(DFlashDrafter(resolve_run(recipe, world_size=2).drafter), tmp_path / "export",
                 card=card_info(recipe, 0))


@pytest.mark.integration  # a tiny target and a drafter saved here, the table run in process (README, "Tests")
def test_the_batched_table_measures_what_the_per_prompt_responder_does(tmp_path):
    from dflash_ds.eval.benchmark_table import BenchOptions, Responder, bench_row, tau_on_conversations
    from dflash_ds.eval.benchmarks import load_conversations, render_prompt
    from dflash_ds.eval.loading import load_pair

    recipe = _recipe(tmp_path)
    _export(tmp_path, recipe)
    target, tokenizer, model = load_pair(recipe.target.path, str(tmp_path / "export"))
    convs = load_conversations("mt_bench", BENCH_DIR, 3)
    assert max(len(t) for t in convs) == 2  # later turns see the target's own earlier answers
    for sampling in (Sampling(), Sampling(1.0)):
        opts = BenchOptions(max_new_tokens=10, samples=2, seed=3, batch=4)  # 6 units: a full and a partial batch
        batched = tau_on_conversations(Responder(target, model, sampling, opts), tokenizer, convs)
        # The reference: one response at a time, conversation by conversation, with the same keys.
        one = Responder(target, model, sampling, opts)
        by_key = {}
        for c, turns in enumerate(convs):
            for s in range(one.samples):
                messages = []
                for t, turn in enumerate(turns):
                    messages.append({"role": "user", "content": turn})
                    before = len(one.result.report.cycles)
                    ids = one.respond(render_prompt(tokenizer, messages, False), ResponseKey(item=c, sample=s, turn=t))
                    by_key[(t, c, s)] = before
                    messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        # The batched path adds responses turn by turn: the reference's in that order.
        order = [by_key[k] for k in sorted(by_key)]
        assert batched.report.cycles == [one.result.report.cycles[i] for i in order]
        assert batched.slot_probs == [one.result.slot_probs[i] for i in order]
        # the same row; its means summed in another order may differ in the last bit
        a, b = bench_row("mt_bench", batched), bench_row("mt_bench", one.result)
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if not isinstance(v, float)} == {k: v for k, v in b.items() if not isinstance(v, float)}
        assert {k: v for k, v in a.items() if isinstance(v, float)} == pytest.approx(
            {k: v for k, v in b.items() if isinstance(v, float)}, rel=1e-12, abs=1e-15)
        assert batched.report.num_cycles > 0


@pytest.mark.integration  # a tiny target and a drafter saved here, the table run in process (README, "Tests")
def test_a_cut_table_resumes_after_its_last_row_and_the_lab_summary_reads_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from dflash_ds.eval import benchmark_table
    from dflash_ds.eval.table_progress import PARTIAL
    from lab.runs import summarize

    recipe = _recipe(tmp_path)
    _export(tmp_path, recipe)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3, "tok_per_s": 1.0}) + "\n")
    # A whole run first, in another directory holding the same export: the reference rows.
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    (whole_dir / "export").symlink_to(tmp_path / "export")
    whole = benchmark_table.run_recipe(_recipe(whole_dir))

    computed = []
    real_row = benchmark_table.bench_row

    def cut_after_three(name, result):
        if len(computed) == 3:
            raise KeyboardInterrupt  # the command's time limit
        computed.append((name, result.sampling.label))
        return real_row(name, result)

    monkeypatch.setattr(benchmark_table, "bench_row", cut_after_three)
    with pytest.raises(KeyboardInterrupt):
        benchmark_table.after_training(recipe)
    assert not (tmp_path / "benchmarks.json").exists()
    partial = json.loads((tmp_path / PARTIAL).read_text())
    assert partial["rows"] == whole[:3] and partial["settings"]["bench_limit"] == 3
    summary = summarize(tmp_path, "cut")
    assert summary["benchmarks"] == whole[:3] and summary["benchmarks_complete"] is False

    # A rerun with other settings starts over; with the same ones (another batch: no response changes)
    # it computes the last row only.
    assert benchmark_table.rows_done(tmp_path, benchmark_table.table_settings(_recipe(tmp_path, "eval.bench_limit=2"))) == {}
    spied = []
    monkeypatch.setattr(benchmark_table, "bench_row", lambda name, result: spied.append(name) or real_row(name, result))
    assert benchmark_table.after_training(_recipe(tmp_path, "eval.bench_batch=1")) == 0
    assert spied == ["mt_bench"]
    assert json.loads((tmp_path / "benchmarks.json").read_text()) == whole
    assert not (tmp_path / PARTIAL).exists()
    assert capsys.readouterr().err.count(f"(from {PARTIAL})") == 3
    summary = summarize(tmp_path, "whole")
    assert summary["benchmarks"] == whole and summary["benchmarks_complete"] is True
