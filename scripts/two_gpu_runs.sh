#!/bin/bash
# The two-GPU measurements of docs/performance.md ("Two GPUs"), one function per experiment.
#   bash scripts/two_gpu_runs.sh OUT_DIR STEP [STEP ...]
# Steps: models benches e1 zero3 replica equal faults. Models and runs live under $WORK (default
# /dev/shm/dflash: the 64-layer bf16 target is 54 GB and loads fastest from memory). Every run is
# `deepspeed launch.sh recipes/qwen27b.yaml` with the overrides printed into OUT_DIR/commands.txt.
set -u
OUT=$(realpath "$1"); shift
WORK=${WORK:-/dev/shm/dflash}
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONFAULTHANDLER=1
M64=$WORK/qwen36-27b-rand64
M16=$WORK/qwen36-27b-rand16
R=recipes/qwen27b.yaml
PORT=29611

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
  log "$name: deepspeed --num_gpus $n --master_port $PORT launch.sh $R $*"
  deepspeed --num_gpus "$n" --master_port "$PORT" launch.sh "$R" "$@" > "$OUT/$name.log" 2>&1 &
  LPID=$!
}

# finish NAME RUN_DIR LIMIT_S: wait for the run; if it has not exited LIMIT_S seconds after its last
# progress line, print every rank's Python stack (SIGABRT -> faulthandler) and kill it.
finish() {
  local name=$1 dir=$2 limit=$3 t0=$SECONDS
  while kill -0 "$LPID" 2>/dev/null; do
    sleep 2
    local last; last=$(stat -c %Y "$OUT/$name.log")
    if (( $(date +%s) - last > limit )); then
      log "$name: no output for ${limit}s: dumping stacks"
      for p in $(pgrep -P "$LPID"); do kill -ABRT "$p"; done
      sleep 5; kill -9 "$LPID" 2>/dev/null
      for p in $(pgrep -P "$LPID"); do kill -9 "$p"; done
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
  CUDA_VISIBLE_DEVICES=0 python -m dflash_ds.bench --role target --steps 10 --warmup 3 --out "$OUT/bench_target.json" > "$OUT/bench_target.log" 2>&1 &
  local p=$!
  CUDA_VISIBLE_DEVICES=1 python -m dflash_ds.bench --role drafter --compile-layers --grad-accum 4 --steps 4 --warmup 2 --out "$OUT/bench_drafter.json" > "$OUT/bench_drafter.log" 2>&1
  wait $p
  python -m dflash_ds.bench --role plan --from "$OUT/bench_target.json" "$OUT/bench_drafter.json" --gpus-per-node 2 > "$OUT/plan.txt" 2>&1
  tail -3 "$OUT/bench_target.log" "$OUT/bench_drafter.log"; cat "$OUT/plan.txt"
}

e1() {  # 1 target GPU + 1 drafter GPU, the full 64-layer geometry
  launch e1_split64 2 $(common "$M64" "$WORK/runs/e1") topology.targets_per_node=1 topology.drafters_per_node=1 \
    optim.max_steps=${E1_STEPS:-40} eval.at_start=false eval.at_end=false
  finish e1_split64 "$WORK/runs/e1" 240
}

zero3() {  # colocated on both GPUs, the target partitioned by ZeRO-3 over both
  launch zero3_colo2 2 $(common "$M16" "$WORK/runs/zero3") topology.colocated=true topology.targets_per_node=0 \
    topology.drafters_per_node=2 optim.grad_accum=2 optim.max_steps=20 target.ds_config=ds_configs/target_zero3.json
  finish zero3_colo2 "$WORK/runs/zero3" ${ZERO3_LIMIT:-90}
  ls "$WORK/runs/zero3" "$WORK/runs/zero3/export" >> "$OUT/zero3_colo2.log" 2>&1
}

replica() {  # colocated on both GPUs, a full target replica on each
  launch replica_colo2 2 $(common "$M16" "$WORK/runs/replica") topology.colocated=true topology.targets_per_node=0 \
    topology.drafters_per_node=2 optim.grad_accum=2 optim.max_steps=20
  finish replica_colo2 "$WORK/runs/replica" 120
}

equal() {  # the same recipe split 1+1 and colocated on 1 GPU (global batch 4 rows as in the 2-rank runs)
  launch equal_split 2 $(common "$M16" "$WORK/runs/split") topology.targets_per_node=1 topology.drafters_per_node=1 \
    optim.grad_accum=4 optim.max_steps=20
  finish equal_split "$WORK/runs/split" 120
  launch equal_colo1 1 $(common "$M16" "$WORK/runs/colo1") topology.colocated=true topology.targets_per_node=0 \
    topology.drafters_per_node=1 optim.grad_accum=4 optim.max_steps=20
  finish equal_colo1 "$WORK/runs/colo1" 120
}

zero3_and_split() {  # both at once on both GPUs: the ZeRO-3 end of training, and split vs 2-rank losses
  launch zero3_colo2 2 $(common "$M16" "$WORK/runs/zero3") topology.colocated=true topology.targets_per_node=0 \
    topology.drafters_per_node=2 optim.grad_accum=2 optim.max_steps=20 target.ds_config=ds_configs/target_zero3.json
  local zpid=$LPID
  launch equal_split 2 $(common "$M16" "$WORK/runs/split") topology.targets_per_node=1 topology.drafters_per_node=1 \
    optim.grad_accum=4 optim.max_steps=20 eval.at_start=false
  local spid=$LPID
  LPID=$zpid; finish zero3_colo2 "$WORK/runs/zero3" ${ZERO3_LIMIT:-90}
  ls -la "$WORK/runs/zero3" "$WORK/runs/zero3/export" >> "$OUT/zero3_colo2.log" 2>&1
  LPID=$spid; finish equal_split "$WORK/runs/split" 120
}

for step in "$@"; do "$step"; done
