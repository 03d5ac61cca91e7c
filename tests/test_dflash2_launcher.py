"""scripts/gpu_dflash2_bench.sh on the CPU (its tiny recipe through the launcher is the conformance
suite's, tests/test_conformance_launcher.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.launcher


def test_gpu_bench_script_runs_its_toy_variant_on_cpu(tmp_path):
    """scripts/gpu_dflash2_bench.sh: usage errors exit 2; --cpu runs both bench commands (v1 and DFlash2 at the
    same anchors and block size) at toy size and writes the summary the GPU run writes."""
    import subprocess

    from .launch_util import ROOT, cpu_env

    bad = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh"], cwd=ROOT, env=cpu_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    bad = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh", str(tmp_path), "--gpus=2"], cwd=ROOT,
                         env=cpu_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gpus=2" in bad.stderr
    proc = subprocess.run(["bash", "scripts/gpu_dflash2_bench.sh", str(tmp_path), "--cpu"], cwd=ROOT, env=cpu_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["v1"]["architecture"] == "dflash" and summary["dflash2"]["architecture"] == "dflash2"
    assert summary["v1"]["anchors"] == summary["dflash2"]["anchors"] == 16
    assert summary["v1"]["block_size"] == summary["dflash2"]["block_size"] == 8
    assert summary["dflash2"]["drafter_params"] > summary["v1"]["drafter_params"]
    assert summary["dflash2_over_v1_tok_s"] == pytest.approx(summary["dflash2"]["tok_s"] / summary["v1"]["tok_s"])
