"""The FP8 target against the bf16 target in one process, on the same random weights.

    python -m dflash_ds.bench --role target --set target.quantization=fp8 --compare-bf16 [--fp8-blocks]

Builds the bf16 target, times it, records every decoder layer's output on one micro-batch, then
quantizes the same model in place (per-row scales, or --fp8-blocks: the 128 x 128 blocks of a
published FP8 checkpoint), times it again and reports the relative RMS error of every layer's
output against bf16 (the tapped layers singled out): through the whole network, each layer on its
own (fed the bf16 input of that layer), and, as a control, what 1% noise on the bf16 embedding
output becomes layer after layer (how much these random weights amplify any perturbation). The result's rate (tok_s) is the FP8 one, so
the JSON feeds `--role plan` as the FP8 target.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .setup import Setup
from .timing import synchronize


def with_quantization(setup: Setup, quantization: str) -> Setup:
    recipe = setup.recipe
    target = dataclasses.replace(recipe.target, quantization=quantization)
    run = dataclasses.replace(setup.run, recipe=dataclasses.replace(recipe, target=target))
    return dataclasses.replace(setup, run=run)


@torch.no_grad()
def layer_io(model, forward, inputs: list[torch.Tensor] | None = None,
             noise: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every decoder layer's input and output (on the device) during `forward()`.

    inputs: layer i runs on inputs[i] instead of what the layer before it produced, so each layer's
    own error is seen apart from what it inherits. noise: relative Gaussian noise of that RMS added
    to the embedding output (how much the network itself amplifies a small perturbation)."""
    from dflash_ds.target_model.model import base_model, decoder_layers

    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def before(i):
        def hook(module, args):
            ins.append(args[0].detach().clone())
            return None if inputs is None else (inputs[i],) + tuple(args[1:])
        return hook

    def after(module, args, output):
        outs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    def perturb(module, args, output):
        g = torch.Generator(device=output.device).manual_seed(0)
        rms = output.float().pow(2).mean().sqrt()
        return output + (noise * rms * torch.randn(output.shape, generator=g, device=output.device)).to(output.dtype)

    layers = decoder_layers(model)
    handles = [layer.register_forward_pre_hook(before(i)) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(after) for layer in layers]
    if noise:
        handles.append(base_model(model).get_input_embeddings().register_forward_hook(perturb))
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    return ins, outs


def relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float32."""
    diff = (out.float() - ref.float()).pow(2).sum()
    return float((diff / ref.float().pow(2).sum().clamp(min=1e-30)).sqrt())


def run_target_compared(setup: Setup, ceiling: dict) -> dict:
    from dflash_ds.target_model import moe
    from dflash_ds.quantization.fp8 import BLOCKS, ROWS, compile_for, quantize_model

    from .target_side import build_target_model, target_worker, time_target

    a = setup.args
    if setup.recipe.target.quantization != "fp8":
        raise ValueError("--compare-bf16 compares the FP8 target with bf16: add --set target.quantization=fp8")
    plain = with_quantization(setup, "none")
    t_build = time.perf_counter()
    model, kind = build_target_model(plain, not a.no_engine)
    worker = target_worker(plain, model)
    synchronize(setup.device)
    bf16 = time_target(plain, worker, ceiling, t_build, build_s=time.perf_counter() - t_build, engine=kind)
    buf = setup.payload.empty(setup.device)

    def forward():
        worker.fill(buf, 0)

    ref_in, ref_out = layer_io(model, forward)
    control = [relative_rms(o, r) for o, r in zip(layer_io(model, forward, noise=0.01)[1], ref_out)]

    scheme = BLOCKS if a.fp8_blocks else ROWS
    t_quant = time.perf_counter()
    report = quantize_model(model, scheme)
    experts = moe.quantize_experts(model)  # a mixture of experts: its routed experts too (row scales)
    compile_for(model, setup.payload.rows * setup.payload.seq_len)
    synchronize(setup.device)
    quant_s = time.perf_counter() - t_quant
    result = time_target(setup, worker, ceiling, t_quant, build_s=quant_s, engine=kind)
    through = [relative_rms(o, r) for o, r in zip(layer_io(model, forward)[1], ref_out)]
    alone = [relative_rms(o, r) for o, r in zip(layer_io(model, forward, inputs=ref_in)[1], ref_out)]
    taps = setup.tap_ids
    result["fp8"] = {
        "scheme": scheme, "quantize_s": quant_s, "speedup": result["tok_s"] / bf16["tok_s"],
        "speedup_median": result["tok_s_median"] / bf16["tok_s_median"],
        "bf16_tok_s": bf16["tok_s"], "fp8_tok_s": result["tok_s"],
        "taps_rel_rms": {str(k): through[k] for k in taps},
        "taps_own_rel_rms": {str(k): alone[k] for k in taps},
        "layers_rel_rms": through, "layers_own_rel_rms": alone,
        "bf16_embedding_noise_1pct_rel_rms": control,
        "fp8_linears": len(report.fp8), "kept_linears": report.kept, "fused_mlps": len(report.fused_mlps),
        "fp8_experts_modules": len(experts),
        "weight_gib": sum(b.numel() * b.element_size() for b in model.buffers()) / 2**30,
    }
    result["bf16"] = {k: bf16[k] for k in ("tok_s", "tok_s_median", "steadiness", "mfu", "tflops", "step_s", "memory")
                      if k in bf16}
    return result
