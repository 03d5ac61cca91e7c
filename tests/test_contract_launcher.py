"""`bash launch.sh` on CPU: every user-caused failure is one line before launch (a recipe that is not
YAML, a crashing pre-launch step, an output location that is a file, wandb out of reach), no lock is
left behind, and a resume keeps the run's contract (refused shape changes, listed allowed ones, the
recorded recipe never overwritten), through launch.sh and through the deepspeed launcher alone."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .launch_util import ROOT, cpu_env, launch, output

pytestmark = pytest.mark.launcher

TINY = "recipes/tiny.yaml"
FAST = ["eval.at_start=false", "eval.at_end=false", "log.every_steps=1", "checkpoint.every_steps=2"]


def launch_sh(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, env=env or cpu_env(), capture_output=True,
                          text=True, timeout=timeout)


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in output(proc).splitlines() if line.startswith("[dflash] error:")]


def test_a_recipe_that_is_not_yaml_stops_launch_sh_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: x\n target: [\n")
    p = launch_sh([str(bad)])
    assert p.returncode == 2, output(p)
    assert errors(p) == [f"[dflash] error: {bad}:3:2: the recipe is not valid YAML (expected <block end>, but found "
                         "'<block mapping start>'); fix that line (indentation, a missing ':' or quote)"]
    assert "Traceback" not in output(p)


def test_launch_sh_starts_nothing_when_its_pre_launch_step_crashes(tmp_path):
    # A python3 that crashes in the pre-launch step only (as a bug there would), named by DFLASH_PYTHON:
    # launch.sh would otherwise prefer the project's .venv once `bash launch.sh` has made it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *dflash_ds.guard.launch*) "
                    f"echo 'Traceback (most recent call last): boom' >&2; exit 1;; esac\nexec {sys.executable} \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = cpu_env(DFLASH_PYTHON=str(fake))
    p = launch_sh([TINY, f"run.output_dir={tmp_path / 'run'}"], env=env, timeout=120)
    assert p.returncode == 1, output(p)
    text = output(p)
    assert "boom" in text and "supervise" not in text and "could not convert" not in text
    assert "deepspeed" not in text.lower() and not (tmp_path / "run").exists()


def test_an_output_location_that_is_a_file_stops_before_launch(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    p = launch_sh([TINY, f"run.output_dir={afile}"])
    assert p.returncode == 2 and errors(p) == [f"[dflash] error: run.output_dir: {afile} is a file, not a directory; "
                                               "move it away or point run.output_dir elsewhere"], output(p)
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export").rmdir()
    (run / "export").write_text("x")
    p = launch_sh([TINY, f"run.output_dir={run}"])
    assert p.returncode == 2 and len(errors(p)) == 1 and "run.output_dir (export)" in errors(p)[0]
    assert not (run / "run.lock").exists() and "Traceback" not in output(p)


def test_unreachable_wandb_stops_in_seconds_without_a_lock(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = cpu_env(WANDB_API_KEY="0" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{port}")
    env.pop("WANDB_MODE")
    run = tmp_path / "run"
    t = time.monotonic()
    p = launch_sh([TINY, f"run.output_dir={run}", "log.wandb.enabled=true"], env=env)
    assert p.returncode == 2 and len(errors(p)) == 1, output(p)
    assert "log.wandb.mode=offline" in errors(p)[0] and "Traceback" not in output(p)
    assert time.monotonic() - t < 60 and not (run / "run.lock").exists()


def test_an_unreachable_hub_costs_one_line_not_retries(tmp_path):
    """A hub id while the hub is out of reach: one short probe, then the local HF cache only, instead
    of ~30 s of retries per lookup before the same answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = cpu_env(HF_ENDPOINT=f"http://127.0.0.1:{port}")
    env.pop("HF_HUB_OFFLINE")
    run = tmp_path / "run"
    t = time.monotonic()
    p = launch_sh([TINY, f"run.output_dir={run}", "data.path=someorg/missing-set", f"data.cache_dir={tmp_path / 'c'}"],
                  env=env)
    took = time.monotonic() - t
    assert p.returncode == 2 and len(errors(p)) == 1, output(p)
    assert errors(p)[0].startswith("[dflash] error: data.path: ") and "the hub is out of reach" in errors(p)[0]
    assert "Retrying" not in output(p) and took < 40, (took, output(p))
    assert not (run / "run.lock").exists()


def test_a_resume_keeps_the_runs_contract(tmp_path):
    run = tmp_path / "run"
    base = [TINY, f"run.output_dir={run}", *FAST]
    p = launch_sh(base + ["optim.max_steps=2"])
    assert p.returncode == 0, output(p)[-4000:]
    recorded = (run / "recipe.yaml").read_text()

    # A changed drafter shape stops before launch, naming each key with both values.
    p = launch_sh(base + ["optim.max_steps=4", "drafter.block_size=4", "drafter.num_layers=3"])
    assert p.returncode == 2, output(p)[-4000:]
    (line,) = errors(p)
    assert "at step 2" in line and "drafter.num_layers 2 -> 3" in line and "drafter.block_size 8 -> 4" in line
    assert "fallback" not in line and (run / "recipe.yaml").read_text() == recorded
    assert not (run / "run.lock").exists()

    # The same through the deepspeed launcher alone (no pre-launch step): the run's lead refuses it.
    p = launch(TINY, [f"run.output_dir={run}", *FAST, "optim.max_steps=4", "drafter.num_layers=3"], procs=2)
    assert p.returncode == 2, output(p)[-4000:]
    assert any("drafter.num_layers 2 -> 3" in line for line in errors(p)) and "Traceback" not in output(p)
    assert not (run / "run.lock").exists() and (run / "recipe.yaml").read_text() == recorded

    # Allowed changes: listed in one line, trained, recorded beside the first recipe.
    p = launch_sh(base + ["optim.max_steps=4", "optim.lr=1e-3"])
    assert p.returncode == 0, output(p)[-4000:]
    listed = [line for line in output(p).splitlines() if "allowed on resume" in line]
    assert len(listed) == 1 and "optim.lr 0.003 -> 0.001" in listed[0] and "optim.max_steps 2 -> 4" in listed[0]
    assert (run / "recipe.yaml").read_text() == recorded and (run / "recipe.resume-2.yaml").is_file()
    assert "resumed from step 2" in output(p)
