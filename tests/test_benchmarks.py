"""Benchmark sets by name, the per-benchmark table (CLI, model card, report) and the thinking setting."""

import json
from pathlib import Path

import pytest

from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.eval.benchmarks import BENCHMARKS, MATH_SUFFIX, load_conversations, parse_names, render_prompt
from dflash_ds.eval.benchmark_table import table_lines
from dflash_ds.eval.cli import main
from dflash_ds.export import save_drafter
from dflash_ds.export.card import add_benchmarks_to_card, model_card, trained_thinking
from tests.test_evaluate import make_tokenizer, world  # noqa: F401 - the module fixture


BENCH_DIR = Path(__file__).resolve().parents[1] / "assets" / "bench"


def test_every_set_loads_from_local_files_worded_as_the_hub_sets():
    convs = {name: load_conversations(name, str(BENCH_DIR)) for name in BENCHMARKS}
    first = json.loads((BENCH_DIR / "gsm8k.jsonl").read_text().splitlines()[0])
    assert convs["gsm8k"][0] == [first["question"] + MATH_SUFFIX]
    assert convs["math500"][1] == ["Solve for $x$: $3x + 5 = 20$." + MATH_SUFFIX]
    assert convs["humaneval"][0][0].startswith("Write a solution to the following problem")
    assert "def add(a: int, b: int) -> int:" in convs["humaneval"][0][0]
    assert convs["mbpp"][2] == ["Write a function to check whether a list is sorted in ascending order."]
    assert [len(c) for c in convs["mt_bench"]] == [2, 2, 2]  # both turns of every conversation
    assert all(len(c) == 1 for name in ("gsm8k", "math500", "humaneval", "mbpp") for c in convs[name])
    assert len(load_conversations("gsm8k", str(BENCH_DIR), 2)) == 2


def test_a_missing_or_malformed_set_fails_in_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        load_conversations("math500", str(tmp_path), setting="eval.bench_dir")
    msg = str(e.value)
    assert "\n" not in msg and "math500" in msg and "eval.bench_dir" in msg and "HuggingFaceH4/MATH-500" in msg
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"text": "no question field"}) + "\n")
    with pytest.raises(ValueError, match="record 0 .* no 'question'"):
        load_conversations("gsm8k", str(tmp_path))
    with pytest.raises(ValueError, match="unknown benchmark.*'gsm9k'"):
        parse_names("gsm8k,gsm9k")
    assert parse_names(" gsm8k , mt_bench,heldout") == ["gsm8k", "mt_bench", "heldout"]


