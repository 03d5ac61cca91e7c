"""Write a random-weight target of a named geometry, loadable as `target.path`, plus long chats.

    python scripts/make_random_target.py --geometry qwen3.6-27b [--layers 64] --out /dev/shm/qwen36-rand \
        [--chats 256 --chat-tokens 3000]

For machines without hub access (GPU benches and end-to-end runs at the flagship's width: speed and
the runtime do not depend on the weights). The model is built directly on the GPU in bf16 with the
model's own initialisation (seconds for 27B parameters) and saved as safetensors shards with an
index, so `from_pretrained`, `embed_and_head` and ZeRO-3 loading read it like a downloaded model.

The tokenizer is assets/tiny-target's (copied with its chat template and generation config): its ids
are a prefix of the geometry's vocabulary, so every token it produces has a row in the 248,320-row
embedding and lm_head the drafter borrows. `--chats N` also writes N synthetic conversations of
about `--chat-tokens` tokens each into OUT/chats.jsonl (and 8 short held-out prompts into
OUT/eval.jsonl), enough to fill one 3072-token row per conversation.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_model(geometry: str, layers: int | None, out: Path, device: str, shard: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_ds.target_model.presets import target_config

    src = ROOT / "assets" / "tiny-target"
    tok = AutoTokenizer.from_pretrained(src)
    cfg = target_config(geometry, layers)
    if len(tok) > cfg.vocab_size:
        raise SystemExit(f"the bundled tokenizer has {len(tok)} tokens, more than the {cfg.vocab_size} rows of "
                         f"{geometry}: its ids would fall outside the embedding")
    gen = json.loads((src / "generation_config.json").read_text())
    cfg.eos_token_id, cfg.pad_token_id = gen["eos_token_id"], gen.get("pad_token_id", 0)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=shard)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    return {"geometry": geometry, "layers": cfg.num_hidden_layers, "params": params, "vocab": cfg.vocab_size,
            "build_s": round(built, 1), "total_s": round(time.perf_counter() - t0, 1), "out": str(out)}


def write_chats(out: Path, n: int, tokens: int, seed: int = 0) -> None:
    """Conversations of plain words, about `tokens` tokens each in the bundled tokenizer."""
    from transformers import AutoTokenizer

    words = ("alpha beta gamma delta seven eleven river stone paper cloud green orange table window north "
             "south count spell list number answer question model token block draft target").split()
    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-target")
    # The small BPE splits most words into several tokens: size the texts by the measured ratio.
    per_word = len(tok(" " + " ".join(words))["input_ids"]) / len(words)
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(words) for _ in range(max(1, round(k / per_word))))

    with (out / "chats.jsonl").open("w") as f:
        for _ in range(n):
            q = rng.randint(tokens // 8, tokens // 4)
            msgs = [{"role": "user", "content": text(q)}, {"role": "assistant", "content": text(tokens - q)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with (out / "eval.jsonl").open("w") as f:
        for _ in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": text(60)}]}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--geometry", default="qwen3.6-27b", help="a name from dflash_ds/target_model/presets.py")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the geometry's own)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shard", default="5GB", help="max_shard_size of the safetensors shards")
    p.add_argument("--chats", type=int, default=0, help="also write this many synthetic conversations")
    p.add_argument("--chat-tokens", type=int, default=3000)
    a = p.parse_args(argv)
    info = write_model(a.geometry, a.layers, a.out, a.device, a.shard)
    if a.chats:
        write_chats(a.out, a.chats, a.chat_tokens)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
