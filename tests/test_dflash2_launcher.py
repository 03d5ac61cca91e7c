"""recipes/tiny-dflash2.yaml end to end through the real `deepspeed` launcher on gloo: the split run's
losses equal the single-process reference (which trains the same selector term), the selector is
trained and logged, the export is a DFlash2 drafter the evaluator reads back, and tau is reported."""

from __future__ import annotations

import json

import pytest

from dflash_ds.metrics import read_metrics

from .launch_util import launch, output
from .reference import recipe_reference_losses

pytestmark = pytest.mark.launcher

RECIPE = "recipes/tiny-dflash2.yaml"
FAST = ["optim.max_steps=4", "log.every_steps=1", "eval.at_start=false", "log.progress=false",
        "data.num_eval=4", "eval.max_new_tokens=16", "objective.dflash2.selector_warmup_ratio=0.25",
        "objective.dflash2.selector_ramp_ratio=0.5"]


def reference(tmp_path, overrides):
    return recipe_reference_losses(RECIPE, FAST + overrides, tmp_path, steps=4)


def test_tiny_dflash2_trains_exports_and_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(RECIPE, FAST + [f"run.output_dir={run_dir}"], procs=2, timeout=400)
    out = output(proc)
    assert proc.returncode == 0, out[-6000:]
    recs = [r for r in read_metrics(run_dir) if "loss" in r]
    ref = reference(tmp_path / "ref", [])
    assert [r["loss"] for r in recs] == pytest.approx(ref, rel=2e-4)
    # The selector term changes training once its weight is on (warm-up: step 1 only).
    no_selector = reference(tmp_path / "ref0", ["objective.dflash2.selector_alpha=0"])
    assert ref[:2] == pytest.approx(no_selector[:2], rel=1e-6) and abs(ref[-1] - no_selector[-1]) > 1e-5
    assert all(r["selector_loss"] >= 0 and 0 <= r["selector_recall"] <= 1 for r in recs)
    assert recs[-1]["selector_loss"] > 0
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 10
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["is_causal"] is False
    assert "tau after training" in out and "acceptance by position" in out
    tau = [r for r in read_metrics(run_dir) if "tau" in r]
    assert tau and len(tau[-1]["tau_position_acceptance"]) == 7

    from dflash_ds.export import load_drafter
    drafter = load_drafter(run_dir / "export")
    assert drafter.config.architecture == "dflash2" and drafter.candidate_selector.successor_codebook.abs().sum() > 0


def test_gpu_bench_script_runs_its_toy_variant_on_cpu(tmp_path):
    """scripts/gpu_dflash2_bench.sh: usage errors exit 2; --cpu runs both bench commands (v1 and DFlash2 at the
    same anchors and block size) at toy size and writes the summary the GPU run writes."""
    import subprocess

    from .launch_util import ROOT, cpu_env

    bad = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh"], cwd=ROOT, env=cpu_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    bad = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh", str(tmp_path), "--gpus=2"], cwd=ROOT,
                         env=cpu_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gpus=2" in bad.stderr
    proc = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh", str(tmp_path), "--cpu"], cwd=ROOT, env=cpu_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["v1"]["architecture"] == "dflash" and summary["dflash2"]["architecture"] == "dflash2"
    assert summary["v1"]["anchors"] == summary["dflash2"]["anchors"] == 16
    assert summary["v1"]["block_size"] == summary["dflash2"]["block_size"] == 8
    assert summary["dflash2"]["drafter_params"] > summary["v1"]["drafter_params"]
    assert summary["dflash2_over_v1_tok_s"] == pytest.approx(summary["dflash2"]["tok_s"] / summary["v1"]["tok_s"])
