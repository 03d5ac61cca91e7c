"""Acceptance length tau (spec section 4), computed exactly offline.

Convention (the one `dflash_ds.specdec.speculative_generate` runs online, cycle for cycle):

- Sequence `x` = prompt (`P` tokens) + the target's greedy response `y`, so `x[P]` is the first
  generated token and `end = len(x)`. The response ends at EOS (included) or at the token budget.
- The target's prefill emits `x[P]` on its own; that token belongs to no cycle.
- A cycle is anchored at the position `t` of the last token the target emitted (its bonus).
  The drafter sees the target's tapped hidden states of positions `< t` and the block
  `[x[t], MASK x (B-1)]` at positions `t .. t+B-1`; block slot `k` proposes the token at `t + k`.
- `a(t)` = the number of leading slots `k = 1 .. B-1` whose argmax equals `x[t + k]`, capped at
  `end - t - 2` so that the cycle's last token, the target's own token at `t + a(t) + 1`, lies in
  the response. The cycle emits `a(t) + 1` tokens; the next cycle is anchored at `t + a(t) + 1`.
- The walk starts at `t = P` and stops at `t = end - 1` (the last response token, which anchors
  nothing). It therefore covers exactly the response: `sum(cycles) = len(y) - 1`.

Because greedy speculative decoding emits exactly the target's greedy text and the target is
causal, one teacher-forced target pass over `x` gives every cycle's context, so tau needs no
online loop (and no cache, which hybrid Gated DeltaNet targets cannot crop).

tau per response = mean of its cycles' emitted tokens; `tau_mean` averages the per-response
means (z-lab's way), `tau_pooled` = total tokens / total cycles.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dflash_ds.attention import build_mask
from dflash_ds.objective import block_inputs
from dflash_ds.target import TapCapture, forward_taps, load_config, text_config

DEFAULT_BATCH_ANCHORS = 64


# ----------------------------------------------------------------------------------------------
# Core: needs the drafter and the taps, not the target model (drafter ranks call these).


def draft_tokens(hidden: torch.Tensor, lm_head_weight: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Greedy tokens of drafter states [..., D] through the target lm_head, in chunks of rows so
    the [rows, vocab] logits of a 248K vocabulary stay small."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = lm_head_weight.to(device=flat.device, dtype=flat.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = (flat[i:i + chunk] @ w.T).argmax(-1)
    return out.view(hidden.shape[:-1])


def _drafter_param(drafter) -> torch.Tensor:
    return next(drafter.parameters())


@torch.no_grad()
def accept_lengths(drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, taps: torch.Tensor,
                   input_ids: torch.Tensor, start: int, end: int, *, block_size: int | None = None,
                   mask_token_id: int | None = None,
                   batch_anchors: int = DEFAULT_BATCH_ANCHORS) -> torch.Tensor:
    """a(t) for every anchor t in [start, end) of one sequence (see the module docstring).

    taps [S, T*D]: the target's tapped states of `input_ids` [S] (teacher-forced), S >= end - 1.
    All anchors go through the drafter in batches of `batch_anchors` blocks with the training
    mask (context strictly before the anchor, own block bidirectional), so this exercises the
    same drafter path as training. Returns a LongTensor [end - start] on the CPU.
    """
    cfg = drafter.config
    B = block_size or cfg.block_size
    mask_id = cfg.mask_token_id if mask_token_id is None else mask_token_id
    ids = input_ids.reshape(-1)
    if not 1 <= start <= end <= ids.numel():
        raise ValueError(f"need 1 <= start <= end <= sequence length, got start={start} end={end} S={ids.numel()}")
    if taps.dim() != 2 or taps.shape[0] < end - 1:
        raise ValueError(f"taps must be [S, T*D] covering positions < {end - 1}, got {tuple(taps.shape)}")
    p = _drafter_param(drafter)
    device, dtype = p.device, p.dtype
    out = torch.zeros(end - start, dtype=torch.long)
    if end - start == 0:
        return out

    s_all = min(taps.shape[0], end)
    ctx = drafter.fuse(taps[None, :s_all].to(device=device, dtype=dtype))
    y = ids[:end].to(device)
    positions = torch.arange(end, device=device)[None]
    doc_ids = torch.zeros(1, s_all, dtype=torch.int32, device=device)
    slots = torch.arange(1, B, device=device)
    for c0 in range(start, end, batch_anchors):
        anchors = torch.arange(c0, min(c0 + batch_anchors, end), device=device)
        n = anchors.numel()
        # Context columns at or after the last anchor are masked for every block of the chunk.
        s_ctx = min(int(anchors[-1]) + 1, s_all)
        block_ids, block_pos = block_inputs(y[None], positions, anchors[None], B, mask_id)
        mask = build_mask(anchors[None], torch.ones(1, n, dtype=torch.bool, device=device),
                          doc_ids[:, :s_ctx], B, kind="dense")
        embeds = embed_weight[block_ids.to(embed_weight.device)].to(device=device, dtype=dtype)
        hidden = drafter(embeds, ctx[:, :s_ctx], block_pos, positions[:, :s_ctx], mask)
        drafts = draft_tokens(hidden.view(n, B, -1)[:, 1:], lm_head_weight)  # [n, B-1]
        where = anchors[:, None] + slots[None]
        inside = where < end
        match = (drafts == y[where.clamp(max=end - 1)]) & inside
        a = match.long().cumprod(1).sum(1)
        cap = (end - 2 - anchors).clamp(min=0)
        out[c0 - start:c0 - start + n] = torch.minimum(a, cap).cpu()
    return out


def walk(a: Sequence[int] | torch.Tensor, first: int, end: int) -> list[int]:
    """Tokens emitted per cycle when decoding positions [first, end) (module docstring).

    `a[i]` is a(first + i), len(a) == end - first. Cycle anchors: t = first, then t + a(t) + 1,
    while t < end - 1. Each cycle records min(a(t), end - t - 2) + 1, so the cycles add up to
    end - 1 - first tokens.
    """
    a = [int(v) for v in (a.tolist() if isinstance(a, torch.Tensor) else a)]
    if len(a) != end - first:
        raise ValueError(f"walk needs a(t) for every t in [first, end): len(a)={len(a)}, first={first}, end={end}")
    cycles, t = [], first
    while t < end - 1:
        emitted = min(max(a[t - first], 0), end - t - 2) + 1
        cycles.append(emitted)
        t += emitted
    return cycles


def tau_from_taps(drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, taps: torch.Tensor,
                  input_ids: torch.Tensor, first: int, end: int, *, block_size: int | None = None,
                  mask_token_id: int | None = None, batch_anchors: int = DEFAULT_BATCH_ANCHORS) -> list[int]:
    """Per-cycle emitted tokens of one response: `first` = prompt length, `end` = sequence length."""
    a = accept_lengths(drafter, embed_weight, lm_head_weight, taps, input_ids, first, end,
                       block_size=block_size, mask_token_id=mask_token_id, batch_anchors=batch_anchors)
    return walk(a, first, end)


@dataclass
class TauReport:
    """tau over a set of responses, from each response's per-cycle emitted tokens."""

    block_size: int
    cycles: list[list[int]] = field(default_factory=list)

    @property
    def per_response(self) -> list[float | None]:
        # A one-token response (EOS or budget right after prefill) has no cycle and no tau.
        return [sum(c) / len(c) if c else None for c in self.cycles]

    @property
    def tau_mean(self) -> float:
        taus = [t for t in self.per_response if t is not None]
        return sum(taus) / len(taus) if taus else math.nan

    @property
    def num_cycles(self) -> int:
        return sum(len(c) for c in self.cycles)

    @property
    def num_tokens(self) -> int:
        return sum(sum(c) for c in self.cycles)

    @property
    def tau_pooled(self) -> float:
        return self.num_tokens / self.num_cycles if self.num_cycles else math.nan

    @property
    def histogram(self) -> list[int]:
        """histogram[j] = number of cycles that accepted exactly j drafts (j = 0 .. B-1)."""
        h = [0] * self.block_size
        for c in self.cycles:
            for emitted in c:
                h[emitted - 1] += 1
        return h

    def as_dict(self) -> dict:
        def num(x):
            return None if x is None or math.isnan(x) else x

        return {
            "tau_mean": num(self.tau_mean),
            "tau_pooled": num(self.tau_pooled),
            "block_size": self.block_size,
            "num_responses": len(self.cycles),
            "num_cycles": self.num_cycles,
            "num_tokens": self.num_tokens,
            "accepted_histogram": self.histogram,
            "tau_per_response": [num(t) for t in self.per_response],
            "cycles": self.cycles,
        }


