#!/bin/sh
# Runs the test suite; sets up the environment first when needed (see scripts/setup_env.sh).
cd "$(dirname "$0")/.." || exit 1
. ./scripts/setup_env.sh
# The test extra (pytest, transformers serve for the regeneration tests) on an environment set up before
# it grew.
"$PYTHON" -c "import pytest, pytest_timeout, fastapi, uvicorn, sentencepiece" >/dev/null 2>&1 || \
  "$PYTHON" -m pip install -q -e ".[test]" || exit 1
# The engine tier serves the exports with llama.cpp and vLLM, built once per machine and cached outside the
# clone (scripts/build_llama_cpp.sh, scripts/build_vllm_cpu.sh). In CI it is built here, before the tests, and a build that fails ends the
# run; elsewhere the tier builds it when it first runs and skips, saying why, when it cannot.
if [ "${CI:-}" = "true" ]; then
  echo "test.sh: building llama.cpp for the engine tier (cached after the first run)" >&2
  PYTHON="$PYTHON" bash scripts/build_llama_cpp.sh >/dev/null || {
    echo "test.sh: scripts/build_llama_cpp.sh failed; the engine tier cannot run (CI=true)" >&2; exit 1; }
  # vLLM's CPU build, in an environment of its own made from the system's python3 (not the project's).
  echo "test.sh: installing vLLM's CPU build for the engine tier (cached after the first run)" >&2
  bash scripts/build_vllm_cpu.sh >/dev/null || {
    echo "test.sh: scripts/build_vllm_cpu.sh failed; the engine tier cannot run (CI=true)" >&2; exit 1; }
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" tests
