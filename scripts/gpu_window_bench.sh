#!/bin/bash
# Sliding-window drafter layers vs full attention, on one GPU (docs/performance.md, "Sliding windows").
#   bash scripts/gpu_window_bench.sh OUT_DIR
# The v1 drafter at the Qwen3.6-27B width (5 layers, D 5120; --geometry qwen3.6-27b), the same anchors per
# token as the flagship recipe (512 per 3,072 = 1 per 6), block 16, one row per micro-batch:
#   rows of 12,288 tokens (2,048 anchors) and of 3,072 tokens (512 anchors), each with every layer full and
#   with layer_types [S, S, S, S, F], window 2048 (the published Qwen3.6-27B drafter's layout).
# Writes OUT_DIR/{full,swa}_{12288,3072}.json (python -m dflash_ds.bench --role drafter) and OUT_DIR/summary.json
# (tok/s, peak GiB and mask build time per run, the sliding/full ratio per row length), and prints the summary.
# Layers run eager (no --compile-layers; flex_attention is always compiled): the comparison is the attention's.
# About 3 minutes on one H200 (estimated from the bench's recorded start-up and step times); each run is capped
# (RUN_TIMEOUT_LONG / RUN_TIMEOUT_SHORT seconds) and no run starts past BUDGET_S (225) seconds, so the script
# ends within 4 minutes even if one hangs. CPU smoke check of the same commands (tiny sizes):
#   LONG=192 SHORT=96 WINDOW=32 EXTRA="--device cpu --geometry tiny-qwen3" bash scripts/gpu_window_bench.sh /tmp/wb
set -u
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/gpu_window_bench.sh OUT_DIR" "${1:-}") || exit 2
whole_numbers LONG SHORT WINDOW STEPS WARMUP BUDGET_S RUN_TIMEOUT_LONG RUN_TIMEOUT_SHORT
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
LONG=${LONG:-12288}
SHORT=${SHORT:-3072}
WINDOW=${WINDOW:-2048}
EXTRA=${EXTRA:-}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
S=sliding_attention
F=full_attention
FULL_SET=(--set drafter.num_layers=5 --set drafter.layer_types=null --set drafter.sliding_window=null
          --set drafter.is_causal=null)
SWA_SET=(--set drafter.num_layers=5 --set "drafter.layer_types=[$S,$S,$S,$S,$F]" --set "drafter.sliding_window=$WINDOW"
         --set drafter.is_causal=null)

run() {  # run NAME SEQ_LEN CAP_S LAYOUT_ARGS...: at most CAP_S seconds, and never past the script's budget
  local name=$1 len=$2 limit=$3; shift 3
  local left=$((END - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "[$(date +%T)] $name skipped: the ${BUDGET_S} s budget is spent"
    return
  fi
  local cmd=(python -m dflash_ds.bench --role drafter --seq-len "$len" --anchors $((len / 6)) --block-size 16
             --steps "$STEPS" --warmup "$WARMUP" $EXTRA "$@" --out "$OUT/$name.json")
  echo "[$(date +%T)] (cap ${limit} s) ${cmd[*]}" | tee -a "$OUT/commands.txt"
  timeout --kill-after=10 "$limit" "${cmd[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 16 "$OUT/$name.log"
  [ $rc -eq 0 ] || echo "[$(date +%T)] $name exited with $rc (124: over its ${limit} s cap); see $OUT/$name.log"
}

START=$(date +%s)
BUDGET_S=${BUDGET_S:-225}
END=$((START + BUDGET_S))
run "full_$LONG" "$LONG" "${RUN_TIMEOUT_LONG:-80}" "${FULL_SET[@]}"
run "swa_$LONG" "$LONG" "${RUN_TIMEOUT_LONG:-80}" "${SWA_SET[@]}"
run "full_$SHORT" "$SHORT" "${RUN_TIMEOUT_SHORT:-60}" "${FULL_SET[@]}"
run "swa_$SHORT" "$SHORT" "${RUN_TIMEOUT_SHORT:-60}" "${SWA_SET[@]}"

python - "$OUT" "$LONG" "$SHORT" "$WINDOW" "$(( $(date +%s) - START ))" <<'EOF'
import json
import sys
from pathlib import Path

out, lengths, window, wall = Path(sys.argv[1]), sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5])
summary = {"window": window, "layout": ["sliding_attention"] * 4 + ["full_attention"], "wall_s": wall, "runs": {},
           "swa_over_full_tok_s": {}}
for length in lengths:
    for layout in ("full", "swa"):
        path = out / f"{layout}_{length}.json"
        if not path.is_file():
            summary["runs"][f"{layout}_{length}"] = None
            continue
        report = json.loads(path.read_text())
        r = report["result"]
        summary["runs"][f"{layout}_{length}"] = {
            "tok_s": r["tok_s"], "step_s_median": r["step_s"]["median"], "mfu": r.get("mfu"),
            "peak_gib": r.get("memory", {}).get("last_step_peak_gib"),
            "mask_build_s": r["mask"]["build_s"], "mask_kind": r["mask"]["kind"],
            "visible_pairs_per_micro": r["drafter_flops"]["visible_pairs_per_micro"],
            "layer_types": report["geometry"]["drafter"]["layer_types"],
            "sliding_window": report["geometry"]["drafter"]["sliding_window"],
            "anchors": report["args"]["anchors"], "device": report["env"].get("device_name")}
    full, swa = summary["runs"].get(f"full_{length}"), summary["runs"].get(f"swa_{length}")
    if full and swa:
        summary["swa_over_full_tok_s"][length] = swa["tok_s"] / full["tok_s"]
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
for name, run in summary["runs"].items():
    if run is None:
        print(f"{name:>12}: no result")
    else:
        peak = "-" if run["peak_gib"] is None else f"{run['peak_gib']:.1f} GiB"
        print(f"{name:>12}: {run['tok_s']:>10,.0f} tok/s  step {run['step_s_median']:.3f} s  peak {peak}  "
              f"mask {run['mask_build_s'] * 1e3:.1f} ms ({run['mask_kind']})")
for length, ratio in summary["swa_over_full_tok_s"].items():
    print(f"rows of {length}: sliding [S,S,S,S,F] W {window} / full = {ratio:.3f}x tok/s")
print(f"wall {wall} s; written {out / 'summary.json'}")
EOF
