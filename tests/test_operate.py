"""Operating a long run, unit level: run lock, checkpoint integrity and resume modes, write
failures, data-file checks, pre-launch checks, stop signals, the peer watchdog, metrics after a
resume and export permissions."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.data.validate import DataFileError, check_json_file
from dflash_ds.metrics import read_metrics, truncate_after
from dflash_ds.runtime import checkpoint
from dflash_ds.guard.lock import LockError, RunLock, check

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- run lock


def test_second_lock_is_refused_and_names_the_holder(tmp_path):
    with RunLock(tmp_path):
        holder = json.loads((tmp_path / "run.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(LockError, match=f"PID {os.getpid()} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
        with pytest.raises(LockError, match="in use by another run"):
            check(tmp_path)
    assert not (tmp_path / "run.lock").exists()
    assert check(tmp_path) is None


def test_stale_lock_is_taken_over(tmp_path):
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have this PID
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": gone, "start_time": 0}))
    assert check(tmp_path) is None
    with RunLock(tmp_path):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_lock_from_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"host": "node-17", "pid": 4242, "start_time": 0}))
    with pytest.raises(LockError, match=r"another host \(PID 4242 on host node-17.*delete .*run.lock"):
        RunLock(tmp_path).acquire()


# ----------------------------------------------------------------------------- checkpoints


def fake_checkpoint(run_dir: Path, step: int, manifest: bool = True) -> Path:
    tag = run_dir / "checkpoints" / checkpoint.tag_of(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 100)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 300)
    if manifest:
        files = {p.name: p.stat().st_size for p in tag.iterdir()}
        (tag / checkpoint.MANIFEST).write_text(json.dumps({"step": step, "files": files}))
    return tag


def set_latest(run_dir: Path, step: int) -> None:
    checkpoint.write_json_atomic(run_dir / "checkpoints" / checkpoint.LATEST,
                                 {"tag": checkpoint.tag_of(step), "step": step})


def test_resolve_fresh_and_intact(tmp_path):
    assert checkpoint.resolve(tmp_path, "auto") is None
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    set_latest(tmp_path, 4)
    assert checkpoint.resolve(tmp_path, "auto") == {"tag": "step00000004", "step": 4}
    assert checkpoint.resolve(tmp_path, "restart") is None


@pytest.mark.parametrize("damage,needle", [
    ("garbled", "latest.json is unreadable (JSONDecodeError"),
    ("missing", "names step00000004, but checkpoint directory"),
    ("truncated", "zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated or damaged (120 bytes, 300 written)"),
    ("no_latest", "holds checkpoints (step00000002, step00000004) but no latest.json"),
])
def test_damaged_checkpoint_stops_with_one_line_or_falls_back(tmp_path, damage, needle):
    fake_checkpoint(tmp_path, 2)
    tag4 = fake_checkpoint(tmp_path, 4)
    set_latest(tmp_path, 4)
    latest = tmp_path / "checkpoints" / checkpoint.LATEST
    if damage == "garbled":
        latest.write_text('{"tag": "step000')
    elif damage == "missing":
        import shutil
        shutil.rmtree(tag4)
    elif damage == "truncated":
        p = tag4 / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        p.write_bytes(p.read_bytes()[:120])
    else:
        latest.unlink()
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.resolve(tmp_path, "auto")
    msg = str(exc.value)
    assert needle in msg and "checkpoint.resume=fallback" in msg and "\n" not in msg
    got = checkpoint.resolve(tmp_path, "fallback")
    # The damaged step-4 checkpoint is skipped (unless only latest.json was lost).
    assert got["step"] == (4 if damage in ("garbled", "no_latest") else 2)
    assert needle in got["warning"] and "falling back" in got["warning"]


def test_fallback_without_any_complete_checkpoint_refuses(tmp_path):
    tag = fake_checkpoint(tmp_path, 3)
    set_latest(tmp_path, 3)
    (tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no complete earlier checkpoint.*resume=restart"):
        checkpoint.resolve(tmp_path, "fallback")


class FakeEngine:
    """save_checkpoint like DeepSpeed's layout; `fail` makes the optimizer file hit a full disk."""

    device = torch.device("cpu")

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(4)}, d / "mp_rank_00_model_states.pt")
        opt = d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        opt.write_bytes(b"partial")
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(opt))
        opt.write_bytes(b"o" * 1000)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_full_disk_removes_the_partial_checkpoint_and_keeps_the_previous(tmp_path, one_rank_group):
    run = tmp_path / "run"
    assert checkpoint.save(FakeEngine(), run, 3, one_rank_group, is_lead=True, keep_last=2) == "step00000003"
    assert checkpoint.verify(run / "checkpoints" / "step00000003") is None
    before = (run / "checkpoints" / checkpoint.LATEST).read_text()
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.save(FakeEngine(fail=True), run, 4, one_rank_group, is_lead=True, keep_last=2)
    msg = str(exc.value)
    assert "could not write checkpoint" in msg and "step00000004" in msg and "No space left on device" in msg
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in msg and "step00000003 is untouched" in msg
    assert not (run / "checkpoints" / "step00000004").exists()
    assert (run / "checkpoints" / checkpoint.LATEST).read_text() == before
    assert checkpoint.resolve(run, "auto") == {"tag": "step00000003", "step": 3}