def test_every_record_of_a_benchmark_set_is_checked_before_launch(tmp_path):
    from dflash_ds.config import load_recipe
    from dflash_ds.guard.launch import check_benchmarks

    good = json.dumps({"question": "What is 2 + 2?"})
    (tmp_path / "gsm8k.jsonl").write_text(good + "\n" + good + "\n" + json.dumps({"text": "no question"}) + "\n")
    r = load_recipe("recipes/tiny.yaml", ["eval.benchmarks=[gsm8k]", f"eval.bench_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"benchmark gsm8k: record 2 of .*gsm8k\.jsonl has no 'question'"):
        check_benchmarks(r)


@pytest.mark.parametrize("name, content, needle", [
    ("gsm8k.jsonl", b'{"question": "a"}\n{"question": "caf\xe9"}\n', ":2: bytes that are not UTF-8"),
    ("gsm8k.jsonl", b'{"question": "a"}\n{"question": \n', ":2: not valid JSON"),
    ("gsm8k.json", b'[{"question": "a"}, {"question": ]', ":1: not valid JSON"),
])
def test_an_unreadable_benchmark_file_is_named_with_its_set(tmp_path, capsys, name, content, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_conversations("gsm8k", str(tmp_path), setting="eval.bench_dir")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"benchmark gsm8k: {tmp_path / name}") and needle in msg, msg
    # The evaluator reads the sets before it loads any model (both folders exist, empty): the same line,
    # at once.
    (tmp_path / "no-target").mkdir()
    (tmp_path / "no-drafter").mkdir()
    assert main(["--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter"),
                 "--bench", "gsm8k", "--bench-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"benchmark gsm8k: {tmp_path / name}" in err and needle in err, err


def test_recipe_names_its_benchmarks_and_checks_them_before_launch(tmp_path):
    from dflash_ds.config import RecipeError, load_recipe
    from dflash_ds.guard.launch import check_benchmarks

    with pytest.raises(RecipeError, match="eval.benchmarks: unknown set"):
        load_recipe("recipes/tiny.yaml", ["eval.benchmarks=[gsm8k,aime]"])
    with pytest.raises(RecipeError, match="eval.top_p"):
        load_recipe("recipes/tiny.yaml", ["eval.top_p=0"])
    r = load_recipe("recipes/tiny.yaml", ["eval.benchmarks=[gsm8k,heldout]", f"eval.bench_dir={tmp_path}"])
    with pytest.raises(ValueError, match="benchmark gsm8k: no gsm8k.jsonl"):
        check_benchmarks(r)
    check_benchmarks(load_recipe("recipes/tiny.yaml", ["eval.benchmarks=[gsm8k,mt_bench]",
                                                       f"eval.bench_dir={BENCH_DIR}"]))


def test_prompts_render_with_the_thinking_setting():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("assets/tiny-target")
    msgs = [{"role": "user", "content": "hi"}]
    off, on = render_prompt(tok, msgs, False), render_prompt(tok, msgs, True)
    assert off != on
    assert tok.decode(off).endswith("<think>\n\n</think>\n\n") and not tok.decode(on).endswith("</think>\n\n")


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_cli_prints_one_row_per_set_and_setting_and_warns_on_thinking(world, tmp_path, capsys):
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    world["target"].float().save_pretrained(target_dir)
    world["target"].double()
    make_tokenizer(target_dir)
    save_drafter(world["drafter"], drafter_dir, card={"thinking": True})
    assert trained_thinking(drafter_dir) is True
    out = tmp_path / "rows.json"
    rc = main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--bench", "gsm8k,mt_bench",
               "--bench-dir", str(BENCH_DIR), "--limit", "2", "--max-new-tokens", "10", "--temperature", "1.0",
               "--top-k", "20", "--samples", "2", "--thinking", "off", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    warnings = [ln for ln in captured.err.splitlines() if "enable_thinking" in ln]
    assert len(warnings) == 1 and "enable_thinking=false" in warnings[0] and "enable_thinking=true" in warnings[0]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["bench"], r["sampling"]) for r in rows] == [
        ("gsm8k", "greedy"), ("gsm8k", "T=1 top_k=20"), ("mt_bench", "greedy"), ("mt_bench", "T=1 top_k=20")]
    # greedy: one response per prompt (mt_bench: per turn); sampled: --samples per prompt
    assert [r["responses"] for r in rows] == [2, 4, 4, 8]
    assert rows[0]["tau_expected"] is None and rows[1]["tau_expected"] is not None
    # greedy rows: the engines' counts of the same responses (at least one token a round); sampled rows none
    assert all(r["vllm"] >= 1 and r["llama_server"] >= 1 for r in rows if r["sampling"] == "greedy")
    assert all(r["vllm"] is None and r["llama_server"] is None for r in rows if r["sampling"] != "greedy")
    assert all(1.0 <= r["tau_mean"] <= 8 for r in rows)
    printed = captured.out.splitlines()
    assert printed[-len(rows) - 1:] == table_lines(rows)
    # The same thinking as in training: no warning.
    assert main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--bench", "gsm8k", "--bench-dir",
                 str(BENCH_DIR), "--limit", "1", "--max-new-tokens", "4"]) == 0
    assert "enable_thinking" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the argument's own check (dflash_ds/arguments.py): exit 2
        main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--bench", "gsm8k",
              "--bench-dir", str(tmp_path / "empty")])
    assert stop.value.code == 2
    assert "--bench-dir" in (err := capsys.readouterr().err) and "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--bench", "gsm8k",
                 "--bench-dir", str(tmp_path / "empty")]) == 2
    assert "benchmark gsm8k" in capsys.readouterr().err
    assert main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--bench", "heldout"]) == 2
    assert "--prompts" in capsys.readouterr().err
    # A prompts file with --temperature: its greedy row (the exact tau printed above it) and a sampled row.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"t{int(i)}" for i in p)}) for p in world["prompts"][:2]))
    assert main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--temperature", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["bench"], r["sampling"]) for r in result["rows"]] == [("prompts", "greedy"), ("prompts", "T=0.5")]
    assert result["rows"][0]["tau_mean"] == pytest.approx(result["tau_mean"])


def _row(bench, sampling, tau, engines=(None, None)):
    return {"bench": bench, "sampling": sampling, "tau_mean": tau, "tau_mean_se": 0.1, "tau_pooled": tau - 0.1,
            "tau_pooled_se": 0.05, "tau_expected": None, "tau_expected_se": None, "position_acceptance": [0.5, None],
            "responses": 4, "cycles": 9, "llama_server": engines[0], "vllm": engines[1]}


