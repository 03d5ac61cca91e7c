#!/bin/bash
# The Qwen3.6-35B-A3B target (random weights from its config) and its 2048-wide drafter on one GPU, and the
# split of an 8-GPU node they imply (recipes/qwen36-35b-a3b.yaml):
#   experts_3072    target, 2 x 3,072-token rows: the routed experts through transformers' eager loop, its
#                   grouped_mm and the project's dflash_grouped, in turn on the same weights (tok/s, MFU on the
#                   active parameters, peak memory, taps against the first)
#   experts_12288   target, the recipe's packed 12,288-token rows (`long` mix): grouped_mm, dflash_grouped
#   fp8_12288       target, the same rows: dflash_grouped in bf16, then the same model in FP8 (projections and
#                   experts), with every layer's error against bf16
#   drafter_12288   the drafter step (ZeRO-2, compiled layers) on the same rows
#   plan_bf16, plan_fp8   python -m dflash_ds.bench --role plan --from TARGET DRAFTER --gpus-per-node 8
#   bash scripts/gpu_moe_bench.sh OUT_DIR           one H200, under 8 minutes (BUDGET_S 450 s for the runs)
#   bash scripts/gpu_moe_bench.sh OUT_DIR --cpu     the same runs at toy size on the CPU (a check of the script)
#   PARTS="experts_3072 experts_12288" bash scripts/gpu_moe_bench.sh OUT_DIR; PARTS="fp8_12288 drafter_12288" ...
#                   some of the runs per call (each call adds to OUT_DIR; the plans and the summary cover what
#                   OUT_DIR holds)
#   PARTS=checks bash scripts/gpu_moe_bench.sh OUT_DIR   the GPU-tier MoE tests alone (not in the default):
#                   pytest -m gpu -k "expert or moe" tests/test_gpu.py, their numbers in gpu_checks_moe.json
# Writes OUT_DIR/<run>.json (the bench's JSON), .log, commands.txt and summary.json (every number above, the
# plans' best splits and the goals: >= 60,000 useful tok/s per GPU at MFU >= 0.45, bounded memory).
set -u
. "$(dirname "$0")/gpu_script_args.sh" "$@"
whole_numbers BUDGET_S
R=recipes/qwen36-35b-a3b.yaml
if [ "$MODE" = gpu ]; then
  BASE=(--recipe "$R" --device cuda --geometry qwen3.6-35b-a3b)
  SHORT=(--seq-len 3072 --rows 2 --grad-accum 1)
  STEPS=(--warmup 2 --steps 4)
  EAGER_STEPS=(--warmup 1 --steps 2)  # the eager loop takes seconds per step
  COMPILE=(--compile-layers)
  CAPS=(170 100 100 110)  # seconds per run; the first pays CUDA start-up, fla's autotuning and 35B of init
else
  BASE=(--recipe "$R" --device cpu --geometry tiny-moe --anchors 16)
  SHORT=(--seq-len 128 --rows 2 --grad-accum 1)
  STEPS=(--warmup 1 --steps 1)
  EAGER_STEPS=(--warmup 1 --steps 1)
  COMPILE=()
  CAPS=(200 200 200 200)
  ROWS=(--seq-len 512)
fi
ROWS=(${ROWS[@]+"${ROWS[@]}"} --lengths long)
BUDGET_S=${BUDGET_S:-450}
ALL="experts_3072 experts_12288 fp8_12288 drafter_12288"
for p in ${PARTS:-}; do
  case " $ALL checks " in *" $p "*) ;; *) echo "PARTS: some of $ALL checks, not $p" >&2; exit 2 ;; esac
