#!/bin/sh
# Runs the test suite; sets up the environment first when needed (see scripts/setup_env.sh).
cd "$(dirname "$0")/.." || exit 1
. ./scripts/setup_env.sh
# The test extra (pytest, transformers serve for the regeneration tests) on an environment set up before
# it grew.
"$PYTHON" -c "import pytest, pytest_timeout, fastapi, uvicorn, sentencepiece" >/dev/null 2>&1 || \
  "$PYTHON" -m pip install -q -e ".[test]" || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" tests