def test_only_a_checkpoint_with_complete_json_is_complete(tmp_path):
    """complete.json is written last: a tag directory without it (a crash during the write, DeepSpeed's
    files all present) is never resumed, and fallback is advised only where a complete one exists."""
    fake_checkpoint(tmp_path, 4, manifest=False)
    set_latest(tmp_path, 4)
    assert "complete.json" in checkpoint.verify(tmp_path / "checkpoints" / "step00000004")
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.resolve(tmp_path, "auto")
    msg = str(exc.value)
    assert "names step00000004" in msg and "complete.json" in msg and "\n" not in msg
    assert "fallback" not in msg and "checkpoint.resume=restart" in msg  # nothing complete to fall back to
    with pytest.raises(checkpoint.CheckpointError, match="no complete earlier checkpoint"):
        checkpoint.resolve(tmp_path, "fallback")
    fake_checkpoint(tmp_path, 2)
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint.resume=fallback"):
        checkpoint.resolve(tmp_path, "auto")
    assert checkpoint.resolve(tmp_path, "fallback")["step"] == 2


def test_pruning_keeps_the_checkpoint_just_written(tmp_path, one_rank_group):
    """A run over a directory holding later steps of another run: pruning by step number alone deleted
    every new checkpoint as soon as it was written."""
    run = tmp_path / "run"
    fake_checkpoint(run, 400)
    fake_checkpoint(run, 500)
    for step in (1, 2, 3):
        checkpoint.save(FakeEngine(), run, step, one_rank_group, is_lead=True, keep_last=2)
        assert checkpoint.verify(run / "checkpoints" / checkpoint.tag_of(step)) is None
    assert checkpoint.tags(run / "checkpoints") == ["step00000002", "step00000003", "step00000400", "step00000500"]


