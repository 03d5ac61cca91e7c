"""`scripts/quality_lab.sh OUT detach STEP` and `OUT wait [SECONDS]`: a lab step that outlives the command
that started it (a machine that limits each command and kills what the command's process group leaves
behind), waited for by later commands. The step here is the table over two run summaries, slowed by an
interpreter that sleeps before it draws, so that the wait finds it still running first."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

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
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" table "*) sleep 4 ;; esac\nexec {sys.executable} "$@"\n')
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
