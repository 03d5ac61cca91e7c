"""recipes/tiny-lilicorr.yaml end to end through the real `deepspeed` launcher on gloo: the target rank
sends its final-norm states beside the taps (the penalty reads the target's logits at the candidates),
the split run's losses equal the single-process reference, the lattice's fields are logged, and the
export is the LiLiCorr drafter the engines' readers load, with tau reported after training."""

from __future__ import annotations

import json

import pytest

from dflash_ds.metrics import read_metrics

from .launch_util import launch, output
from .reference import recipe_reference_losses

pytestmark = pytest.mark.launcher

RECIPE = "recipes/tiny-lilicorr.yaml"
FAST = ["optim.max_steps=4", "log.every_steps=1", "eval.at_start=false", "log.progress=false",
        "data.num_eval=4", "eval.max_new_tokens=16"]


def reference(tmp_path):
    return recipe_reference_losses(RECIPE, FAST, tmp_path, steps=4)


def test_tiny_lilicorr_trains_split_exports_and_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(RECIPE, FAST + [f"run.output_dir={run_dir}"], procs=2, timeout=400)
    out = output(proc)
    assert proc.returncode == 0, out[-6000:]
    recs = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["loss"] for r in recs] == pytest.approx(reference(tmp_path / "ref"), rel=2e-4)
    last = recs[-1]
    for field in ("lilicorr_ce", "lilicorr_penalty", "lilicorr_selected_prefix", "lilicorr_oracle_prefix",
                  "lilicorr_logfactor_spread"):
        assert field in last, sorted(last)
    assert last["lilicorr_oracle_prefix"] >= last["lilicorr_selected_prefix"] >= 0
    assert last["lilicorr_ce"] > 0 and last["lilicorr_penalty"] >= 0
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert config["dflash_config"]["projector_type"] == "lilicorr", config["dflash_config"]
    assert "tau after training" in out and "acceptance by position" in out
