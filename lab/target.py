"""The lab target: a dense Qwen3ForCausalLM built from a config (no hub), pretrained on the corpus's
training documents and then fine-tuned on the training conversations (loss on assistant tokens only),
each phase under a wall-clock budget, and saved as a HF model directory that `target.path` loads.

Both phases feed packed fixed-length rows (documents, or rendered conversations, end to end) and
train with AdamW and a cosine schedule in bf16 autocast. A phase's step count is planned from its
budget after a few timed steps (or fixed with `steps`, to repeat an earlier run exactly), and a hard
wall-clock stop ends it early if the rate drops; the steps actually taken are recorded.
Deterministic from the corpus and the seed up to the GPU's own nondeterminism (atomics in backward).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from lab.tokenizer import IM_END, PAD


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


SHAPES = {
    # 88M parameters at a 16,384 vocabulary (63M in the blocks, 25M in the untied embedding and head)
    "lab": Shape(hidden=768, layers=10, heads=12, kv_heads=4, head_dim=64, intermediate=2048),
    "tiny": Shape(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=192),
}


@dataclass(frozen=True)
class Phase:
    seconds: float  # wall-clock budget, timed steps and compilation included
    steps: int | None  # fixed step count (None: planned from the budget)
    lr: float
    rows: int  # rows per step
    warmup: float = 0.02


@dataclass(frozen=True)
class Plan:
    shape: str
    seq_len: int
    pretrain: Phase
    sft: Phase
    seed: int = 0
    compile: bool = True
    deadline: float = 1e9  # seconds from the start of train_target by which the target must be saved


def build_model(shape: Shape, tokenizer, seq_len: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=max(seq_len, 4096), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD))
    return Qwen3ForCausalLM(config)


def pack(seqs, seq_len: int, masks=None) -> tuple[np.ndarray, np.ndarray]:
    """Sequences end to end, cut into full rows of `seq_len` ([rows, seq_len] int32; the tail that does
    not fill a row is dropped); with `masks`, each token's loss flag travels with it (else all 1)."""
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    flags = (np.concatenate([np.asarray(m, dtype=np.int8) for m in masks]) if masks is not None
             else np.ones(len(ids), dtype=np.int8))
    n = len(ids) // seq_len
    return ids[:n * seq_len].reshape(n, seq_len), flags[:n * seq_len].reshape(n, seq_len)


