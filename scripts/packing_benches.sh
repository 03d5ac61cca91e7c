#!/bin/bash
# The packed-row measurements of docs/performance.md ("Useful tokens on chat data") on one GPU.
#   bash scripts/packing_benches.sh OUT_DIR STEP [STEP ...]
# Steps: target (packed rows: varlen attention, then the masked-SDPA route; full rows), colocated
# (one conversation per row), gpu_tier (tests/test_gpu.py, recorded as gpu_checks.json).
set -u
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/packing_benches.sh OUT_DIR STEP [STEP ...]" "${1:-}") || exit 2
shift
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
B="python -m dflash_ds.bench"

bench() {  # NAME ARGS...: one bench, its JSON and log under OUT
  # On the 3,072-token rows these figures were measured on (the recipes' rows are longer now; an
  # explicit --seq-len in ARGS wins).
  local name=$1; shift
  echo "[$(date +%T)] $name: $B --seq-len 3072 $*" | tee -a "$OUT/commands.txt"
  $B --seq-len 3072 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  tail -4 "$OUT/$name.log"
}

target() {
  bench target_packed --role target --lengths chat --steps 12 --warmup 3 --profile "$OUT/profile_target_packed.txt"
  bench target_packed_masked --role target --lengths chat --steps 12 --warmup 3 --masked-attention \
    --profile "$OUT/profile_target_packed_masked.txt"
  bench target_full --role target --steps 12 --warmup 3
}

colocated() {
  bench colocated_unpacked --role colocated --lengths chat --set data.pack=false --compile-layers --grad-accum 4 \
    --steps 6 --warmup 2
}

gpu_tier() {
  echo "[$(date +%T)] gpu_tier: DFLASH_GPU_RECORD=gpu_checks.json python -m pytest -m gpu tests/test_gpu.py" \
    | tee -a "$OUT/commands.txt"
  DFLASH_GPU_RECORD="$OUT/gpu_checks.json" python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    > "$OUT/gpu_tier.log" 2>&1
  tail -5 "$OUT/gpu_tier.log"
}

known_steps "bash scripts/packing_benches.sh OUT_DIR STEP [STEP ...]" "$@"  # every step before the first one runs
for step in "$@"; do "$step"; done
