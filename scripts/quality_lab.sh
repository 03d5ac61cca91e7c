#!/usr/bin/env bash
# The quality lab (docs/quality.md), one step per command so that each fits a 10-minute device call:
#   bash scripts/quality_lab.sh OUT [all [NAME...]]      GPU: the whole lab in one command, resumable: the
#     target and its regeneration where missing, then every run (all the catalog's, or the NAMEs) trained
#     at once, then the trained ones evaluated in one process, then the table; with LAB_COMMAND_SECONDS=N
#     it stops within N seconds (the runs still training with a checkpoint) and exits 75: the same command
#     again goes on from there
#   bash scripts/quality_lab.sh OUT prepare              CPU side, needs PyPI: corpus, tokenizer, conversations
#     (carry runs/lab/corpus.jsonl.xz, runs/lab/tokenizer and runs/lab/conversations.tar.xz to the GPU machine)
#   bash scripts/quality_lab.sh OUT target               GPU: the lab target (~5.5 min), then its regeneration
#   bash scripts/quality_lab.sh OUT regenerate           GPU: finish a time-boxed regeneration (resumes)
#   bash scripts/quality_lab.sh OUT train NAME [k=v ...] GPU: one drafter run, trained and evaluated
#   bash scripts/quality_lab.sh OUT run PHASE NAME [k=v ...]   the same, PHASE train, eval or all
#   bash scripts/quality_lab.sh OUT sweep PHASE NAME...  GPU: several runs at once on the one GPU
#   bash scripts/quality_lab.sh OUT evaluate [NAME...]   GPU: the trained runs evaluated in one process
#     (the target loaded once, each response generated once; LAB_EVAL_SECONDS boxes it; exits 75 if cut)
#   bash scripts/quality_lab.sh OUT table                anywhere: OUT/quality_lab.md + OUT/quality_lab_table.json
#   bash scripts/quality_lab.sh OUT detach STEP [ARG...] any step above started in a session of its own (setsid
#     nohup), its output in OUT/detached.log, its exit status in OUT/detached.rc when it ends: it outlives
#     the command that started it, for machines that limit each command but not what it leaves running
#   bash scripts/quality_lab.sh OUT wait [SECONDS]       wait for the detached step: its exit status once it
#     has ended, 75 if it is still running after SECONDS (default: no limit); the log's last lines either way
# NAME is one of lab/catalog.py's runs (a lab recipe + overrides: v1, v1-seed1, dflash2, dspark,
# lilicorr, lilicorr-v1, v1-noanchor, dflash2-noanchor, dspark-b7, v1-fp8, v1-kl, dspark-sizing, v1-full, v1-b8, dflash2-b16; lilicorr-v1 starts
# from v1's export, so a sweep starts it once v1 has trained). PHASE: train (training only), eval (the benchmark
# table, the greedy tau and llama.cpp's count on the held-out prose and on the in-domain set, OUT/NAME.json) or all.
# Every step is resumable: a built target, written regeneration shards and a finished run are reused
# (they live in the ignored LAB_DIR, default runs/lab). What each step leaves in OUT is small (JSON and
# logs): OUT/target.json, OUT/regenerate.json, OUT/NAME.json (the run's summary), OUT/*.log.
# Settings (environment): LAB_DIR; LAB_TARGET_ARGS (extra `python -m lab target` arguments, e.g.
# "--seconds 300" or "--steps 1234" to repeat a recorded run); LAB_FRAME_ARGS (the same for `frame`);
# LAB_REGEN_SECONDS (the regeneration's time box; default: what is left of 540 s after the target, 480 s alone);
# LAB_REGEN_ARGS (extra `python -m lab regenerate` arguments, e.g. "--batch-size 2048");
# LAB_OVERRIDES (recipe key=value settings for the regeneration and every run, e.g. for a CPU check);
# LAB_STEPS (optim.max_steps of a run). DFLASH_PYTHON names the interpreter (scripts/setup_env.sh).
# all: LAB_EVAL_RESERVE (seconds of the box kept from the training for the evaluation), LAB_START_MARGIN (of the
# runs' time, what their start takes before the first step: their loops' box, optim.max_seconds, is the rest;
# default 150), LAB_TRAIN_SECONDS (that box itself, for any run step), LAB_REGEN_BENCH=1 (the target step
# benchmarks the regeneration's two decoders first: OUT/bench_regenerate.json), LAB_SWEEP_MIN /
# LAB_REGEN_MIN / LAB_EVAL_MIN (the least time worth starting the runs, the regeneration, the evaluation).
# sweep: each run gets its own rendezvous port (DFLASH_PORT), its log OUT/NAME.log and a start
# LAB_SWEEP_STAGGER seconds (default 5) after the previous one, so that compilations do not all collide;
# LAB_SWEEP_SECONDS (default: none) stops the runs still training after that many seconds with a
# checkpoint (SIGTERM to launch.sh), for a command's time limit, and LAB_STOP_GRACE seconds (default 60)
# later stops those still going at once (a second SIGTERM); a run that starts from another's export
# starts when that one has trained. The sweep waits for all; it exits 1 naming the runs that failed (or
# could not start), else 75 naming those stopped (rerun the same sweep: they resume), else 0.
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,44p' "$0" >&2
  exit 2
