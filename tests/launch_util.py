"""Running the real `deepspeed` launcher on CPU from tests: free ports, timeouts, captured logs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dflash_ds.guard.launch import free_port  # noqa: F401  (used by the tests)

ROOT = Path(__file__).resolve().parents[1]



def cpu_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def deepspeed_cmd() -> list[str]:
    exe = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    assert exe, "the deepspeed launcher is not installed"
    return [exe]


def launch(recipe: str, overrides: list[str], procs: int, timeout: float = 300, env: dict | None = None,
           launcher_args: list[str] | None = None, entry: list[str] | None = None) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus procs --master_port P launch.sh recipe overrides` with a hard timeout
    (`entry`: another rank entry point and its leading arguments instead of launch.sh)."""
    args = launcher_args if launcher_args is not None else ["--num_gpus", str(procs), "--master_port", str(free_port())]
    cmd = deepspeed_cmd() + args + (entry or ["launch.sh"]) + [recipe] + overrides
    return run(cmd, timeout, env or cpu_env())


def run(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    # A new session, killed as a whole on timeout: a hung rank must not outlive the test.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s (a hang): {' '.join(cmd)}\n{out[-4000:]}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout or "") + (proc.stderr or "")
