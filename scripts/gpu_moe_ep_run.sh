#!/bin/bash
# Expert parallelism on GPUs (a 4-GPU machine): the Qwen3.6-35B-A3B geometry (random weights, LAYERS of its
# 40 layers, default 16) trained twice through launch.sh with 2 drafter + 2 target ranks, on the same rows:
#   replica  every target rank holds the whole target (target.expert_parallel 1)
#   ep2      the 2 target ranks hold one target together, 128 of the 256 experts each (expert_parallel 2)
# The two runs draw the same rows and anchors, so their losses agree up to bf16 rounding; summary.json has
# both loss curves, their largest relative difference and the target ranks' tok/s (metrics.jsonl).
#   bash scripts/gpu_moe_ep_run.sh OUT_DIR        (WORK=/dev/shm/dflash: the checkpoint, ~29 GB at 16 layers)
#   RUNS=replica bash scripts/gpu_moe_ep_run.sh OUT_DIR; RUNS=ep2 bash ...   the two runs in two calls (each
#   writes its own directory; the summary covers what OUT_DIR holds)
set -u
. "$(dirname "$0")/script_checks.sh"
OUT=$(out_folder "bash scripts/gpu_moe_ep_run.sh OUT_DIR" "${1:-}") || exit 2
whole_numbers LAYERS STEPS
cd "$(dirname "$0")/.." || exit 1
. ./scripts/setup_env.sh
WORK=${WORK:-/dev/shm/dflash}
LAYERS=${LAYERS:-16}
STEPS=${STEPS:-20}
mkdir -p "$OUT" "$WORK" || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
M=$WORK/qwen36-35b-a3b-rand$LAYERS
if [ ! -f "$M/config.json" ]; then
  "$PYTHON" scripts/make_random_target.py --geometry qwen3.6-35b-a3b --layers "$LAYERS" --out "$M" --chats 128 \
    --chat-tokens 3000 > "$OUT/make_target.log" 2>&1 || { tail -3 "$OUT/make_target.log"; exit 1; }
fi
COMMON=(target.path="$M" data.path="$M/chats.jsonl" data.eval_path="$M/eval.jsonl" data.num_eval=4
        data.cache_dir="$WORK/data_cache" data.regenerate.enabled=false data.split=train eval.max_new_tokens=32
        eval.every_steps=0 optim.max_steps="$STEPS" log.every_steps=1 log.wandb.enabled=false
        checkpoint.every_steps=100000 topology.drafters_per_node=2 topology.targets_per_node=2)
status=0
for name in ${RUNS:-replica ep2}; do
  case $name in replica) n=1 ;; ep2) n=2 ;; *) echo "RUNS: replica and/or ep2, not $name" >&2; exit 2 ;; esac
  echo "[$(date +%T)] $name: deepspeed --num_gpus 4 launch.sh recipes/qwen36-35b-a3b.yaml ${COMMON[*]} target.expert_parallel=$n run.output_dir=$OUT/$name" | tee -a "$OUT/commands.txt"
  timeout 900 deepspeed --num_gpus 4 launch.sh recipes/qwen36-35b-a3b.yaml "${COMMON[@]}" target.expert_parallel="$n" \
    run.output_dir="$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "$name failed: $(tail -1 "$OUT/$name.log")"; status=1; }
done
"$PYTHON" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

from dflash_ds.metrics import read_metrics

out = Path(sys.argv[1])
runs = {}
for name in ("replica", "ep2"):
    recs = [r for r in read_metrics(out / name) if "loss" in r] if (out / name).is_dir() else []
    runs[name] = {"loss": [r["loss"] for r in recs],
                  "target_tok_per_s": [r.get("target_tok_per_s") for r in recs][-5:]}
a, b = runs["replica"]["loss"], runs["ep2"]["loss"]
n = min(len(a), len(b))
summary = {"runs": runs, "steps_compared": n,
           "max_rel_loss_diff": max((abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), default=None)}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
exit $status