fi

check_settings() {  # OUT and every LAB_* setting, before anything is made or started (lab/settings.py)
  # once per command: the steps this script starts again (a sweep's runs, all's target) inherit the check
  [ -z "${DFLASH_LAB_CHECKED:-}" ] || return 0
  local HERE=$PWD
  (cd "$(dirname "$0")/.." && . ./scripts/setup_env.sh && "$PYTHON" -m lab.settings "$HERE" "$@") || exit 2
  export DFLASH_LAB_CHECKED=1
}
check_settings "$@"
mkdir -p "$1"
OUT=$(cd "$1" && pwd)  # before the cd below: OUT is relative to where the script was started
STEP=${2:-all}
shift
[ $# -gt 0 ] && shift
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
lab() { "$PY" -m lab "$@"; }

need() {  # a file a step needs, and the step that makes it
  if [ ! -e "$1" ]; then echo "[lab] error: $1 is missing; run: bash scripts/quality_lab.sh OUT $2" >&2; exit 2; fi
}

regenerate() {  # $1: its time box in seconds (a group of shards starts only while the last one's time fits)
  local RARGS
  read -r -a RARGS <<< "${LAB_REGEN_ARGS:-}"
  lab --record "$OUT/regenerate.json" regenerate recipes/lab/v1.yaml "${PATHS[@]}" "${EXTRA[@]}" \
    --seconds "$1" "${RARGS[@]}" 2>&1 | tee -a "$OUT/regenerate.log"
}

phase_ok() {
  case "$1" in train|eval|all) ;; *) echo "[lab] error: PHASE '$1': one of train, eval, all" >&2; exit 2 ;; esac
}

