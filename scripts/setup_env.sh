# Sourced by launch.sh and scripts/test.sh: make `python` one that can import dflash_ds and its
# dependencies. DFLASH_PYTHON, when set, is that interpreter; otherwise the project's .venv when it
# has been set up, then the active interpreter when it already can; otherwise creates .venv (seeing
# the system's packages, so a preinstalled CUDA torch is reused) and installs the project into it.
_dflash_root=$(cd "$(dirname "$0")" && git rev-parse --show-toplevel 2>/dev/null || pwd)
_dflash_ok() { "$1" -c "import dflash_ds, torch, deepspeed, transformers, datasets, yaml, safetensors" >/dev/null 2>&1; }
if [ -n "${DFLASH_PYTHON:-}" ]; then
  PYTHON=$(command -v "$DFLASH_PYTHON") || { echo "[dflash] error: DFLASH_PYTHON=$DFLASH_PYTHON is not a program" >&2; exit 2; }
elif [ -x "$_dflash_root/.venv/bin/python" ] && _dflash_ok "$_dflash_root/.venv/bin/python"; then
  PYTHON="$_dflash_root/.venv/bin/python"
elif [ -z "${DFLASH_FORCE_VENV:-}" ] && _dflash_ok python3 && python3 -c "import pytest" >/dev/null 2>&1; then
  PYTHON=python3
else
  echo "[dflash] setting up $_dflash_root/.venv (one time)" >&2
  [ -x "$_dflash_root/.venv/bin/python" ] || python3 -m venv --system-site-packages "$_dflash_root/.venv" || exit 1
  PYTHON="$_dflash_root/.venv/bin/python"
  "$PYTHON" -m pip install -q --upgrade pip >/dev/null 2>&1
  # Install torch first and on its own: with no torch present, a dependency range would pull a
  # multi-GB CUDA build onto a CPU machine. 2.13.0 is the tested CPU build. --no-compile: modules are
  # compiled when first imported, not all of them at install.
  "$PYTHON" -c "import torch" >/dev/null 2>&1 || "$PYTHON" -m pip install -q --no-compile "torch==2.13.0" || exit 1
  "$PYTHON" -m pip install -q --no-compile -e "$_dflash_root[test]" || exit 1
fi
PATH="$(dirname "$PYTHON"):$PATH"
export PYTHON PATH
