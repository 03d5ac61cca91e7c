"""The split runtime end to end on CPU: the real `deepspeed` launcher, gloo, the tiny recipe."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from dflash_ds.config import load_recipe
from dflash_ds.metrics import read_metrics

from .launch_util import cpu_env, deepspeed_cmd, free_port, launch, output, run

# Every test here runs the real launcher (or launch.sh) on gloo.
pytestmark = pytest.mark.launcher

TINY = "recipes/tiny.yaml"
# Short runs: few steps, a log line and a checkpoint every step where needed.
FAST = ["optim.max_steps=4", "log.every_steps=1", "eval.at_start=false", "eval.at_end=false", "log.progress=false"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def ok(proc):
    assert proc.returncode == 0, output(proc)[-6000:]
    return output(proc)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """Single-process losses and gradient norms for 1 target + 2 drafter ranks' worth of data, grad_accum 2."""
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.resolve.run import resolve_run
    from .reference import reference_losses
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model.model import embed_and_head, load_target

    out = tmp_path_factory.mktemp("ref")
    recipe = load_recipe(TINY, FAST + ["topology.drafters_per_node=2", "optim.grad_accum=2", f"run.output_dir={out}"])
    spec = resolve_run(recipe, world_size=3)
    data = load_training_data(recipe)
    spec = spec.with_rows(data.num_rows)
    target = load_target(recipe.target.path, dtype="float32")
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    norms: list[float] = []
    got = reference_losses(spec, target, DraftModel(build_drafter(spec), embed, head), data.rows, steps=4,
                           grad_norms=norms)
    return {"losses": got, "grad_norms": norms}


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run["losses"]


def test_split_runtime_matches_single_process(tmp_path, reference, reference_run):
    """1 target + 2 drafters, grad_accum 2: transport and schedule lose and reorder nothing (with steps 2-3
    profiled on every rank, which must not change a loss)."""
    run_dir = tmp_path / "run"
    ok(launch(TINY, FAST + ["topology.drafters_per_node=2", "optim.grad_accum=2", f"run.output_dir={run_dir}",
                            "log.profile_start=2", "log.profile_steps=2"], procs=3))
    got = losses(run_dir)
    assert len(got) == 4
    assert got == pytest.approx(reference, rel=2e-4), (got, reference)
    assert got[-1] < got[0]
    # The gradients too: each step's norm before clipping (DeepSpeed's ZeRO-2 vs torch's clip_grad_norm_).
    norms = [r["grad_norm"] for r in read_metrics(run_dir) if "loss" in r]
    # Every logged step also says how long the drafter idled in device-wide synchronisations.
    assert all(0 <= r["drafter_sync_share"] < 1 for r in read_metrics(run_dir) if "loss" in r)
    assert norms == pytest.approx(reference_run["grad_norms"], rel=2e-4), (norms, reference_run["grad_norms"])
    names = sorted(f.name for f in (run_dir / "profile").iterdir())
    ranks = ["rank0-drafter", "rank1-drafter", "rank2-target"]
    assert names == sorted([f"{r}.json" for r in ranks] + [f"{r}.trace.json.gz" for r in ranks]), names
    for r in ranks:
        summary = json.loads((run_dir / "profile" / f"{r}.json").read_text())
        assert summary["steps"] == [2, 3] and summary["wall_s"] > 0 and summary["gpu_events"] == 0, summary
        with gzip.open(run_dir / "profile" / f"{r}.trace.json.gz") as f:
            assert json.load(f)["traceEvents"], r


def test_colocated_matches_single_process(tmp_path, reference):
    """Two colocated ranks (both models on each, hidden states in memory) train the same drafter."""
    run_dir = tmp_path / "run"
    ok(launch(TINY, FAST + ["topology.colocated=true", "topology.targets_per_node=0", "topology.drafters_per_node=2",
                            "optim.grad_accum=2", f"run.output_dir={run_dir}"], procs=2))
    assert losses(run_dir) == pytest.approx(reference, rel=2e-4)


KL = ["objective.kl_weight=0.5", "objective.kl_temperature=2.0"]


def test_kl_term_end_to_end_split_and_colocated(tmp_path):
    """With the KL term on, targets send their final-norm states as an extra tap: the split and the
    colocated runtime train exactly like the single-process reference, and differently from CE alone."""
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.resolve.run import resolve_run
    from .reference import reference_losses
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model.model import embed_and_head, load_target

    base = FAST + KL + ["topology.drafters_per_node=2", "optim.grad_accum=2"]
    recipe = load_recipe(TINY, base + [f"run.output_dir={tmp_path / 'ref'}"])
    spec = resolve_run(recipe, world_size=3)
    data = load_training_data(recipe)
    spec = spec.with_rows(data.num_rows)
    p = spec.payload
    assert p.final_norm and p.tap_cols == (len(spec.drafter.target_layer_ids) + 1) * p.hidden
    target = load_target(recipe.target.path, dtype="float32")
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    ref = reference_losses(spec, target, DraftModel(build_drafter(spec), embed, head), data.rows, steps=4)
    ce_recipe = load_recipe(TINY, FAST + ["topology.drafters_per_node=2", "optim.grad_accum=2",
                                          f"run.output_dir={tmp_path / 'ref_ce'}"])
    ce_spec = resolve_run(ce_recipe, world_size=3).with_rows(data.num_rows)
    ce_only = reference_losses(ce_spec, target, DraftModel(build_drafter(ce_spec), embed, head), data.rows, steps=4)
    assert ref[0] == pytest.approx(ce_only[0], rel=1e-6)  # the first loss is before any update
    assert abs(ref[-1] - ce_only[-1]) > 1e-4  # the KL gradient changed the training

    split = tmp_path / "split"
    ok(launch(TINY, base + ["eval.at_end=true", f"run.output_dir={split}"], procs=3))
    assert losses(split) == pytest.approx(ref, rel=2e-4)
    recs = read_metrics(split)
    assert all(r["kl"] > 0 for r in recs if "loss" in r)
    tau = [r for r in recs if "tau" in r]
    assert tau and len(tau[-1]["tau_position_acceptance"]) == recipe.drafter.block_size - 1
    colocated = tmp_path / "colocated"
    ok(launch(TINY, base + ["topology.colocated=true", "topology.targets_per_node=0", f"run.output_dir={colocated}"],
              procs=2))
    assert losses(colocated) == pytest.approx(ref, rel=2e-4)


