#!/usr/bin/env bash
# The quality lab (docs/quality.md), one step per command so that each fits a 10-minute device call:
#   bash scripts/quality_lab.sh OUT prepare              CPU side, needs PyPI: corpus, tokenizer, conversations
#     (carry runs/lab/corpus.jsonl.xz, runs/lab/tokenizer and runs/lab/conversations.tar.xz to the GPU machine)
#   bash scripts/quality_lab.sh OUT target               GPU: the lab target (~7.5 min), then its regeneration
#   bash scripts/quality_lab.sh OUT regenerate           GPU: finish a time-boxed regeneration (resumes)
#   bash scripts/quality_lab.sh OUT train NAME [k=v ...] GPU: one drafter: v1, v1-seed1, dflash2, dspark
#   bash scripts/quality_lab.sh OUT table                anywhere: OUT/quality_lab.md + OUT/quality_lab_table.json
# Every step is resumable: a built target, written regeneration shards and a finished run are reused
# (they live in the ignored LAB_DIR, default runs/lab). What each step leaves in OUT is small (JSON and
# logs): OUT/target.json, OUT/regenerate.json, OUT/NAME.json (the run's summary), OUT/*.log.
# Settings (environment): LAB_DIR; LAB_TARGET_ARGS (extra `python -m dflash_ds.lab target` arguments, e.g.
# "--seconds 300" or "--steps 1234" to repeat a recorded run); LAB_FRAME_ARGS (the same for `frame`);
# LAB_REGEN_SECONDS (the regeneration's time box; default: what is left of 540 s after the target, 480 s alone);
# LAB_OVERRIDES (recipe key=value settings for the regeneration and every run, e.g. for a CPU check);
# LAB_STEPS (optim.max_steps of a run). DFLASH_PYTHON names the interpreter (scripts/setup_env.sh).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)  # before the cd below: OUT is relative to where the script was started
STEP=$2
shift 2
cd "$(dirname "$0")/.."
. ./scripts/setup_env.sh  # $PYTHON: DFLASH_PYTHON, the project's .venv or the active interpreter
PY=$PYTHON
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline}
LAB=${LAB_DIR:-runs/lab}
mkdir -p "$LAB"
read -r -a EXTRA <<< "${LAB_OVERRIDES:-}"
# The lab directory's paths, given to every recipe so that LAB_DIR moves all of them together.
PATHS=("target.path=$LAB/target" "data.path=$LAB/conversations/train.jsonl"
       "data.eval_path=$LAB/conversations/bench/heldout.jsonl" "data.regenerate.output_dir=$LAB/regenerated"
       "data.cache_dir=$LAB/.data_cache" "eval.bench_dir=$LAB/conversations/bench")
lab() { "$PY" -m dflash_ds.lab "$@"; }

need() {  # a file a step needs, and the step that makes it
  if [ ! -e "$1" ]; then echo "[lab] error: $1 is missing; run: bash scripts/quality_lab.sh OUT $2" >&2; exit 2; fi
}

regenerate() {  # $1: its time box in seconds (it stops after the shard that passes it)
  lab --record "$OUT/regenerate.json" regenerate recipes/lab/v1.yaml "${PATHS[@]}" "${EXTRA[@]}" \
    --seconds "$1" 2>&1 | tee -a "$OUT/regenerate.log"
}

