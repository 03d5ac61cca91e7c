#!/bin/bash
# Rows of whole conversations on one GPU: useful tok/s, padding share, compiles after warm-up and peak
# memory of the target and the drafter on the `chat` and the `long` (long answers) length mixes, in rows
# of the longest conversation (3,072 tokens: data.max_length) against the recipe's rows (data.row_length,
# 12,288 for recipes/qwen27b.yaml), at the same tokens per optimizer step; the full-row rate of
# 3,072-token rows (no padding) is the reference every useful rate is divided by.
#   bash scripts/gpu_rows_bench.sh OUT_DIR [RECIPE]
# Writes OUT_DIR/<role>_<rows>_<mix>.json (the bench's JSON), .log, commands.txt and summary.json.
# The drafter's step costs the same whatever its rows hold (static shapes), so its full-row rate is the
# raw rate of its 3,072-token runs; the target's packed rows run another attention path, so it gets a
# full-row run of its own. Nine runs, the most telling first; a run that would end past BUDGET_S is
# skipped (and marked so in the summary), so the script ends within about 4 minutes.
# Environment: TARGET_LAYERS (8: the target's first 8 layers, 6 Gated DeltaNet + 2 full attention; the
# ratios are per layer), STEPS (5), WARMUP (2), DEVICE (auto; cpu runs the same plan as a smoke test, e.g.
# with recipes/tiny.yaml), RUN_TIMEOUT (seconds per run, 75), BUDGET_S (225), COMPILE_LAYERS (1: --compile-layers).
set -u
OUT=$(realpath -m "$1")
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
RUN_TIMEOUT=${RUN_TIMEOUT:-75}
BUDGET_S=${BUDGET_S:-225}
MIN_RUN_S=20

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
START=$(date +%s)

bench() {  # NAME ARGS...: one bench run, its JSON and log under OUT; a failure is recorded, not fatal
  local name=$1; shift
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt "$MIN_RUN_S" ]; then
    echo "  $name skipped: ${left} s of the ${BUDGET_S} s budget left"
    echo "{\"rc\": \"skipped\", \"wall_s\": 0}" > "$OUT/$name.rc.json"
    return
  fi
  local limit=$(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
  echo "[$(date +%T)] $name: python -m dflash_ds.bench ${COMMON[*]} $*" | tee -a "$OUT/commands.txt"
  local t0=$SECONDS
  timeout "$limit" "$PY" -m dflash_ds.bench "${COMMON[@]}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"rc\": $rc, \"wall_s\": $((SECONDS - t0))}" > "$OUT/$name.rc.json"
  if [ $rc -ne 0 ]; then echo "  $name failed (rc $rc): $(tail -1 "$OUT/$name.log")"; fi
}

T=(--role target --layers "$LAYERS")
D=(--role drafter "${COMPILE[@]}")
S=(--seq-len "$SHORT" --grad-accum "$GA_SHORT")
bench "target_${SHORT}_full" "${T[@]}" "${S[@]}"
bench "target_${LONG}_long" "${T[@]}" --lengths long  # the recipe's rows (flags left to the recipe)
bench "drafter_${SHORT}_long" "${D[@]}" "${S[@]}" --lengths long
bench "drafter_${LONG}_long" "${D[@]}" --lengths long
bench "target_${SHORT}_long" "${T[@]}" "${S[@]}" --lengths long
bench "target_${LONG}_chat" "${T[@]}" --lengths chat
bench "drafter_${LONG}_chat" "${D[@]}" --lengths chat
bench "target_${SHORT}_chat" "${T[@]}" "${S[@]}" --lengths chat
bench "drafter_${SHORT}_chat" "${D[@]}" "${S[@]}" --lengths chat

"$PY" - "$OUT" "$SHORT" "$LONG" "$(( $(date +%s) - START ))" <<'EOF'
import json
import sys
from pathlib import Path

out, short, long, wall = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def read(name):
    f, rc = out / f"{name}.json", out / f"{name}.rc.json"
    status = json.loads(rc.read_text()) if rc.is_file() else {"rc": None}
    if not f.is_file():
        return None, status
    return json.loads(f.read_text())["result"], status


summary = {"rows": {"short": short, "recipe": long}, "wall_s": wall, "roles": {}, "goals": {},
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
            print(f"{role:<8} {e['rows']:>6} {e['mix']:<5} {'skipped' if e['rc'] == 'skipped' else 'failed'} (rc {e['rc']})")
            continue
        ratio = e["useful_vs_full_rows"]
        peak = e["peak_gib_first_last"][1]
        print(f"{role:<8} {e['rows']:>6} {e['mix']:<5} {e['useful_tok_s']:>13,.0f} {e['padding_share']:>8.2%} "
              f"{(f'{ratio:.3f}' if ratio else '-'):>13} {(f'{peak:.1f}' if peak else '-'):>9}")
print(f"goals (recipe rows: useful >= full 3,072-row rate, padding <= 3%, no compiles after warm-up): "
      + ", ".join(f"{k} {({True: 'met', False: 'NOT met', None: 'not measured'})[v['met']]}"
                  for k, v in summary["goals"].items()))
print(f"total {wall} s; {out / 'summary.json'}")
EOF