def test_restart_moves_the_previous_runs_checkpoints_aside(tmp_path, one_rank_group, capsys):
    from types import SimpleNamespace

    from dflash_ds.guard import control

    run = tmp_path / "run"
    fake_checkpoint(run, 400)
    fake_checkpoint(run, 500)
    set_latest(run, 500)
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [f"run.output_dir={run}", "checkpoint.resume=restart"])
    ctl = control.RunControl(recipe, SimpleNamespace(role=lambda r: "drafter", is_drafter=lambda r: True), 0)
    try:
        assert ctl._decide() == {"start": None}
    finally:
        ctl.release()
    ck = run / "checkpoints"
    (aside,) = [p for p in ck.iterdir() if p.name.startswith("previous-")]
    assert checkpoint.tags(ck) == [] and not (ck / checkpoint.LATEST).exists()
    assert checkpoint.tags(aside) == ["step00000400", "step00000500"] and (aside / checkpoint.LATEST).is_file()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "previous-" in ln]
    assert len(lines) == 1 and str(aside) in lines[0] and "checkpoint.resume=restart" in lines[0]
    # The new run's checkpoints are its own: pruned among themselves, resumed from, never the old ones.
    for step in (1, 2, 3):
        checkpoint.save(FakeEngine(), run, step, one_rank_group, is_lead=True, keep_last=2)
    assert checkpoint.tags(ck) == ["step00000002", "step00000003"]
    assert checkpoint.resolve(run, "auto") == {"tag": "step00000003", "step": 3}
    assert checkpoint.resolve(run, "fallback") == {"tag": "step00000003", "step": 3}


class EngineLikeDeepSpeed(FakeEngine):
    """DeepSpeed's save_checkpoint logs and swallows the OSError of its makedirs; torch.save then fails
    on the missing directory."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        try:
            (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        torch.save({"w": torch.ones(4)}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")


def test_a_checkpoint_directory_that_cannot_be_written_says_not_writable(one_rank_group):
    run = Path("/sys/dflash-test-run")  # no one, root included, creates directories in /sys
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.save(EngineLikeDeepSpeed(), run, 3, one_rank_group, is_lead=True, keep_last=2)
    msg = str(exc.value)
    assert "\n" not in msg and "is not writable" in msg and str(run / "checkpoints") in msg, msg
    assert "does not exist" not in msg


# ----------------------------------------------------------------------------- data and pre-launch


@pytest.mark.parametrize("content,needle", [
    (b"", "is empty"),
    (b"\n  \n", "is empty"),
    (b'{"messages": []}\n{"messages": "caf\xe9"}\n', ":2: bytes that are not UTF-8 (0xe9 at column 18)"),
    (b'{"messages": []}\n' * 5 + b'{"messages": [}\n' + b'{"messages": []}\n' * 3, ":6: not valid JSON"),
    (b'{"messages": []}\n[1, 2]\n', ":2: expected a JSON object per line, got list"),
])
def test_bad_data_files_name_file_and_line(tmp_path, content, needle):
    f = tmp_path / "chat.jsonl"
    f.write_bytes(content)
    with pytest.raises(DataFileError) as exc:
        check_json_file(f, "data.path")
    assert str(exc.value).startswith(f"data.path: {f}") and needle in str(exc.value)


def test_good_data_file_passes():
    assert check_json_file(ROOT / "assets" / "tiny_chat.jsonl", "data.path") == 1200


def tiny(tmp_path, *overrides):
    return load_recipe(ROOT / "recipes" / "tiny.yaml", [f"run.output_dir={tmp_path / 'run'}", *overrides])


def test_wandb_online_without_key_is_refused(tmp_path, monkeypatch):
    from dflash_ds.guard import launch
    from dflash_ds.guard.launch import check_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(RecipeError, match="WANDB_API_KEY"):
        check_wandb(tiny(tmp_path, "log.wandb.enabled=true"))
    check_wandb(tiny(tmp_path, "log.wandb.enabled=true", "log.wandb.mode=offline"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(launch, "_wandb_probe", lambda key, timeout: None)  # the service is tested on its own
    check_wandb(tiny(tmp_path, "log.wandb.enabled=true"))


def test_model_without_tokenizer_is_blamed_on_target_path(tmp_path):
    from dflash_ds.guard.launch import prelaunch

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model / name).symlink_to(ROOT / "assets" / "tiny-target" / name)
    with pytest.raises(ValueError) as exc:
        prelaunch(tiny(tmp_path, f"target.path={model}"))
    assert str(exc.value).startswith(f"target.path: no tokenizer in {str(model)!r}")


@pytest.mark.launcher
def test_settings_for_a_stopped_launch_sh_end_in_one_line(tmp_path):
    """launch.sh stopped (SIGTERM) during its checks is gone with its end of the pipe when the settings
    are printed: one line and the signal's status, not a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "dflash_ds.guard.launch", "recipes/tiny.yaml",
                               f"run.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "stopped during the pre-launch checks; nothing was started" in proc.stderr


