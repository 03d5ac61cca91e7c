#!/bin/bash
# Rows of whole conversations on one GPU: useful tok/s, padding share, compiles after warm-up and peak
# memory of the target and the drafter on the `chat` and the `long` (long answers) length mixes, in rows
# of the longest conversation (3,072 tokens: data.max_length) against the recipe's rows (data.row_length,
# 12,288 for recipes/qwen27b.yaml), at the same tokens per optimizer step; the full-row rate of
# 3,072-token rows (no padding) is the reference every useful rate is divided by.
#   PART=target  bash scripts/gpu_rows_bench.sh OUT_DIR [RECIPE]   full 3,072-token rows, then the recipe's rows on `long`
#   PART=drafter bash scripts/gpu_rows_bench.sh OUT_DIR [RECIPE]   3,072-token rows, then the recipe's rows, both on `long`
#   PART=chat    bash scripts/gpu_rows_bench.sh OUT_DIR [RECIPE]   the `chat` mix (recipe's rows, then 3,072) and target 3,072 `long`
# Run the parts in this order into the same OUT_DIR, on the same machine: the first two hold the four runs
# that decide the goals, the third reuses their full-row rates and the warm compile caches. Each part
# ends within BUDGET_S (225 s) and OUT_DIR/summary.json always covers every run found in OUT_DIR.
# Why three parts: the first run of each role on a fresh machine compiles its kernels from empty caches
# (fla's autotuning on the target, flex_attention and the compiled layers on the drafter) and took longer
# than 75 s on an H200 for both roles, where the same kind of run took 48 s once warm; so each part opens
# with one cold run under COLD_TIMEOUT (130 s) and gives the next run what is left of the budget.
# Writes OUT_DIR/<role>_<rows>_<mix>.json (the bench's JSON), .log, .rc.json, commands.txt and summary.json.
# The drafter's step costs the same whatever its rows hold (static shapes), so its full-row rate is the
# raw rate of its 3,072-token runs; the target's packed rows run another attention path, so it gets a
# full-row run of its own. A run that cannot get MIN_RUN_S (40 s) of the budget is skipped and marked so.
# Environment: PART (target, drafter, chat or all: the three in one go, for a machine without a time
# limit), TARGET_LAYERS (8: the target's first 8 layers, 6 Gated DeltaNet + 2 full attention; the ratios
# are per layer), STEPS (5), WARMUP (2), DEVICE (auto; cpu runs the same plan as a smoke test, e.g. with
# recipes/tiny.yaml), COLD_TIMEOUT (130), RUN_TIMEOUT (seconds for any later run, 100), BUDGET_S (225;
# with PART=all, per part), MIN_RUN_S (40), COMPILE_LAYERS (1: --compile-layers).
set -u
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/gpu_rows_bench.sh OUT_DIR" "${1:-}") || exit 2
whole_numbers STEPS WARMUP TARGET_LAYERS COLD_TIMEOUT RUN_TIMEOUT BUDGET_S MIN_RUN_S
RECIPE=${2:-recipes/qwen27b.yaml}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
DEVICE=${DEVICE:-auto}
LAYERS=${TARGET_LAYERS:-8}
PART=${PART:-}
COLD_TIMEOUT=${COLD_TIMEOUT:-130}
RUN_TIMEOUT=${RUN_TIMEOUT:-100}
BUDGET_S=${BUDGET_S:-225}
MIN_RUN_S=${MIN_RUN_S:-40}
case "$PART" in
  target|drafter|chat|all) ;;
  *) echo "gpu_rows_bench.sh: set PART=target, PART=drafter or PART=chat (run in that order into one OUT_DIR; PART=all runs the three)" >&2
     exit 2 ;;
esac

