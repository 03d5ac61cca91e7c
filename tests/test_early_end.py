"""Ending a run early, annealed (dflash_ds/runtime/stopping.py): the plateau rule, the cooldown's learning
rate, the time box, the recipe checks, and a colocated two-rank run through the launcher that plateaus,
cools down, ends, exports, and measures the training rows beside the held-out prompts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.metrics import read_metrics
from dflash_ds.resolve.plan import Cooldown, Plan, lr_factor
from dflash_ds.runtime import stopping
from dflash_ds.runtime.stopping import EarlyEnd, Plateau

from .launch_util import launch, output

TINY = "recipes/tiny.yaml"


@pytest.mark.unit
def test_the_plateau_waits_for_evaluations_without_a_rise():
    p = Plateau(patience=2, delta=0.05)
    # two-evaluation means 1.0, 1.25, 1.75, 2.01 (each a rise), then 2.025 and 2.02: the second ends it
    assert [p.add(t) for t in (1.0, 1.5, 2.0, 2.02, 2.03, 2.01)] == [False] * 5 + [True]
    assert p.best == pytest.approx(2.01)
    q = Plateau(patience=2, delta=0.05)
    assert not any(q.add(t) for t in (1.0, 1.2, 1.4, 1.6, 1.8))  # steady progress never plateaus
    assert Plateau(patience=0, delta=0.0).add(1.0) is False  # off


@pytest.mark.unit
def test_the_cooldown_falls_linearly_from_where_it_starts_to_the_floor():
    plan = Plan(layout=None, rows_per_micro=1, grad_accum=1, seq_len=8, num_rows=8, steps_per_epoch=8,
                total_steps=100, warmup_steps=10, schedule="cosine")
    c = Cooldown()
    before = [lr_factor(s, plan, 0.1, c) for s in range(100)]
    assert before == [lr_factor(s, plan, 0.1) for s in range(100)]  # unset: the plan's schedule
    c.start, c.steps = 40, 4
    base = lr_factor(40, plan, 0.1)
    got = [lr_factor(s, plan, 0.1, c) for s in range(38, 46)]
    assert got[:2] == before[38:40]
    assert got[2:6] == pytest.approx([base - (base - 0.1) * k / 4 for k in (1, 2, 3, 4)])
    assert got[6:] == pytest.approx([0.1, 0.1])
    assert c.end == 44


def early(monkeypatch, **settings):
    monkeypatch.setattr(stopping.dist, "all_reduce", lambda t, **kw: None)  # one rank: the lead's own flag
    recipe = SimpleNamespace(optim=SimpleNamespace(cooldown_ratio=settings.get("ratio", 0.25),
                                                   max_seconds=settings.get("max_seconds")),
                             eval=SimpleNamespace(plateau_evals=settings.get("patience", 0), plateau_delta=0.01))
    return EarlyEnd(recipe, 1000, Cooldown(), group=None, device="cpu", lead=True)


@pytest.mark.unit
def test_the_time_box_starts_the_cooldown_while_it_still_fits(monkeypatch):
    e = early(monkeypatch, max_seconds=100.0, ratio=0.25)
    assert e.decide(100, 79.0) is None  # 79 s run + 25% of it to cool down still fits in 100
    rec = e.decide(200, 80.5)
    assert rec == {"step": 200, "early_end": "time box", "cooldown_steps": 50, "end_step": 250}
    assert e.end_step == 250 and e.decide(210, 90.0) is None  # decided once


@pytest.mark.unit
def test_a_resumed_run_keeps_its_evaluations_and_its_cooldown(monkeypatch, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = [{"step": 10, "eval": "periodic", "tau": 2.0}, {"step": 20, "eval": "periodic", "tau": 2.0},
            {"step": 20, "early_end": "plateau", "cooldown_steps": 5, "end_step": 25},
            {"step": 30, "eval": "periodic", "tau": 9.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    e = early(monkeypatch, patience=3)
    e.resume(metrics, 22)
    assert e.plateau.taus == [2.0, 2.0] and e.end_step == 25 and e.reason == "plateau"


@pytest.mark.unit
def test_the_recipe_checks_of_an_early_end():
    with pytest.raises(RecipeError, match="eval.plateau_evals needs topology.colocated"):
        load_recipe(TINY, ["eval.plateau_evals=2", "eval.every_steps=5"])
    with pytest.raises(RecipeError, match="set eval.every_steps too"):
        load_recipe(TINY, ["eval.plateau_evals=2", "topology.colocated=true", "topology.targets_per_node=0"])
    with pytest.raises(RecipeError, match="optim.cooldown_ratio must be in"):
        load_recipe(TINY, ["optim.cooldown_ratio=1.0"])
    with pytest.raises(RecipeError, match="optim.max_seconds must be > 0"):
        load_recipe(TINY, ["optim.max_seconds=-3"])


@pytest.mark.launcher
def test_a_colocated_run_plateaus_cools_down_and_ends_with_its_export(tmp_path):
    """plateau_delta so large that no evaluation counts as progress: the plateau at the second
    evaluation (step 4), a cooldown of half the steps run (2), the end at step 6 of 20 planned."""
    run = tmp_path / "run"
    proc = launch(TINY, [f"run.output_dir={run}", "topology.colocated=true", "topology.targets_per_node=0",
                         "topology.drafters_per_node=2", "optim.max_steps=20", "log.every_steps=1",
                         "log.progress=false", "eval.at_start=false", "eval.every_steps=2", "eval.plateau_evals=1",
                         "eval.plateau_delta=100", "optim.cooldown_ratio=0.5", "eval.train_probe=6",
                         "eval.max_new_tokens=16", "checkpoint.every_steps=100"], procs=2)
    assert proc.returncode == 0, output(proc)[-4000:]
    recs = read_metrics(run)
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == list(range(1, 7))
    end = [{k: v for k, v in r.items() if k != "time"} for r in recs if "early_end" in r]
    assert len(end) == 1 and end[0].pop("plateau_best_tau") >= 1.0
    cooled = end[0].pop("lr")
    assert end == [{"step": 4, "early_end": "plateau", "cooldown_steps": 2, "end_step": 6}]
    lrs = {r["step"]: r["lr"] for r in recs if "loss" in r}
    # each record names the next step's rate: the plan's for step 5 at step 4's record, then the cooldown's
    # (its record: half of it for step 5; the floor, min_lr_ratio 0, for step 6)
    assert cooled == pytest.approx(lrs[4] / 2) and lrs[5] == 0.0
    periodic = [r for r in recs if r.get("eval") == "periodic"]
    assert [r["step"] for r in periodic] == [2, 4]
    assert all(r["train_responses"] == 6 and r["train_tau"] >= 1.0 for r in periodic)
    assert any(r.get("eval") == "after training" and r["step"] == 6 for r in recs)
    assert (run / "export" / "config.json").is_file()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 6