one() {  # $1: PHASE, $2: NAME (lab/catalog.py), then key=value settings; output also in OUT/NAME.log
  local PHASE=$1 NAME=$2 SPEC_TEXT
  shift 2
  phase_ok "$PHASE"
  SPEC_TEXT=$(lab run-settings "$NAME" --lab-dir "$LAB") || exit 2
  mapfile -t SPEC <<< "$SPEC_TEXT"
  local RECIPE=${SPEC[0]} RUN="$LAB/runs/$NAME" PIDFILE="$LAB/runs/.$NAME.launch_pid" AFTER
  need "$LAB/target/lab_target.json" target
  if [ "$PHASE" != eval ] && [ ! -f "$RUN/.lab_trained" ]; then
    AFTER=$(lab run-after "$NAME")  # the run whose export this one starts from (drafter.init_from)
    [ -z "$AFTER" ] || need "$LAB/runs/$AFTER/.lab_trained" "train $AFTER"
  fi
  exec > >(tee -a "$OUT/$NAME.log") 2>&1
  SETTINGS=("${PATHS[@]}" "run.output_dir=$RUN" "${SPEC[@]:1}" "${EXTRA[@]}")
  [ -n "${LAB_STEPS:-}" ] && SETTINGS+=("optim.max_steps=$LAB_STEPS")
  # the training loop's own time box: it cools down in time to end inside it (runtime/stopping.py)
  [ -n "${LAB_TRAIN_SECONDS:-}" ] && SETTINGS+=("optim.max_seconds=$LAB_TRAIN_SECONDS")
  SETTINGS+=("$@")
  local T0 RC
  T0=$(date +%s)
  # Four parts, each skipped once done, so that a command cut by its time limit is rerun as is:
  # training (resumes from its last checkpoint), the benchmark table, the held-out and in-domain counts.
  if [ "$PHASE" != eval ] && [ ! -f "$RUN/.lab_trained" ]; then
    mkdir -p "$LAB/runs"
    # in the background only to know launch.sh's PID: a sweep's time box stops it there (a checkpoint first)
    bash launch.sh "$RECIPE" "${SETTINGS[@]}" "eval.benchmarks=[]" &
    echo $! > "$PIDFILE"
    if wait $!; then RC=0; else RC=$?; fi
    rm -f "$PIDFILE"
    if [ "$RC" -eq 75 ]; then
      echo "[lab] $NAME: training stopped with a checkpoint; rerun the same command to resume"
    fi
    [ "$RC" -eq 0 ] || exit "$RC"
    touch "$RUN/.lab_trained"
  fi
  [ "$PHASE" = train ] && return 0
  need "$RUN/.lab_trained" "run train $NAME"
  if [ ! -f "$RUN/benchmarks.json" ]; then
    "$PY" -m dflash_ds.eval.benchmark_table "$RECIPE" "${SETTINGS[@]}"
  fi
  # The exact greedy tau and llama.cpp's count, as the evaluator prints them: on the held-out prose, then
  # on the in-domain set (conversations of the training projects that training did not use)
  local INDOMAIN="$LAB/conversations/indomain.jsonl"
  if [ ! -f "$RUN/lab_eval.json" ]; then
    lab_eval "$LAB/conversations/bench/heldout.jsonl" "$RUN/lab_eval.json"
  fi
  if [ ! -f "$RUN/lab_eval_indomain.json" ]; then
    if [ -f "$INDOMAIN" ]; then
      lab_eval "$INDOMAIN" "$RUN/lab_eval_indomain.json"
    else
      echo "[lab] $NAME: no $INDOMAIN (conversations framed before the in-domain set); its evaluation is skipped"
    fi
  fi
  lab summarize "$RUN" "$NAME" "$OUT/$NAME.json" --wall-s $(( $(date +%s) - T0 ))
}

EVAL_BUDGET=""  # the run's "max_new_tokens bench_limit", read from its recipe once
lab_eval() {  # $1: prompts file, $2: report; RECIPE, SETTINGS and RUN are one()'s
  local NEW LIMIT
  [ -n "$EVAL_BUDGET" ] || EVAL_BUDGET=$("$PY" -c "import sys; from dflash_ds.config import load_recipe; \
r = load_recipe(sys.argv[1], sys.argv[2:]); print(r.eval.max_new_tokens, r.eval.bench_limit)" "$RECIPE" "${SETTINGS[@]}")
  read -r NEW LIMIT <<< "$EVAL_BUDGET"
  "$PY" -m dflash_ds.eval --target "$LAB/target" --drafter "$RUN/export" \
    --prompts "$1" --limit "$LIMIT" --max-new-tokens "$NEW" \
    --chat-template-kwargs '{"enable_thinking": false}' --out "$2"
}

