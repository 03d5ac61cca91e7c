#!/bin/bash
# The two-GPU measurements of docs/performance.md ("Two GPUs"), one function per experiment.
#   bash scripts/two_gpu_runs.sh OUT_DIR STEP [STEP ...]
# Steps: models model16 benches e1 colo1 (colo1_full, colo1_small; colo1_pair runs both at once, one per GPU)
# e1_no_overlap split replica zero3 faults kills (and zero3_and_split, zero3_then_faults).
# Models and runs live under $WORK (default /dev/shm/dflash: the 64-layer bf16 target is 54 GB and
# loads fastest from memory). Every run is `deepspeed launch.sh recipes/qwen27b.yaml` with the
# overrides printed into OUT_DIR/commands.txt. The equality runs (colo1, split, replica, zero3) log
# every step; SMALL="drafter.num_layers=1" runs the drafter with one layer (same width) where only
# equality or fault handling is measured, so checkpoints take seconds instead of half a minute.
set -u
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/two_gpu_runs.sh OUT_DIR STEP [STEP ...]" "${1:-}") || exit 2
shift
whole_numbers NUM_EVAL NEW_TOKENS PORT
WORK=${WORK:-/dev/shm/dflash}
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONFAULTHANDLER=1
M64=$WORK/qwen36-27b-rand64
M16=$WORK/qwen36-27b-rand16
R=${RECIPE:-recipes/qwen27b.yaml}
PORT=${PORT:-29611}
SMALL="drafter.num_layers=1"
SPLIT="topology.targets_per_node=1 topology.drafters_per_node=1 optim.grad_accum=4"
COLO2="topology.colocated=true topology.targets_per_node=0 topology.drafters_per_node=2 optim.grad_accum=2"
COLO1="topology.colocated=true topology.targets_per_node=0 topology.drafters_per_node=1 optim.grad_accum=4"
# EQ_EXTRA: overrides for every equality run (e.g. "optim.lr=6e-5" for a setting that does not amplify
# rounding differences); E1_EXTRA: for the 64-layer split (e.g. "log.profile_start=11 log.profile_steps=3").
EQ="optim.max_steps=20 log.every_steps=1 ${EQ_EXTRA:-}"

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/commands.txt"; }

common() {  # overrides shared by every run on model dir $1, output dir $2
  echo "target.path=$1 data.path=$1/chats.jsonl data.eval_path=$1/eval.jsonl data.num_eval=${NUM_EVAL:-8}" \
       "data.cache_dir=$WORK/data_cache eval.max_new_tokens=${NEW_TOKENS:-64} log.every_steps=5 log.wandb.enabled=false" \
       "data.regenerate.enabled=false data.split=train checkpoint.every_steps=100000 checkpoint.keep_last=1" \
       "run.output_dir=$2 ${SHORT:-}"
}

