#!/bin/bash
# The drafter in FP8 (drafter.fp8) on one GPU: the lm_head A/B, the speed of every mode beside bf16 at the
# recipe's rows, and the loss of every mode trained from the same initialisation. BUDGET seconds for the
# parts (510 by default), each capped by what is left (the lm_head part also by LM_HEAD_CAP, 240); on one
# H200 the quality part alone takes about 8 minutes, so it gets a call of its own (PARTS=quality BUDGET=570).
# A speed or quality run cut short keeps the modes and steps it finished, and the summary reads whatever
# is in OUT.
#   PARTS="lm_head speed" bash scripts/gpu_fp8_drafter.sh OUT
#   PARTS="quality" bash scripts/gpu_fp8_drafter.sh OUT     only some parts (lm_head speed quality), into the
#                                                            same OUT (e.g. a second call for what did not fit)
#   PARTS="checks" bash scripts/gpu_fp8_drafter.sh OUT      the GPU-tier FP8 drafter tests alone (not in the default)
# Needs the project's dependencies (PYTHONPATH is set to the repository) and torchao; fla for the target's
# Gated DeltaNet layers in the quality runs. The drafter everywhere is recipes/qwen27b.yaml's (5 layers,
# width 5,120, 32 heads of 128, 8 KV heads, MLP 17,408, [sliding x 4, full] window 2,048, block 16) with the
# Qwen3.6-27B geometry's random-weight lm_head (248,320 x 5,120).
# Writes to OUT:
#   lm_head.json/.log   --role lm_head: one fused-loss chunk's two lm_head GEMMs (1,920 x 248,320 x 5,120 at the
#                       recipe's rows) in bf16, the hand-written FP8 path (exact and fast accumulation of the
#                       input gradient) and torchao's per-row float8 inference on the same weights
#   speed.json/.log     --role drafter --fp8-modes: the drafter step at the recipe's rows (12,288 tokens, 2,048
#                       anchors, one row per optimizer step) in bf16, rowwise, tensorwise and rowwise+lm_head, one
#                       after another in one process: tok/s (mean and median step), ratio to bf16, peak memory
#   plan.json/.log      the planner's 8-GPU split with that FP8 drafter and the FP8 target's measured rate
#                       (TARGET_RATE, 17,183 tok/s: docs/performance.md, "The target in FP8")
#   quality_a.json, quality_b.json/.log   --role quality, two processes side by side on the GPU: Q_MODES_A
#                       (bf16 then rowwise), Q_MODES_B (bf16 seed 1 then rowwise+lm_head); Q_STEPS steps (300) on Q_SEQ-token rows
#                       (1,024, anchors at the recipe's density: 171) of the bundled conversations, taps of the
#                       geometry's random target cut to Q_LAYERS layers (8: taps 1-5)
#   quality.json, quality.txt   the curves side by side, the final losses and their differences from bf16 in
#                       units of the seed-to-seed noise
#   gpu_checks_fp8_drafter.json/.log   PARTS=checks: pytest -m gpu -k fp8_drafter tests/test_gpu.py, its numbers
#   summary.txt         the headline lines of every part
set -u
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/gpu_fp8_drafter.sh OUT" >&2; exit 2
fi
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/gpu_fp8_drafter.sh OUT_DIR" "$1") || exit 2
whole_numbers BUDGET Q_STEPS Q_SEQ Q_LAYERS LM_HEAD_CAP
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT" || exit 1
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  WANDB_MODE=disabled
BUDGET=${BUDGET:-510}
PARTS=${PARTS:-lm_head speed quality}
TARGET_RATE=${TARGET_RATE:-17183}
Q_STEPS=${Q_STEPS:-300}
Q_SEQ=${Q_SEQ:-1024}
Q_LAYERS=${Q_LAYERS:-8}
Q_MODES_A=${Q_MODES_A:-bf16,rowwise}          # the modes of the two quality processes, each in this order
Q_MODES_B=${Q_MODES_B:-bf16@1,rowwise+lm_head}
# The recipe's drafter heads (the bench otherwise gives the drafter the target's).
HEADS=(--set drafter.num_attention_heads=32 --set drafter.num_key_value_heads=8 --set drafter.head_dim=128)
status=0

left() { echo $((BUDGET - SECONDS)); }
part() {  # name, at most seconds, bench args...
  local name=$1 cap=$2; shift 2
  local limit; limit=$(left); [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -le 15 ]; then echo "$name not started: the ${BUDGET} s budget is spent" >&2; status=1; return; fi
  echo "[$(date +%T)] $name (at most $limit s): $PYTHON -m dflash_ds.bench $*"
  timeout "$limit" "$PYTHON" -m dflash_ds.bench "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
    || { echo "$name failed (exit $?): see $OUT/$name.log" >&2; tail -5 "$OUT/$name.log" >&2; status=1; }
}

"$PYTHON" -c "import torchao" 2>/dev/null || { echo "torchao is not importable: pip install 'dflash-ds[fp8]'" >&2; exit 2; }

