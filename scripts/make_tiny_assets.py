"""Build the tiny bundled assets used by the CPU tests and the smoke recipes.

    python scripts/make_tiny_assets.py [--out assets] [--steps 1000]

Writes, deterministically from fixed seeds:
  assets/tiny_chat.jsonl   templated chat conversations in OpenAI `messages` format
  assets/tiny_eval.jsonl   held-out prompts with their reference answers
  assets/tiny-target/      byte-level BPE tokenizer + a small Qwen3ForCausalLM trained on the chat data

The responses are generated from templates (arithmetic, counting, spelling, lookups, lists) so that a
model of ~1.4M parameters learns them in about two minutes on a laptop CPU and its greedy replies are
regular: exactly the kind of text a drafter can learn to predict.  The data and the tokenizer are
bit-for-bit reproducible; the trained weights are reproducible on the same machine and torch build
(float reductions differ across CPU instruction sets).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

NUM_TRAIN = 1200
NUM_EVAL = 16
DATA_SEED = 1234
TRAIN_SEED = 0
TOKENIZER_SIZE = 1006  # 6 markup tokens (ids 0..5), 256 bytes, merges; the model's vocab rounds up to 1024

# The markup tokens, the Qwen3-style chat template and the tokenizer's training are the lab tokenizer's
# (one definition for both of the project's own tokenizers).
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ stands beside the package, not installed
from lab.tokenizer import CHAT_TEMPLATE, IM_END, MASK, PAD, train_tokenizer  # noqa: E402

WORDS = ["apple", "river", "garden", "planet", "silver", "window", "rabbit", "castle", "orange",
         "pencil", "forest", "candle", "dragon", "bottle", "yellow", "mirror", "basket", "rocket",
         "turtle", "winter", "summer", "button", "ladder", "island", "pepper", "violin", "butter",
         "jungle", "market", "pillow", "tomato", "kitten", "guitar", "lemon", "cloud", "stone",
         "bread", "light", "music", "tiger", "ocean", "paper", "sugar", "table", "zebra", "horse",
         "train", "house", "green", "water"]
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
          "a tomato": "red", "an orange": "orange", "a lemon": "yellow", "milk": "white",
          "a strawberry": "red", "the sun": "yellow", "a crow": "black", "a frog": "green",
          "an eggplant": "purple", "chocolate": "brown", "a flamingo": "pink"}
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid",
            "Germany": "Berlin", "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi",
            "Peru": "Lima", "Norway": "Oslo", "Greece": "Athens", "Chile": "Santiago",
            "Poland": "Warsaw", "Ireland": "Dublin", "Portugal": "Lisbon", "Austria": "Vienna"}
OPPOSITES = {"hot": "cold", "big": "small", "up": "down", "day": "night", "fast": "slow",
             "happy": "sad", "open": "closed", "light": "dark", "early": "late", "full": "empty",
             "old": "new", "hard": "soft", "wet": "dry", "high": "low", "loud": "quiet",
             "strong": "weak"}
CATEGORIES = {"fruits": ["apple", "banana", "cherry", "grape", "mango", "pear"],
              "animals": ["cat", "dog", "horse", "lion", "tiger", "zebra"],
              "colors": ["red", "blue", "green", "yellow", "purple", "orange"],
              "vegetables": ["carrot", "potato", "onion", "pepper", "cabbage", "pea"],
              "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn"],
              "metals": ["iron", "copper", "silver", "gold", "tin", "zinc"]}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.",
                  "Answer briefly and exactly."]


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(11)
    if kind == 0:
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a = rng.randint(0, 40)
        b = a + rng.randint(2, 7)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"Spell the word {w}.", f"{w} is spelled " + "-".join(w) + "."
    if kind == 3:
        w = rng.choice(WORDS)
        return f"Write {w} in capital letters.", f"{w.upper()}"
    if kind == 4:
        thing = rng.choice(sorted(COLORS))
        return f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."
    if kind == 5:
        country = rng.choice(sorted(CAPITALS))
        return (f"What is the capital of {country}?",
                f"The capital of {country} is {CAPITALS[country]}.")
    if kind == 6:
        w = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {w}?", f"The opposite of {w} is {OPPOSITES[w]}."
    if kind == 7:
        cat = rng.choice(sorted(CATEGORIES))
        n = rng.randint(2, 5)
        items = CATEGORIES[cat][:n]
        return (f"List {NUMBER_WORDS[n]} {cat}.",
                f"Here are {NUMBER_WORDS[n]} {cat}: " + ", ".join(items) + ".")
    if kind == 8:
        i = rng.randrange(7)
        return f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."
    if kind == 9:
        words = rng.sample(WORDS, rng.randint(2, 4))
        return ("Repeat after me: " + " ".join(words),
                " ".join(words))
    w = rng.choice(WORDS)
    return f"How many letters are in the word {w}?", f"The word {w} has {len(w)} letters."


def make_conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    for _ in range(turns):
        question, answer = _task(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def make_datasets() -> tuple[list[dict], list[dict]]:
    rng = random.Random(DATA_SEED)
    train = [make_conversation(rng) for _ in range(NUM_TRAIN)]
    seen = {json.dumps(c["messages"][:-1]) for c in train}
    eval_rng = random.Random(DATA_SEED + 1)
    held_out = []
    while len(held_out) < NUM_EVAL:
        conv = make_conversation(eval_rng)
        if len(conv["messages"]) > 3 or json.dumps(conv["messages"][:-1]) in seen:
            continue  # keep eval prompts single-turn and unseen
        held_out.append(conv)
    return train, held_out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_tokenizer(texts: list[str]):
    """The lab tokenizer's recipe (markup ids 0..5, <|mask|> = 5 the drafter's MASK id; BPE entries
    follow) at the tiny target's size and context."""
    fast = train_tokenizer(texts, TOKENIZER_SIZE)
    assert len(fast) == TOKENIZER_SIZE, len(fast)
    fast.model_max_length = 1024
    return fast


