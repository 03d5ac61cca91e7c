#!/bin/bash
# Builds the llama.cpp that the engine test tier serves exports with: the tree vendored in one pinned
# llama-cpp-python source distribution, CPU only, only the programs the tier runs. Prints the install
# directory (bin/, convert_hf_to_gguf.py, conversion/, gguf-py/) on stdout; everything else goes to stderr.
#
# The result is cached outside the clone, keyed by the pinned version and hash, so a second run on the same
# machine only checks that the directory is there. Two runs may race: each builds in its own temporary
# directory next to the cache and renames it into place; the loser discards its copy.
#
#   bash scripts/build_llama_cpp.sh            # PYTHON (default python3) runs pip download
#   DFLASH_LLAMA_CPP_JOBS=4 bash scripts/build_llama_cpp.sh
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PROGRAMS=(llama-speculative-simple llama-completion llama-tokenize)
# Static, so the programs keep working after the directory is renamed; no tests, server or web UI; the
# examples and tools trees are configured (the programs live there) but only the named targets are built.
# -O1 instead of Release's -O3: 226 s instead of 316 s on 2 cores, and the same numbers (no fast-math
# either way, so no floating-point operation is reordered; ggml's kernels are written with intrinsics).
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG"
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON)

PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/dflash-ds"
# The build settings are part of the key: a changed program list or flag builds a new directory
# instead of finding an old one incomplete.
BUILD_KEY="$(printf '%s\n' "${PROGRAMS[@]}" "${CMAKE_FLAGS[@]}" | sha256sum | cut -c1-8)"
DEST="$CACHE_ROOT/llama.cpp-$VERSION-${SHA256:0:12}-$BUILD_KEY"
JOBS="${DFLASH_LLAMA_CPP_JOBS:-$(nproc 2>/dev/null || echo 2)}"

complete() {
  local p
  for p in "${PROGRAMS[@]}"; do [ -x "$1/bin/$p" ] || return 1; done
  [ -f "$1/convert_hf_to_gguf.py" ] && [ -d "$1/gguf-py" ]
}

if complete "$DEST"; then
  echo "$DEST"
  exit 0
fi

for tool in cmake c++ cc; do
  command -v "$tool" >/dev/null || { echo "build_llama_cpp: '$tool' not found; install a C/C++ compiler and cmake" >&2; exit 2; }
done

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/.llama.cpp-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# One try (--retries 0): a failed download is reported at once, pip's own words whole, not after pip's five
# retries; the next run of this script tries again.
if ! "$PYTHON" -m pip download -q --retries 0 --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/dl" \
    >"$WORK/pip.log" 2>&1; then
  echo "build_llama_cpp: pip download of llama-cpp-python==$VERSION (the llama.cpp source) failed; pip said:" >&2
  cat "$WORK/pip.log" >&2
  exit 2
fi
SDIST="$WORK/dl/llama_cpp_python-$VERSION.tar.gz"
echo "$SHA256  $SDIST" | sha256sum -c --quiet - >&2 || { echo "build_llama_cpp: $SDIST does not match the pinned sha256" >&2; exit 2; }
tar -xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

cmake -S "$SRC" -B "$WORK/build" "${CMAKE_FLAGS[@]}" >&2
cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${PROGRAMS[@]}" >&2

OUT="$WORK/install"
mkdir -p "$OUT/bin"
for p in "${PROGRAMS[@]}"; do cp "$WORK/build/bin/$p" "$OUT/bin/"; done
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$OUT/"
complete "$OUT"

# rename(2) onto an existing non-empty directory fails, so exactly one racer installs; the others use it.
mv -T "$OUT" "$DEST" 2>/dev/null || complete "$DEST"
echo "$DEST"
