#!/usr/bin/env bash
# The FP8 target measured against bf16 at the flagship geometry (one GPU), and the GPU-tier checks
# of the FP8 path. Writes to ${OUT:-runs/bench_fp8}: fp8_target_rows.json, fp8_target_blocks.json,
# fp8_engine_path.json, gpu_checks_fp8.json and their logs. ~4.5 min on an H200;
# `bash scripts/bench_fp8.sh checks` runs the GPU-tier FP8 checks alone (~1.5 min).
set -u
out=${OUT:-runs/bench_fp8}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench() {  # name, extra args...
    local name=$1; shift
    # 3,072-token rows, as measured for docs/performance.md (the bench otherwise takes the recipe's rows)
    timeout 300 python3 -m dflash_ds.bench --role target --seq-len 3072 --set target.quantization=fp8 \
        --out "$out/$name.json" "$@" \
        2>&1 | grep -v "Warning\|warn(\|Configuration class" | tail -30 | tee "$out/$name.log"
}
if [ "${1:-all}" != checks ]; then
    bench fp8_target_rows --compare-bf16
    bench fp8_target_blocks --compare-bf16 --fp8-blocks
    bench fp8_engine_path --layers 16 --steps 5   # the runtime's path: quantized when the engine is built
fi
DFLASH_GPU_RECORD="$out/gpu_checks_fp8.json" timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -k fp8 tests/test_gpu.py 2>&1 | grep -v "Warning\|warn(\|Configuration class\|DEBUG" | tail -15 \
    | tee "$out/gpu_checks_fp8.log"