def test_resume_setting_accepts_old_booleans(tmp_path):
    assert tiny(tmp_path, "checkpoint.resume=true").checkpoint.resume == "auto"
    assert tiny(tmp_path, "checkpoint.resume=false").checkpoint.resume == "restart"
    with pytest.raises(RecipeError, match="checkpoint.resume must be auto, fallback or restart"):
        tiny(tmp_path, "checkpoint.resume=sometimes")


# ----------------------------------------------------------------------------- metrics and export


def test_metrics_drop_replayed_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in (0, 1, 2, 3, 4)) + '{"step": 5, "lo')
    truncate_after(p, 3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    truncate_after(p, 0)
    assert read_metrics(tmp_path) == []


def test_export_is_readable_by_others(tmp_path):
    from dflash_ds.export import save_drafter

    from .test_export import make_drafter

    out = save_drafter(make_drafter(), tmp_path / "export")
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())


# ----------------------------------------------------------------------------- signals and watchdog


def run_script(code: str, timeout: float = 60) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.launcher
def test_first_signal_is_recorded_while_blocked_second_exits_at_once():
    proc = run_script("""
        import threading, time
        from dflash_ds.guard.signals import StopRequest
        stop = StopRequest("rank 0 (drafter on h)").install()
        print("ready", flush=True)
        # The main thread blocks in C (a lock wait), as it would inside a receive.
        threading.Event().wait(timeout=3)
        print("requested", stop.requested, stop.name, flush=True)
        threading.Event().wait(timeout=30)
        print("not reached", flush=True)
    """)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "requested True SIGTERM"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 5 and proc.returncode == 128 + signal.SIGINT and "not reached" not in out
    assert "SIGTERM received; stopping after the current step" in err and "SIGINT received again" in err


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_only_drafter_ranks_create_the_stop_group(monkeypatch, tmp_path, rank):
    """On GPUs DeepSpeed binds each rank to its device, and torch then makes a rank that calls
    new_group for a group it is not in join an NCCL split over WORLD, which the members of a gloo
    group never join: the split topology hung at start-up. Target ranks must stay out of the
    drafters' stop-vote group, and the drafters create it among themselves."""
    from dflash_ds.guard import control
    from dflash_ds.resolve.topology import Layout

    calls = []
    monkeypatch.setattr(control.StopRequest, "install", lambda self: self)
    monkeypatch.setattr(control.Watchdog, "start", lambda self: self)
    monkeypatch.setattr(control.watchdog, "install", lambda dog: None)
    monkeypatch.setattr(control.dist, "broadcast_object_list", lambda objs, src=0: objs.__setitem__(0, {"start": None}))
    monkeypatch.setattr(control.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(control.dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj] * 4))
    monkeypatch.setattr(control.dist, "new_group", lambda ranks, **kw: calls.append((list(ranks), kw)) or "stop group")
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [f"run.output_dir={tmp_path}"])
    c = control.RunControl.setup(recipe, Layout(4, drafters_per_node=2, targets_per_node=2), rank)
    c.release()
    if rank < 2:
        assert c.stop_group == "stop group"
        assert [(r, kw["backend"], kw["use_local_synchronization"]) for r, kw in calls] == [([0, 1], "gloo", True)]
    else:
        assert c.stop_group is None and calls == []


