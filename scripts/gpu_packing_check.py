"""GPU check of packed rows on a hybrid target at real width (CUDA + flash-linear-attention).

    python scripts/gpu_packing_check.py --layers 8 --out packing.json

Qwen3.6-27B layer geometry (D 5120, 48 value heads of Gated DeltaNet, 24 query heads of gated
full attention), the first `layers` layers, random weights, bf16. Two 3072-token rows packed with
documents of chat-like lengths. Compared per document (relative L2 error over its tokens, every
layer's output):
  - packed: the packed row through target.packed (fla varlen kernel, masked short convolution)
    vs each document alone through the stock transformers forward (fla, no cu_seqlens);
  - noise floor: each document alone in bf16 vs the same weights run in float32 (what bf16 costs
    anyway), beside packed bf16 vs that float32 reference;
  - leak: the stock forward over the packed row (no boundaries in the Gated DeltaNet layers)
    vs each document alone, the error the packed path removes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_ds.data.packing import position_ids_from_doc_ids  # noqa: E402
from dflash_ds.target.model import TapCapture, forward_taps  # noqa: E402
from dflash_ds.target.presets import target_config  # noqa: E402

DOCS = [[700, 1210, 95, 880, 150], [2400, 500, 60]]  # tokens per document; the rest of a row is padding
# Pass rule. bf16 alone costs ~2.7e-2 relative L2 at this depth with random weights (each document
# alone in bf16 vs the same weights in float32, measured on an H200), so a fixed bf16-vs-bf16 bound
# says little: the packed bf16 taps must be as close to the float32 reference as the stock bf16
# forward of each document alone is (within 25%), and the cross-document leak must be far larger.
BF16_SLACK = 1.25
LEAK_FACTOR = 10.0


def build(layers: int, dtype, device):
    from transformers import Qwen3_5ForCausalLM

    cfg = target_config("qwen3.6-27b", layers=layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def rows(seq_len: int, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (len(DOCS), seq_len), generator=g)
    doc_ids = torch.full((len(DOCS), seq_len), -1, dtype=torch.int32)
    for r, lengths in enumerate(DOCS):
        at = 0
        for d, n in enumerate(lengths):
            doc_ids[r, at:at + n] = d
            at += n
    return ids.to(device), doc_ids.to(device)


def run(model, ids, doc_ids, *, packed: bool, alone: bool):
    n = len(model.model.layers)
    d = model.config.hidden_size
    out = torch.zeros(*ids.shape, n * d, dtype=next(model.parameters()).dtype, device=ids.device)
    cap = TapCapture(model, range(n))
    try:
        if alone:
            for r in range(ids.shape[0]):
                at = 0
                for length in DOCS[r]:
                    forward_taps(model, cap, ids[r:r + 1, at:at + length], None, out[r:r + 1, at:at + length])
                    at += length
        else:
            forward_taps(model, cap, ids, position_ids_from_doc_ids(doc_ids), out,
                         doc_ids=doc_ids if packed else None)
    finally:
        cap.remove()
    return out


def per_doc_error(got, want):
    worst = 0.0
    for r, lengths in enumerate(DOCS):
        at = 0
        for length in lengths:
            a, b = got[r, at:at + length].double(), want[r, at:at + length].double()
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
            at += length
    return worst


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def check(layers: int = 8, seq_len: int = 3072) -> dict:
    import importlib.util

    device = "cuda"
    model = build(layers, torch.bfloat16, device)
    ids, doc_ids = rows(seq_len, model.config.vocab_size, device)
    alone = run(model, ids, doc_ids, packed=False, alone=True)
    packed = run(model, ids, doc_ids, packed=True, alone=False)
    stock = run(model, ids, doc_ids, packed=False, alone=False)
    t_packed = timed(lambda: run(model, ids, doc_ids, packed=True, alone=False), reps=3)
    t_stock = timed(lambda: run(model, ids, doc_ids, packed=False, alone=False), reps=3)
    model.float()  # the same weights in float32: the reference bf16 is measured against
    alone32 = run(model, ids, doc_ids, packed=False, alone=True).float()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fla": importlib.util.find_spec("fla") is not None,
        "geometry": f"qwen3.6-27b, first {layers} layers, random weights",
        "rows": DOCS,
        "seq_len": seq_len,
        "pass_rule": f"packed_bf16_vs_alone_fp32 <= {BF16_SLACK} x alone_bf16_vs_alone_fp32 and "
                     f"stock_packed_vs_alone_leak >= {LEAK_FACTOR} x alone_bf16_vs_alone_fp32",
        "packed_vs_alone_bf16": per_doc_error(packed, alone),
        "alone_bf16_vs_alone_fp32": per_doc_error(alone.float(), alone32),
        "packed_bf16_vs_alone_fp32": per_doc_error(packed.float(), alone32),
        "stock_packed_vs_alone_leak": per_doc_error(stock, alone),
        "finite": bool(torch.isfinite(packed).all()),
        "forward_ms_packed_path": 1000 * t_packed,
        "forward_ms_stock_path": 1000 * t_stock,
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    res = check(a.layers)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if passed(res) else 1


def passed(res: dict) -> bool:
    floor = res["alone_bf16_vs_alone_fp32"]
    return (res["finite"] and res["packed_bf16_vs_alone_fp32"] <= BF16_SLACK * floor
            and res["stock_packed_vs_alone_leak"] >= LEAK_FACTOR * floor)


if __name__ == "__main__":
    sys.exit(main())