def tokenizer_corpus(conversations: list[dict]) -> list[str]:
    """The rendered conversations (both thinking modes), so merges cover the template's layout."""
    from jinja2 import Environment

    template = Environment().from_string(CHAT_TEMPLATE)
    texts = []
    for conv in conversations:
        texts.append(template.render(messages=conv["messages"]))
        texts.append(template.render(messages=conv["messages"][:-1], add_generation_prompt=True,
                                     enable_thinking=False))
    return texts


def _render(tokenizer, messages: list[dict], **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def train_model(tokenizer, conversations: list[dict], steps: int, batch_size: int = 16):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(TRAIN_SEED)
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    model = Qwen3ForCausalLM(config).float()
    # Two views of every conversation: the full render (earlier turns without the think block, the
    # last with an empty one) and, for single-turn ones, the thinking-off generation prompt followed
    # by the answer, which is how eval prompts are rendered when `data.thinking` is false.
    seqs = []
    for conv in conversations:
        msgs = conv["messages"]
        seqs.append(tokenizer(_render(tokenizer, msgs), add_special_tokens=False)["input_ids"])
        prompt = _render(tokenizer, msgs[:-1], add_generation_prompt=True, enable_thinking=False)
        seqs.append(tokenizer(prompt + msgs[-1]["content"] + IM_END + "\n",
                              add_special_tokens=False)["input_ids"])
    pad = config.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = 30
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = random.Random(TRAIN_SEED)
    # Batches of similar lengths (shuffled order) waste little compute on padding.
    by_length = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
    order: list[int] = []
    model.train()
    for step in range(steps):
        if not order:
            order = list(range(len(batches)))
            gen.shuffle(order)
        batch = [seqs[i] for i in batches[order.pop()]]
        width = max(len(s) for s in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, :len(s)] = torch.tensor(s)
            labels[r, :len(s)] = torch.tensor(s)
        attn = (labels != -100).long()
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def greedy_replies(model, tokenizer, conversations: list[dict], max_new_tokens: int = 48) -> list[str]:
    import torch

    stop = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)}
    replies = []
    for conv in conversations:
        prompt = _render(tokenizer, conv["messages"][:-1], add_generation_prompt=True,
                         enable_thinking=False)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                if nxt in stop:
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        replies.append(tokenizer.decode(out))
    return replies


def save_target(model, tokenizer, out: Path) -> None:
    import torch
    from transformers import GenerationConfig

    if out.exists():
        shutil.rmtree(out)  # no stale files from an older layout
    out.mkdir(parents=True)
    # Stored in bfloat16 to keep the repository small; config.json asks for float32 so that
    # `from_pretrained` upcasts (exactly) and CPU tests compute in float32.
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    im_end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    GenerationConfig(eos_token_id=[im_end, pad], pad_token_id=pad, do_sample=False,
                     max_new_tokens=64).save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "assets"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    import torch

    # One thread: on small 2-vCPU machines a second OpenMP thread made these tiny matmuls 3-5x slower.
    torch.set_num_threads(1)
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_datasets()
    write_jsonl(out / "tiny_chat.jsonl", train)
    write_jsonl(out / "tiny_eval.jsonl", held_out)

    tokenizer = build_tokenizer(tokenizer_corpus(train))
    print(f"tokenizer: {len(tokenizer)} tokens, mask id {tokenizer.convert_tokens_to_ids(MASK)}")

    model = train_model(tokenizer, train, args.steps, args.batch_size)
    save_target(model, tokenizer, out / "tiny-target")

    # Check the saved (bf16-rounded) weights, the ones users get.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = out / "tiny-target"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    replies = greedy_replies(model, tokenizer, held_out)
    exact = 0
    for conv, reply in zip(held_out, replies):
        ref = conv["messages"][-1]["content"]
        exact += reply == ref
        print(f"{conv['messages'][-2]['content']!r:50} -> {reply!r}  (ref {ref!r})")
    print(f"exact match {exact}/{len(held_out)}; vocab {model.config.vocab_size}, "
          f"mask id {tokenizer.convert_tokens_to_ids(MASK)}; took {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
