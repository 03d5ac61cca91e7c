"""Regeneration speed: `python -m dflash_ds.bench --role regenerate --target PATH --prompts FILE`.

The two decoders of the hf regeneration backend (dflash_ds/data/decoders.py) on the same prompts (the
first assistant turn's prompt of each of the first `--limit` conversations of FILE, as the regeneration
renders it), greedy, `--max-new-tokens` a turn:

- `static`: the static decoder with `--slots` rows (CUDA graphs on a GPU);
- `generate`: transformers' generate in batches of `--batch-size` (the decoder regeneration used before),
  on the first `--generate-limit` prompts (it is the slow one);
- their answers compared on the prompts both decoded: identical answers, and the share of tokens before
  the first difference. In bfloat16 two batched decoders may part at a near tie; the same comparison in
  float64 on `--exact-limit` prompts (`--exact-new-tokens` each) is where they must be equal token for token.

Rates are generated tokens per second (the stop token counted), wall time from the first prompt to the
last answer on the host, the model loaded beforehand.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

from dflash_ds.safety import Exit, say


def read_prompts(path: str, tokenizer, limit: int, *, thinking: bool = False) -> list[list[int]]:
    from dflash_ds.data.chat import ChatEncoder, SampleError, detect_schema, normalize

    enc = ChatEncoder(tokenizer, thinking)
    out = []
    for line in Path(path).read_text().splitlines():
        if len(out) >= limit:
            break
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            msgs = normalize(row, detect_schema(list(row), "--prompts", path))
            k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            out.append(enc.prompt_ids(msgs[:k]))
        except (SampleError, StopIteration):
            continue
    if not out:
        raise ValueError(f"--prompts {path}: no conversation with an assistant turn")
    return out


def _timed(gen, prompts) -> tuple[list, dict]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    answers = gen(prompts, 0)
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) + int(fin) for ids, fin in answers)
    return answers, {"prompts": len(prompts), "seconds": seconds, "generated_tokens": tokens,
                     "tok_s": tokens / max(seconds, 1e-9), "unfinished": sum(not fin for _, fin in answers)}


def agreement(a: list, b: list) -> dict:
    """Identical answers, and the tokens before the first difference as a share of the tokens of `a`."""
    same = sum(x == y for x, y in zip(a, b))
    shared = total = 0
    for (x, fx), (y, fy) in zip(a, b):
        xs, ys = x + [-1] * fx, y + [-1] * fy  # the stop counts as a token
        n = next((i for i, (u, v) in enumerate(zip(xs, ys)) if u != v), min(len(xs), len(ys)))
        shared, total = shared + n, total + len(xs)
    return {"answers": len(a), "identical": same, "identical_share": same / max(len(a), 1),
            "prefix_token_share": shared / max(total, 1)}


def run(args) -> dict:
    import torch

    from dflash_ds.data.decoders import HFGenerator, StaticGenerator, load_causal_lm
    from dflash_ds.data.sources import load_tokenizer

    tok = load_tokenizer(args.target)
    n = max(args.limit, args.generate_limit, args.exact_limit)
    prompts = read_prompts(args.prompts, tok, n)
    st = SimpleNamespace(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, slots=args.slots)
    model, device = load_causal_lm(args.target)
    static = StaticGenerator(args.target, tok, st, device, model=model)
    # one short untimed call: the first CUDA graphs and kernels' set-up belong to no measured rate
    static(prompts[:min(8, len(prompts))], 0)
    answers, static_rate = _timed(static, prompts[:args.limit])
    static_rate["graph_failure"] = static.decoder.graph_failure
    gen = HFGenerator(args.target, tok, st, device, batch_size=args.batch_size, model=model)
    m = min(args.generate_limit, len(prompts))
    ref, gen_rate = _timed(gen, prompts[:m])
    out = {"static": static_rate, "generate": gen_rate, "speedup": static_rate["tok_s"] / max(gen_rate["tok_s"], 1e-9),
           "agreement": agreement(ref, answers[:m]), "dtype": str(next(model.parameters()).dtype),
           "device": torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"}
    if args.exact_limit:
        # float64: both decoders' arithmetic exact enough that their greedy answers must be equal
        exact = SimpleNamespace(**{**vars(st), "max_new_tokens": args.exact_new_tokens})
        m64, _ = load_causal_lm(args.target, device, torch.float64)
        few = prompts[:args.exact_limit]
        a = StaticGenerator(args.target, tok, exact, device, model=m64)(few, 0)
        b = HFGenerator(args.target, tok, exact, device, batch_size=args.batch_size, model=m64)(few, 0)
        out["float64_agreement"] = agreement(b, a)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ds.bench --role regenerate", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["regenerate"], required=True)
    p.add_argument("--target", required=True, help="an HF causal LM directory (with its tokenizer)")
    p.add_argument("--prompts", required=True, help="a .jsonl of conversations (messages or conversations)")
    p.add_argument("--limit", type=int, default=2048, help="prompts the static decoder decodes")
    p.add_argument("--generate-limit", type=int, default=512, help="prompts generate decodes (the first ones)")
    p.add_argument("--batch-size", type=int, default=512, help="generate's batch")
    p.add_argument("--slots", type=int, default=1024, help="the static decoder's rows")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--exact-limit", type=int, default=32, help="prompts of the float64 comparison (0: none)")
    p.add_argument("--exact-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    for name in ("limit", "generate_limit", "batch_size", "slots", "max_new_tokens", "exact_new_tokens"):
        if getattr(args, name) < 1:
            say(f"bench error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
            return Exit.USER
    if args.exact_limit < 0:
        say(f"bench error: --exact-limit must be >= 0, got {args.exact_limit}")
        return Exit.USER
    for name in ("target", "prompts"):
        if not Path(getattr(args, name)).exists():
            say(f"bench error: --{name} {getattr(args, name)} does not exist")
            return Exit.USER
    try:
        report = run(args)
    except ValueError as exc:
        say(f"bench error: {exc}")
        return Exit.USER
    s, g = report["static"], report["generate"]
    print(f"role regenerate | {report['device']} | {report['dtype']}\n"
          f"  static   {s['prompts']:>6} prompts {s['generated_tokens']:>10,} tokens {s['seconds']:8.1f} s "
          f"{s['tok_s']:>10,.0f} tok/s\n"
          f"  generate {g['prompts']:>6} prompts {g['generated_tokens']:>10,} tokens {g['seconds']:8.1f} s "
          f"{g['tok_s']:>10,.0f} tok/s\n"
          f"  speedup {report['speedup']:.1f}x | {report['dtype']} answers identical {report['agreement']['identical_share']:.1%}, "
          f"tokens before the first difference {report['agreement']['prefix_token_share']:.1%}"
          + (f" | float64 identical {report['float64_agreement']['identical']}/{report['float64_agreement']['answers']}"
             if "float64_agreement" in report else ""), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"role": "regenerate", "args": vars(args), "result": report}, indent=1) + "\n")
        print(f"written {args.out}", flush=True)
    return Exit.OK
