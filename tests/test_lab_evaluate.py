"""The lab's one-process evaluation (lab/evaluate.py) against the per-run path it replaces: the
same benchmark rows as `python -m dflash_ds.eval.benchmark_table` and the same held-out and in-domain
reports as `python -m dflash_ds.eval --prompts ... --out`, for three drafters (two of one seed, one of
another) measured against one target loaded once, breadth first, with every response generated once;
and a time box that stops between parts and is resumed by the same call."""

import json
from pathlib import Path

import pytest

from .test_benchmark_batch import ROOT, _recipe

pytestmark = pytest.mark.integration  # a tiny target and drafters saved here, run in process (README, "Tests")

SEEDS = {"a": (0, 0), "b": (0, 1), "c": (1, 2)}  # name: (run.seed, drafter init seed)


def _lab(tmp_path) -> tuple[Path, dict]:
    lab = tmp_path / "lab"
    chats = (ROOT / "assets" / "tiny_chat.jsonl").read_text().splitlines()
    (lab / "conversations" / "bench").mkdir(parents=True)
    (lab / "conversations" / "bench" / "heldout.jsonl").write_text("\n".join(chats[:4]) + "\n")
    (lab / "conversations" / "indomain.jsonl").write_text("\n".join(chats[4:8]) + "\n")
    recipes = {}
    for name, (seed, init) in SEEDS.items():
        run_dir = lab / "runs" / name
        run_dir.mkdir(parents=True)
        recipe = _recipe(run_dir, f"run.seed={seed}")
        _export(run_dir, recipe, init)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3, "tok_per_s": 1.0}) + "\n")
        (run_dir / ".lab_trained").touch()
        recipes[name] = recipe
    return lab, recipes


def _export(run_dir, recipe, init):
    """A drafter of random weights drawn from seed `init`, exported as training would."""
    import torch

    from dflash_ds.export import save_drafter
    from dflash_ds.export.card import card_info
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.resolve.run import resolve_run

    torch.manual_seed(init)
    save_drafter(DFlashDrafter(resolve_run(recipe, world_size=2).drafter), run_dir / "export", card=card_info(recipe, 0))


def test_one_process_evaluation_equals_the_per_run_path_and_generates_each_response_once(tmp_path, monkeypatch):
    from dflash_ds.eval import batched, benchmark_table
    from dflash_ds.eval.cli import main as eval_main
    from lab.evaluate import evaluate_recipes

    lab, recipes = _lab(tmp_path)
    reference = {}
    for name, recipe in recipes.items():
        run_dir = lab / "runs" / name
        reference[name] = {"rows": benchmark_table.run_recipe(recipe)}
        (run_dir / "benchmarks.partial.json").unlink()
        for prompts, report in (("bench/heldout.jsonl", "heldout"), ("indomain.jsonl", "indomain")):
            path = tmp_path / f"ref-{name}-{report}.json"
            assert eval_main(["--target", str(recipe.target.path), "--drafter", str(run_dir / "export"),
                              "--prompts", str(lab / "conversations" / prompts), "--limit", "3", "--max-new-tokens", "10",
                              "--chat-template-kwargs", '{"enable_thinking": false}', "--out", str(path)]) == 0
            reference[name][report] = json.loads(path.read_text())
    # the drafters differ: otherwise sharing could not be told from measuring one drafter three times
    assert reference["a"]["rows"] != reference["b"]["rows"]

    made = []
    real = batched.batched_continuations
    monkeypatch.setattr(batched, "batched_continuations", lambda target, prompts, **kw: made.append(len(prompts)) or
                        real(target, prompts, **kw))
    from lab import evaluate as lab_evaluate

    parts = []
    real_do = lab_evaluate._Run.do
    monkeypatch.setattr(lab_evaluate._Run, "do", lambda run, part, shared: parts.append((run.name, part)) or
                        real_do(run, part, shared))
    got = evaluate_recipes(recipes, out=tmp_path / "out", lab_dir=str(lab), log=lambda msg: None)
    assert got["evaluated"] == ["a", "b", "c"] and got["unfinished"] == [] and got["untrained"] == []
    # breadth first: a part of every run before the next part of any (a cut leaves them all alike)
    assert parts[:9] == [(n, p) for p in ("row", "heldout", "indomain") for n in "abc"]
    assert parts[9:] == [(n, "row") for _ in range(3) for n in "abc"]  # the table's other 3 rows, one a pass
    for name in recipes:
        run_dir = lab / "runs" / name
        assert json.loads((run_dir / "benchmarks.json").read_text()) == reference[name]["rows"]
        for report, file in (("heldout", "lab_eval.json"), ("indomain", "lab_eval_indomain.json")):
            mine, ref = json.loads((run_dir / file).read_text()), reference[name][report]
            assert ref["num_responses"] == 3 and ref["cycles"]
            assert {k: v for k, v in mine.items() if k != "drafter"} == {k: v for k, v in ref.items() if k != "drafter"}
        summary = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert summary["benchmarks_complete"] is True and summary["eval_s"] > 0
        assert summary["heldout_greedy"]["tau_mean"] == reference[name]["heldout"]["tau_mean"]
    # Every response once. Run a: its table's 27 (3 prompts + 3 two-turn conversations, greedy once and
    # twice sampled at T = 1) and 3 + 3 greedy held-out and in-domain ones; run b (a's seed): none; run c
    # (another seed): its 18 sampled ones only. Apart, the three runs generate 99.
    assert got["responses_generated"] == sum(made) == 27 + 6 + 18, made


def test_the_box_stops_between_parts_and_the_same_call_resumes(tmp_path):
    from lab.evaluate import evaluate_recipes

    lab, recipes = _lab(tmp_path)
    recipes.pop("c")
    (lab / "runs" / "b" / ".lab_trained").unlink()
    got = evaluate_recipes(recipes, out=tmp_path / "out", lab_dir=str(lab), seconds=0, log=lambda msg: None)
    assert got["evaluated"] == [] and got["unfinished"] == ["a"] and got["untrained"] == ["b"]
    run_dir = lab / "runs" / "a"
    assert not (run_dir / "benchmarks.json").exists() and not (run_dir / "lab_eval.json").exists()
    assert json.loads((tmp_path / "out" / "a.json").read_text())["benchmarks_complete"] is False
    got = evaluate_recipes(recipes, out=tmp_path / "out", lab_dir=str(lab), log=lambda msg: None)
    assert got["evaluated"] == ["a"]
    assert (run_dir / "benchmarks.json").is_file() and (run_dir / "lab_eval_indomain.json").is_file()
    assert json.loads((tmp_path / "out" / "a.json").read_text())["benchmarks_complete"] is True
