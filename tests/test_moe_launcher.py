"""A tiny mixture-of-experts target (Qwen3.5-MoE layout: Gated DeltaNet + full attention, 4 experts,
top 2) end to end through the real `deepspeed` launcher on gloo: 1 drafter rank fed by 2 target ranks
that hold the target together (target.expert_parallel 2, 2 experts each) on packed rows. The losses
equal the single-process reference trained on the unsplit target, and the held-out continuations
(generated with both target ranks in lock-step) give a tau."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ds.config import load_recipe
from dflash_ds.metrics import read_metrics

from .launch_util import launch, output
from .test_make_random_target import script

pytestmark = pytest.mark.launcher

RECIPE = "recipes/tiny.yaml"
SPLIT = ["target.expert_parallel=2", "topology.targets_per_node=2", "optim.grad_accum=2", "optim.max_steps=3",
         "log.every_steps=1", "log.progress=false", "data.num_eval=4", "eval.max_new_tokens=12", "eval.benchmarks=[]"]


def reference(target_path, run_dir):
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.resolve.run import resolve_run
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model import moe
    from dflash_ds.target_model.model import embed_and_head, load_target

    from .reference import reference_losses

    recipe = load_recipe(RECIPE, SPLIT + [f"target.path={target_path}", f"run.output_dir={run_dir}"])
    data = load_training_data(recipe)
    spec = resolve_run(recipe, world_size=3).with_rows(data.num_rows)
    target = load_target(recipe.target.path, dtype="float32")
    moe.use_experts(target, "eager")  # the unsplit target through transformers' own experts loop
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    return reference_losses(spec, target, DraftModel(build_drafter(spec), embed, head), data.rows, steps=3)


def test_tiny_moe_target_split_over_two_ranks_trains_like_the_reference(tmp_path):
    target = tmp_path / "tiny-moe"
    script().write_model("tiny-moe", None, target, "cpu", "5GB")
    run_dir = tmp_path / "run"
    proc = launch(RECIPE, SPLIT + [f"target.path={target}", f"run.output_dir={run_dir}"], procs=3, timeout=500)
    out = output(proc)
    assert proc.returncode == 0, out[-6000:]
    assert "expert-parallel groups (each rank 1/2 of the experts): [[1, 2]]" in (run_dir / "plan.txt").read_text()
    recs = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["loss"] for r in recs] == pytest.approx(reference(target, tmp_path / "ref"), rel=2e-4)
    tau = [r for r in read_metrics(run_dir) if "tau" in r]
    assert tau and tau[-1]["tau"] >= 1.0
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["dflash_config"]["target_layer_ids"] == [1, 3]


def test_gpu_moe_bench_script_refuses_bad_usage():
    """scripts/gpu_moe_bench.sh: usage errors exit 2 before any bench starts (its --cpu variant runs
    every bench command at toy size; it takes minutes on 2 cores, so it is run by hand)."""
    import subprocess

    from .launch_util import ROOT, cpu_env

    for args, parts, needle in (([], "", "usage"), (["/tmp/x", "--gpus=2"], "", "unknown option --gpus=2"),
                                (["/tmp/x"], "experts_3072 fp8", "PARTS: some of experts_3072 experts_12288")):
        bad = subprocess.run(["bash", "scripts/gpu_moe_bench.sh", *args], cwd=ROOT, env={**cpu_env(), "PARTS": parts},
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and needle in bad.stderr
