"""The benchmark table's generation alone, one prompt at a time against a batch (eval.batched).

    PYTHONPATH=. python scripts/bench_generation_batch.py [PROMPTS] [NEW_TOKENS] [DTYPE]

The tiny target (assets/tiny-target, DTYPE float32 or bfloat16, default float32; on the GPU when there
is one, as the table runs) answers the first
user turns of the first PROMPTS (default 32) bundled chats with NEW_TOKENS (default 128) tokens each,
no stop token so that every response is as long as the table's budget: greedy and T = 1, per prompt
(generate.greedy_continuation, sampled.sampled_continuation) and as one batch. Checks that both give
the same tokens (in bf16 a batch's kernels may round differently, so it counts the identical ones),
then prints the wall times. Results: docs/performance.md.
"""

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dflash_ds.eval.batched import ResponseKey, batched_continuations, response_generator  # noqa: E402
from dflash_ds.eval.generate import greedy_continuation  # noqa: E402
from dflash_ds.eval.sampled import Sampling, sampled_continuation  # noqa: E402


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()  # every continuation ends with .cpu(): the device's work is done when it returns
    return time.perf_counter() - t0, out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-target", dtype=dtype).eval().to(device)
    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-target")
    lines = (ROOT / "assets" / "tiny_chat.jsonl").read_text().splitlines()[:n]
    prompts = [torch.tensor(tok(tok.apply_chat_template(json.loads(line)["messages"][:1], tokenize=False,
                                                        add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]) for line in lines]
    greedy_continuation(target, prompts[0], max_new_tokens=4)  # first-call set-up out of the timings
    t = Sampling(1.0)

    def gens():
        return [response_generator(0, ResponseKey(item=i), device) for i in range(len(prompts))]

    rows = []
    for label, one, batch in [
        ("greedy", lambda: [greedy_continuation(target, p, max_new_tokens=new, eos_token_id=-1) for p in prompts],
         lambda: batched_continuations(target, prompts, max_new_tokens=new, eos_token_id=-1)),
        ("T=1", lambda: [sampled_continuation(target, p, t, g, max_new_tokens=new, eos_token_id=-1)
                         for p, g in zip(prompts, gens())],
         lambda: batched_continuations(target, prompts, max_new_tokens=new, sampling=t, generators=gens(),
                                       eos_token_id=-1))]:
        s_one, a = _timed(one)
        s_batch, b = _timed(batch)
        same = sum(x.tolist() == y.tolist() for x, y in zip(a, b))
        if dtype == torch.float32 and same < len(prompts):
            raise SystemExit(f"{label}: {len(prompts) - same} batched responses differ from the per-prompt ones")
        rows.append(f"{label}: per prompt {s_one:.2f} s, one batch of {len(prompts)} {s_batch:.2f} s "
                    f"({s_one / s_batch:.1f}x), {same}/{len(prompts)} responses identical")
    print(f"{len(prompts)} prompts x {new} new tokens on {device}, {dtype}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