# launch NAME NUM_GPUS OVERRIDES...: runs in the background, pid in $LPID, log in OUT/NAME.log
launch() {
  local name=$1 n=$2; shift 2
  PORT=$((PORT + 1))
  # With CUDA_VISIBLE_DEVICES set (one job per GPU), the launcher takes the GPUs from it instead.
  local gpus="--num_gpus $n"; [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=""
  log "$name: deepspeed $gpus --master_port $PORT launch.sh $R $*"
  # Its own process group (setsid), so finish can end the ranks too, not only the launcher: ranks
  # orphaned by a killed launcher kept a GPU busy under the next run.
  setsid deepspeed $gpus --master_port "$PORT" launch.sh "$R" "$@" > "$OUT/$name.log" 2>&1 &
  LPID=$!
}

# finish NAME RUN_DIR LIMIT_S: wait for the run; if it has not exited LIMIT_S seconds after its last
# output line, print every rank's Python stack (SIGABRT -> faulthandler) and kill the whole job.
finish() {
  local name=$1 dir=$2 limit=$3 t0=$SECONDS
  while kill -0 "$LPID" 2>/dev/null; do
    sleep 2
    local last; last=$(stat -c %Y "$OUT/$name.log")
    if (( $(date +%s) - last > limit )); then
      log "$name: no output for ${limit}s: dumping stacks"
      pkill -ABRT -f -- "--local_rank=.*run.output_dir=$dir( |\$)"
      sleep 5; kill -9 -- "-$LPID" 2>/dev/null
      break
    fi
  done
  wait "$LPID"; local rc=$?
  log "$name: rc=$rc after $((SECONDS - t0))s"
  [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  return 0
}

model16() {
  log "model16: scripts/make_random_target.py --layers 16"
  python scripts/make_random_target.py --layers 16 --out "$M16" --chats 256 > "$OUT/model16.json" 2>"$OUT/model16.err"
  cat "$OUT/model16.json"
}

models() {
  log "models: scripts/make_random_target.py (64 and 16 layers)"
  CUDA_VISIBLE_DEVICES=0 python scripts/make_random_target.py --layers 64 --out "$M64" --chats 256 > "$OUT/model64.json" 2>"$OUT/model64.err" &
  local p=$!
  CUDA_VISIBLE_DEVICES=1 python scripts/make_random_target.py --layers 16 --out "$M16" --chats 256 > "$OUT/model16.json" 2>"$OUT/model16.err"
  wait $p
  cat "$OUT/model64.json" "$OUT/model16.json"
}

benches() {  # the two single-GPU benches at once, one per GPU, then the planner on their JSON
  log "benches: python -m dflash_ds.bench --role target / --role drafter (GPU 0 / GPU 1)"
  CUDA_VISIBLE_DEVICES=0 python -m dflash_ds.bench --role target --seq-len 3072 --steps 10 --warmup 3 --out "$OUT/bench_target.json" > "$OUT/bench_target.log" 2>&1 &
  local p=$!
  CUDA_VISIBLE_DEVICES=1 python -m dflash_ds.bench --role drafter --seq-len 3072 --compile-layers --grad-accum 4 --steps 4 --warmup 2 --out "$OUT/bench_drafter.json" > "$OUT/bench_drafter.log" 2>&1
  wait $p
  python -m dflash_ds.bench --role plan --from "$OUT/bench_target.json" "$OUT/bench_drafter.json" --gpus-per-node 2 > "$OUT/plan.txt" 2>&1
  tail -3 "$OUT/bench_target.log" "$OUT/bench_drafter.log"; cat "$OUT/plan.txt"
}

e1() {  # 1 target GPU + 1 drafter GPU, the full 64-layer geometry (E1_NAME: another run of it)
  local n=${E1_NAME:-e1}
  launch ${n}_split64 2 $(common "$M64" "$WORK/runs/$n") topology.targets_per_node=1 topology.drafters_per_node=1 \
    optim.max_steps=${E1_STEPS:-30} eval.at_start=false eval.at_end=false eval.every_steps=0 ${E1_EXTRA:-}
  finish ${n}_split64 "$WORK/runs/$n" 420
  [ -d "$WORK/runs/$n/profile" ] && cp -r "$WORK/runs/$n/profile" "$OUT/${n}_profile"
  return 0
}

# The 1-GPU references: colocated, global batch 4 rows; the full drafter and the one-layer one.
colo1_full() {
  launch colo1_full 1 $(common "$M16" "$WORK/runs/colo1_full") $COLO1 $EQ
  finish colo1_full "$WORK/runs/colo1_full" 150
}
colo1_small() {
  launch colo1_small 1 $(common "$M16" "$WORK/runs/colo1_small") $COLO1 $EQ $SMALL
  finish colo1_small "$WORK/runs/colo1_small" 150
}
colo1() { colo1_full; colo1_small; }

# The split with the drafter's ZeRO-2 reduction not overlapped (one drafter rank has nothing to
# overlap): no device-wide synchronisation in its backward, so a receive posted ahead cannot stall it.
e1_no_overlap() {
  python - "$WORK/drafter_zero2_no_overlap.json" <<'PY'
import json, sys
cfg = json.load(open("ds_configs/drafter_zero2.json"))
cfg["zero_optimization"]["overlap_comm"] = False
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PY
  E1_NAME=e1_no_overlap E1_EXTRA="drafter.ds_config=$WORK/drafter_zero2_no_overlap.json ${E1_EXTRA:-}" e1
}
colo1_pair() {  # both references at once, one per GPU (own ports: each job's launcher needs one)
  (export CUDA_VISIBLE_DEVICES=0 PORT=29650; colo1_full) &
  (export CUDA_VISIBLE_DEVICES=1 PORT=29660; colo1_small) &
  wait
}

split() {  # 1 target GPU + 1 drafter GPU over NCCL, to compare with colo1_small step by step
  launch split_small 2 $(common "$M16" "$WORK/runs/split_small") $SPLIT $EQ $SMALL
  finish split_small "$WORK/runs/split_small" 150
}

replica() {  # colocated on both GPUs (2 drafter ranks, ZeRO-2 over NCCL), a full target replica on each
  launch replica_colo2 2 $(common "$M16" "$WORK/runs/replica") $COLO2 $EQ
  finish replica_colo2 "$WORK/runs/replica" 150
}

zero3() {  # colocated on both GPUs, the target partitioned by ZeRO-3 over both
  launch zero3_colo2 2 $(common "$M16" "$WORK/runs/zero3") $COLO2 $EQ target.ds_config=ds_configs/target_zero3.json
  finish zero3_colo2 "$WORK/runs/zero3" ${ZERO3_LIMIT:-150}
  ls -la "$WORK/runs/zero3" "$WORK/runs/zero3/export" >> "$OUT/zero3_colo2.log" 2>&1
}

zero3_and_split() {  # both at once on both GPUs (each job has a process on each GPU)
  launch zero3_colo2 2 $(common "$M16" "$WORK/runs/zero3") $COLO2 $EQ target.ds_config=ds_configs/target_zero3.json
  local zpid=$LPID
  launch split_small 2 $(common "$M16" "$WORK/runs/split_small") $SPLIT $EQ $SMALL
  local spid=$LPID
  LPID=$zpid; finish zero3_colo2 "$WORK/runs/zero3" ${ZERO3_LIMIT:-150}
  LPID=$spid; finish split_small "$WORK/runs/split_small" 150
}

# kill9 NAME LOCAL_RANK STEP: a split run with a checkpoint every 5 steps; once the log shows step
# STEP, SIGKILL the process of LOCAL_RANK (0 = the drafter, 1 = the target: drafters take the first
# ranks) and time how long the job takes to end; the lines naming the peer go to OUT/faults.txt.
kill9() {
  local name=$1 rank=$2 at=$3 dir=$WORK/runs/$1
  launch "$name" 2 $(common "$M16" "$dir") $SPLIT $EQ $SMALL checkpoint.every_steps=5 eval.at_start=false \
    eval.at_end=false
  local t0=$SECONDS
  until grep -q "^step $at/" "$OUT/$name.log" 2>/dev/null; do
    if ! kill -0 "$LPID" 2>/dev/null || (( SECONDS - t0 > 300 )); then log "$name: never reached step $at"; return 0; fi
    sleep 0.2
  done
  local victim; victim=$(pgrep -f -- "--local_rank=$rank .*run.output_dir=$dir( |\$)" | head -1)
  log "$name: step $at logged after $((SECONDS - t0))s; kill -9 local rank $rank (pid $victim)"
  local k0; k0=$(date +%s%N)
  kill -9 "$victim"
  finish "$name" "$dir" 200
  local k1; k1=$(date +%s%N)
  echo "$name: kill -9 of local rank $rank at step $at -> job ended after $(( (k1 - k0) / 1000000 )) ms" >> "$OUT/faults.txt"
  grep -v "^step " "$OUT/$name.log" | grep -iE "peer|died|lost|timeout|exit|signal|killed" | tail -8 | cut -c1-400 >> "$OUT/faults.txt"
}

# ZeRO-3 colocated alone until its last step, then (during its checkpoint, export and eval) the split
# equality run and both kill -9 runs at once; throughput is read only from runs that had the GPUs alone.
zero3_then_faults() {
  launch zero3_colo2 2 $(common "$M16" "$WORK/runs/zero3") $COLO2 $EQ target.ds_config=${ZERO3_CONFIG:-ds_configs/target_zero3.json} \
    eval.at_start=false
  local zpid=$LPID t0=$SECONDS
  until grep -q "^step 20/" "$OUT/zero3_colo2.log" 2>/dev/null || ! kill -0 "$zpid" 2>/dev/null || (( SECONDS - t0 > 300 )); do
    sleep 1
  done
  (PORT=29700; split) &
  kills &
  LPID=$zpid; finish zero3_colo2 "$WORK/runs/zero3" ${ZERO3_LIMIT:-150}
  ls -la "$WORK/runs/zero3" "$WORK/runs/zero3/export" >> "$OUT/zero3_colo2.log" 2>&1
  wait
  PORT=30000
  launch fault_resume 2 $(common "$M16" "$WORK/runs/fault_drafter") $SPLIT $EQ $SMALL checkpoint.every_steps=5 \
    eval.at_start=false eval.at_end=false
  finish fault_resume "$WORK/runs/fault_drafter" 150
  grep -iE "resum" "$OUT/fault_resume.log" | head -3 >> "$OUT/faults.txt"
}

kills() {  # kill -9 the drafter of one split run and the target of another, both runs at once
  (PORT=29800; kill9 fault_drafter 0 6) &
  (PORT=29900; kill9 fault_target 1 6) &
  wait
}

faults() {  # kill -9 the drafter, then the target; resume the first run to step 20 (compare with split_small)
  kill9 fault_drafter 0 8
  kill9 fault_target 1 8
  launch fault_resume 2 $(common "$M16" "$WORK/runs/fault_drafter") $SPLIT $EQ $SMALL checkpoint.every_steps=5 \
    eval.at_start=false eval.at_end=false
  finish fault_resume "$WORK/runs/fault_drafter" 150
  grep -iE "resum" "$OUT/fault_resume.log" | head -3 >> "$OUT/faults.txt"
}

known_steps "bash scripts/two_gpu_runs.sh OUT_DIR STEP [STEP ...]" "$@"  # every step before the first one runs
for step in "$@"; do "$step"; done
