"""Operating a long run through `bash launch.sh` on CPU/gloo: stop signals, one run per directory,
damaged checkpoints and a full disk, lost and stalled peers, bad data found before launch."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from dflash_ds.metrics import read_metrics
from dflash_ds.guard import launch
from dflash_ds.runtime import checkpoint

from .launch_util import ROOT, cpu_env, launch, output

pytestmark = pytest.mark.launcher

TINY = "recipes/tiny.yaml"
QUIET = ["log.every_steps=1", "eval.at_start=false", "eval.at_end=false", "log.progress=true"]
HOST = socket.gethostname()


class Job:
    """`bash launch.sh ...` in the background, output to a file; killed as a whole on teardown."""

    def __init__(self, run_dir: Path, overrides: list[str], fsize: int | None = None):
        self.run_dir, self.log = run_dir, run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.log"
        limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))) if fsize else None
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(["bash", "launch.sh", TINY, f"run.output_dir={run_dir}", *overrides], cwd=ROOT,
                                         env=cpu_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=limit)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 240) -> None:
        t0 = time.monotonic()
        while needle not in self.text():
            assert self.proc.poll() is None, f"job ended before {needle!r}:\n{self.text()[-5000:]}"
            assert time.monotonic() - t0 < timeout, f"no {needle!r} after {timeout}s:\n{self.text()[-5000:]}"
            time.sleep(0.5)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job still running after {timeout}s:\n{self.text()[-5000:]}") from None

    def kill(self) -> None:
        for p in job_processes(self.run_dir):
            p.kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def lines(self) -> list[str]:
        return [ln for ln in self.text().splitlines() if ln.startswith("[dflash]")]


def job_processes(run_dir: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in a for a in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def rank_process(run_dir: Path, rank: int) -> psutil.Process:
    procs = [p for p in job_processes(run_dir) if f"--local_rank={rank}" in p.info["cmdline"]]
    assert len(procs) == 1, procs
    return procs[0]


def no_process_left(run_dir: Path, within: float) -> None:
    t0 = time.monotonic()
    while job_processes(run_dir):
        assert time.monotonic() - t0 < within, [p.info["cmdline"] for p in job_processes(run_dir)]
        time.sleep(0.5)


def digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def job_cleanup():
    jobs = []
    yield jobs.append
    for j in jobs:
        j.kill()


def test_sigterm_checkpoints_the_step_reached_and_leaves_no_process(tmp_path, job_cleanup):
    run = tmp_path / "run"
    job = Job(run, QUIET + ["optim.max_steps=400", "checkpoint.every_steps=100", "run.stop_grace_s=60"])
    job_cleanup(job)
    job.wait_for("step 2/400")
    # A second run on the same directory is refused before anything starts.
    second = subprocess.run(["bash", "launch.sh", TINY, f"run.output_dir={run}"], cwd=ROOT, env=cpu_env(),
                            capture_output=True, text=True, timeout=120)
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("[dflash] error")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert f"is in use by another run (PID" in errors[0] and f"on host {HOST}" in errors[0]
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    rc = job.wait(timeout=30)
    no_process_left(run, within=30 - (time.monotonic() - t0))
    assert rc == 75, job.text()[-4000:]
    stopped = [ln for ln in job.lines() if "stopped by SIGTERM after step" in ln]
    assert len(stopped) == 1, job.text()[-4000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    where = run / "checkpoints" / checkpoint.tag_of(step)
    assert f"checkpoint {where};" in stopped[0] and step >= 2
    assert checkpoint.resolve(run, "auto") == {"tag": where.name, "step": step}
    assert checkpoint.verify(where) is None and not (run / "run.lock").exists()
    assert max(r["step"] for r in read_metrics(run)) == step


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run that finished 2 steps with a checkpoint at each."""
    run = tmp_path_factory.mktemp("finished") / "run"
    job = Job(run, QUIET + ["optim.max_steps=2", "checkpoint.every_steps=1", "checkpoint.keep_last=2"])
    assert job.wait() == 0, job.text()[-4000:]
    return run


