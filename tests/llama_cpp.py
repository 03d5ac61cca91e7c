"""llama.cpp for the engine tier: the build (scripts/build_llama_cpp.sh), its converter, and its programs.

Outside CI a missing compiler or a failed build skips the tier with the reason; with CI=true it fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build_llama_cpp.sh"

# Flash attention on CPU rounds the queries to f16 and the KV cache defaults to f16: both move logits
# by ~1e-4, enough to flip the tiny target's near-ties (one held-out prompt has a 5e-5 gap) against the
# float32 reference. The tier checks the algorithm, so the engine computes in float32 throughout.
FLOAT32 = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
FLOAT32_DRAFT = ["-ctkd", "f32", "-ctvd", "f32"]

# llama.cpp's logger writes from a thread and is not flushed at exit (its singleton is leaked on
# purpose), so the last lines of a run are lost when that thread is behind, as on a busy machine. A
# preloaded library that waits a moment at exit lets it finish; a run without its closing summary is
# still rerun.
_EXIT_DELAY_C = "#include <unistd.h>\n__attribute__((destructor)) static void exit_delay(void) { usleep(300000); }\n"
_ATTEMPTS = 4


def unavailable(reason: str):
    """Skip the engine tier, or fail it in CI, where a skip would pass silently."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"engine tier: {reason}", pytrace=False)
    pytest.skip(f"engine tier: {reason}")


def built_env_python(script: Path) -> Path:
    """The python of the environment a build script makes once per machine and prints (its last line), or
    the engine tier skipped (failed in CI) naming the script's error."""
    try:
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    except OSError as e:
        unavailable(f"cannot run {script.name}: {e}")
    if r.returncode != 0:
        unavailable(f"{script.name} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return Path(r.stdout.strip().splitlines()[-1]) / "bin" / "python"


@dataclass(frozen=True)
class LlamaCpp:
    home: Path  # the install directory the build script prints
    exit_delay: Path

    def program(self, name: str) -> str:
        return str(self.home / "bin" / name)

    def convert(self, model_dir: Path, out: Path, target_dir: Path | None = None) -> Path:
        """llama.cpp's own convert_hf_to_gguf.py, float32 out (run as a script, as users run it)."""
        args = [sys.executable, "-c", _CONVERT, str(self.home), str(model_dir), "--outfile", str(out), "--outtype", "f32"]
        if target_dir is not None:
            args += ["--target-model-dir", str(target_dir)]
        r = subprocess.run(args, capture_output=True, text=True)
        assert r.returncode == 0 and out.is_file(), f"conversion of {model_dir} failed:\n{r.stderr[-3000:]}"
        return out

    def run(self, args: list[str], complete: str) -> subprocess.CompletedProcess:
        """A program run until its log holds `complete` (see _EXIT_DELAY_C); asserts it exits 0."""
        env = dict(os.environ, LD_PRELOAD=str(self.exit_delay))
        for _ in range(_ATTEMPTS):
            r = subprocess.run(args, capture_output=True, text=True, env=env)
            assert r.returncode == 0, f"{args[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}"
            if complete in r.stderr or complete in r.stdout:
                return r
        raise AssertionError(f"{args[0]}: {_ATTEMPTS} runs ended without {complete!r} in the log")

    def tokenize(self, gguf: Path, text: str) -> list[int]:
        r = subprocess.run([self.program("llama-tokenize"), "-m", str(gguf), "-p", text, "--ids", "--log-disable"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return [int(v) for v in re.findall(r"\d+", r.stdout.strip().splitlines()[-1])]


# The tiny target's tokenizer is trained here, so llama.cpp's converter, which names BPE pre-tokenizers
# by hashing a fixed text's tokens, does not know it; its pre-tokenizer is Qwen2's regex (assets/README.md),
# which is the name the converter is given when it finds no other.
_CONVERT = """
import runpy, sys
from pathlib import Path
home = Path(sys.argv[1])
sys.path[:0] = [str(home), str(home / "gguf-py")]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [str(home / "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def build(tmp: Path) -> LlamaCpp:
    """The cached build (seconds once built; a fresh machine builds it, ~8 minutes on 2 cores)."""
    env = dict(os.environ, PYTHON=sys.executable)
    try:
        r = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, env=env)
    except OSError as e:
        unavailable(f"cannot run {BUILD.name}: {e}")
    if r.returncode != 0:
        # Whole: a reason cut mid-line hides the cause (pip's error is its last lines, its context before).
        unavailable(f"{BUILD.name} failed ({r.returncode}): {r.stderr.strip()}")
    home = Path(r.stdout.strip().splitlines()[-1])
    src = tmp / "exit_delay.c"
    src.write_text(_EXIT_DELAY_C)
    lib = tmp / "exit_delay.so"
    c = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)], capture_output=True, text=True)
    if c.returncode != 0:
        unavailable(f"cc cannot build a shared library: {c.stderr.strip()[-500:]}")
    try:
        import sentencepiece  # noqa: F401 - the converter imports it for every Qwen-family vocabulary
    except ImportError:
        unavailable("the converter needs sentencepiece: pip install -e '.[test]'")
    return LlamaCpp(home, lib)
