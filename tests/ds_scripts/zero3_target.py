"""ZeRO-Inference on the target group while the drafter rank does other work.

Targets: load_target_zero3 (HF from_pretrained under zero_init_on, optional LoRA merged into the
partitioned weights, a forward-only ZeRO-3 engine), then several forward_taps calls whose tapped
states must equal an unsharded load_target of the same checkpoint bit for bit. The drafter never
joins a target collective. Without zero_init_on (`--without zero_init`) or without
skip_zero3_trace_check (`--without trace_check`) this run hangs.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math

import common
import torch
import torch.distributed as dist

from dflash_ds.runtime import deepspeed_patches as patches
from dflash_ds.target_model.model import TapCapture, forward_taps, load_target
from dflash_ds.runtime.zero_inference import load_target_zero3

LAYER_IDS = [0, 2]
ROWS, SEQ = 2, 24


def zero3_config(num_targets: int) -> dict:
    cfg = json.loads((common.ROOT / "ds_configs" / "target_zero3.json").read_text())
    cfg["bf16"] = {"enabled": False}  # float32 on CPU: exact comparison with the unsharded model
    # Partition every weight of the tiny model (the default keeps small ones whole on each rank).
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    # What engine_config.target_ds_config injects for a ZeRO-3 target.
    cfg.update(train_micro_batch_size_per_gpu=ROWS, gradient_accumulation_steps=1, train_batch_size=ROWS * num_targets)
    return cfg


def inputs(i: int, vocab: int):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    # Two packed documents per row: positions restart where the second one begins.
    cut = 7 + 3 * i
    pos = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).expand(ROWS, SEQ).contiguous()
    return ids, pos


def taps(model, batches, hidden: int) -> list[torch.Tensor]:
    capture = TapCapture(model, LAYER_IDS)
    out = [forward_taps(model, capture, ids, pos, out=torch.full((ROWS, SEQ, len(LAYER_IDS) * hidden), float("nan")))
           for ids, pos in batches]
    capture.remove()
    return out


def check_partitioned(model, ctx) -> None:
    n = len(ctx.target_ranks)
    params = list(model.named_parameters())
    assert params
    for name, p in params:
        assert dist.get_process_group_ranks(p.ds_process_group) == ctx.target_ranks, name
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / n), (name, p.ds_tensor.numel(), p.ds_numel)
        assert p.numel() == 0, f"{name} is not partitioned at rest"
        assert not p.requires_grad, name


def run_target(ctx) -> None:
    a = ctx.args
    ref = load_target(a.model, adapter=a.adapter, dtype="float32", last_layer=max(LAYER_IDS))
    hidden, vocab = ref.config.hidden_size, ref.config.vocab_size
    batches = [inputs(i, vocab) for i in range(a.forwards)]
    expected = taps(ref, batches, hidden)
    with torch.no_grad():
        expected_logits = ref(input_ids=batches[0][0], position_ids=batches[0][1], use_cache=False).logits
    if a.adapter:
        plain = load_target(a.model, dtype="float32", last_layer=max(LAYER_IDS))
        assert not torch.equal(taps(plain, batches[:1], hidden)[0], expected[0]), "the adapter changes nothing"
        del plain
    del ref

    cfg = zero3_config(len(ctx.target_ranks))
    if "zero_init" in a.without:
        del cfg["train_batch_size"]  # else zero.Init's batch check (it counts WORLD) fails before any collective
    model = load_target_zero3(a.model, cfg, ctx.target_group, dtype="float32",
                              adapter=a.adapter, last_layer=max(LAYER_IDS))
    gc.collect()  # the engine object must survive the caller keeping only the module
    assert not model.training
    check_partitioned(model, ctx)
    got = taps(model, batches, hidden)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"forward {i}: max |diff| {(g - e).abs().max().item()}"
    coordinator = model.zero_inference_engine.optimizer.get_param_coordinator()
    # The trace completes at the second base-model forward: that is where the WORLD check sat.
    assert coordinator.is_complete_trace(), "forward_taps never finished a ZeRO-3 step"
    # A whole-model forward (lm_head included) in between base-model ones: one step each.
    with torch.no_grad():
        logits = model(input_ids=batches[0][0], position_ids=batches[0][1], use_cache=False).logits
    assert torch.equal(logits, expected_logits)
    assert torch.equal(taps(model, batches[-1:], hidden)[0], expected[-1])
    print(f"rank {ctx.rank}: {a.forwards} ZeRO-3 forwards equal the unsharded model", flush=True)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", default=None)
    p.add_argument("--forwards", type=int, default=3)
    args = p.parse_args()
    if "trace_check" in args.without:
        patches.skip_zero3_trace_check = lambda: None
    if "zero_init" in args.without:
        patches.zero_init_on = lambda group: contextlib.nullcontext()
    common.targets_work(args, run_target)


if __name__ == "__main__":
    main()