def prelaunch_error(run: Path, *overrides: str) -> str:
    """launch.sh's pre-launch step, in process: the shell text it hands to `eval`."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        launch.main([TINY, f"run.output_dir={run}", *overrides])
    text = out.getvalue()
    assert text.startswith("echo ") and text.rstrip().endswith("exit 2"), text
    return shlex.split(text.split(" >&2")[0])[1]  # the line launch.sh prints


@pytest.mark.parametrize("damage,needle", [
    ("garbled", "latest.json is unreadable (JSONDecodeError"),
    ("missing", "names step00000002, but checkpoint directory"),
    ("truncated", "zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated or damaged"),
])
def test_damaged_checkpoint_stops_before_launch_and_loses_nothing(finished, tmp_path, damage, needle):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ck = run / "checkpoints"
    if damage == "garbled":
        (ck / "latest.json").write_text("{not json")
    elif damage == "missing":
        shutil.rmtree(ck / "step00000002")
    else:
        opt = ck / "step00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        opt.write_bytes(opt.read_bytes()[:1000])
    before = digest(run)
    if damage == "truncated":  # once through the real launch.sh: exit 2, one line, no rank started
        proc = subprocess.run(["bash", "launch.sh", TINY, f"run.output_dir={run}"], cwd=ROOT, env=cpu_env(),
                              capture_output=True, text=True, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[dflash]")]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-3000:]
        assert str(ck) in lines[0] and "checkpoint.resume=fallback" in lines[0]
    else:
        assert needle in prelaunch_error(run)
    assert digest(run) == before


def test_fallback_resumes_and_a_full_disk_keeps_the_previous_checkpoint(finished, tmp_path, job_cleanup):
    """latest.json names a missing step 3: fallback resumes from step 2, trains step 3, and the
    step-3 checkpoint hits the file-size limit (a full disk): one line, nothing lost."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    checkpoint.write_json_atomic(run / "checkpoints" / "latest.json", {"tag": "step00000003", "step": 3})
    keep = {k: v for k, v in digest(run).items() if k.startswith(("export/", "checkpoints/step00000002/"))}
    # The optimizer file (5 MB) exceeds the limit; the data cache, export and logs stay below it.
    job = Job(run, QUIET + ["optim.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                            "checkpoint.resume=fallback"], fsize=3 * 2**20)
    job_cleanup(job)
    rc = job.wait()
    text = job.text()
    assert rc == 4, text[-5000:]
    assert "names step00000003, but checkpoint directory" in text and "falling back to the newest complete" in text
    assert f"resumed from step 2 (checkpoint {run / 'checkpoints' / 'step00000002'})" in text
    failed = [ln for ln in job.lines() if "could not write checkpoint" in ln]
    assert len(failed) == 1 and str(run / "checkpoints" / "step00000003") in failed[0], text[-5000:]
    assert f"a write was cut short (the file-size limit (ulimit -f) is {3 * 2**20} bytes" in failed[0], failed[0]
    assert f"the previous checkpoint {run / 'checkpoints' / 'step00000002'} is untouched" in failed[0]
    assert not (run / "checkpoints" / "step00000003").exists()
    # The target adds nothing: no "lost rank" line, no gloo traceback.
    assert "Traceback" not in text and not [ln for ln in job.lines() if "lost" in ln or "gone" in ln], text[-5000:]
    assert {k: v for k, v in digest(run).items() if k in keep} == keep
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]
    no_process_left(run, within=30)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_lost_peer_ends_the_job_within_the_watchdog_bound(tmp_path, job_cleanup, how):
    run = tmp_path / "run"
    timeout = 8
    job = Job(run, QUIET + ["optim.max_steps=400", "checkpoint.every_steps=1000", f"topology.peer_timeout_s={timeout}",
                            "topology.peer_report_s=3"])
    job_cleanup(job)
    job.wait_for("step 2/400")
    target = rank_process(run, 1)
    t0 = time.monotonic()
    target.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    rc = job.wait(timeout=timeout + 20)
    # Exit.PEER whichever rank DeepSpeed's launcher sees end first (a rank killed by SIGKILL: 256 - 9).
    assert rc == 3 and time.monotonic() - t0 < timeout + 8, (rc, time.monotonic() - t0, job.text()[-4000:])
    no_process_left(run, within=10)
    assert not (run / "run.lock").exists()  # the lead ended from its watchdog, and released the lock
    peer = f"rank 1 (target on {HOST})"
    if how == "killed":
        lost = [ln for ln in job.lines() if "lost" in ln]
        assert lost and lost[0].startswith(f"[dflash] rank 0 (drafter on {HOST}): lost {peer}"), job.text()[-4000:]
    else:
        assert f"rank 0 (drafter on {HOST}) has waited 3s on {peer}" in job.text()
        stalled = [ln for ln in job.lines() if "no progress from" in ln]
        assert len(stalled) == 1 and f"rank 0 (drafter on {HOST}): no progress from {peer}" in stalled[0], job.text()[-4000:]


@pytest.mark.parametrize("content,needle", [
    (b"", "is empty"),
    (b'{"messages": []}\n\xff\xfe\n', ":2: bytes that are not UTF-8"),
    (b'{"messages": []}\n' * 3 + b'{"messages": [\n' + b'{"messages": []}\n', ":4: not valid JSON"),
])
def test_bad_data_stops_before_launch(tmp_path, content, needle):
    data = tmp_path / "chat.jsonl"
    data.write_bytes(content)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    text = prelaunch_error(tmp_path / "run", f"data.path={data}", cache)
    assert f"data.path: {data}" in text and needle in text
    if needle == ":4: not valid JSON":  # once through the real launch.sh: exit 2, one line, no rank
        proc = subprocess.run(["bash", "launch.sh", TINY, f"run.output_dir={tmp_path / 'run'}", f"data.path={data}",
                               cache], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[dflash]")]
        assert proc.returncode == 2 and len(lines) == 1 and f"{data}:4: not valid JSON" in lines[0], proc.stderr[-3000:]
        assert "local_rank" not in proc.stdout + proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokenizer_and_wandb_problems_stop_before_launch(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(ROOT / "assets" / "tiny-target" / name)
    assert f"target.path: no tokenizer in {str(model)!r}" in prelaunch_error(tmp_path / "run", f"target.path={model}")
    env = {k: os.environ.pop(k) for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC") if k in os.environ}
    os.environ["NETRC"] = str(tmp_path / "no-netrc")
    try:
        text = prelaunch_error(tmp_path / "run", "log.wandb.enabled=true", "log.wandb.mode=online")
    finally:
        os.environ.pop("NETRC")
        os.environ.update(env)
    assert "log.wandb.enabled is true with log.wandb.mode online but WANDB_API_KEY is not set" in text


def test_one_sigterm_as_the_benchmark_table_starts_lets_it_finish(tmp_path, job_cleanup):
    """The target rank, exiting as the lead starts the table, must not die of the forwarded signal (the
    launcher then signalled the lead again: exit 241, no table)."""
    run = tmp_path / "run"
    job = Job(run, ["optim.max_steps=2", "eval.at_start=false", "checkpoint.every_steps=100", "eval.bench_limit=4",
                    "eval.max_new_tokens=32"])
    job_cleanup(job)
    job.wait_for("[dflash] benchmarks ", timeout=300)
    os.kill(job.proc.pid, signal.SIGTERM)
    rc = job.wait(timeout=240)
    text = job.text()
    assert rc == 0, text[-5000:]
    assert "finishing the benchmark table" in text and "received again" not in text, text[-5000:]
    rows = json.loads((run / "benchmarks.json").read_text())
    assert {r["bench"] for r in rows} == {"heldout", "gsm8k", "mt_bench"}
    assert not (run / "run.lock").exists() and "Traceback" not in text
    no_process_left(run, within=10)


def test_a_drafter_traceback_ends_the_job_as_the_drafters_own(tmp_path):
    """An unexpected error on the drafter: its traceback, exit 1 (not the target's 3), the target adds no
    line of its own, the last complete checkpoint stays, no lock and no process are left."""
    run = tmp_path / "run"
    proc = launch(TINY, QUIET + ["optim.max_steps=400", "checkpoint.every_steps=2", f"run.output_dir={run}"],
                  procs=2, entry=["tests/ds_scripts/crash_after_step.py", "3:raise"])
    text = output(proc)
    assert proc.returncode == 1, text[-5000:]
    assert text.count("Traceback (most recent call last)") == 1 and "an injected fault in the drafter" in text
    assert not [ln for ln in text.splitlines() if ln.startswith("[dflash]") and ("lost" in ln or "gone" in ln)], \
        text[-5000:]
    assert checkpoint.resolve(run, "auto") == {"tag": "step00000002", "step": 2}
    assert not (run / "run.lock").exists()
    no_process_left(run, within=10)
