#!/bin/bash
# Installs SGLang for the opt-in SGLang loader check (tests/test_engine_sglang.py): sglang 0.5.23 by sha256
# in a virtual environment of its own, since it pins torch 2.14.1 and transformers 5.19.0. SGLang cannot
# serve a DFlash drafter on a CPU (its server refuses DFLASH there and its CPU engine needs sgl_kernel,
# whose wheel needs libcuda), so only its model classes are imported and run on the exports. Prints the
# environment's directory on stdout (run its bin/python); everything else goes to stderr.
#
# About 6 GB (torch 2.14.1 is the CUDA build with its CUDA libraries: the package index has no CPU wheel
# of it) and several minutes on a 2-core machine, so CI does not install it: the tier is opt-in.
# Cached outside the clone, keyed by the pinned wheel hash and the requirements file; each run installs
# in a temporary directory next to the cache and renames it into place (the loser of a race discards its
# copy). Run the environment as DIR/bin/python; the console scripts keep the temporary path.
#
#   bash scripts/build_sglang_cpu.sh           # PYTHON (default python3, 3.11) makes the environment
set -euo pipefail

VERSION=0.5.23
WHEEL=sglang-$VERSION-cp311-cp311-manylinux_2_34_x86_64.whl
SHA256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937
# The whole environment but sglang, pinned; installed with --no-deps so that none of sglang's GPU
# kernels (flashinfer, sgl-kernel, deep-gemm, ...) is pulled in: the model classes do not need them.
REQUIREMENTS="$(cd "$(dirname "$0")" && pwd)/sglang_cpu_requirements.txt"

PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/dflash-ds"
[ -f "$REQUIREMENTS" ] || { echo "build_sglang_cpu: $REQUIREMENTS is missing; restore it from the repository" >&2; exit 2; }
BUILD_KEY="$(sha256sum < "$REQUIREMENTS" | cut -c1-8)"
DEST="$CACHE_ROOT/sglang-$VERSION-${SHA256:0:12}-$BUILD_KEY"

complete() { [ -x "$1/bin/python" ] && [ -f "$1/.dflash-ds-complete" ]; }

if complete "$DEST"; then
  echo "$DEST"
  exit 0
fi

"$PYTHON" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || {
  echo "build_sglang_cpu: $PYTHON is not a Python 3.11 with the venv module (the pinned sglang wheel is cp311); set PYTHON to one" >&2
  exit 2; }
[ "$(uname -m)" = x86_64 ] || { echo "build_sglang_cpu: the pinned sglang wheel is for x86_64 Linux, not $(uname -m)" >&2; exit 2; }

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/.sglang-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'echo "build_sglang_cpu: \`$BASH_COMMAND\` failed (line $LINENO; pip output above): check the network to the package index and the free space under $CACHE_ROOT (about 6 GB)" >&2' ERR

"$PYTHON" -m venv "$WORK/env" >&2
VPY="$WORK/env/bin/python"
"$VPY" -m pip download -q --no-deps "sglang==$VERSION" -d "$WORK/dl" >&2
echo "$SHA256  $WORK/dl/$WHEEL" | sha256sum -c --quiet - >&2 || {
  echo "build_sglang_cpu: $WHEEL does not match the pinned sha256" >&2; exit 2; }
"$VPY" -m pip install -q --no-deps -r "$REQUIREMENTS" >&2
"$VPY" -m pip install -q --no-deps "$WORK/dl/$WHEEL" >&2
rm -rf "$WORK/dl"
(cd "$WORK" && "$VPY" -c 'import sglang.srt.models.dflash, sglang.srt.models.dspark') >&2 || {
  echo "build_sglang_cpu: the installed environment cannot import SGLang's DFlash and DSpark model classes (see above)" >&2; exit 2; }
touch "$WORK/env/.dflash-ds-complete"

mv -T "$WORK/env" "$DEST" 2>/dev/null || complete "$DEST"
echo "$DEST"