frozen_tree() {  # $1: a PID; it and every process under it, each stopped (SIGSTOP) before its children are
  # listed, so that none starts another meanwhile, and printed; the subtrees of the PIDs in SKIP left out
  local C
  kill -STOP "$1" 2> /dev/null || return 0
  echo "$1"
  for C in $(ps -o pid= --ppid "$1" 2> /dev/null); do
    [[ " ${SKIP[*]-} " == *" $C "* ]] || frozen_tree "$C"
  done
}

# What a sweep has started: each run's shell and its name, global so that its exit traps still see them
# however it ends (an error under `set -e` unwinds the function's locals first).
SWEEP_PIDS=() SWEEP_NAMES=()
stop_started() {  # sweep's traps: the runs it started that are still going, stopped and waited for
  trap - EXIT TERM INT HUP
  local k F SKIP=() OTHERS=() P T LIVE
  for k in "${!SWEEP_PIDS[@]}"; do
    kill -0 "${SWEEP_PIDS[$k]}" 2> /dev/null || continue
    F=$LAB/runs/.${SWEEP_NAMES[$k]}.launch_pid
    [ -f "$F" ] && SKIP+=("$(cat "$F")")
    OTHERS+=("${SWEEP_PIDS[$k]}")
  done
  [ ${#OTHERS[@]} -gt 0 ] || return 0
  # launch.sh's supervisor (SKIP) stops its job with a checkpoint on SIGTERM, so its own processes are
  # left to it; the rest (each run's shell, its log's tee, an evaluation) simply end
  local TREE=()
  for P in "${OTHERS[@]}"; do TREE+=($(frozen_tree "$P")); done
  OTHERS=("${TREE[@]}" ${SKIP[@]+"${SKIP[@]}"})
  echo "[lab] sweep: ending before its runs; stopping what it started (PIDs ${OTHERS[*]})" >&2
  for P in "${OTHERS[@]}"; do kill -TERM "$P" 2> /dev/null || true; done
  for P in "${TREE[@]}"; do kill -CONT "$P" 2> /dev/null || true; done
  # within LAB_STOP_GRACE seconds (the supervisors' checkpoint), then a second SIGTERM stops them at once
  for T in $(seq $(( ${LAB_STOP_GRACE:-60} + 15 ))); do
    LIVE=()
    for P in "${OTHERS[@]}"; do kill -0 "$P" 2> /dev/null && LIVE+=("$P"); done
    [ ${#LIVE[@]} -eq 0 ] && return 0
    if [ "$T" -eq $(( ${LAB_STOP_GRACE:-60} + 1 )) ]; then
      for P in "${LIVE[@]}"; do kill -TERM "$P" 2> /dev/null || true; done
    fi
    sleep 1
  done
  echo "[lab] sweep: still running after the stop: PIDs ${LIVE[*]}" >&2
}

sweep() {  # $1: PHASE, then the runs' names
  local PHASE=${1:-}
  [ $# -ge 2 ] || { echo "[lab] usage: bash scripts/quality_lab.sh OUT sweep train|eval|all NAME..." >&2; exit 2; }
  shift
  phase_ok "$PHASE"
  local NAME AFTERS=() A
  for NAME in "$@"; do lab run-settings "$NAME" > /dev/null || exit 2; done  # every name, before any start
  need "$LAB/target/lab_target.json" target
  # A run that starts from another's export (lab run-after) waits for that run's training when it is in
  # the sweep too; otherwise that run must be trained already. An evaluation waits for nothing.
  if [ "$PHASE" = eval ]; then
    for NAME in "$@"; do AFTERS+=(""); done
  else
    mapfile -t AFTERS < <(lab run-after "$@")
  fi
  local NAMES=("$@") i
  for i in "${!NAMES[@]}"; do
    NAME=${NAMES[$i]} A=${AFTERS[$i]}
    if [ -n "$A" ] && [ ! -f "$LAB/runs/$NAME/.lab_trained" ] && [ ! -f "$LAB/runs/$A/.lab_trained" ] && \
        [[ " $* " != *" $A "* ]]; then
      echo "[lab] error: $NAME starts from $A's export, which is not trained: sweep them together" \
        "(bash scripts/quality_lab.sh OUT sweep $PHASE $A $NAME) or train $A first" >&2
      exit 2
    fi
  done
  # distinct free ports, held together while they are chosen (one per run's launcher)
  local PORTS
  read -r -a PORTS <<< "$("$PY" -c 'import socket, sys
s = [socket.socket() for _ in range(int(sys.argv[1]))]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])' $#)"
  local PIDS=() STATE=() j T0 STOPPED=0 ALIVE P STARTED=0
  T0=$(date +%s)
  start() {  # $1: the run's index; a start after the first waits LAB_SWEEP_STAGGER seconds
    local NAME=${NAMES[$1]}
    rm -f "$LAB/runs/.$NAME.launch_pid"  # a PID left by a command that was killed is not this run's
    [ "$STARTED" -gt 0 ] && sleep "${LAB_SWEEP_STAGGER:-5}"
    DFLASH_PORT=${PORTS[$1]} bash scripts/quality_lab.sh "$OUT" run "$PHASE" "$NAME" > /dev/null 2>&1 &
    PIDS[$1]=$!
    SWEEP_PIDS+=("$!") SWEEP_NAMES+=("$NAME")
    STATE[$1]=started
    STARTED=$((STARTED + 1))
    local FROM=""
    [ -z "${AFTERS[$1]}" ] || FROM=" from ${AFTERS[$1]}'s export"
    echo "[lab] sweep: $NAME started ($PHASE, port ${PORTS[$1]}, log $OUT/$NAME.log)$FROM; PID ${PIDS[$1]}"
  }
  signal_training() {  # SIGTERM to each run still training (its launch.sh's PID), marked stopped
    local k F
    for k in "${!NAMES[@]}"; do
      F=$LAB/runs/.${NAMES[$k]}.launch_pid
      if [ -f "$F" ]; then kill -TERM "$(cat "$F")" 2> /dev/null || true; STATE[$k]=stopped; fi
    done
  }
  # However the sweep ends before its runs (an error, a signal), it stops every process it started.
  trap 'stop_started' EXIT
  trap 'stop_started; exit 143' TERM
  trap 'stop_started; exit 130' INT
  trap 'stop_started; exit 129' HUP
  for i in "${!NAMES[@]}"; do
    STATE[$i]=waiting
    PIDS[$i]=""
    if [ "$PHASE" = train ] && [ -f "$LAB/runs/${NAMES[$i]}/.lab_trained" ]; then
      STATE[$i]=trained  # nothing to start (a resumed `all` would otherwise spend a stagger on each)
    elif [ -z "${AFTERS[$i]}" ] || [ -f "$LAB/runs/${AFTERS[$i]}/.lab_trained" ]; then
      start "$i"
    fi
  done
  while :; do
    ALIVE=0
    for i in "${!NAMES[@]}"; do
      if [ "${STATE[$i]}" = waiting ]; then
        # its parent: trained (start it), still running (wait), or ended without training (it cannot start)
        if [ -f "$LAB/runs/${AFTERS[$i]}/.lab_trained" ]; then
          if [ "$STOPPED" = 0 ]; then start "$i"; else STATE[$i]=halted; fi
        else
          P=""
          for j in "${!NAMES[@]}"; do [ "${NAMES[$j]}" = "${AFTERS[$i]}" ] && P=${PIDS[$j]}; done
          if [ "$STOPPED" != 0 ]; then STATE[$i]=halted
          elif [ -n "$P" ] && ! kill -0 "$P" 2> /dev/null; then STATE[$i]=orphaned
          else ALIVE=1
          fi
        fi
      fi
      [ -n "${PIDS[$i]}" ] && kill -0 "${PIDS[$i]}" 2> /dev/null && ALIVE=1
    done
    [ "$ALIVE" = 0 ] && break
    if [ -n "${LAB_SWEEP_SECONDS:-}" ] && [ "$STOPPED" = 0 ] && [ $(( $(date +%s) - T0 )) -ge "$LAB_SWEEP_SECONDS" ]; then
      echo "[lab] sweep: ${LAB_SWEEP_SECONDS} s passed; stopping the runs still training (with a checkpoint)"
      signal_training
      STOPPED=1
    elif [ "$STOPPED" = 1 ] && [ $(( $(date +%s) - T0 - LAB_SWEEP_SECONDS )) -ge "${LAB_STOP_GRACE:-60}" ]; then
      # A run still compiling when asked to stop finishes its first step before it checkpoints, which
      # can take minutes (seen on the H200: the command ran past its 10-minute limit). The box is a
      # limit: after LAB_STOP_GRACE seconds the signal again stops the rest at once; they resume from
      # their last checkpoint, or start again.
      echo "[lab] sweep: ${LAB_STOP_GRACE:-60} s after the stop; stopping the runs still going at once"
      signal_training
      STOPPED=2
    fi
    sleep 2
  done
  local FAILED=() HALTED=() RC
  for i in "${!NAMES[@]}"; do
    NAME=${NAMES[$i]}
    case "${STATE[$i]}" in
      halted) HALTED+=("$NAME"); echo "[lab] sweep: $NAME not started (${AFTERS[$i]} was still training)"; continue ;;
      orphaned) FAILED+=("$NAME"); echo "[lab] sweep: $NAME not started (${AFTERS[$i]} did not finish training)"; continue ;;
      trained) echo "[lab] sweep: $NAME done (train; trained before)"; continue ;;
    esac
    if wait "${PIDS[$i]}"; then RC=0; else RC=$?; fi
    # stopped by the box (while starting, or by the second signal: no checkpoint then): resumable
    [ "${STATE[$i]}" = stopped ] && [ "$RC" -ne 0 ] && RC=75
    case "$RC" in
      0) echo "[lab] sweep: $NAME done ($PHASE)" ;;
      75) HALTED+=("$NAME"); echo "[lab] sweep: $NAME stopped (it resumes from its last checkpoint, if any)" ;;
      *) FAILED+=("$NAME"); echo "[lab] sweep: $NAME failed (exit $RC; see $OUT/$NAME.log)" ;;
    esac
  done
  echo "[lab] sweep: $(( $(date +%s) - T0 )) s"
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "[lab] error: sweep $PHASE: failed: ${FAILED[*]} (logs in $OUT)" >&2
    exit 1
  fi
  if [ ${#HALTED[@]} -gt 0 ]; then
    echo "[lab] sweep $PHASE: stopped by LAB_SWEEP_SECONDS: ${HALTED[*]}; rerun the same sweep to finish them" >&2
    exit 75
  fi
}

everything() {  # the runs' names (default: the catalog's); LAB_COMMAND_SECONDS boxes the whole command
  local T0 NAMES RC LEFT
  T0=$(date +%s)
  left() { echo $(( ${LAB_COMMAND_SECONDS:-1000000} - ($(date +%s) - T0) )); }
  # each phase's start, in seconds from the command's: a log brought back from a lost machine still times them
  mark() { echo "[lab] all: at $(( $(date +%s) - T0 )) s: $*"; }
  if [ $# -gt 0 ]; then NAMES=("$@"); else read -r -a NAMES <<< "$(lab run-names)"; fi
  for NAME in "${NAMES[@]}"; do lab run-settings "$NAME" > /dev/null || exit 2; done
  if [ ! -f "$LAB/target/lab_target.json" ]; then
    mark "the target, then its regeneration"
    LAB_COMMAND_SECONDS=$(left) bash "$0" "$OUT" target
  elif ! regenerated && [ "$(left)" -ge "${LAB_REGEN_MIN:-150}" ]; then
    mark "the regeneration"
    regenerate "$(left)"  # a group of shards starts only while its time fits, but the first always does
  fi
  if ! regenerated; then
    echo "[lab] all: the regeneration is not complete; rerun the same command to go on" >&2
    exit 75
  fi
  # LAB_EVAL_RESERVE seconds of the box are kept from the training for the evaluation that follows it
  LEFT=$(( $(left) - ${LAB_EVAL_RESERVE:-0} ))
  # a run stopped before its first step (still loading and compiling) ends without a checkpoint
  if [ "$LEFT" -lt "${LAB_SWEEP_MIN:-180}" ]; then
    echo "[lab] all: ${LEFT} s left for the runs; rerun the same command to go on" >&2
    exit 75
  fi
  mark "the runs (${LEFT} s for them)"
  # Each run's loop gets the box less its start (data, target, compilation, held-out answers: LAB_START_MARGIN),
  # so that it cools down and ends by itself; the sweep's own stop at LEFT stays the hard limit.
  local TRAIN=$(( LEFT - ${LAB_START_MARGIN:-150} ))
  [ "$TRAIN" -ge 60 ] || TRAIN=60
  if LAB_SWEEP_SECONDS=$LEFT LAB_TRAIN_SECONDS=${LAB_TRAIN_SECONDS:-$TRAIN} bash "$0" "$OUT" sweep train "${NAMES[@]}"; then
    RC=0; else RC=$?; fi
  # The trained runs are evaluated together in one process, after the training (lab/evaluate.py):
  # the target loaded once and each response generated once, with the GPU to themselves.
  LEFT=$(left)
  if [ "$LEFT" -ge "${LAB_EVAL_MIN:-60}" ]; then
    mark "the evaluation (${LEFT} s for it)"
    evaluate_runs "$LEFT" "${NAMES[@]}" || RC=1
    if [ "$RC" = 0 ] && ! evaluated_all; then RC=75; fi
  else
    echo "[lab] all: ${LEFT} s left; the evaluation waits for the same command again" >&2
    [ "$RC" = 0 ] && RC=75
  fi
  lab table "$OUT" > /dev/null && echo "[lab] all: the table: $OUT/quality_lab.md"
  return "$RC"
}

evaluate_runs() {  # $1: the time box in seconds ("" for none), then the runs' names
  local ARGS
  ARGS=(--names "${@:2}" --lab-dir "$LAB" --settings "${PATHS[@]}")
  [ ${#EXTRA[@]} -eq 0 ] || ARGS+=(--overrides "${EXTRA[@]}")
  [ -z "$1" ] || ARGS+=(--seconds "$1")
  lab --record "$OUT/evaluate.json" evaluate "$OUT" "${ARGS[@]}" 2>&1 | tee -a "$OUT/evaluate.log"
}

evaluated_all() {  # the last evaluation left no run unfinished
  "$PY" -c 'import json, sys; sys.exit(1 if json.load(open(sys.argv[1]))["unfinished"] else 0)' "$OUT/evaluate.json"
}

regenerated() {  # the regeneration's last record says every shard is written
  [ -f "$OUT/regenerate.json" ] && "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("complete") else 1)' \
    "$OUT/regenerate.json"
}

case "$STEP" in
  all)
    everything "$@"
    ;;
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
    # LAB_REGEN_BENCH=1: the static decoder against generate on the same training prompts, once, before the
    # regeneration (python -m dflash_ds.bench --role regenerate; OUT/bench_regenerate.json)
    if [ "${LAB_REGEN_BENCH:-0}" = 1 ] && [ ! -f "$OUT/bench_regenerate.json" ]; then
      read -r -a BARGS <<< "${LAB_REGEN_BENCH_ARGS:---limit 1024 --generate-limit 256 --batch-size 256}"
      "$PY" -m dflash_ds.bench --role regenerate --target "$LAB/target" --prompts "$LAB/conversations/train.jsonl" \
        "${BARGS[@]}" --out "$OUT/bench_regenerate.json" 2>&1 | tee "$OUT/bench_regenerate.log" || true
    fi
    # What is left of a 10-minute command (less a margin for loading and the first group) goes to the regeneration.
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
    one all "$NAME" "$@"
    ;;
  run)
    [ $# -ge 2 ] || { echo "[lab] usage: bash scripts/quality_lab.sh OUT run train|eval|all NAME [key=value ...]" >&2; exit 2; }
    one "$@"
    ;;
  sweep)
    sweep "$@"
    ;;
  evaluate)
    if [ $# -gt 0 ]; then NAMES=("$@"); else read -r -a NAMES <<< "$(lab run-names)"; fi
    need "$LAB/target/lab_target.json" target
    evaluate_runs "${LAB_EVAL_SECONDS:-}" "${NAMES[@]}"
    evaluated_all || exit 75
    ;;
  table)
    lab table "$OUT"
    ;;
  detach)
    [ $# -ge 1 ] || { echo "[lab] usage: bash scripts/quality_lab.sh OUT detach STEP [ARG...]" >&2; exit 2; }
    if [ -f "$OUT/detached.pid" ] && [ ! -f "$OUT/detached.rc" ] && kill -0 "$(cat "$OUT/detached.pid")" 2> /dev/null; then
      echo "[lab] error: a detached step is still running in $OUT (PID $(cat "$OUT/detached.pid")):" \
        "bash scripts/quality_lab.sh OUT wait" >&2
      exit 2
    fi
    rm -f "$OUT/detached.rc" "$OUT/detached.pid"
    # setsid: a session of its own, so that the end of this command (and its process group) leaves it
    # running. The wrapper writes its own PID (setsid may fork, so $! need not be it) and the step's
    # status, whatever way the step ends.
    SESSION=()
    command -v setsid > /dev/null && SESSION=(setsid)
    "${SESSION[@]}" nohup bash -c 'echo $$ > "$1/detached.pid"; bash "$0" "$@"; echo $? > "$1/detached.rc"' \
      scripts/quality_lab.sh "$OUT" "$@" > "$OUT/detached.log" 2>&1 < /dev/null &
    for _ in $(seq 50); do [ -s "$OUT/detached.pid" ] && break; sleep 0.2; done
    [ -s "$OUT/detached.pid" ] || { echo "[lab] error: the detached step did not start; see $OUT/detached.log" >&2; exit 1; }
    echo "[lab] detached: $* (PID $(cat "$OUT/detached.pid"), log $OUT/detached.log);" \
      "then: bash scripts/quality_lab.sh OUT wait [SECONDS]"
    ;;
  wait)
    [ -f "$OUT/detached.pid" ] || { echo "[lab] error: nothing detached in $OUT: bash scripts/quality_lab.sh OUT detach STEP" >&2; exit 2; }
    LIMIT=${1:-}
    T0=$(date +%s)
    while [ ! -f "$OUT/detached.rc" ]; do
      if ! kill -0 "$(cat "$OUT/detached.pid")" 2> /dev/null; then
        sleep 1  # the wrapper writes the status just before it ends
        [ -f "$OUT/detached.rc" ] && break
        echo "[lab] error: the detached step ended without a status (killed?); see $OUT/detached.log" >&2
        tail -n 5 "$OUT/detached.log" >&2
        exit 1
      fi
      if [ -n "$LIMIT" ] && [ $(( $(date +%s) - T0 )) -ge "$LIMIT" ]; then
        tail -n 3 "$OUT/detached.log"
        echo "[lab] wait: still running after ${LIMIT} s"
        exit 75
      fi
      sleep 2
    done
    tail -n 3 "$OUT/detached.log"
    RC=$(cat "$OUT/detached.rc")
    echo "[lab] wait: the detached step ended with status $RC"
    exit "$RC"
    ;;
  *)
    echo "[lab] error: unknown step '$STEP'; one of all, prepare, target, regenerate, train, run, sweep, evaluate, table, detach, wait" >&2
    exit 2
    ;;
esac
