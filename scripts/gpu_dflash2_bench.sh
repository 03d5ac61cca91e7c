#!/bin/bash
# DFlash2 drafter speed and memory beside v1 on one GPU, at the flagship width (Qwen3.6-27B geometry,
# recipes/qwen27b-dflash2.yaml: block 8, 5 sliding layers of window 2048), on the recipe's rows (12,288 tokens,
# 2,048 anchors, one row per optimizer step) or, with SEQ_LEN=3072, on 3,072-token rows with 512 anchors (the
# same anchors per token; there the optimizer step, paid once per row, weighs four times as much).
# Both runs use the same recipe, anchors and block size; only drafter.architecture differs, so the
# ratio is the cost of the block convolutions, the selector and its loss (the 2 x 248,320 x 256
# codebooks included).
#   bash scripts/gpu_dflash2_bench.sh OUT_DIR           one H200, under 4 minutes
#   SEQ_LEN=3072 bash scripts/gpu_dflash2_bench.sh OUT_DIR
#   bash scripts/gpu_dflash2_bench.sh OUT_DIR --cpu     the same two runs at toy size on the CPU (a check)
# PROFILE=1 adds a kernel profile of both runs (OUT_DIR/profile_v1.txt, profile_dflash2.txt: bench --profile).
# Writes OUT_DIR/v1.json and OUT_DIR/dflash2.json (python -m dflash_ds.bench --role drafter) and
# OUT_DIR/summary.json: tok/s, peak GiB and parameters of both, and the DFlash2/v1 rate ratio.
set -u
. "$(dirname "$0")/gpu_script_args.sh" "$@"
whole_numbers BUDGET SEQ_LEN
R=recipes/qwen27b-dflash2.yaml
if [ "$MODE" = gpu ]; then
  # Flagship width; the 64-layer geometry's taps; compiled layers as in training (drafter.compile); 6 timed
  # steps after 2 warm-up steps (the first compiles: about a minute from process start with a cold cache).
  ARGS=(--role drafter --recipe "$R" --device cuda --block-size 8 --compile-layers --warmup 2 --steps 6)
  if [ -n "${SEQ_LEN:-}" ]; then ARGS+=(--seq-len "$SEQ_LEN" --anchors $((SEQ_LEN / 6))); fi
  LIMIT=115
else
  # Toy width on the CPU: the tiny geometry (2 drafter layers of width 64), short rows, a small window.
  ARGS=(--role drafter --recipe "$R" --device cpu --geometry tiny --block-size 8 --anchors 16 --seq-len 128
        --warmup 1 --steps 2 --set "drafter.layer_types=[sliding_attention,sliding_attention]"
        --set drafter.sliding_window=64 --set drafter.dflash2.selector_rank=16)
  LIMIT=300
fi
status=0
BUDGET=${BUDGET:-225}  # seconds for both runs: the script ends within 4 minutes
for arch in dflash dflash2; do
  name=$([ "$arch" = dflash ] && echo v1 || echo dflash2)
  left=$((BUDGET - SECONDS))
  [ $left -lt $LIMIT ] && limit=$left || limit=$LIMIT
  if [ $limit -le 10 ]; then echo "$name not started: the ${BUDGET} s budget is spent" >&2; status=1; break; fi
  echo "[$(date +%T)] $name (at most $limit s): $PYTHON -m dflash_ds.bench ${ARGS[*]} --architecture $arch"
  PROF=()
  if [ -n "${PROFILE:-}" ]; then PROF=(--profile "$OUT/profile_$name.txt"); fi
  timeout "$limit" "$PYTHON" -m dflash_ds.bench "${ARGS[@]}" "${PROF[@]}" --architecture "$arch" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || { echo "$name failed (exit $?): see $OUT/$name.log" >&2; tail -5 "$OUT/$name.log" >&2; status=1; }
done
[ $status -eq 0 ] || exit $status
"$PYTHON" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("v1", "dflash2")}
summary = {}
for name, rep in runs.items():
    r = rep["result"]
    mem = r.get("memory", {})
    summary[name] = {"architecture": r.get("architecture"), "tok_s": r["tok_s"], "step_s": r["step_s"]["median"],
                     "peak_gib": mem.get("last_step_peak_gib"), "drafter_params": r.get("drafter_params"),
                     "anchors": rep["args"]["anchors"], "block_size": rep["args"]["block_size"],
                     "device": rep["env"].get("device_name")}
summary["dflash2_over_v1_tok_s"] = summary["dflash2"]["tok_s"] / summary["v1"]["tok_s"]
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