def test_model_card_states_thinking_and_holds_one_benchmark_table(tmp_path):
    from transformers import Qwen3Config

    from dflash_ds.config import DrafterConfig
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.network.shape import DrafterShape

    cfg = drafter_shape(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                               vocab_size=64),
                                   DrafterConfig(num_layers=1, block_size=4, mask_token_id=63, target_layer_ids=(1,)))
    card = model_card(cfg, thinking=False)
    assert "| chat template | `enable_thinking: false`" in card
    assert """--default-chat-template-kwargs '{"enable_thinking": false}'""" in card
    assert trained_thinking(tmp_path) is None
    export = save_drafter(DFlashDrafter(cfg), tmp_path / "export", card={"thinking": False})
    assert trained_thinking(export) is False
    add_benchmarks_to_card(export, [_row("gsm8k", "greedy", 3.2), _row("gsm8k", "T=1", 2.9)])
    assert "| gsm8k | greedy | 3.20 ± 0.10 | 3.10 ± 0.05 | - | - | 4 |" in (Path(export) / "README.md").read_text()
    # replaces the earlier table; a greedy row has the engines' counts, a sampled row none
    add_benchmarks_to_card(export, [_row("math500", "greedy", 2.7, (2.6, 2.8)), _row("math500", "T=1", 2.5)])
    text = (Path(export) / "README.md").read_text()
    assert text.count("## Acceptance by benchmark") == 1
    assert "| math500 | greedy | 2.70 ± 0.10 | 2.60 ± 0.05 | 2.60 | 2.80 | 4 | 1:0.50 2:- |" in text
    assert "| math500 | T=1 | 2.50 ± 0.10 | 2.40 ± 0.05 | - | - | 4 | 1:0.50 2:- |" in text and "gsm8k" not in text
    assert text.index("## Acceptance by benchmark") < text.index("## Serving")
    assert "| vLLM model runner | V1 or V2: vLLM's CPU build serves it too |" in text


def test_the_card_names_the_vllm_runner_an_export_needs():
    from dataclasses import replace

    from dflash_ds.export.card import vllm_runner_rows
    from tests.test_conformance import small_shape

    def row(shape):
        rows = vllm_runner_rows(shape, shape.spec.card(shape).serving)
        assert len(rows) == 1
        return rows[0]

    assert row(small_shape("dflash")) == "| vLLM model runner | V1 or V2: vLLM's CPU build serves it too |"
    mixed = replace(small_shape("dflash"), layer_types=("sliding_attention", "full_attention"), sliding_window=64)
    for shape, why in [(small_shape("dflash2"), "the DFlash2 candidate head"), (small_shape("dspark"), "DSpark drafting"),
                       (mixed, "drafter layers that mix sliding-window and full attention")]:
        assert row(shape).startswith(f"| vLLM model runner | Model Runner V2 (GPU) for {why}; the V1 runner"), row(shape)
    # all layers sliding: one KV group, which the V1 runner serves
    slid = replace(small_shape("dflash"), layer_types=("sliding_attention",) * 2, sliding_window=64)
    assert "V1 or V2" in row(slid)


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_report_shows_the_benchmark_table(tmp_path):
    pytest.importorskip("matplotlib")
    from dflash_ds.report import write_report

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "tau": 1.0, "tau_pooled": 1.0, "tau_histogram": [3, 0], "tau_position_acceptance": [0.0],
         "eval": "before training"},
        {"step": 10, "loss": 2.0, "accept_proxy": 0.5, "lr": 1e-3, "tok_per_s": 100.0}]) + "\n")
    page = write_report(tmp_path).read_text()
    assert "Acceptance by benchmark" not in page
    (tmp_path / "benchmarks.json").write_text(json.dumps([_row("humaneval", "T=0.7 top_p=0.95", 2.75)]))
    page = write_report(tmp_path).read_text()
    assert "Acceptance by benchmark" in page and "humaneval" in page and "2.750 &plusmn; 0.100" in page


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_after_training_writes_the_table_into_the_run_the_card_and_the_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from dflash_ds.config import load_recipe
    from dflash_ds.eval.benchmark_table import after_training
    from dflash_ds.export.card import card_info
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.resolve.run import resolve_run

    recipe = load_recipe("recipes/tiny.yaml", [f"run.output_dir={tmp_path}", "eval.benchmarks=[gsm8k,mt_bench]",
                                               f"eval.bench_dir={BENCH_DIR}", "eval.bench_limit=1",
                                               "eval.max_new_tokens=6", "eval.samples=2"])
    spec = resolve_run(recipe, world_size=2)
    save_drafter(DFlashDrafter(spec.drafter), tmp_path / "export", card=card_info(recipe, 0))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3, "tok_per_s": 1.0}) + "\n")
    assert after_training(recipe) == 0
    from dflash_ds.report import finish_run

    finish_run(tmp_path, None)  # as train.py does next: the report again, the card kept
    rows = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [(r["bench"], r["sampling"], r["responses"]) for r in rows] == [
        ("gsm8k", "greedy", 1), ("gsm8k", "T=1", 2), ("mt_bench", "greedy", 2), ("mt_bench", "T=1", 4)]
    out = capsys.readouterr().err
    assert "enable_thinking=false" in out and out.count("[dflash] gsm8k") == 2
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| mt_bench | T=1 |" in card and "`enable_thinking: false`" in card
    assert "Acceptance by benchmark" in (tmp_path / "report" / "index.html").read_text()
