"""`python -m dflash_ds.eval`: acceptance length tau of an exported drafter, greedy (exact) and sampled,
on a prompts file or the standard benchmark sets by name."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

import dflash_ds.architectures  # noqa: F401  (registers every drafter architecture)
from dflash_ds.arguments import (Parser, existing_file, existing_folder, integer, json_object, model_folder,
                                number, output_file)
from dflash_ds.eval.benchmark_table import (BenchOptions, Responder, bench_row, settings_of, table_lines,
                                      tau_on_conversations, tau_on_prompts)
from dflash_ds.eval.benchmarks import BENCHMARKS, HELDOUT, load_conversations, parse_names
from dflash_ds.eval.engine_count import LlamaCppCounts
from dflash_ds.eval.generate import eos_ids, offline_tau, target_taps
from dflash_ds.eval.loading import load_pair
from dflash_ds.eval.sampled import Sampling, SampledTau
from dflash_ds.eval.tau import DEFAULT_BATCH_ANCHORS, TauReport
from dflash_ds.eval.vllm_count import VllmCounts, with_block
from dflash_ds.export.card import trained_thinking
from dflash_ds.libraries import quiet_libraries
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.safety import Exit, say


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


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    # Every argument is checked as it is parsed (dflash_ds/arguments.py): a wrong one is one line, exit 2,
    # before either model loads.
    parser = Parser(prog="python -m dflash_ds.eval",
                    description="Exact greedy acceptance length tau of a DFlash drafter export.")
    parser.add_argument("--target", required=True, type=model_folder, help="target model directory or hub id")
    parser.add_argument("--drafter", required=True, type=existing_folder, help="drafter export directory (config.json + model.safetensors)")
    parser.add_argument("--prompts", default=None, type=existing_file, help="jsonl of {'messages': [...]} or {'prompt': str}")
    parser.add_argument("--bench", default=None,
                        help="comma-separated benchmark sets: " + ", ".join(BENCHMARKS) + " (one row each)")
    parser.add_argument("--bench-dir", default=None, type=existing_folder, help="directory of <name>.jsonl benchmark files (else the hub)")
    parser.add_argument("--temperature", type=number(0), default=0.0,
                        help="also report tau sampled at this temperature, as vLLM/SGLang verify (0: greedy only)")
    parser.add_argument("--top-p", type=number(0, above=True), default=1.0)
    parser.add_argument("--top-k", type=integer(0), default=0, help="0: no top-k filter")
    parser.add_argument("--samples", type=integer(1), default=1, help="sampled responses per prompt")
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--thinking", choices=["on", "off"], default=None,
                        help="chat template enable_thinking for --bench (default: the drafter's training setting)")
    parser.add_argument("--max-new-tokens", type=integer(1), default=512)
    parser.add_argument("--limit", type=integer(1), default=None, help="evaluate the first K prompts (conversations) only")
    parser.add_argument("--online", action="store_true",
                        help="also run the reference speculative-decoding loop and check it against the offline tau")
    parser.add_argument("--chat-template-kwargs", default=None, type=json_object,
                        help='JSON passed to the chat template, e.g. \'{"enable_thinking": false}\'; must match training')
    parser.add_argument("--batch-anchors", type=integer(1), default=DEFAULT_BATCH_ANCHORS)
    parser.add_argument("--num-speculative-tokens", type=integer(1), default=None, metavar="N",
                        help="vLLM's count as served with N speculative tokens (1 to the drafter's drafts per block; "
                             "default: all of them): the drafter then runs a shorter block, as vLLM does")
    parser.add_argument("--out", default=None, type=output_file, help="write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:
        say(f"error: {e}")
        return Exit.USER


def _check_args(args) -> dict | None:
    """Flag errors between arguments before anything loads (each alone was checked as it was parsed);
    returns the parsed --chat-template-kwargs."""
    if not args.prompts and not args.bench:
        raise ValueError("pass --prompts FILE and/or --bench gsm8k,math500,...")
    Sampling(args.temperature, args.top_p, args.top_k).check()
    if args.bench and HELDOUT in parse_names(args.bench):
        raise ValueError(f"--bench {HELDOUT} names a recipe's held-out prompts; pass a prompts file as --prompts instead")
    return args.chat_template_kwargs or None


def _thinking(args, kwargs: dict | None) -> bool:
    """The evaluation's enable_thinking; one warning line when it differs from the drafter's training data."""
    trained = trained_thinking(args.drafter)
    if args.thinking is not None:
        thinking = args.thinking == "on"
    elif kwargs and "enable_thinking" in kwargs:
        thinking = bool(kwargs["enable_thinking"])
    else:
        thinking = bool(trained)
    if trained is not None and thinking != trained:
        say(f"warning: evaluating with enable_thinking={str(thinking).lower()} but {args.drafter} was trained with "
            f"enable_thinking={str(trained).lower()} (data.thinking): acceptance drops when they differ")
    return thinking


def _run(args) -> int:
    kwargs = _check_args(args)
    # The sets first: a bad file is named before any model loads.
    sets = {name: load_conversations(name, args.bench_dir, args.limit) for name in parse_names(args.bench)} \
        if args.bench else {}
    target, tokenizer, model = load_pair(args.target, args.drafter)
    if args.num_speculative_tokens is not None:
        try:  # the range the drafter's block allows, known once it is loaded
            with_block(model, args.num_speculative_tokens)
        except ValueError as e:
            raise ValueError(f"--num-speculative-tokens: {e}") from None
    thinking = _thinking(args, kwargs)
    opts = BenchOptions(max_new_tokens=args.max_new_tokens, samples=args.samples, seed=args.seed,
                        thinking=thinking, batch_anchors=args.batch_anchors,
                        num_speculative_tokens=args.num_speculative_tokens)
    settings = settings_of(args.temperature, args.top_p, args.top_k)
    result = {"target": args.target, "drafter": args.drafter, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "enable_thinking": thinking}
    rows = []
    if args.prompts:
        report = _prompts_tau(args, target, tokenizer, model, kwargs=kwargs, result=result)
        rows.append(bench_row("prompts", SampledTau(Sampling(), report)))
        for sampling in settings[1:]:
            prompts = read_prompts(args.prompts, tokenizer, limit=args.limit, chat_template_kwargs=kwargs)
            rows.append(bench_row("prompts", tau_on_prompts(Responder(target, model, sampling, opts), prompts)))
    for name, convs in sets.items():
        for sampling in settings:
            responder = Responder(target, model, sampling, opts)
            rows.append(bench_row(name, tau_on_conversations(responder, tokenizer, convs)))
    if args.bench or len(settings) > 1:
        print("\n".join(table_lines(rows)))
        result["rows"] = rows
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return Exit.OK


def llama_cpp_loads(model: DraftModel) -> bool:
    """Whether llama.cpp loads this drafter (its architecture's serving says so): else no count to predict."""
    return model.config.spec.card(model.config).serving.llama_cpp_type is not None


def engine_counts(target, model, prompts, sequences, *, budget: int,
                  num_speculative_tokens: int | None = None) -> tuple[LlamaCppCounts | None, VllmCounts]:
    """llama.cpp's and vLLM's rounds over the responses (the target's taps computed once for both),
    vLLM's served with `num_speculative_tokens` (default: every draft of the block); llama.cpp's is None
    when it does not load the drafter (its architecture's serving says so: no count to predict)."""
    llama_cpp = LlamaCppCounts() if llama_cpp_loads(model) else None
    vllm = VllmCounts.of(target, num_speculative_tokens or model.num_drafts)
    for prompt, x in zip(prompts, sequences):
        taps = target_taps(target, x, model.layer_ids)
        if llama_cpp is not None:
            llama_cpp.add(model, taps, x, len(prompt), budget=budget, stop=eos_ids(target))
        vllm.add(model, taps, x, prompt_len=len(prompt), budget=budget)
    return llama_cpp, vllm


def greedy_report(target, model: DraftModel, prompts, *, opts: BenchOptions, shared=None) -> dict:
    """What `--prompts --out` reports of the greedy responses (tau, llama.cpp's and vLLM's counts), the
    responses generated `opts.batch` at a time and kept in `shared` (eval.batched.SharedResponses) for the
    next drafter: in float32 the same numbers as the per-prompt path here (eval.batched)."""
    responder = Responder(target, model, Sampling(), opts, shared=shared)
    tau_on_prompts(responder, prompts)
    report = responder.result.report.as_dict()
    report["llama_cpp"] = responder.llama_cpp.as_dict() if llama_cpp_loads(model) else None
    report["vllm"] = responder.vllm.as_dict()
    return report


def _prompts_tau(args, target, tokenizer, model, *, kwargs, result: dict) -> TauReport:
    """The exact greedy tau of --prompts, printed as before (and checked online with --online)."""
    prompts = read_prompts(args.prompts, tokenizer, limit=args.limit, chat_template_kwargs=kwargs)
    sequences: list = []
    report = offline_tau(target, model, prompts, max_new_tokens=args.max_new_tokens,
                         batch_anchors=args.batch_anchors, sequences=sequences)
    llama_cpp, vllm = engine_counts(target, model, prompts, sequences, budget=args.max_new_tokens,
                                    num_speculative_tokens=args.num_speculative_tokens)
    result.update(report.as_dict())
    result["llama_cpp"] = llama_cpp.as_dict() if llama_cpp is not None else None
    result["vllm"] = vllm.as_dict()
    print(f"tau_mean {_fmt(report.tau_mean)}  tau_pooled {_fmt(report.tau_pooled)}  "
          f"({len(report.cycles)} responses, {report.num_cycles} cycles, block size {model.block_size})")
    print(llama_cpp.line() + " (docs/algorithm.md section 7.3)" if llama_cpp is not None else
          "llama.cpp does not load this drafter (its model card says why): no llama.cpp count")
    print(vllm.line() + " (docs/algorithm.md section 7.4)")
    print("accepted drafts per cycle: " + " ".join(f"{j}:{n}" for j, n in enumerate(report.histogram)))
    print(report.position_line())
    if args.online:
        result["online"] = online = _online(target, model, prompts, sequences, report=report,
                                            max_new_tokens=args.max_new_tokens)
        print(f"online: tau_mean {_fmt(online['tau_mean'])} tau_pooled {_fmt(online['tau_pooled'])}, "
              f"{online['responses_matching_offline']}/{len(prompts)} responses identical to the offline walk "
              "(in bf16, recomputing the target over other lengths can flip near-ties)")
    return report


def _online(target, model: DraftModel, prompts, sequences, *, report: TauReport, max_new_tokens: int) -> dict:
    """The reference loop on every prompt, compared response by response with the offline walk."""
    from dflash_ds.eval.specdec import speculative_generate

    online, agree = TauReport(block_size=model.max_emitted), 0
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