# ----------------------------------------------------------------------------------------------
# With the target model.


def eos_ids(target, eos_token_id=None) -> list[int]:
    """The stop tokens: the explicit argument, else the target's generation config."""
    if eos_token_id is None:
        gen = getattr(target, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)]


@torch.no_grad()
def greedy_continuation(target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """prompt + the target's greedy response (HF generate, do_sample False), as [S] on the CPU.

    A fresh GenerationConfig keeps a checkpoint's sampling defaults (temperature, repetition
    penalty) out of it: tau is defined for plain greedy decoding.
    """
    from transformers import GenerationConfig

    eos = eos_ids(target, eos_token_id)
    device = _drafter_param(target).device
    ids = prompt_ids.reshape(1, -1).to(device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                           pad_token_id=eos[0] if eos else 0)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0].cpu()


@torch.no_grad()
def target_taps(target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """The target's tapped states [S, T*D] over input_ids [S], teacher-forced, no lm_head."""
    p = _drafter_param(target)
    d = text_config(target.config).hidden_size
    ids = input_ids.reshape(1, -1).to(p.device)
    out = torch.empty(1, ids.shape[1], len(layer_ids) * d, dtype=p.dtype, device=p.device)
    capture = TapCapture(target, layer_ids)
    try:
        forward_taps(target, capture, ids, None, out)
    finally:
        capture.remove()
    return out[0]


def check_layer_ids(drafter, layer_ids: Sequence[int]) -> list[int]:
    if list(layer_ids) != list(drafter.config.target_layer_ids):
        raise ValueError(f"layer_ids {list(layer_ids)} differ from the drafter's target_layer_ids "
                         f"{list(drafter.config.target_layer_ids)}; tau is only meaningful with the taps it was trained on")
    return list(layer_ids)


@torch.no_grad()
def offline_tau(target, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                prompts: Sequence[torch.Tensor | Sequence[int]], *, max_new_tokens: int, layer_ids: Sequence[int],
                eos_token_id=None, batch_anchors: int = DEFAULT_BATCH_ANCHORS,
                sequences: list | None = None) -> TauReport:
    """Exact greedy tau of `drafter` on `prompts` (token ids): greedy response, one teacher-forced
    tap pass, a(t) for every response position, the walk. `sequences`, when a list, receives each
    prompt + response."""
    layer_ids = check_layer_ids(drafter, layer_ids)
    report = TauReport(block_size=drafter.config.block_size)
    for prompt in prompts:
        prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        x = greedy_continuation(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        if sequences is not None:
            sequences.append(x)
        taps = target_taps(target, x, layer_ids)
        report.cycles.append(tau_from_taps(drafter, embed_weight, lm_head_weight, taps, x, prompt.numel(), x.numel(),
                                           batch_anchors=batch_anchors))
    return report


# ----------------------------------------------------------------------------------------------
# CLI


def read_prompts(path: str, tokenizer, *, limit: int | None = None, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of a jsonl of {"messages": [...]} (rendered with the target's chat template,
    generation prompt added, a trailing assistant turn dropped) or {"prompt": "already rendered"}."""
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--prompts {path}: cannot read it ({e}); pass a jsonl file of messages or prompt records")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(prompts) >= limit:
            break
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"--prompts {path}:{lineno}: not JSON ({e})") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            messages = list(record["messages"])
            if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise ValueError(f"--prompts {path}:{lineno}: each line needs a 'messages' list or a 'prompt' string")
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError(f"--prompts {path}:{lineno}: the prompt renders to no tokens")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts found")
    return prompts


def _load_target(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        load_config(path)
    except ValueError as e:
        raise ValueError(str(e).replace("target.path", "--target")) from None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"--target {path}: cannot load the model or its tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]}); pass a causal LM directory or reachable hub id") from None
    return model.eval().requires_grad_(False).to(device), tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ds.evaluate",
                                     description="Exact greedy acceptance length tau of a DFlash drafter export.")
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--drafter", required=True, help="drafter export directory (config.json + model.safetensors)")
    parser.add_argument("--prompts", required=True, help="jsonl of {'messages': [...]} or {'prompt': str}")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first K prompts only")
    parser.add_argument("--online", action="store_true",
                        help="also run the reference speculative-decoding loop and check it against the offline tau")
    parser.add_argument("--chat-template-kwargs", default=None,
                        help='JSON passed to the chat template, e.g. \'{"enable_thinking": false}\'; must match training')
    parser.add_argument("--batch-anchors", type=int, default=DEFAULT_BATCH_ANCHORS)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from dflash_ds.export import load_drafter

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    kwargs = None
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"--chat-template-kwargs is not JSON ({e})") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        drafter = load_drafter(args.drafter, device=device)
    except ValueError as e:
        raise ValueError(f"--drafter: {e}") from None
    target, tokenizer = _load_target(args.target, device)
    drafter = drafter.to(next(target.parameters()).dtype)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    _check_pair(drafter, target, embed, args.drafter)
    prompts = read_prompts(args.prompts, tokenizer, limit=args.limit, chat_template_kwargs=kwargs)
    layer_ids = list(drafter.config.target_layer_ids)
    sequences: list = []
    report = offline_tau(target, drafter, embed, head, prompts, max_new_tokens=args.max_new_tokens,
                         layer_ids=layer_ids, batch_anchors=args.batch_anchors, sequences=sequences)
    result = {"target": args.target, "drafter": args.drafter, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, **report.as_dict()}
    print(f"tau_mean {_fmt(report.tau_mean)}  tau_pooled {_fmt(report.tau_pooled)}  "
          f"({len(report.cycles)} responses, {report.num_cycles} cycles, block size {report.block_size})")
    print("accepted drafts per cycle: " + " ".join(f"{j}:{n}" for j, n in enumerate(report.histogram)))
    if args.online:
        result["online"] = online = _online(target, drafter, embed, head, prompts, sequences, report,
                                            args.max_new_tokens)
        print(f"online: tau_mean {_fmt(online['tau_mean'])} tau_pooled {_fmt(online['tau_pooled'])}, "
              f"{online['responses_matching_offline']}/{len(prompts)} responses identical to the offline walk "
              "(in bf16, recomputing the target over other lengths can flip near-ties)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _check_pair(drafter, target, embed: torch.Tensor, drafter_path: str) -> None:
    cfg, tc = drafter.config, text_config(target.config)
    if cfg.hidden_size != tc.hidden_size or cfg.vocab_size != embed.shape[0]:
        raise ValueError(f"--drafter {drafter_path} was built for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                         f"--target has {tc.hidden_size} / {embed.shape[0]}: pass the target the drafter was trained against")
    if max(cfg.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(f"--drafter taps layers {list(cfg.target_layer_ids)} but --target has {tc.num_hidden_layers} "
                         "layers: pass the target the drafter was trained against")


def _online(target, drafter, embed, head, prompts, sequences, report: TauReport, max_new_tokens: int) -> dict:
    """The reference loop on every prompt, compared response by response with the offline walk."""
    from dflash_ds.specdec import speculative_generate

    cfg = drafter.config
    online, agree = TauReport(block_size=cfg.block_size), 0
    for prompt, x, offline_cycles in zip(prompts, sequences, report.cycles):
        ids, counts = speculative_generate(target, drafter, embed, head, torch.tensor(prompt),
                                           max_new_tokens=max_new_tokens, layer_ids=list(cfg.target_layer_ids),
                                           block_size=cfg.block_size, mask_token_id=cfg.mask_token_id)
        online.cycles.append(counts)
        agree += int(ids.tolist() == x[len(prompt):].tolist() and counts == offline_cycles)
    d = online.as_dict()
    return {"tau_mean": d["tau_mean"], "tau_pooled": d["tau_pooled"], "responses_matching_offline": agree}


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