@pytest.mark.launcher
def test_watchdog_names_the_stalled_peer_and_ends_the_process():
    proc = run_script("""
        import threading
        from dflash_ds.runtime import watchdog
        from dflash_ds.runtime.watchdog import Peer, Watchdog
        me, peer = Peer("drafter", 0, "node-a", 1), Peer("target", 1, "node-b", 2)
        watchdog.install(Watchdog(me, {0: me, 1: peer}, timeout_s=2.5, report_s=1.0).start())
        with watchdog.waiting_on("a payload receive", 1):
            threading.Event().wait(timeout=30)
    """)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and time.monotonic() - t0 < 10
    assert "rank 0 (drafter on node-a) has waited 1s on rank 1 (target on node-b) for a payload receive" in err
    lines = [ln for ln in err.splitlines() if "no progress" in ln]
    assert len(lines) == 1 and "rank 0 (drafter on node-a): no progress from rank 1 (target on node-b)" in lines[0]


WATCH_LOCAL_PEER = """
    import socket, subprocess, sys, threading
    from dflash_ds.runtime import watchdog
    from dflash_ds.runtime.watchdog import Peer, Watchdog
    left = sys.argv[1]
    peer_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    me, peer = Peer("target", 1, host, 0), Peer("drafter", 0, host, peer_proc.pid)
    dog = Watchdog(me, {0: peer, 1: me}, timeout_s=60, report_s=60, left_dir=left)
    if sys.argv[2] == "announced":  # the peer says it leaves on purpose before it exits
        Watchdog(peer, {0: peer, 1: me}, timeout_s=60, report_s=60, left_dir=left).mark_left()
    import pathlib
    pathlib.Path(left).mkdir(exist_ok=True)
    pathlib.Path(left, "rank1").write_text("0")  # this rank's marker from an earlier run: cleared by start()
    dog.start()
    print("watching", peer_proc.pid, flush=True)
    peer_proc.kill()
    peer_proc.wait()
    # Blocked the way an NCCL rank is after its peer died: not in any guarded wait.
    threading.Event().wait(timeout=float(sys.argv[3]))
    print("still running", flush=True)
"""


@pytest.mark.launcher
@pytest.mark.parametrize("announced", [False, True])
def test_watchdog_ends_the_rank_when_a_local_peer_process_is_gone(tmp_path, announced):
    # The process check needs no failed wait and no timeout: the peer's PID disappearing is enough,
    # unless the peer announced that it leaves on purpose (finished or stopped).
    script = textwrap.dedent(WATCH_LOCAL_PEER)
    how = "announced" if announced else "killed"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "left"), how, "3"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
    pid = proc.stdout.split()[1]
    assert not (tmp_path / "left" / "rank1").exists()
    if announced:
        assert proc.returncode == 0 and "still running" in proc.stdout, proc.stderr
        assert (tmp_path / "left" / "rank0").read_text() == f"{pid} 0"
        return
    assert proc.returncode == 3 and "still running" not in proc.stdout and time.monotonic() - t0 < 3, proc.stderr
    host = socket.gethostname()
    assert proc.stderr.strip().splitlines() == [
        f"[dflash] rank 1 (target on {host}): lost rank 0 (drafter on {host}): its process (PID {pid}) ended "
        "without finishing (killed or crashed); stopping the job"]


