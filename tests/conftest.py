"""Test tiers and shared fixtures.

Every test belongs to exactly one tier (see README, "Tests"):
  unit         fast, in-process: no launcher, no subprocess, no worker processes (the default);
  integration  in-process end to end, seconds each: a tiny target, a drafter trained in the test, the
               speculative loops and evaluation tables run on them, the report drawn, a regeneration
               run through a fake server (no processes either);
  launcher     the real `deepspeed` launcher on gloo, or other spawned processes;
  engine       exports served by llama.cpp, built by scripts/build_llama_cpp.sh, and by vLLM's CPU
               build, installed by scripts/build_vllm_cpu.sh (skipped without a compiler or when a
               build fails, except under CI=true, where that fails the tier), and SGLang's model classes
               (scripts/build_sglang_cpu.sh; opt-in with DFLASH_SGLANG=1, about 6 GB);
  gpu          needs CUDA (skipped without it).
A test is `unit` unless it is marked `integration`, `launcher`, `engine` or `gpu`. A unit or integration test that
starts a Python, shell or launcher process, or a multiprocessing worker, fails with a message saying to
mark it `launcher`, so the in-process tiers cannot silently grow slow. (Other processes, such as wandb's service, are not
caught: mark those tests by hand.)
"""

import contextlib
import multiprocessing.process
import os
import subprocess

import pytest
import torch

TIERS = ("unit", "integration", "launcher", "engine", "gpu")
IN_PROCESS = ("unit", "integration")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(tiers)}: a test belongs to exactly one tier")
        if not tiers:
            item.add_marker(pytest.mark.unit)
        elif "gpu" in tiers and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="gpu tier: needs CUDA"))


def _spawns_a_process(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    program = os.path.basename(os.fsdecode(argv[0]).split()[0])
    text = " ".join(os.fsdecode(a) for a in argv)
    # Compilers run by torch.compile / the inductor's compile workers are not test processes.
    if "compile_worker" in text:
        return False
    return program.startswith("python") or program in ("deepspeed", "bash", "sh", "torchrun")


@contextlib.contextmanager
def _no_processes(name: str):
    """Make starting a Python/launcher process or a worker pool fail, naming the test."""

    def refuse(what):
        raise AssertionError(f"{name} is an in-process test but starts {what}: mark it @pytest.mark.launcher")

    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *a, **kw):
        if _spawns_a_process(args):
            refuse(f"the process {args!r}")
        popen_init(self, args, *a, **kw)

    patches = [(subprocess.Popen, "__init__", guarded_popen),
               (multiprocessing.process.BaseProcess, "start", lambda self: refuse("a multiprocessing worker"))]
    try:
        import multiprocess.process  # datasets' worker pools (num_proc > 1)

        patches.append((multiprocess.process.BaseProcess, "start", lambda self: refuse("a worker process pool")))
    except ImportError:
        pass
    saved = [(obj, attr, obj.__dict__[attr]) for obj, attr, _ in patches]
    for obj, attr, fn in patches:
        setattr(obj, attr, fn)
    try:
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def _in_process(item) -> bool:
    return any(item.get_closest_marker(tier) for tier in IN_PROCESS)


# Fixture set-up is guarded too: a module fixture that launches processes makes its tests launcher tests.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes(item.nodeid) if _in_process(item) else contextlib.nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes(item.nodeid) if _in_process(item) else contextlib.nullcontext():
        yield


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Every test uses tiny shapes: on small CI machines a second OpenMP thread costs more than it
    # gives (3-6x slower measured on 2 shared cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)



# GPU tests name themselves as they start and end, flushed at once: a tier stopped from outside (a time
# limit around `pytest -m gpu`) still shows which test it was in, and a slow one shows its time, where
# `-q` alone prints dots until the final summary that a killed run never reaches. (pytest-timeout's
# `--timeout S` fails a test that runs past S seconds, by name, and lets the tier go on.)
def _on_gpu(item) -> bool:
    return item.get_closest_marker("gpu") is not None and torch.cuda.is_available()


def _gpu_line(item, text: str) -> None:
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write(f"\n{text}\n", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _on_gpu(item):
        _gpu_line(item, f"gpu: start {item.nodeid}")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _on_gpu(item) and (report.when == "call" or report.failed):
        _gpu_line(item, f"gpu: {report.outcome.upper()} {item.nodeid} ({report.duration:.1f} s, {report.when})")
