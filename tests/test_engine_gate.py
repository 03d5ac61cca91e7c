"""The engine tier's gate (tests/llama_cpp.py): a build that cannot run skips the tier with the build's
reason, except under CI=true, where a skip would pass silently, so it fails."""

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
