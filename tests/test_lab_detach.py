"""`scripts/quality_lab.sh OUT detach STEP` and `OUT wait [SECONDS]`: a lab step that outlives the command
that started it (a machine that limits each command and kills what the command's process group leaves
behind), waited for by later commands. The step here is the table over two run summaries, slowed by an
interpreter that sleeps before it draws, so that the wait finds it still running first."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .launch_util import ROOT, cpu_env, output, run

pytestmark = pytest.mark.launcher

SUMMARIES = ROOT / "docs" / "bench" / "lab" / "2026-12-04"


def lab(out, *args, env, timeout=60):
    return run(["bash", "scripts/quality_lab.sh", str(out), *args], timeout, env)


def test_detached_step_outlives_its_command_and_is_waited_for(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("v1.json", "v1-seed1.json"):
        shutil.copy(SUMMARIES / name, out / name)
    slow = tmp_path / "python"  # the lab's interpreter, 4 s slower when it draws the table
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" lab table "*) sleep 4 ;; esac\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    env = cpu_env(DFLASH_PYTHON=str(slow))

    proc = lab(out, "wait", env=env)  # nothing detached yet: said, not waited for
    assert proc.returncode == 2 and "nothing detached" in output(proc), output(proc)

    # the starting command in a process group of its own, killed as a whole once it has returned, as a
    # machine that limits commands does: the detached step must not be in that group
    starter = subprocess.Popen(["bash", "scripts/quality_lab.sh", str(out), "detach", "table"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    said, _ = starter.communicate(timeout=30)
    assert starter.returncode == 0 and "[lab] detached: table" in said, said
    try:
        os.killpg(starter.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group had already emptied: nothing of it was left to kill
    pid = int((out / "detached.pid").read_text())
    assert pid != starter.pid and os.getsid(pid) != starter.pid  # a session of its own

    proc = lab(out, "detach", "table", env=env)  # one detached step at a time per folder
    assert proc.returncode == 2 and "still running" in output(proc), output(proc)
    proc = lab(out, "wait", "1", env=env)
    assert proc.returncode == 75 and "still running after 1 s" in output(proc), output(proc)
    assert not (out / "quality_lab.md").exists()

    proc = lab(out, "wait", "60", env=env)
    assert proc.returncode == 0 and "ended with status 0" in output(proc), output(proc)
    assert (out / "detached.rc").read_text().strip() == "0"
    table = (out / "quality_lab.md").read_text()
    assert "| v1 |" in table and "| v1-seed1 |" in table

    # a step that fails: its status comes back through wait, the log holds why
    proc = lab(out, "detach", "sweep", "train", "nosuch", env=env)
    assert proc.returncode == 0, output(proc)
    proc = lab(out, "wait", "60", env=env)
    assert proc.returncode == 2 and "ended with status 2" in output(proc), output(proc)
    assert "unknown lab run 'nosuch'" in (out / "detached.log").read_text()


def _left_running(marker: str, pids: list[int]) -> list[int]:
    """The processes still alive among `pids` and those whose command line names `marker` (a test's folder)."""
    from dflash_ds.safety import alive

    named = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                named.append(int(proc.name))
        except OSError:
            continue
    return sorted(p for p in set(pids) | set(named) if alive(p) and p != os.getpid())


def test_bad_script_settings_start_nothing_and_a_failed_sweep_ends_what_it_started(tmp_path):
    """An OUT that is a file, a step that does not exist or a setting that is not a number stop the scripts
    in one line before they start anything; a bad lab setting stops the sweep before any start; a sweep
    that fails after its runs have started (a stagger `sleep` that refuses, the check passed by) or is
    sent SIGTERM stops each process it started: the runs' shells, their logs' tee and launch.sh's
    supervisor, by their PIDs."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for script, args, extra, words in [
            ("quality_lab.sh", [str(a_file), "table"], {}, f"OUT {a_file} is a file; pass a folder"),
            ("quality_lab.sh", [str(tmp_path / "o"), "wait", "soon"], {}, "wait SECONDS='soon': expected a whole number"),
            ("packing_benches.sh", [str(a_file), "target"], {}, f"OUT_DIR {a_file} is a file; pass a folder"),
            ("packing_benches.sh", [str(tmp_path / "o"), "targett"], {}, "unknown step 'targett'"),
            ("two_gpu_runs.sh", [str(tmp_path / "o"), "e1", "nosuch"], {}, "unknown step 'nosuch'"),
            ("gpu_rows_bench.sh", [str(tmp_path / "o")], {"STEPS": "five"}, "STEPS=five: expected a whole number"),
            ("gpu_dflash2_bench.sh", [str(a_file)], {}, f"OUT_DIR {a_file} is a file")]:
        proc = run(["bash", f"scripts/{script}", *args], 60, cpu_env(**extra))
        lines = output(proc).strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], (script, output(proc))
    assert a_file.read_text() == "x" and not (tmp_path / "o" / "commands.txt").exists()

    lab_dir, out = tmp_path / "lab", tmp_path / "out"
    (lab_dir / "target").mkdir(parents=True)
    (lab_dir / "target" / "lab_target.json").write_text("{}")
    supervisors = tmp_path / "supervisors"
    stand_in = tmp_path / "python"  # launch.sh's checks pass; its supervisor sleeps, its PID recorded
    stand_in.write_text(f'#!/bin/bash\ncase "$1 $2" in\n'
                        f'  "-m dflash_ds.guard.launch") echo "DFLASH_PROCS=1 DFLASH_PORT=1 DFLASH_STOP_GRACE=1"; exit 0 ;;\n'
                        f'  "-m dflash_ds.guard.supervise") echo $$ >> {supervisors}; exec sleep 600 ;;\n'
                        f'esac\nexec {sys.executable} "$@"\n')
    stand_in.chmod(0o755)
    env = cpu_env(DFLASH_PYTHON=str(stand_in), LAB_DIR=str(lab_dir), LAB_STOP_GRACE="2")
    sweep = ["bash", "scripts/quality_lab.sh", str(out), "sweep", "train", "v1", "v1-seed1", "v1-kl"]

    proc = run(sweep, 60, dict(env, LAB_SWEEP_STAGGER="abc"))
    assert proc.returncode == 2 and "[lab] sweep:" not in output(proc), output(proc)
    assert "LAB_SWEEP_STAGGER='abc': expected a finite number of seconds >= 0" in output(proc)
    assert not supervisors.exists() and not list(out.glob("*.log"))

    # the same failure past the check (DFLASH_LAB_CHECKED is the script's own mark that it was done)
    proc = run(sweep, 120, dict(env, LAB_SWEEP_STAGGER="abc", DFLASH_LAB_CHECKED="1"))
    said = output(proc)
    assert proc.returncode != 0 and "v1 started" in said and "invalid time interval" in said, said
    shells = [int(p) for p in re.findall(r"started .*; PID (\d+)", said)]
    assert len(shells) == 1 and "ending before its runs; stopping what it started" in said
    # (the run may not have reached launch.sh yet: its shell alone is then what there is to stop)
    launched = [int(p) for p in supervisors.read_text().split()] if supervisors.exists() else []
    assert _left_running(str(tmp_path), shells + launched) == []
    time.sleep(1)  # nothing it started goes on to start more
    assert _left_running(str(tmp_path), shells + launched) == []

    # a sweep sent SIGTERM (a command's time limit) while its runs train
    supervisors.unlink(missing_ok=True)
    sweeping = subprocess.Popen(sweep, cwd=ROOT, env=dict(env, LAB_SWEEP_STAGGER="0"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for _ in range(300):
            if supervisors.exists() and len(supervisors.read_text().split()) == 3:
                break
            time.sleep(0.1)
        started = [int(p) for p in supervisors.read_text().split()]
        running = _left_running(str(tmp_path), started)
        assert len(started) == 3 and set(started) <= set(running) and len(running) >= 9  # 3 shells, tees, sleeps
        sweeping.send_signal(signal.SIGTERM)
        said, _ = sweeping.communicate(timeout=60)
    finally:
        if sweeping.poll() is None:
            os.killpg(sweeping.pid, signal.SIGKILL)
    assert sweeping.returncode == 143 and "ending before its runs" in said, said
    assert _left_running(str(tmp_path), running) == []
