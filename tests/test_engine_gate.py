"""The engine tier's gate (tests/llama_cpp.py, tests/vllm_cpu.py): a build that cannot run skips the tier
with the build's reason, except under CI=true, where a skip would pass silently, so it fails."""

import pytest

from tests import llama_cpp

pytestmark = pytest.mark.launcher  # runs a build script


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_build_that_cannot_run_skips_locally_and_fails_in_ci(tmp_path, monkeypatch, ci, outcome):
    script = tmp_path / "build_llama_cpp.sh"
    script.write_text("echo \"build_llama_cpp: 'cmake' not found; install a C/C++ compiler and cmake\" >&2; exit 2\n")
    monkeypatch.setattr(llama_cpp, "BUILD", script)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="build_llama_cpp.sh failed \\(2\\).*'cmake' not found"):
        llama_cpp.build(tmp_path)


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_vllm_install_that_cannot_run_skips_locally_and_fails_in_ci(tmp_path, monkeypatch, ci, outcome):
    from tests import vllm_cpu

    script = tmp_path / "build_vllm_cpu.sh"
    script.write_text("echo 'build_vllm_cpu: python3 is not a Python 3.10 to 3.13 with the venv module' >&2; exit 2\n")
    monkeypatch.setattr(vllm_cpu, "BUILD", script)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="build_vllm_cpu.sh failed \\(2\\).*venv module"):
        vllm_cpu.build()


def test_a_failed_download_is_tried_once_and_reported_whole(tmp_path, monkeypatch):
    """pip's error reaches the skip reason whole (not cut mid-line), after one try, not pip's retries."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n"
                    "echo 'WARNING: a first line of context' >&2\n"
                    "echo 'ERROR: Could not find a version that satisfies the requirement llama-cpp-python' >&2\n"
                    "echo 'ERROR: No matching distribution found for llama-cpp-python==0.3.36' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PYTHON", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CI", "")
    monkeypatch.setattr(llama_cpp.sys, "executable", str(fake))
    with pytest.raises(pytest.skip.Exception) as skipped:
        llama_cpp.build(tmp_path)
    reason = str(skipped.value)
    assert "pip download of llama-cpp-python==0.3.36" in reason and "a first line of context" in reason
    assert reason.rstrip().endswith("No matching distribution found for llama-cpp-python==0.3.36")
    (line,) = calls.read_text().splitlines()
    assert "--retries 0" in line