def test_colocated_zero3_target_ends_cleanly(tmp_path, reference):
    """Two colocated ranks with the target partitioned by ZeRO-3 over both: the same losses as the
    single process, then the whole end of training (final checkpoint, export, tau after training)
    and a clean exit, within a timeout (a rank left alone in a ZeRO-3 gather would hang here)."""
    run_dir = tmp_path / "run"
    out = ok(launch(TINY, FAST + ["topology.colocated=true", "topology.targets_per_node=0", "topology.drafters_per_node=2",
                                  "optim.grad_accum=2", "target.ds_config=ds_configs/target_zero3_cpu.json",
                                  "eval.at_end=true", "data.num_eval=4", "eval.max_new_tokens=16",
                                  f"run.output_dir={run_dir}"], procs=2, timeout=240))
    assert losses(run_dir) == pytest.approx(reference, rel=2e-4)
    assert "step 4: checkpoint written" in out and "tau after training" in out, out[-3000:]
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == 4
    assert (run_dir / "export" / "model.safetensors").is_file()


def test_two_targets_one_drafter(tmp_path):
    run_dir = tmp_path / "run"
    ok(launch(TINY, FAST + ["topology.targets_per_node=2", f"run.output_dir={run_dir}"], procs=3))
    assert len(losses(run_dir)) == 4
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"]


def test_resume_after_crash_gives_the_same_losses(tmp_path):
    common = ["optim.max_steps=6", "log.every_steps=1", "checkpoint.every_steps=3", "eval.at_start=false",
              "eval.at_end=false", "log.progress=false"]
    straight = tmp_path / "straight"
    ok(launch(TINY, common + [f"run.output_dir={straight}"], procs=2))
    crashed = tmp_path / "crashed"
    proc = launch(TINY, common + [f"run.output_dir={crashed}"], procs=2,
                  entry=["tests/ds_scripts/crash_after_step.py", "4"])
    assert proc.returncode != 0
    assert len(losses(crashed)) == 4
    ok(launch(TINY, common + [f"run.output_dir={crashed}"], procs=2))
    resumed = losses(crashed)
    # Steps 4 and 5 ran twice (before the crash and after resuming from step 3); the resumed ones
    # must equal the uninterrupted run.
    assert resumed[-3:] == pytest.approx(losses(straight)[-3:], rel=1e-5)


def test_two_simulated_nodes(tmp_path):
    """Two 'nodes' on one machine (hostfile, --no_ssh, --node_rank), 1 drafter + 1 target each."""
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    port = free_port()
    env = cpu_env()
    cmds = []
    for node in range(2):
        args = ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                "--master_port", str(port)]
        cmds.append(deepspeed_cmd() + args + ["launch.sh", TINY] + FAST + [f"run.output_dir={run_dir}"])
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda c: run(c, 400, env), cmds))
    for p in procs:
        ok(p)
    assert len(losses(run_dir)) == 4
    plan = (run_dir / "plan.txt").read_text()
    # Every send goes to a drafter of the sender's own node (ranks 0,1 = node 0; 2,3 = node 1).
    sends = re.findall(r"target (\d+): ->(\d+)", plan)
    assert sends and all(int(t) // 2 == int(d) // 2 for t, d in sends)


def test_launch_sh_turns_a_recipe_error_into_one_line_and_exit_2(tmp_path):
    """The user's entry point: no launcher start, no traceback, one line naming the setting.

    (Every other check made before the process group exists runs in-process: test_config.py.)"""
    proc = run(["bash", "launch.sh", TINY, "drafter.blok_size=4", f"run.output_dir={tmp_path}"], 120, cpu_env())
    lines = output(proc).strip().splitlines()
    assert proc.returncode == 2, output(proc)[-4000:]
    assert len(lines) == 1 and "drafter.blok_size" in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_universal_checkpoint_resumes_on_fewer_drafter_ranks(tmp_path):
    """Saved by 2 drafter ranks, converted with ds_to_universal, resumed by 1: training continues."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    common = ["optim.max_steps=4", "checkpoint.every_steps=2", "log.every_steps=1", "eval.at_start=false",
              "eval.at_end=false", "log.progress=false", f"run.output_dir={run_dir}"]
    proc = launch(TINY, common + ["topology.drafters_per_node=2"], procs=3,
                  entry=["tests/ds_scripts/crash_after_step.py", "2"])
    assert proc.returncode != 0
    ck = run_dir / "checkpoints"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(ck / "step00000002"), "--output_folder", str(ck / "step00000002_universal")],
                   check=True, capture_output=True, env=cpu_env(), timeout=120)
    ok(launch(TINY, common + ["checkpoint.universal=true"], procs=2))
    got = losses(run_dir)
    assert len(got) == 4
    # Steps 3-4 continue from the 2-rank run's state instead of restarting from random weights.
    assert got[2] < 0.8 * got[0] and abs(got[2] - got[1]) < 0.3 * got[1]