case "$STEP" in
  prepare)
    [ -f "$LAB/corpus.jsonl.xz" ] || lab --record "$OUT/corpus.json" corpus --out "$LAB/corpus.jsonl.xz"
    [ -f "$LAB/tokenizer/tokenizer.json" ] || lab --record "$OUT/tokenizer.json" tokenizer \
      --corpus "$LAB/corpus.jsonl.xz" --out "$LAB/tokenizer"
    [ -f "$LAB/conversations/train.jsonl" ] || lab --record "$OUT/frame.json" frame \
      --corpus "$LAB/corpus.jsonl.xz" --out "$LAB/conversations"
    # carried to the GPU machine beside the corpus: framing there would take the target's minutes
    [ -f "$LAB/conversations.tar.xz" ] || tar -cJf "$LAB/conversations.tar.xz" -C "$LAB" conversations
    ;;
  target)
    T0=$(date +%s)
    need "$LAB/corpus.jsonl.xz" prepare
    need "$LAB/tokenizer/tokenizer.json" prepare
    read -r -a FARGS <<< "${LAB_FRAME_ARGS:-}"
    if [ ! -f "$LAB/conversations/train.jsonl" ] && [ -f "$LAB/conversations.tar.xz" ]; then
      tar -xJf "$LAB/conversations.tar.xz" -C "$LAB"
    fi
    [ -f "$LAB/conversations/train.jsonl" ] || lab --record "$OUT/frame.json" frame \
      --corpus "$LAB/corpus.jsonl.xz" --out "$LAB/conversations" "${FARGS[@]}"
    if [ ! -f "$LAB/target/lab_target.json" ]; then
      read -r -a TARGS <<< "${LAB_TARGET_ARGS:-}"
      TOKENIZERS_PARALLELISM=true lab target --corpus "$LAB/corpus.jsonl.xz" --tokenizer "$LAB/tokenizer" \
        --conversations "$LAB/conversations" --out "$LAB/target" "${TARGS[@]}" 2>&1 | tee "$OUT/target.log"
    fi
    cp "$LAB/target/lab_target.json" "$OUT/target.json"
    # What is left of a 10-minute command (less a margin for the last shard) goes to the regeneration.
    LEFT=$(( ${LAB_COMMAND_SECONDS:-540} - ($(date +%s) - T0) ))
    if [ "$LEFT" -ge 40 ]; then
      regenerate "${LAB_REGEN_SECONDS:-$LEFT}"
    else
      echo "[lab] the target took the command's time; next: bash scripts/quality_lab.sh OUT regenerate"
    fi
    ;;
  regenerate)
    need "$LAB/target/lab_target.json" target
    regenerate "${LAB_REGEN_SECONDS:-480}"
    ;;
  train)
    NAME=${1:?usage: bash scripts/quality_lab.sh OUT train NAME [key=value ...]}
    shift
    RECIPE=recipes/lab/${NAME%%-seed*}.yaml
    need "$RECIPE" "train v1|v1-seed1|dflash2|dspark"
    need "$LAB/target/lab_target.json" target
    SEED=0
    case "$NAME" in *-seed*) SEED=${NAME##*-seed} ;; esac
    RUN="$LAB/runs/$NAME"
    SETTINGS=("${PATHS[@]}" "run.output_dir=$RUN" "run.seed=$SEED" "${EXTRA[@]}")
    [ -n "${LAB_STEPS:-}" ] && SETTINGS+=("optim.max_steps=$LAB_STEPS")
    SETTINGS+=("$@")
    T0=$(date +%s)
    # Three parts, each skipped once done, so that a command cut by its time limit is rerun as is:
    # training (resumes from its last checkpoint), the benchmark table, llama.cpp's count.
    if [ ! -f "$RUN/.lab_trained" ]; then
      bash launch.sh "$RECIPE" "${SETTINGS[@]}" "eval.benchmarks=[]" 2>&1 | tee -a "$OUT/$NAME.log"
      touch "$RUN/.lab_trained"
    fi
    if [ ! -f "$RUN/benchmarks.json" ]; then
      "$PY" -m dflash_ds.eval.benchmark_table "$RECIPE" "${SETTINGS[@]}" 2>&1 | tee -a "$OUT/$NAME.log"
    fi
    # llama.cpp's count on the held-out prose (greedy), as the evaluator prints it beside tau
    if [ ! -f "$RUN/lab_eval.json" ]; then
      MAX_NEW=$("$PY" -c "import sys; from dflash_ds.config import load_recipe; r = load_recipe(sys.argv[1], sys.argv[2:]); \
print(r.eval.max_new_tokens, r.eval.bench_limit)" "$RECIPE" "${SETTINGS[@]}")
      read -r NEW LIMIT <<< "$MAX_NEW"
      "$PY" -m dflash_ds.eval --target "$LAB/target" --drafter "$RUN/export" \
        --prompts "$LAB/conversations/bench/heldout.jsonl" --limit "$LIMIT" --max-new-tokens "$NEW" \
        --chat-template-kwargs '{"enable_thinking": false}' --out "$RUN/lab_eval.json" 2>&1 | tee -a "$OUT/$NAME.log"
    fi
    lab summarize "$RUN" "$NAME" "$OUT/$NAME.json" --wall-s $(( $(date +%s) - T0 ))
    ;;
  table)
    lab table "$OUT"
    ;;
  *)
    echo "[lab] error: unknown step '$STEP'; one of prepare, target, regenerate, train, table" >&2
    exit 2
    ;;
esac
