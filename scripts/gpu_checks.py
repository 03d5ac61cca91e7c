"""GPU correctness checks that CPU CI cannot run (flex_attention has no CPU backward).

    python scripts/gpu_checks.py --out results.json

1. The drafter through compiled flex_attention (BlockMask) vs the identical dense mask through
   SDPA: forward outputs and every parameter gradient, several packed documents, padding blocks.
2. BlockMask construction time at the real size (S=3072, 512 anchors, B=16) and the cold compile
   time of flex_attention forward+backward at the 27B drafter's head geometry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_ds.model.attention import attend, build_mask  # noqa: E402
from dflash_ds.model.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_ds.model.objective import block_inputs, sample_anchors  # noqa: E402
from dflash_ds.data.packing import position_ids_from_doc_ids  # noqa: E402


def packed_row(b, s, docs, device, g):
    bounds = sorted(torch.randperm(s - 2, generator=g)[: docs - 1].add(1).tolist())
    doc_ids = torch.zeros(b, s, dtype=torch.int32)
    for i, start in enumerate(bounds):
        doc_ids[:, start:] = i + 1
    doc_ids[:, s - s // 16:] = -1  # padding tail
    loss_mask = (torch.rand(b, s, generator=g) > 0.2) & (doc_ids >= 0)
    return doc_ids.to(device), loss_mask.to(device)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compare(dtype, device):
    g = torch.Generator().manual_seed(0)
    cfg = DrafterConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e7, rope_scaling=None,
                        max_position_embeddings=8192, vocab_size=1000, num_target_layers=8,
                        target_layer_ids=(1, 3, 5), block_size=16, mask_token_id=999, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).to(device, dtype)
    b, s, n = 2, 1024, 64
    doc_ids, loss_mask = packed_row(b, s, 3, device, g)
    anchors, valid = sample_anchors(loss_mask.cpu(), doc_ids.cpu(), n, g)
    anchors, valid = anchors.to(device), valid.to(device)
    ids = torch.randint(0, 999, (b, s), generator=g).to(device)
    pos = position_ids_from_doc_ids(doc_ids)
    block_ids, block_pos = block_inputs(ids, pos, anchors, 16, 999)
    taps = torch.randn(b, s, 3 * 512, generator=g).to(device, dtype)
    emb = torch.randn(1000, 512, generator=g).to(device, dtype)
    out, grads = {}, {}
    for kind in ("dense", "flex"):
        model.zero_grad()
        mask = build_mask(anchors, valid, doc_ids, 16, kind=kind)
        h = model(emb[block_ids], model.fuse(taps), block_pos, pos, mask)
        h.float().pow(2).mean().backward()
        out[kind] = h.detach()
        grads[kind] = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    worst = max(rel(grads["flex"][k], grads["dense"][k]) for k in grads["dense"])
    return {"dtype": str(dtype), "forward_rel_err": rel(out["flex"], out["dense"]), "worst_grad_rel_err": worst,
            "valid_blocks": int(valid.sum())}


def timing(device):
    g = torch.Generator().manual_seed(1)
    s, n, bsz = 3072, 512, 16
    doc_ids, loss_mask = packed_row(1, s, 2, device, g)
    anchors, valid = sample_anchors(loss_mask.cpu(), doc_ids.cpu(), n, g)
    anchors, valid = anchors.to(device), valid.to(device)
    build_mask(anchors, valid, doc_ids, bsz, kind="flex")  # warm kernels
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        mask = build_mask(anchors, valid, doc_ids, bsz, kind="flex")
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t) / 10 * 1e3
    q = torch.randn(1, 32, n * bsz, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, s + n * bsz, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    t = time.perf_counter()
    attend(q, k, v, mask, 128 ** -0.5).sum().backward()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    mask2 = build_mask(anchors.flip(1).sort(1).values, valid, doc_ids, bsz, kind="flex")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        attend(q, k, v, mask2, 128 ** -0.5).sum().backward()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / 10 * 1e3
    return {"blockmask_build_ms": build_ms, "flex_first_fwd_bwd_s": first_s, "flex_fwd_bwd_ms": step_ms,
            "sparsity": float(mask.block_mask.sparsity())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_checks.json")
    args = p.parse_args()
    device = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "compare": [compare(torch.float32, device), compare(torch.bfloat16, device)], "timing": timing(device)}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__" and "--short-conv" not in sys.argv and "--fused-loss" not in sys.argv:
    main()


def short_conv_check():
    """fla's short-conv kernel (dflash_ds.kernels) against transformers' PyTorch fallback."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen35

    from dflash_ds.target.kernels import use_fla_short_conv

    fallback = qwen35.causal_conv1d_fn
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 3072, 10240, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    w = torch.randn(10240, 4, device="cuda", dtype=torch.bfloat16, generator=g) * 0.3
    ref = fallback(x, w, None, activation="silu")
    if not use_fla_short_conv():
        return {"patched": False}
    out = qwen35.causal_conv1d_fn(x, w, None, activation="silu")
    times = {}
    for name, fn in (("fallback", fallback), ("fla", qwen35.causal_conv1d_fn)):
        for _ in range(3):
            fn(x, w, None, activation="silu")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn(x, w, None, activation="silu")
        torch.cuda.synchronize()
        times[name + "_ms"] = (time.perf_counter() - t) / 20 * 1e3
    qwen35.causal_conv1d_fn = fallback
    return {"patched": True, "rel_err": rel(out.float(), ref.float()), **times}


if __name__ == "__main__" and "--short-conv" in sys.argv:
    print(json.dumps(short_conv_check(), indent=1))


def fused_loss_check():
    """objective.chunked_loss fused (grad in forward) vs the checkpointed autograd path, bf16, 27B sizes."""
    from dflash_ds.model.objective import chunked_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, bs, d, v = 1, 512, 16, 5120, 248320
    hidden = (torch.randn(b, n * bs, d, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(v, d, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, n * bs), device="cuda", generator=g)
    weights = torch.rand(b, n * bs, device="cuda", generator=g)
    norm = weights.sum()
    res = {}
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        for _ in range(2):  # warm (compile)
            h.grad = None
            chunked_loss(h, weight, labels, weights, norm, 16, block_size=bs, fused=fused).loss.backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            h.grad = None
            out = chunked_loss(h, weight, labels, weights, norm, 16, block_size=bs, fused=fused)
            out.loss.backward()
        torch.cuda.synchronize()
        res["fused" if fused else "autograd"] = {"ms": (time.perf_counter() - t) / 5 * 1e3, "loss": float(out.loss),
                                                 "grad": h.grad.float(), "correct": out.correct}
    a, f = res["autograd"], res["fused"]
    return {"autograd_ms": a["ms"], "fused_ms": f["ms"], "loss_autograd": a["loss"], "loss_fused": f["loss"],
            "grad_rel_err": rel(f["grad"], a["grad"]), "correct_equal_frac": float((a["correct"] == f["correct"]).float().mean())}


if __name__ == "__main__" and "--fused-loss" in sys.argv:
    print(json.dumps(fused_loss_check(), indent=1))