def test_alive_sees_exited_and_unreaped_processes():
    from dflash_ds.safety import alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert alive(child.pid) and alive(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while alive(child.pid) and time.monotonic() < deadline:  # a zombie until wait()
            time.sleep(0.05)
        assert not alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not alive(child.pid)
    assert alive(1)  # init: another user's process is alive, not gone


def test_a_peer_gone_after_announcing_a_failure_ends_this_rank_with_its_code(tmp_path, monkeypatch):
    from dflash_ds.runtime import watchdog
    from dflash_ds.runtime.watchdog import Peer, Watchdog

    ended = []
    monkeypatch.setattr(watchdog, "exit_now", lambda code, line=None, who=None: ended.append((int(code), line)))
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have this PID
    host = socket.gethostname()
    me, peer = Peer("target", 1, host, os.getpid()), Peer("drafter", 0, host, gone)
    left = tmp_path / "left"
    dog = Watchdog(me, {0: peer, 1: me}, timeout_s=60, report_s=60, left_dir=left)
    dog.check_local_peers()  # gone without a word: killed
    assert ended == [(3, f"lost {peer}: its process (PID {gone}) ended without finishing (killed or crashed); "
                         "stopping the job")]
    ended.clear()
    Watchdog(peer, {0: peer, 1: me}, timeout_s=60, report_s=60, left_dir=left).mark_left(4)
    dog = Watchdog(me, {0: peer, 1: me}, timeout_s=60, report_s=60, left_dir=left)
    assert dog.announced_failure() == 4
    dog.check_local_peers()  # gone after its own line (a checkpoint it could not write): silent, same code
    assert ended == [(4, None)] and (left / "rank1").read_text() == f"{os.getpid()} 4"


def test_the_launchers_signal_after_a_peers_failure_ends_the_rank_silently(monkeypatch, capsys):
    from dflash_ds.guard import signals

    ended = []
    monkeypatch.setattr(signals, "exit_now", lambda code, line=None, who=None: ended.append((int(code), line)))
    stop = signals.StopRequest("rank 1 (target on h)", saves=False)
    stop.peer_failed = lambda: 4
    stop.on_signal(signal.SIGTERM)
    assert ended[0] == (4, None) and "SIGTERM" not in capsys.readouterr().err


def test_failed_wait_becomes_one_line_naming_the_peer():
    from dflash_ds.runtime.watchdog import Peer, PeerLost, Watchdog

    me, peer = Peer("target", 1, "node-b", 2), Peer("drafter", 0, "node-a", 1)
    dog = Watchdog(me, {0: peer, 1: me}, timeout_s=60, report_s=60)
    with pytest.raises(PeerLost) as exc:
        with dog.waiting("a payload send", 0):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321")
    assert str(exc.value) == ("rank 1 (target on node-b): lost rank 0 (drafter on node-a) during a payload send "
                              "([../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321); "
                              "stopping the job")


SUPERVISED_RANK = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda s, f: print("rank got", s, flush=True))
print("rank up", flush=True)
while True:
    time.sleep(0.1)
"""


def supervised(tmp_path, grace: float) -> tuple[subprocess.Popen, Path]:
    """supervise -> sh -> one fake rank process (`--local_rank=0`) that ignores SIGTERM."""
    rank = tmp_path / "rank.py"
    rank.write_text(SUPERVISED_RANK)
    log = tmp_path / "rank.log"
    inner = f"{sys.executable} {rank} --local_rank=0 > {log} & wait"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ds.guard.supervise", "--grace", str(grace), "--", "sh", "-c",
                             inner], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    while "rank up" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() - t0 < 30
        time.sleep(0.1)
    return proc, log


def alive(marker: Path) -> bool:
    import psutil

    return any(str(marker) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


@pytest.mark.launcher
def test_supervisor_forwards_once_then_kills_the_group_on_a_second_signal(tmp_path):
    proc, log = supervised(tmp_path, grace=60)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while "rank got 15" not in log.read_text():
        assert time.monotonic() - t0 < 10
        time.sleep(0.1)
    time.sleep(1)
    assert proc.poll() is None and log.read_text().count("rank got") == 1  # the rank decides; no duplicate
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode != 0 and "SIGINT again: killing the job now" in err
    assert not alive(tmp_path / "rank.py")


@pytest.mark.launcher
def test_supervisor_kills_the_group_after_the_grace_time(tmp_path):
    proc, _ = supervised(tmp_path, grace=2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=15)
    assert 1.5 < time.monotonic() - t0 < 8 and "run.stop_grace_s=2s passed" in err
    assert not alive(tmp_path / "rank.py")
