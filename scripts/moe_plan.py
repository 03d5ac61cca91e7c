"""Mixture-of-experts targets on 8-GPU nodes, on paper: memory per GPU and tok/s per node.

    python scripts/moe_plan.py --target-rate R --drafter-rate D [--gpu-gib 139] [--link-gbs 350]

R: the measured tok/s of one GPU running the Qwen3.6-35B-A3B target (bench --role target, the recipe's
rows); D: the measured tok/s of one GPU running its 2048-wide drafter (bench --role drafter). For each
target geometry (presets.py), dtype and target.expert_parallel N it prints:
  - GiB per target GPU: the weights of the layers up to the last tap counted exactly on the meta device
    (1/N of the routed experts; FP8 = 1 byte a projection or expert weight, embedding and lm_head in bf16),
    plus the transient memory of one micro-batch (payload buffers, activations, the gathered tokens and one
    chunk of the experts);
  - the per-GPU target rate: R scaled by the active matmul weights per token (35B-A3B's / this target's), x
    the FP8 gain (--fp8-gain, the dense 27B's measured 1.4), less the expert-parallel exchange (6 (N-1) T D
    bytes per MoE layer per rank at --link-gbs, not overlapped);
  - the drafter rate: D scaled by the drafter step's FLOPs (bench/flops.py) at this target's width;
  - the best split of 8 GPUs (targets a multiple of N) and its tok/s per node.
Estimates, not measurements: they assume the per-GPU MFU of the 35B-A3B target and the 2048-wide drafter
carries over to the other widths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GEOMETRIES = ("qwen3.6-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b")
ROW, ANCHORS, BLOCK, TAPS = 12288, 2048, 16, 5


def target_counts(name: str) -> dict:
    """Exact weights (non-expert, routed experts, embedding + head) and active matmul weights per token
    of the layers a 5-tap drafter needs."""
    from transformers import AutoModelForCausalLM

    from dflash_ds.bench.flops import active_linear_params
    from dflash_ds.network.taps import build_target_layer_ids
    from dflash_ds.target_model.model import truncate_after
    from dflash_ds.target_model.moe import experts_linear_params
    from dflash_ds.target_model.presets import target_config

    cfg = target_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    truncate_after(model, max(build_target_layer_ids(cfg.num_hidden_layers, TAPS)))
    layers = model.model.layers
    experts, _ = experts_linear_params(layers)
    layer_params = sum(p.numel() for p in layers.parameters())
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return {"config": cfg, "layers": len(layers), "experts": experts, "rest": layer_params - experts,
            "embed": embed, "active": active_linear_params(layers)["active"]}


def drafter_flops_per_token(cfg) -> float:
    from dflash_ds.bench.flops import drafter_step_flops
    from dflash_ds.config.sections import DrafterConfig
    from dflash_ds.resolve.drafter import drafter_shape

    shape = drafter_shape(cfg, DrafterConfig(num_layers=TAPS, mask_token_id=5))
    pairs = ANCHORS * BLOCK * (ROW // 2 // 4 + BLOCK)  # ~4 conversations a row: half of one before an anchor
    return drafter_step_flops(shape, ROW, ANCHORS * BLOCK, pairs)["total"] / ROW


def gib_per_gpu(c: dict, n: int, fp8: bool) -> float:
    cfg, d = c["config"], c["config"].hidden_size
    w = 1 if fp8 else 2
    weights = (c["rest"] + c["experts"] / n) * w + c["embed"] * 2
    payload = ROW * (TAPS * d + 6) * 2
    transient = 5 * payload + 16 * ROW * d * 2  # bench/plan: payloads in flight + activations
    if n > 1:
        transient += n * ROW * d * 6  # the gathered tokens (bf16) and the partial sums (fp32)
    chunk = min(16384, n * ROW) * cfg.num_experts_per_tok
    transient += chunk * (2 * d + 3 * cfg.moe_intermediate_size) * 2
    return (weights + transient) / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-rate", type=float, required=True, help="tok/s of one GPU, Qwen3.6-35B-A3B target")
    p.add_argument("--drafter-rate", type=float, required=True, help="tok/s of one GPU, its 2048-wide drafter")
    p.add_argument("--fp8-gain", type=float, default=1.4, help="FP8 / bf16 target rate")
    p.add_argument("--gpu-gib", type=float, default=139.0, help="usable memory of one GPU")
    p.add_argument("--link-gbs", type=float, default=350.0, help="all-gather / reduce-scatter bandwidth per GPU, GB/s")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    base = target_counts(GEOMETRIES[0])
    base_drafter = drafter_flops_per_token(base["config"])
    rows = []
    for name in GEOMETRIES:
        c = base if name == GEOMETRIES[0] else target_counts(name)
        cfg = c["config"]
        drafter = a.drafter_rate * base_drafter / drafter_flops_per_token(cfg)
        for fp8 in (False, True):
            for n in (1, 2, 4, 8):
                gib = gib_per_gpu(c, n, fp8)
                if gib > a.gpu_gib or n >= a.gpus:
                    rows.append({"target": name, "fp8": fp8, "expert_parallel": n, "gib_per_gpu": gib, "fits": False})
                    continue
                alone = a.target_rate * base["active"] / c["active"] * (a.fp8_gain if fp8 else 1.0)
                compute = ROW / alone
                exchange = c["layers"] * 6 * (n - 1) * ROW * cfg.hidden_size / (a.link_gbs * 1e9) if n > 1 else 0.0
                target = ROW / (compute + exchange)
                splits = [(t, min(t * target, (a.gpus - t) * drafter)) for t in range(n, a.gpus, n)]
                t, tok_s = max(splits, key=lambda s: s[1])
                rows.append({"target": name, "fp8": fp8, "expert_parallel": n, "gib_per_gpu": gib, "fits": True,
                             "target_tok_s_per_gpu": target, "exchange_share": exchange / (compute + exchange),
                             "drafter_tok_s_per_gpu": drafter, "targets": t, "drafters": a.gpus - t,
                             "node_tok_s": tok_s})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'target':<18} {'dtype':<5} {'EP':>2} {'GiB/GPU':>8} {'target/GPU':>11} {'exchange':>9} "
          f"{'drafter/GPU':>12} {'split':>6} {'tok/s/node':>11}")
    for r in rows:
        head = f"{r['target']:<18} {'fp8' if r['fp8'] else 'bf16':<5} {r['expert_parallel']:>2} {r['gib_per_gpu']:>8.1f}"
        if not r["fits"]:
            print(f"{head}   does not fit (or leaves no drafter GPU)")
            continue
        print(f"{head} {r['target_tok_s_per_gpu']:>11,.0f} {r['exchange_share']:>9.1%} {r['drafter_tok_s_per_gpu']:>12,.0f} "
              f"{r['targets']:>2}+{r['drafters']:<3} {r['node_tok_s']:>11,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