# The recipe's rows: SHORT = the longest conversation, LONG = its row length; grad_accum on short rows
# keeps the tokens of an optimizer step equal (4 x 3,072 = 1 x 12,288 for the flagship).
read -r SHORT LONG GA_SHORT GA_LONG < <("$PY" - "$RECIPE" <<'EOF'
import sys
from dflash_ds.config import load_recipe
r = load_recipe(sys.argv[1])
d, o = r.data, r.optim
if d.row_length % d.max_length:
    sys.exit(f"data.row_length ({d.row_length}) is not a multiple of data.max_length ({d.max_length})")
print(d.max_length, d.row_length, o.grad_accum * d.row_length // d.max_length, o.grad_accum)
EOF
) || exit 1
[ -n "${LONG:-}" ] || { echo "could not read the rows of $RECIPE" >&2; exit 1; }
echo "recipe $RECIPE: conversations up to $SHORT tokens, rows of $LONG (grad_accum $GA_LONG; $GA_SHORT on $SHORT-token rows)"

COMMON=(--recipe "$RECIPE" --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP")
COMPILE=(--compile-layers)
if [ "$DEVICE" = cpu ] || [ "${COMPILE_LAYERS:-1}" = 0 ]; then COMPILE=(); fi

bench() {  # CAP NAME ARGS...: one bench run of at most CAP s, its JSON and log under OUT; a failure is recorded, not fatal
  local cap=$1 name=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  rm -f "$OUT/$name.json"  # never summarise a result left by an earlier invocation
  if [ "$left" -lt "$MIN_RUN_S" ]; then
    echo "  $name skipped: ${left} s of the ${BUDGET_S} s budget left"
    echo "{\"rc\": \"skipped\", \"wall_s\": 0}" > "$OUT/$name.rc.json"
    return
  fi
  local limit=$(( left < cap ? left : cap ))
  echo "[$(date +%T)] $name (at most $limit s): python -m dflash_ds.bench ${COMMON[*]} $*" | tee -a "$OUT/commands.txt"
  local t0=$SECONDS
  timeout "$limit" "$PY" -m dflash_ds.bench "${COMMON[@]}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"rc\": $rc, \"wall_s\": $((SECONDS - t0)), \"cap_s\": $limit}" > "$OUT/$name.rc.json"
  if [ $rc -eq 124 ]; then echo "  $name stopped at its $limit s cap (rc 124)"
  elif [ $rc -ne 0 ]; then echo "  $name failed (rc $rc): $(tail -1 "$OUT/$name.log")"; fi
}

T=(--role target --layers "$LAYERS")
D=(--role drafter "${COMPILE[@]}")
S=(--seq-len "$SHORT" --grad-accum "$GA_SHORT")
# Each part: its first run may be cold (COLD_TIMEOUT), the later ones run on warm caches (RUN_TIMEOUT).
run_part() {
  START=$(date +%s)
  echo "part $1 (budget $BUDGET_S s)"
  case "$1" in
    target)
      bench "$COLD_TIMEOUT" "target_${SHORT}_full" "${T[@]}" "${S[@]}"
      bench "$RUN_TIMEOUT" "target_${LONG}_long" "${T[@]}" --lengths long ;;  # the recipe's rows (flags left to the recipe)
    drafter)
      bench "$COLD_TIMEOUT" "drafter_${SHORT}_long" "${D[@]}" "${S[@]}" --lengths long
      bench "$RUN_TIMEOUT" "drafter_${LONG}_long" "${D[@]}" --lengths long ;;
    chat)
      bench "$COLD_TIMEOUT" "target_${LONG}_chat" "${T[@]}" --lengths chat
      bench "$COLD_TIMEOUT" "drafter_${LONG}_chat" "${D[@]}" --lengths chat
      bench "$RUN_TIMEOUT" "target_${SHORT}_chat" "${T[@]}" "${S[@]}" --lengths chat
      bench "$RUN_TIMEOUT" "drafter_${SHORT}_chat" "${D[@]}" "${S[@]}" --lengths chat
      bench "$RUN_TIMEOUT" "target_${SHORT}_long" "${T[@]}" "${S[@]}" --lengths long ;;
  esac
}
T0=$(date +%s)
if [ "$PART" = all ]; then
  for p in target drafter chat; do run_part "$p"; done
else
  run_part "$PART"
fi