done
START=$(date +%s)
[ -n "${PARTS:-}" ] || rm -f "$OUT/commands.txt"
status=0
wants() { case " ${PARTS:-$ALL} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

bench() {  # CAP NAME ARGS...: one bench run within CAP s and what is left of the budget; a failure is recorded
  local cap=$1 name=$2; shift 2
  wants "$name" || return
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  rm -f "$OUT/$name.json"
  if [ "$left" -lt 30 ]; then echo "  $name skipped: ${left} s of the ${BUDGET_S} s budget left"; status=1; return; fi
  local limit=$(( left < cap ? left : cap ))
  echo "[$(date +%T)] $name (at most $limit s): $PYTHON -m dflash_ds.bench $*" | tee -a "$OUT/commands.txt"
  timeout "$limit" "$PYTHON" -m dflash_ds.bench "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then echo "  $name failed (rc $rc): $(tail -1 "$OUT/$name.log")"; status=1; fi
}

if [ "$MODE" = gpu ] && wants checks; then
  DFLASH_GPU_RECORD="$OUT/gpu_checks_moe.json" timeout "$BUDGET_S" "$PYTHON" -m pytest -q -p no:cacheprovider \
    -m gpu -k "expert or moe" tests/test_gpu.py > "$OUT/gpu_checks_moe.log" 2>&1 || status=1
  tail -3 "$OUT/gpu_checks_moe.log"
fi
# The eager loop runs fewer steps than the others: the same process times all three, so the steps apply to all.
bench "${CAPS[0]}" experts_3072 --role target "${BASE[@]}" "${SHORT[@]}" "${EAGER_STEPS[@]}" \
  --experts eager,grouped_mm,dflash_grouped
bench "${CAPS[1]}" experts_12288 --role target "${BASE[@]}" "${ROWS[@]}" "${STEPS[@]}" \
  --experts grouped_mm,dflash_grouped
bench "${CAPS[2]}" fp8_12288 --role target "${BASE[@]}" "${ROWS[@]}" "${STEPS[@]}" \
  --set target.quantization=fp8 --compare-bf16
bench "${CAPS[3]}" drafter_12288 --role drafter "${BASE[@]}" "${ROWS[@]}" "${STEPS[@]}" ${COMPILE[@]+"${COMPILE[@]}"}
for t in experts_12288:bf16 fp8_12288:fp8; do
  src=${t%%:*}; kind=${t##*:}
  if [ -f "$OUT/$src.json" ] && [ -f "$OUT/drafter_12288.json" ]; then
    "$PYTHON" -m dflash_ds.bench --role plan --recipe "$R" --from "$OUT/$src.json" "$OUT/drafter_12288.json" \
      --gpus-per-node 8 --out "$OUT/plan_$kind.json" > "$OUT/plan_$kind.log" 2>&1 || status=1
  fi
done

"$PYTHON" - "$OUT" "$(( $(date +%s) - START ))" <<'PY'
import json
import sys
from pathlib import Path

out, wall = Path(sys.argv[1]), int(sys.argv[2])


def result(name):
    f = out / f"{name}.json"
    return json.loads(f.read_text())["result"] if f.is_file() else None


def brief(r):
    mem = r.get("memory", {})
    return {"tok_s": r["tok_s"], "useful_tok_s": r.get("useful_tok_s", r["tok_s"]), "mfu": r["mfu"],
            "peak_gib": mem.get("max_step_peak_gib"), "step_s": r["step_s"]["median"] if "step_s" in r else None}


summary = {"wall_s": wall, "runs": {}, "plans": {}, "goals": {}}
for name in ("experts_3072", "experts_12288"):
    r = result(name)
    summary["runs"][name] = None if r is None else {
        impl: (e if "error" in e else {**brief(e), "taps_rel_rms_vs_first": e["taps_rel_rms_vs_first"]})
        for impl, e in r["experts_runs"].items()}
r = result("fp8_12288")
summary["runs"]["fp8_12288"] = None if r is None else {
    "bf16": brief(r["bf16"]), "fp8": brief(r), "speedup": r["fp8"]["speedup"],
    "taps_rel_rms": r["fp8"]["taps_rel_rms"], "fp8_experts_modules": r["fp8"].get("fp8_experts_modules")}
r = result("drafter_12288")
summary["runs"]["drafter_12288"] = None if r is None else {**brief(r), "drafter_params": r.get("drafter_params")}
for kind in ("bf16", "fp8"):
    r = result(f"plan_{kind}")
    summary["plans"][kind] = None if r is None else {"best": r["best"], "fractional": r["fractional"],
                                                    "recipe": r["recipe"], "warnings": r["warnings"]}
best = (summary["runs"]["experts_12288"] or {}).get("dflash_grouped") or {}
short = (summary["runs"]["experts_3072"] or {}).get("dflash_grouped") or {}
summary["goals"] = {
    "useful_tok_s_ge_60000": None if "useful_tok_s" not in best else best["useful_tok_s"] >= 60000,
    "mfu_active_ge_0.45": None if "mfu" not in best else best["mfu"] >= 0.45,
    "peak_gib_2x3072": short.get("peak_gib"),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
exit $status