def document_rows(tokenizer, docs: list[dict], seq_len: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray, int]:
    """Documents tokenised, each followed by the end-of-text id, packed; their flags; the token count.
    Tokenised in chunks of documents, kept as int32 arrays: the training split is ~30M tokens."""
    sep = tokenizer.convert_tokens_to_ids(PAD)
    seqs = []
    for start in range(0, len(docs), chunk):
        texts = [d["text"] for d in docs[start:start + chunk]]
        seqs += [np.asarray(e + [sep], dtype=np.int32) for e in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    rows, flags = pack(seqs, seq_len)
    return rows, flags, sum(len(s) for s in seqs)


def conversation_rows(tokenizer, convs: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Conversations rendered as training renders them (data.thinking false), assistant tokens flagged."""
    from dflash_ds.data.chat import ChatEncoder, SampleError

    encoder = ChatEncoder(tokenizer, thinking=False, tokenizer_setting="lab tokenizer")
    seqs, masks = [], []
    for c in convs:
        try:
            e = encoder.encode(c["messages"])
        except SampleError:
            continue
        seqs.append(e.input_ids)
        masks.append(e.loss_mask)
    return pack(seqs, seq_len, masks)


class Clock:
    """Wall time of a phase and the step plan drawn from it."""

    def __init__(self, phase: Phase, rows: int):
        self.phase, self.t0 = phase, time.monotonic()
        epochs_cap = max(1, rows // phase.rows) * 50
        self.total = phase.steps or epochs_cap  # replanned after the timed steps when not fixed
        self.planned = phase.steps is not None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def replan(self, step: int, since: float) -> None:
        """After `step` steps (the first few, compile included, excluded from `since`): fit the rest."""
        if self.planned:
            return
        per_step = (time.monotonic() - since) / max(step, 1)
        left = self.phase.seconds - self.elapsed()
        self.total = max(step + 1, min(self.total, step + int(left / per_step)))
        self.planned = True

    def over(self) -> bool:
        return self.elapsed() > self.phase.seconds

    def lr(self, step: int) -> float:
        warm = max(1, int(self.phase.warmup * self.total))
        if step < warm:
            return self.phase.lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, self.total - warm))
        return self.phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def run_phase(model, rows, flags, phase: Phase, *, device, seed: int, log) -> dict:
    """Train on `rows` (loss where `flags` is 1) until the plan or the budget ends; returns the record."""
    import torch

    step_fn = model
    gen = random.Random(seed)
    order: list[int] = []
    clock = Clock(phase, len(rows))
    opt = torch.optim.AdamW(model.parameters(), lr=phase.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    losses, step, timed_from, tokens = [], 0, None, 0
    model.train()
    while step < clock.total and not clock.over():
        batch = []
        for _ in range(phase.rows):
            if not order:
                order = list(range(len(rows)))
                gen.shuffle(order)
            batch.append(order.pop())
        ids = torch.from_numpy(rows[batch]).to(device=device, dtype=torch.long)
        labels = ids.masked_fill(torch.from_numpy(flags[batch]).to(device) == 0, -100)
        for g in opt.param_groups:
            g["lr"] = clock.lr(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            try:
                loss = step_fn(input_ids=ids, labels=labels).loss
            except Exception as e:  # noqa: BLE001 - a compiler failure costs speed, not the target
                if step_fn is not model or not hasattr(model, "_orig_mod"):
                    raise
                log(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); training eager")
                step_fn = model._orig_mod
                loss = step_fn(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += ids.numel()
        if step == 3:  # compilation and the allocator's warm-up are behind: time from here
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed_from, tokens_from = time.monotonic(), tokens
        if step == 13 or (step == 4 and clock.total <= 13):
            if device.type == "cuda":
                torch.cuda.synchronize()
            clock.replan(step - 3, timed_from)
        # the first step's loss too: the curve then shows where training started, however soon the clock stops it
        if step == 1 or step % 25 == 0 or step == clock.total:
            losses.append((step, loss.item()))
            log(f"step {step}/{clock.total} loss {loss.item():.4f} lr {clock.lr(step - 1):.2e} "
                f"{clock.elapsed():.0f} s")
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = clock.elapsed()
    rate = (tokens - tokens_from) / (time.monotonic() - timed_from) if timed_from and step > 3 else None
    model.eval()
    return {"steps": step, "planned_steps": clock.total, "stopped_by_clock": step < clock.total,
            "rows_per_step": phase.rows, "tokens": tokens, "tokens_per_s": rate, "wall_s": wall,
            "final_loss": loss.item() if step else None, "losses": losses,
            "budget_s": phase.seconds, "lr": phase.lr}


def eval_loss(model, rows, flags, *, device, batch: int = 8, limit: int = 64) -> float | None:
    """Mean loss over up to `limit` rows (held-out documents: the target's fit to unseen projects)."""
    import torch

    rows, flags = rows[:limit], flags[:limit]
    if not len(rows):
        return None
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            ids = torch.from_numpy(rows[i:i + batch]).to(device=device, dtype=torch.long)
            labels = ids.masked_fill(torch.from_numpy(flags[i:i + batch]).to(device) == 0, -100)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                total += float(model(input_ids=ids, labels=labels).loss) * len(ids)
            count += len(ids)
    return total / count


def train_target(plan: Plan, tokenizer, docs: list[dict], convs: list[dict], *, out: Path, log) -> dict:
    """Pretrain, fine-tune, save to `out`; returns the record (also written to out/lab_target.json)."""
    import torch

    random.seed(plan.seed)
    torch.manual_seed(plan.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    train_docs = [d for d in docs if d["split"] == "train"]
    rows, ones, corpus_tokens = document_rows(tokenizer, train_docs, plan.seq_len)
    held_rows, held_ones, held_tokens = document_rows(tokenizer, [d for d in docs if d["split"] == "heldout"],
                                                      plan.seq_len)
    sft_rows, sft_flags = conversation_rows(tokenizer, convs, plan.seq_len)
    if not len(rows) or not len(sft_rows):
        raise ValueError(f"lab target: too little text for {plan.seq_len}-token rows ({len(rows)} document rows, "
                         f"{len(sft_rows)} conversation rows)")
    log(f"data: {corpus_tokens:,} training tokens ({len(rows):,} rows of {plan.seq_len}), {held_tokens:,} held-out "
        f"tokens, {len(sft_rows):,} conversation rows; {time.monotonic() - t0:.0f} s")
    model = build_model(SHAPES[plan.shape], tokenizer, plan.seq_len).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params / 1e6:.1f}M parameters ({SHAPES[plan.shape]}) on {device}")
    compiled = torch.compile(model) if plan.compile and device.type == "cuda" else model
    record = {"plan": asdict(plan), "parameters": params, "device": str(device), "data_s": time.monotonic() - t0,
              "corpus_train_tokens": corpus_tokens, "corpus_heldout_tokens": held_tokens,
              "document_rows": len(rows), "conversation_rows": len(sft_rows)}
    # The data took its share of the command: pretraining gets what is left before the deadline, less
    # the fine-tuning and a margin for the held-out loss and the save.
    left = plan.deadline - (time.monotonic() - t0) - plan.sft.seconds - 30
    pretrain = plan.pretrain if left >= plan.pretrain.seconds else replace(plan.pretrain, seconds=max(left, 30.0))
    if pretrain is not plan.pretrain:
        log(f"pretraining budget cut to {pretrain.seconds:.0f} s to save the target by the deadline")
    record["pretrain"] = run_phase(compiled, rows, ones, pretrain, device=device, seed=plan.seed, log=log)
    record["pretrain"]["epochs"] = record["pretrain"]["tokens"] / max(1, len(rows) * plan.seq_len)
    record["sft"] = run_phase(compiled, sft_rows, sft_flags, plan.sft, device=device, seed=plan.seed + 1, log=log)
    record["heldout_document_loss"] = eval_loss(model, held_rows, held_ones, device=device)
    save_target(model, tokenizer, out)
    record["wall_s"] = time.monotonic() - t0
    (out / "lab_target.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def save_target(model, tokenizer, out: Path) -> None:
    """config.json (bfloat16) + model.safetensors + tokenizer + generation config, written whole or not at all."""
    import shutil

    import torch
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    im_end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    GenerationConfig(eos_token_id=[im_end, pad], pad_token_id=pad, do_sample=False,
                     max_new_tokens=512).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