wants() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if wants checks; then
  DFLASH_GPU_RECORD="$OUT/gpu_checks_fp8_drafter.json" timeout "$(left)" "$PYTHON" -m pytest -q -p no:cacheprovider \
    -m gpu -k fp8_drafter tests/test_gpu.py > "$OUT/gpu_checks_fp8_drafter.log" 2>&1 || status=1
  tail -3 "$OUT/gpu_checks_fp8_drafter.log"
fi
wants lm_head && part lm_head "${LM_HEAD_CAP:-240}" --role lm_head --device cuda "${HEADS[@]}" --warmup 3 --steps 20
wants speed && part speed 270 --role drafter --device cuda --compile-layers "${HEADS[@]}" --warmup 2 --steps 6 \
  --fp8-modes bf16,rowwise,tensorwise,rowwise+lm_head
if wants speed && [ -f "$OUT/speed.json" ]; then
  "$PYTHON" -m dflash_ds.bench --role plan --from "$OUT/speed.json" --target-rate "$TARGET_RATE" --gpus-per-node 8 \
    --out "$OUT/plan.json" > "$OUT/plan.log" 2>&1 || status=1
fi

# Quality: both processes share the GPU (about 50 GB each); what is left of the budget, less the summary's.
limit=$(( $(left) - 10 ))
if ! wants quality; then
  :
elif [ "$limit" -le 60 ]; then
  echo "quality not started: ${limit} s left of the ${BUDGET} s budget" >&2; status=1
else
  Q=(--role quality --device cuda --compile-layers "${HEADS[@]}" --layers "$Q_LAYERS" --seq-len "$Q_SEQ"
     --steps "$Q_STEPS")
  echo "[$(date +%T)] quality a, b (at most $limit s): $PYTHON -m dflash_ds.bench ${Q[*]} --fp8-modes ..."
  timeout "$limit" "$PYTHON" -m dflash_ds.bench "${Q[@]}" --fp8-modes "$Q_MODES_A" --out "$OUT/quality_a.json" \
    > "$OUT/quality_a.log" 2>&1 &
  pa=$!
  timeout "$limit" "$PYTHON" -m dflash_ds.bench "${Q[@]}" --fp8-modes "$Q_MODES_B" \
    --out "$OUT/quality_b.json" > "$OUT/quality_b.log" 2>&1 &
  pb=$!
  wait $pa || { echo "quality a ended with $?: see $OUT/quality_a.log (its curves so far are kept)" >&2; status=1; }
  wait $pb || { echo "quality b ended with $?: see $OUT/quality_b.log (its curves so far are kept)" >&2; status=1; }
fi

"$PYTHON" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

from dflash_ds.bench.fp8_quality import summarize, summary_text

out = Path(sys.argv[1])
lines = []


def read(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        lines.append(f"{name}: no result")
        return None


ab = read("lm_head")
if ab:
    r = ab["result"]
    lines.append(f"lm_head GEMMs per chunk ({r['chunk_rows']} x {r['vocab']} x {r['hidden']}):")
    for name, v in r["lm_head"].items():
        lines.append(f"  {name:<22} {v['logits_ms']:.3f} + {v['input_grad_ms']:.3f} ms = {v['speedup_vs_bf16']:.3f}x "
                     f"bf16; rel. RMS error vs float64: logits {v['logits_rel_rms']:.2e}, input grad "
                     f"{v['input_grad_rel_rms']:.2e}")
speed = read("speed")
if speed:
    lines.append(f"drafter step at {speed['args']['seq_len']}-token rows, {speed['args']['anchors']} anchors "
                 f"({speed.get('env', {}).get('device_name')})" + (", cut short" if speed.get("partial") else "") + ":")
    for name, m in speed["result"]["fp8_modes"].items():
        st = m.get("steadiness") or {}
        lines.append(f"  {name:<22} {m['tok_s']:,.0f} tok/s (median step {m['tok_s_median']:,.0f}) = "
                     f"{m['vs_first']:.3f}x bf16 ({m['vs_first_median']:.3f}x median); peak "
                     f"{m['memory'].get('max_step_peak_gib', 0):.1f} GiB; drift {st.get('drift', float('nan')):+.1%}; "
                     f"compiles in timed steps {m['compile']['timed'].get('unique_graphs')}")
plan = read("plan")
if plan:
    b = plan["result"]["best"]
    lines.append(f"8-GPU plan (target {plan['result']['target_rate']:,.0f}, drafter {plan['result']['drafter_rate']:,.0f} "
                 f"tok/s): {b['targets']} + {b['drafters']} -> {b['tok_s']:,.0f} tok/s ({b['bound']}-bound)")
reports = [r for r in (read("quality_a"), read("quality_b")) if r]
if reports:
    s = summarize([r["result"] for r in reports])
    text = summary_text(s)
    (out / "quality.json").write_text(json.dumps({"summary": s, "runs": [r["result"] for r in reports],
                                                  "partial": [bool(r.get("partial")) for r in reports]}, indent=1) + "\n")
    (out / "quality.txt").write_text(text + "\n")
    lines.append("quality" + (" (a run was cut short: read over the steps all reached)" if any(
        r.get("partial") for r in reports) else "") + ":")
    lines += ["  " + line for line in text.splitlines()]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
exit $status
