"""Performance harness: measured rates of each role, and the targets:drafters split they imply.

    python -m dflash_ds.bench --role target    [--geometry qwen3.6-27b] [--layers N] [--no-engine]
    python -m dflash_ds.bench --role target --set target.quantization=fp8 [--compare-bf16] [--fp8-blocks]
    python -m dflash_ds.bench --role drafter   [--anchors 512] [--compile-layers] [--cold-cache]
    python -m dflash_ds.bench --role drafter --recipe recipes/qwen27b-dflash2.yaml --block-size 8 [--architecture dflash]
    python -m dflash_ds.bench --role drafter --compile-layers --fp8-modes bf16,rowwise,tensorwise,rowwise+lm_head
    python -m dflash_ds.bench --role lm_head   (the fused loss's lm_head GEMMs: bf16, FP8, torchao's float8)
    python -m dflash_ds.bench --role quality --compile-layers --layers 4 --fp8-modes bf16,bf16@1,rowwise,rowwise+lm_head
    python -m dflash_ds.bench --role colocated
    python -m dflash_ds.bench --role target --lengths chat|long [--seq-len 3072] [--set data.pack=false]
    python -m dflash_ds.bench --role target --geometry qwen3.6-35b-a3b --experts eager,grouped_mm,dflash_grouped
    python -m dflash_ds.bench --role transport [--transport-backend gloo|nccl]
    python -m dflash_ds.bench --role plan --from target.json drafter.json --gpus-per-node 8
    python -m dflash_ds.bench --role data      [--chats 1000] [--tokenizer PATH]   (CPU: data preparation)
    python -m dflash_ds.bench --role regenerate --target PATH --prompts FILE.jsonl   (the regeneration's decoders)

Rows are the recipe's (data.row_length, optim.rows_per_micro_batch, optim.grad_accum and its anchors
per row token) unless the flags say otherwise.
Rates are context tokens per second (rows x seq_len), the unit both sides share, so they can be
balanced; every role also reports the useful (non-padding) rate and the padding share of its rows
(`--lengths` fills rows from a conversation-length mix instead of one full-length document). MFU
uses the project's FLOP counting rules (flops.py: the same counts as the published anchor figures)
against a bf16 (CPU: fp32) matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from .environment import compile_cache_state, environment
from .planner import best_split, fractional_split, plan_splits
from .roles import run_drafter, run_target, run_transport
from .setup import DEFAULT_RECIPE, REPO, init_single_process, pick_device, resolve_setup
from .timing import drift_warnings, matmul_ceiling

from dflash_ds.architectures import DEFAULT, names
from dflash_ds.arguments import Parser, existing_file, integer, number, output_file
from dflash_ds.safety import Exit, say

ROLES = ("target", "drafter", "colocated", "transport", "lm_head", "quality", "plan", "data", "regenerate")


# ============================================================================ the plan role


def _rate_from(path: str) -> tuple[str, float, dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--from {path}: cannot read a bench JSON ({exc})") from None
    role = data.get("role")
    if role not in ("target", "drafter") or "tok_s" not in data.get("result", {}):
        raise ValueError(f"--from {path}: a --role target or --role drafter bench output is needed, got role {role!r}")
    return role, float(data["result"]["tok_s"]), data


def row_warnings(sources: dict, args: argparse.Namespace) -> list[str]:
    """Rates measured on rows other than the recipe's (data.row_length) do not plan its run: a role's
    rate depends on the row length (attention, anchors per row, padding)."""
    from dflash_ds.config import load_recipe

    recipe = load_recipe(Path(args.recipe) if args.recipe else DEFAULT_RECIPE, list(args.set or []))
    out = []
    for role, src in sources.items():
        seq_len = src["args"].get("seq_len")
        if seq_len and seq_len != recipe.data.row_length:
            out.append(f"{src['file']}: {role} measured on {seq_len}-token rows, but {recipe.source} trains on "
                       f"{recipe.data.row_length}-token rows (data.row_length); measure with the recipe's rows "
                       "(leave --seq-len out)")
    return out


def run_plan(args: argparse.Namespace) -> dict:
    rates = {"target": args.target_rate, "drafter": args.drafter_rate}
    sources, warnings = {}, []
    for path in args.from_files or []:
        role, rate, data = _rate_from(path)
        rates[role] = rate
        run_args = data.get("args") or {}
        sources[role] = {"file": path, "args": run_args, "device_name": data.get("env", {}).get("device_name"),
                         "ceiling_tflops": data.get("ceiling", {}).get("tflops")}
        if run_args.get("layers"):
            warnings.append(f"{path}: measured with --layers {run_args['layers']}, not the full target; its rate "
                            "is not the training rate")
        if run_args.get("device") == "cpu" or data.get("env", {}).get("device") == "cpu":
            warnings.append(f"{path}: measured on CPU")
    warnings += row_warnings(sources, args)
    missing = [k for k, v in rates.items() if v is None]
    if missing:
        raise ValueError(f"no {' and no '.join(missing)} rate: pass --{missing[0]}-rate TOK_S or --from a bench JSON "
                         f"of --role {missing[0]}")
    n = args.gpus_per_node
    splits = plan_splits(rates["target"], rates["drafter"], n)
    best = best_split(splits)
    t_frac, tok_frac = fractional_split(rates["target"], rates["drafter"], n)
    return {"target_rate": rates["target"], "drafter_rate": rates["drafter"], "gpus_per_node": n,
            "splits": [{"targets": s.targets, "drafters": s.drafters, "target_tok_s": s.target_tok_s,
                        "drafter_tok_s": s.drafter_tok_s, "tok_s": s.tok_s, "bound": s.bound} for s in splits],
            "best": {"targets": best.targets, "drafters": best.drafters, "tok_s": best.tok_s, "bound": best.bound},
            "fractional": {"targets": t_frac, "drafters": n - t_frac, "tok_s": tok_frac},
            "recipe": f"topology.targets_per_node={best.targets} topology.drafters_per_node={best.drafters}",
            "sources": sources, "warnings": warnings}


# ============================================================================ CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    # Each argument is checked as it is parsed (dflash_ds/arguments.py): one line, exit 2, nothing built.
    p = Parser(prog="python -m dflash_ds.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--geometry", default="qwen3.6-27b", help="named target geometry (dflash_ds/target_model/presets.py)")
    p.add_argument("--recipe", default=None, type=existing_file,
                   help=f"recipe for engine/optimiser settings (default {DEFAULT_RECIPE.relative_to(REPO)}); its "
                        "target geometry is used when target.path is a local directory")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra recipe override (repeatable)")
    p.add_argument("--layers", type=integer(1), default=None, help="override the target's layer count (taps recomputed)")
    p.add_argument("--seq-len", type=integer(1), default=None, help="row length (default: the recipe's data.row_length)")
    p.add_argument("--rows", type=integer(1), default=None,
                   help="rows per micro-batch (default: the recipe's optim.rows_per_micro_batch)")
    p.add_argument("--grad-accum", type=integer(1), default=None, help="micro-batches per step (default: the recipe's)")
    p.add_argument("--anchors", type=integer(1), default=None,
                   help="anchors per row (default: the recipe's anchors per row token x the row length)")
    p.add_argument("--block-size", type=integer(1), default=16)
    p.add_argument("--architecture", default=None, choices=names(),
                   help="drafter.architecture (default: the recipe's), e.g. the plain backbone of a recipe of another "
                        "architecture, to measure what the architecture's additions cost")
    p.add_argument("--prompt-tokens", type=integer(0), default=None, help="prompt prefix without loss (default seq_len/8)")
    p.add_argument("--lengths", default=None, metavar="FILE|chat|long",
                   help="fill rows with conversations of these lengths ('chat', 'long' (long answers): built-in mixes, "
                        "see docs/performance.md; FILE: the lengths.json `python -m dflash_ds.data prepare` writes), "
                        "cut to data.max_length and packed per data.pack")
    p.add_argument("--steps", type=integer(1), default=20, help="timed steps")
    p.add_argument("--warmup", type=integer(0), default=3, help="untimed steps before, the first one timed alone")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--out", default=None, type=output_file, help="write all numbers to this JSON file")
    p.add_argument("--no-engine", action="store_true", help="run the target without DeepSpeed")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each drafter layer")
    p.add_argument("--loss-impl", default="fused", choices=("fused", "autograd"),
                   help="drafter: the loss with hand-written gradients (objective/loss.py), or autograd per chunk "
                        "with a backward per chunk (torchtitan's chunked loss; bench/chunk_autograd.py)")
    p.add_argument("--no-fla-conv", action="store_true", help="target: keep transformers' PyTorch short conv")
    p.add_argument("--no-fused-target", action="store_true",
                   help="target: keep transformers' own norms and SwiGLU instead of the compiled fused ones")
    p.add_argument("--masked-attention", action="store_true",
                   help="target, packed rows: full-attention layers through transformers' masked SDPA instead of "
                        "the FlashAttention varlen kernel (for comparison)")
    p.add_argument("--compare-bf16", action="store_true",
                   help="target with --set target.quantization=fp8: time the bf16 target first on the same weights, "
                        "then the FP8 one, and report the error of every layer's output against bf16")
    p.add_argument("--fp8-blocks", action="store_true",
                   help="target, FP8: 128x128 weight blocks and 1x128 activation groups (a published FP8 "
                        "checkpoint's format) instead of per-row scales")
    p.add_argument("--experts", default=None, metavar="IMPL[,IMPL...]",
                   help="target, mixture of experts: time each experts implementation in turn on the same weights "
                        "(dflash_grouped, grouped_mm, batched_mm, eager) and compare their taps")
    p.add_argument("--expert-chunk", type=integer(1), default=16384,
                   help="target, dflash_grouped experts: tokens per chunk (bounds the experts' transient memory)")
    p.add_argument("--fp8-modes", default=None, metavar="MODE,MODE...",
                   help="drafter: time these precision modes one after another on the same drafter (bench/fp8_modes.py: "
                        "bf16, rowwise or tensorwise, each optionally +lm_head, e.g. bf16,rowwise,rowwise+lm_head); "
                        "quality: train each from the same initialisation (MODE@SEED: from another seed)")
    p.add_argument("--profile", default=None, type=output_file, help="write a kernel time table of 2 extra steps to this file")
    p.add_argument("--cold-cache", action="store_true", help="fresh inductor/triton caches (cold compile times)")
    p.add_argument("--transport-backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--in-flight", type=integer(1), default=4, help="transport: sends outstanding (topology.max_in_flight)")
    p.add_argument("--recv-depth", type=integer(1), default=2, help="transport: receives posted ahead")
    p.add_argument("--transport-timeout", type=number(0, above=True), default=600.0)
    p.add_argument("--target-rate", type=number(0, above=True), default=None, help="plan: target tok/s per GPU")
    p.add_argument("--drafter-rate", type=number(0, above=True), default=None, help="plan: drafter tok/s per GPU")
    p.add_argument("--from", dest="from_files", nargs="+", default=None, type=existing_file, help="plan: bench JSONs to read rates from")
    p.add_argument("--gpus-per-node", type=integer(1), default=8)
    return p.parse_args(argv)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def summary_lines(report: dict) -> list[str]:
    r = report["result"]
    geo = report.get("geometry", {}).get("name", "")
    lines = [f"role {report['role']} | {geo} | {report['env']['device_name']}"]
    if report["role"] == "plan":
        lines.append(f"rates per GPU: target {r['target_rate']:,.0f} tok/s, drafter {r['drafter_rate']:,.0f} tok/s; "
                     f"{r['gpus_per_node']} GPUs per node")
        lines.append(f"{'targets':>8} {'drafters':>9} {'target tok/s':>13} {'drafter tok/s':>14} {'tok/s':>9}  bound")
        for s in r["splits"]:
            mark = "  <- best" if (s["targets"], s["drafters"]) == (r["best"]["targets"], r["best"]["drafters"]) else ""
            lines.append(f"{s['targets']:>8} {s['drafters']:>9} {s['target_tok_s']:>13,.0f} {s['drafter_tok_s']:>14,.0f} "
                         f"{s['tok_s']:>9,.0f}  {s['bound']}{mark}")
        f = r["fractional"]
        lines.append(f"fractional optimum: {f['targets']:.2f} targets + {f['drafters']:.2f} drafters -> {f['tok_s']:,.0f} tok/s")
        lines.append(f"recipe: {r['recipe']}")
        lines += [f"warning: {w}" for w in r["warnings"]]
        return lines
    c = report.get("ceiling") or {}
    if c:
        lines.append(f"matmul ceiling {c['tflops']:.4g} TFLOP/s ({c['dtype']} {c['size']}^3)")
    keys = [("tok/s (mean step)", "tok_s"), ("tok/s (median step)", "tok_s_median"),
            ("useful tok/s (non-padding)", "useful_tok_s"), ("padding share", "padding_share"),
            ("documents per row", "docs_per_row"), ("MFU", "mfu"), ("TFLOP/s", "tflops"), ("GB/s", "gb_s"), ("payloads/s", "payloads_per_s"),
            ("build s", "build_s"), ("first step s", "first_step_s"), ("first step since build s", "first_step_since_build_s"),
            ("first step since process start s", "first_step_since_process_start_s")]
    for label, key in keys:
        if key in r:
            lines.append(f"  {label:<34} {_fmt(r[key])}")
    if "step_s" in r:
        st = r["step_s"]
        lines.append(f"  {'step s (mean/median/min/max)':<34} {st['mean']:.4f} / {st['median']:.4f} / {st['min']:.4f} / {st['max']:.4f}")
    mem = r.get("memory", {})
    if "first_step_peak_gib" in mem:
        lines.append(f"  {'peak GiB (first/last timed step)':<34} {mem['first_step_peak_gib']:.2f} / {mem['last_step_peak_gib']:.2f}")
    if "drafter_params" in r:
        lines.append(f"  {'drafter parameters':<34} {r['drafter_params']:,} ({r.get('architecture', DEFAULT.spec.name)})")
    if "mask" in r:
        m = r["mask"]
        lines.append(f"  {'mask build s (first/warm)':<34} {m['first_build_s']:.4f} / {m['build_s']:.4f} ({m['kind']})")
    if "fp8" in r:
        q = r["fp8"]
        lines.append(f"  {'FP8 (' + q['scheme'] + ') / bf16 tok/s':<34} {q['fp8_tok_s']:,.0f} / {q['bf16_tok_s']:,.0f} "
                     f"= {q['speedup']:.3f}x (median steps: {q['speedup_median']:.3f}x)")
        taps = ", ".join(f"{k}: {v:.4f}" for k, v in q["taps_rel_rms"].items())
        lines.append(f"  {'taps rel. RMS error vs bf16':<34} {taps}")
        own = ", ".join(f"{k}: {v:.4f}" for k, v in q["taps_own_rel_rms"].items())
        lines.append(f"  {'  each layer alone (bf16 input)':<34} {own}")
        ctl = q["bf16_embedding_noise_1pct_rel_rms"]
        lines.append(f"  {'  bf16, 1% embedding noise':<34} " + ", ".join(f"{k}: {ctl[int(k)]:.4f}" for k in q["taps_rel_rms"]))
        lines.append(f"  {'FP8 linears / kept / fused MLPs':<34} {q['fp8_linears']} / {len(q['kept_linears'])} / "
                     f"{q['fused_mlps']}")
    for name, e in (r.get("experts_runs") or {}).items():
        if "error" in e:
            lines.append(f"  {'experts ' + name:<34} {e['error']}")
            continue
        peak = e.get("memory", {}).get("max_step_peak_gib")
        lines.append(f"  {'experts ' + name:<34} {e['tok_s']:,.0f} tok/s, MFU {e['mfu']:.3f}, peak "
                     f"{'-' if peak is None else f'{peak:.1f}'} GiB, taps rel. RMS vs first "
                     f"{e['taps_rel_rms_vs_first']:.2e}")
    if report["role"] == "quality":
        from .fp8_quality import summary_text

        lines += ["  " + line for line in summary_text(r["summary"]).splitlines()]
    for name, v in r.get("lm_head", {}).items():
        lines.append(f"  {name:<34} logits {v['logits_ms']:.3f} ms + input grad {v['input_grad_ms']:.3f} ms = "
                     f"{v['speedup_vs_bf16']:.3f}x bf16; rel. RMS error {v['logits_rel_rms']:.2e} / "
                     f"{v['input_grad_rel_rms']:.2e}")
    for name, m in r.get("fp8_modes", {}).items():
        lines.append(f"  {'mode ' + name:<34} {m['tok_s']:,.0f} tok/s ({m['tok_s_median']:,.0f} median), "
                     f"{m['vs_first']:.3f}x the first ({m['vs_first_median']:.3f}x median), peak "
                     f"{m['memory'].get('max_step_peak_gib', 0):.1f} GiB, {m['fp8_layers']} float8 linears"
                     f"{', FP8 lm_head' if m['lm_head_fp8'] else ''}")
    comp = r.get("compile", {})
    if comp.get("total", {}).get("unique_graphs"):
        lines.append(f"  {'graphs compiled (first/warmup/timed)':<34} {comp['first_step']['unique_graphs']} / "
                     f"{comp['warmup']['unique_graphs']} / {comp['timed']['unique_graphs']}")
    lines += [f"warning: {w}" for w in drift_warnings(r)]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "data" in argv and argv[argv.index("data") - 1] == "--role" or "--role=data" in argv:
        from .data import main as data_main  # CPU only, its own options

        return data_main([a for a in argv if a != "--role=data"])
    if "regenerate" in argv and argv[argv.index("regenerate") - 1] == "--role" or "--role=regenerate" in argv:
        from .regenerate import main as regenerate_main  # the regeneration's decoders, its own options

        return regenerate_main(argv)
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.masked_attention:
            from dflash_ds.target_model import packed

            packed.varlen_usable = lambda config, dtype, device: False  # bench-only A/B switch
        report = run(args)
    except ValueError as exc:
        say(f"bench error: {exc}")
        return Exit.USER
    print("\n".join(summary_lines(report)), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"written {args.out}", flush=True)
    return Exit.OK


def run(args: argparse.Namespace) -> dict:
    cache = compile_cache_state(args.cold_cache)
    if args.role == "plan":
        return {"role": "plan", "args": vars(args), "env": environment(torch.device("cpu"), cache),
                "result": run_plan(args)}
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup = resolve_setup(args, device)
    if args.fp8_modes:
        from .fp8_modes import check_modes, parse_modes

        if args.role not in ("drafter", "quality"):
            raise ValueError(f"--fp8-modes applies to --role drafter and --role quality, not {args.role}")

        check_modes(setup, parse_modes(args.fp8_modes))  # before anything is built
    ceiling = matmul_ceiling(device)
    if args.role == "target" and args.experts:
        from .experts import run_target_experts

        init_single_process(device)
        result = run_target_experts(setup, ceiling)
    elif args.role == "target":
        result = run_target(setup, ceiling)
    elif args.role == "lm_head":
        from .fp8_head_ab import run_lm_head

        result = run_lm_head(setup, ceiling)
    elif args.role == "quality":
        from .fp8_quality import run_quality

        result = run_quality(setup, ceiling)
    elif args.role == "drafter" and args.fp8_modes:
        from .fp8_modes import run_drafter_modes

        result = run_drafter_modes(setup, ceiling)
    elif args.role in ("drafter", "colocated"):
        result = run_drafter(setup, ceiling, colocated=args.role == "colocated")
    else:
        result = run_transport(setup, ceiling)
    c = setup.drafter_config
    return {"role": args.role, "args": vars(args), "env": environment(device, cache), "ceiling": ceiling,
            "geometry": {"name": setup.geometry_name, "target_layers": setup.target_config.num_hidden_layers,
                         "hidden": c.hidden_size, "vocab": c.vocab_size, "taps": list(c.target_layer_ids),
                         "drafter": dataclasses.asdict(c)},
            "recipe": {"source": setup.recipe.source, "drafter_ds_config": setup.recipe.drafter.ds_config,
                       "target_ds_config": setup.recipe.target.ds_config},
            "result": result}
