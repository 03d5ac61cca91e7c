"""The safety vocabulary (dflash_ds/safety.py) and the one place failures become exit codes."""

from __future__ import annotations

import ast
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_ds.guard import control
from dflash_ds.safety import CheckpointError, Exit, LockError, PeerLost, Stopped, transport_failure

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_ds"


def test_exit_codes_are_the_documented_ones():
    assert [int(e) for e in (Exit.OK, Exit.FAILED, Exit.USER, Exit.PEER, Exit.CHECKPOINT, Exit.STOPPED)] == \
        [0, 1, 2, 3, 4, 75]
    assert Exit.of_signal(signal.SIGINT) == 130
    doc = PACKAGE.parent / "docs" / "operating.md"
    line = next(x for x in doc.read_text().split("\n- ") if x.startswith("**Exit codes**"))
    for e in Exit:
        assert f" {int(e)} " in line, f"{doc.name}'s exit codes lack {e!r}"


@pytest.mark.parametrize("exc, lost", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321"), True),
    (ConnectionResetError("reset"), True),
    (PeerLost("rank 1: lost rank 0"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (CheckpointError("could not write"), False),
    (ValueError("a bug"), False),
])
def test_transport_failures_are_recognised_in_one_place(exc, lost):
    assert transport_failure(exc) is lost


def _guarded(monkeypatch, exc, role="drafter", stop_signal=None, peer_failed=None):
    """run_guarded on a fake control; returns (exit code, printed line or None). The code it announces
    to its peers must be the one it exits with."""
    ended = {}
    monkeypatch.setattr(control, "exit_now", lambda code, line=None, who=None: ended.setdefault("code", code))
    monkeypatch.setattr(control, "say", lambda line, who=None: ended.setdefault("line", line))
    stop = SimpleNamespace(requested=stop_signal is not None, name=stop_signal or "")
    ctl = SimpleNamespace(me="rank 0 (drafter on h)", stop=stop, role=role, release=lambda: None,
                          leaving=lambda code=0: ended.setdefault("announced", code), peer_failed=lambda: peer_failed)

    def fail():
        raise exc

    control.run_guarded(fail, ctl)
    assert ended["announced"] == ended["code"]
    return int(ended["code"]), ended.get("line")


def test_failures_map_to_their_exit_codes_by_type(monkeypatch):
    assert _guarded(monkeypatch, CheckpointError("no space")) == (4, "rank 0 (drafter on h): no space")
    assert _guarded(monkeypatch, LockError("taken"))[0] == 2
    assert _guarded(monkeypatch, PeerLost("rank 0 (drafter on h): lost rank 1")) == \
        (3, "rank 0 (drafter on h): lost rank 1")
    code, line = _guarded(monkeypatch, Stopped(7, "/run/checkpoints/step7"), stop_signal="SIGTERM")
    assert code == 75 and "stopped by SIGTERM after step 7" in line
    code, line = _guarded(monkeypatch, RuntimeError("Connection closed by peer"))
    assert code == 3 and "gone or stalled (Connection closed by peer)" in line
    # A target whose drafters stopped on request sees them go: that is the same stop.
    assert _guarded(monkeypatch, PeerLost("lost"), role="target", stop_signal="SIGINT")[0] == 75


def test_other_errors_end_with_their_traceback_and_exit_1_announced(monkeypatch, capsys):
    assert _guarded(monkeypatch, ValueError("a bug")) == (1, None)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: a bug" in err


def test_a_lost_peer_that_announced_its_failure_is_that_failure(monkeypatch):
    """The peer printed its line (a checkpoint it could not write: 4): this rank adds no "lost" line and
    ends with the same code, whichever exit the launcher sees first."""
    assert _guarded(monkeypatch, PeerLost("rank 1 (target on h): lost rank 0"), peer_failed=4) == (4, None)
    assert _guarded(monkeypatch, RuntimeError("Connection closed by peer"), peer_failed=1) == (1, None)
    assert _guarded(monkeypatch, PeerLost("rank 1: lost rank 0"), peer_failed=None)[0] == 3


def test_the_job_status_of_a_rank_killed_by_a_signal_is_a_lost_peer():
    from dflash_ds.guard.supervise import job_status

    # DeepSpeed's launcher exits with the killed rank's negative status: 256 - 9 for kill -9.
    assert job_status(256 - signal.SIGKILL) == Exit.PEER and job_status(256 - signal.SIGTERM) == Exit.PEER
    assert job_status(-signal.SIGKILL) == 128 + signal.SIGKILL  # the launcher itself killed
    for code in (0, 1, 2, 3, 4, 75, Exit.of_signal(signal.SIGTERM)):
        assert job_status(code) == code


def test_no_literal_exit_codes_in_the_package():
    """Processes end through safety.exit_now / Exit; os._exit and sys.exit take no literal number."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            fn = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else \
                getattr(f, "id", "")
            if fn == "os._exit" and path.name != "safety.py":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} os._exit (use safety.exit_now)")
            if fn in ("os._exit", "sys.exit", "exit_now") and node.args and isinstance(node.args[0], ast.Constant):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {fn}({node.args[0].value!r})")
    assert not found, "\n".join(found)


def test_the_start_is_decided_in_one_place(monkeypatch, tmp_path):
    """launch.sh's pre-launch check and the run's lead both ask launch.decide_start."""
    from dflash_ds.config import RecipeError, load_recipe
    from dflash_ds.guard import launch

    calls = []

    def decide(recipe):
        calls.append(recipe.run.output_dir)
        raise CheckpointError("latest.json names a checkpoint that is gone")

    monkeypatch.setattr(launch, "decide_start", decide)
    recipe = load_recipe("recipes/tiny.yaml", [f"run.output_dir={tmp_path}"])
    with pytest.raises(RecipeError, match="latest.json names a checkpoint that is gone"):
        launch.check_resume(recipe)
    ctl = control.RunControl(recipe, SimpleNamespace(role=lambda r: "drafter", is_drafter=lambda r: True), 0)
    assert ctl._decide() == {"error": "latest.json names a checkpoint that is gone"}
    assert calls == [str(tmp_path)] * 2
