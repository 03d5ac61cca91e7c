"""`python -m dflash_ds.eval`: exact greedy acceptance length tau of an exported drafter."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from dflash_ds.eval.generate import offline_tau
from dflash_ds.eval.tau import DEFAULT_BATCH_ANCHORS, TauReport
from dflash_ds.model.draft_model import DraftModel
from dflash_ds.target.model import load_config, text_config
from dflash_ds.safety import Exit


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
    parser = argparse.ArgumentParser(prog="python -m dflash_ds.eval",
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
        return Exit.USER


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
    model = DraftModel.from_target(drafter, target)
    _check_pair(model, target, args.drafter)
    prompts = read_prompts(args.prompts, tokenizer, limit=args.limit, chat_template_kwargs=kwargs)
    sequences: list = []
    report = offline_tau(target, model, prompts, max_new_tokens=args.max_new_tokens,
                         batch_anchors=args.batch_anchors, sequences=sequences)
    result = {"target": args.target, "drafter": args.drafter, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, **report.as_dict()}
    print(f"tau_mean {_fmt(report.tau_mean)}  tau_pooled {_fmt(report.tau_pooled)}  "
          f"({len(report.cycles)} responses, {report.num_cycles} cycles, block size {report.block_size})")
    print("accepted drafts per cycle: " + " ".join(f"{j}:{n}" for j, n in enumerate(report.histogram)))
    print(report.position_line())
    if args.online:
        result["online"] = online = _online(target, model, prompts, sequences, report, args.max_new_tokens)
        print(f"online: tau_mean {_fmt(online['tau_mean'])} tau_pooled {_fmt(online['tau_pooled'])}, "
              f"{online['responses_matching_offline']}/{len(prompts)} responses identical to the offline walk "
              "(in bf16, recomputing the target over other lengths can flip near-ties)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return Exit.OK


def _check_pair(model: DraftModel, target, drafter_path: str) -> None:
    cfg, tc, embed = model.config, text_config(target.config), model.embed
    if cfg.hidden_size != tc.hidden_size or cfg.vocab_size != embed.shape[0]:
        raise ValueError(f"--drafter {drafter_path} was built for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                         f"--target has {tc.hidden_size} / {embed.shape[0]}: pass the target the drafter was trained against")
    if max(cfg.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(f"--drafter taps layers {list(cfg.target_layer_ids)} but --target has {tc.num_hidden_layers} "
                         "layers: pass the target the drafter was trained against")


def _online(target, model: DraftModel, prompts, sequences, report: TauReport, max_new_tokens: int) -> dict:
    """The reference loop on every prompt, compared response by response with the offline walk."""
    from dflash_ds.eval.specdec import speculative_generate

    online, agree = TauReport(block_size=model.block_size), 0
    for prompt, x, offline_cycles in zip(prompts, sequences, report.cycles):
        ids, counts = speculative_generate(target, model, torch.tensor(prompt), max_new_tokens=max_new_tokens)
        online.cycles.append(counts)
        agree += int(ids.tolist() == x[len(prompt):].tolist() and counts == offline_cycles)
    d = online.as_dict()
    return {"tau_mean": d["tau_mean"], "tau_pooled": d["tau_pooled"], "responses_matching_offline": agree}


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