"$PY" - "$OUT" "$SHORT" "$LONG" "$(( $(date +%s) - T0 ))" "$PART" <<'EOF'
import json
import sys
from pathlib import Path

out, short, long, wall, part = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


def read(name):
    f, rc = out / f"{name}.json", out / f"{name}.rc.json"
    status = json.loads(rc.read_text()) if rc.is_file() else {"rc": None}
    if not f.is_file():
        return None, status
    return json.loads(f.read_text())["result"], status


summary = {"rows": {"short": short, "recipe": long}, "part": part, "wall_s_this_part": wall, "roles": {}, "goals": {},
           "full_row_reference": {"target": "raw tok/s of full 3,072-token rows",
                                  "drafter": "raw tok/s of its 3,072-token runs (static shapes)"}}
for role in ("target", "drafter"):
    if role == "target":
        ref, _ = read(f"{role}_{short}_full")
        full = ref["tok_s"] if ref else None
    else:  # static shapes: a 3,072-token row costs the same full or padded, so its raw rate is the full-row rate
        raws = [r["tok_s"] for r in (read(f"drafter_{short}_{m}")[0] for m in ("long", "chat")) if r]
        full = sum(raws) / len(raws) if raws else None
    runs = {}
    for rows in (short, long):
        for mix in ("full", "chat", "long"):
            if mix == "full" and (rows != short or role == "drafter"):
                continue
            r, status = read(f"{role}_{rows}_{mix}")
            entry = {"rows": rows, "mix": mix, **status}
            if r:
                useful = r.get("useful_tok_s", r["tok_s"])
                mem = r.get("memory", {})
                entry.update({"tok_s": r["tok_s"], "useful_tok_s": useful, "padding_share": r.get("padding_share", 0.0),
                              "docs_per_row": r.get("docs_per_row"), "useful_vs_full_rows": useful / full if full else None,
                              "graphs_compiled_timed": r.get("compile", {}).get("timed", {}).get("unique_graphs"),
                              "peak_gib_first_last": [mem.get("first_step_peak_gib"), mem.get("last_step_peak_gib")]})
            runs[f"{rows}_{mix}"] = entry
    summary["roles"][role] = {"full_row_tok_s": full, "runs": runs}
    for mix in ("chat", "long"):
        e = runs.get(f"{long}_{mix}", {})
        ok = None if e.get("useful_vs_full_rows") is None else (
            e["useful_vs_full_rows"] >= 1.0 and e["padding_share"] <= 0.03 and not e.get("graphs_compiled_timed"))
        summary["goals"][f"{role}_{mix}"] = {"met": ok, "useful_vs_full_rows": e.get("useful_vs_full_rows"),
                                             "padding_share": e.get("padding_share")}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"{'role':<8} {'rows':>6} {'mix':<5} {'useful tok/s':>13} {'padding':>8} {'vs full rows':>13} {'peak GiB':>9}")
for role, s in summary["roles"].items():
    for e in s["runs"].values():
        if "useful_tok_s" not in e:
            why = {"skipped": "skipped (budget)", None: "not run yet (another PART)", 124: "stopped at its cap"}.get(e["rc"], "failed")
            print(f"{role:<8} {e['rows']:>6} {e['mix']:<5} {why} (rc {e['rc']})")
            continue
        ratio = e["useful_vs_full_rows"]
        peak = e["peak_gib_first_last"][1]
        print(f"{role:<8} {e['rows']:>6} {e['mix']:<5} {e['useful_tok_s']:>13,.0f} {e['padding_share']:>8.2%} "
              f"{(f'{ratio:.3f}' if ratio else '-'):>13} {(f'{peak:.1f}' if peak else '-'):>9}")
print(f"goals (recipe rows: useful >= full 3,072-row rate, padding <= 3%, no compiles after warm-up): "
      + ", ".join(f"{k} {({True: 'met', False: 'NOT met', None: 'not measured'})[v['met']]}"
                  for k, v in summary["goals"].items()))
print(f"part {part}: {wall} s; {out / 'summary.json'} (every run found in {out})")
EOF
