"""python -m lab STEP: the quality lab's steps (docs/quality.md).

    corpus      download the pinned sdists (PyPI), build runs/lab/corpus.jsonl.xz           CPU, needs PyPI
    tokenizer   train the BPE tokenizer on the training split -> runs/lab/tokenizer         CPU
    frame       conversations and held-out benchmark sets -> runs/lab/conversations        CPU
    target      pretrain + fine-tune the lab target -> runs/lab/target                      GPU, <= ~8 min
    regenerate  the target's own answers to the training conversations (time-boxed)         GPU
    run-settings  a named run's recipe and overrides, one a line (lab/catalog.py)
    run-after   the run whose export each named run starts from, one a line (empty when none)
    evaluate    every trained run of a list evaluated in one process, each response generated once  GPU
    summarize   one run's summary JSON (benchmarks, losses, llama.cpp counts, wall time)
    table       the table of every summary in a folder -> quality_lab.md + quality_lab_table.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LAB = Path("runs/lab")
STARTED = time.monotonic()


def _log(msg: str) -> None:
    print(f"[lab] {msg}", flush=True)


def _corpus(args) -> dict:
    from lab import corpus

    t0 = time.monotonic()
    counts = corpus.build(Path(args.out), cache_dir=Path(args.cache).expanduser())
    size = Path(args.out).stat().st_size
    _log(f"wrote {args.out}: {size / 2**20:.1f} MiB, {time.monotonic() - t0:.0f} s")
    return {"file": args.out, "bytes": size, "counts": counts}


def _tokenizer(args) -> dict:
    from lab import corpus, tokenizer

    docs = corpus.read_corpus(Path(args.corpus))
    t0 = time.monotonic()
    tok = tokenizer.train_tokenizer(tokenizer.tokenizer_texts(docs, int(args.max_chars)), args.vocab)
    tokenizer.save(tok, args.out)
    _log(f"trained a {len(tok)}-token BPE in {time.monotonic() - t0:.0f} s -> {args.out}")
    return {"tokenizer": args.out, "vocab": len(tok), "mask_token_id": tok.convert_tokens_to_ids(tokenizer.MASK),
            "eos_token_id": tok.eos_token_id, "tokens": token_counts(tok, docs)}


def token_counts(tok, docs: list[dict]) -> dict:
    """Tokens per split and kind, and characters per token."""
    out: dict = {}
    for start in range(0, len(docs), 512):
        chunk = docs[start:start + 512]
        for d, ids in zip(chunk, tok([d["text"] for d in chunk], add_special_tokens=False)["input_ids"]):
            row = out.setdefault(f"{d['split']}/{d['kind']}", {"documents": 0, "tokens": 0, "chars": 0})
            row["documents"] += 1
            row["tokens"] += len(ids)
            row["chars"] += len(d["text"])
    for row in out.values():
        row["chars_per_token"] = round(row["chars"] / max(1, row["tokens"]), 3)
    return out


def _frame(args) -> dict:
    from lab import corpus, framing

    docs = corpus.read_corpus(Path(args.corpus))
    return framing.frame(docs, Path(args.out), train_count=args.train_count, bench_count=args.bench_count,
                         seed=args.seed)


def _target(args) -> dict:
    from lab import corpus, tokenizer
    from lab.target import SHAPES, Phase, Plan, train_target

    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r}: one of {sorted(SHAPES)}")
    convs_path = Path(args.conversations) / "train.jsonl"
    if not convs_path.is_file():
        raise ValueError(f"lab target: {convs_path} is missing; run `python -m lab frame` first")
    docs = corpus.read_corpus(Path(args.corpus))
    tok = tokenizer.load(args.tokenizer)
    convs = [json.loads(line) for line in convs_path.read_text().splitlines() if line.strip()]
    plan = Plan(shape=args.shape, seq_len=args.seq_len, seed=args.seed, compile=not args.no_compile,
                deadline=args.deadline - (time.monotonic() - STARTED),
                pretrain=Phase(seconds=args.seconds, steps=args.steps, lr=args.lr, rows=args.rows),
                sft=Phase(seconds=args.sft_seconds, steps=args.sft_steps, lr=args.lr / 3, rows=args.rows))
    return train_target(plan, tok, docs, convs, out=Path(args.out), log=_log)


def _regenerate(args) -> dict:
    from lab.runs import regenerate

    return regenerate(args.recipe, args.overrides, batch_size=args.batch_size, seconds=args.seconds, log=_log,
                      slots=args.slots)


def _run_settings(args) -> dict:
    from lab.catalog import settings_lines

    print("\n".join(settings_lines(args.name, args.lab_dir)))
    return {}


def _run_after(args) -> dict:
    from lab.catalog import run

    print("\n".join(run(name).starts_from or "" for name in args.names))
    return {}


def _run_names(args) -> dict:
    from lab.catalog import RUNS

    print(" ".join(RUNS))
    return {}


def _from_logs(args) -> dict:
    from lab.catalog import RUNS
    from lab.logs import summary_from_log

    folder, written = Path(args.folder), []
    for name in RUNS:
        log, out = folder / f"{name}.log", folder / f"{name}.json"
        if log.is_file() and not out.is_file():
            summary = summary_from_log(log, name)
            if summary["benchmarks"]:
                out.write_text(json.dumps(summary, indent=1) + "\n")
                written.append(name)
    return {"written": written}


def _evaluate(args) -> dict:
    from lab.evaluate import evaluate

    return evaluate(args.names, out=Path(args.out), lab_dir=args.lab_dir, settings=args.settings,
                    overrides=args.overrides, seconds=args.seconds, log=_log)


def _summarize(args) -> dict:
    from lab.runs import summarize

    summary = summarize(Path(args.run_dir), args.name, wall_s=args.wall_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return {"summary": args.out}


def _table(args) -> dict:
    from lab.table import write

    md, js = write(Path(args.folder), Path(args.out or args.folder))
    print(md.read_text())
    return {"markdown": str(md), "json": str(js)}


def parser() -> argparse.ArgumentParser:
    from dflash_ds.arguments import (Parser, existing_file, existing_folder, integer, number, output_file,
                                     output_folder)

    # Each argument is checked as it is parsed (dflash_ds/arguments.py): one line, exit 2, nothing started.
    p = Parser(prog="python -m lab", description=__doc__.splitlines()[0])
    p.add_argument("--record", default=None, type=output_file, help="also write the step's result as JSON here")
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--out", default=str(LAB / "corpus.jsonl.xz"), type=output_file)
    c.add_argument("--cache", default="~/.cache/dflash-ds/lab/sdists", type=output_folder)
    t = sub.add_parser("tokenizer")
    t.add_argument("--corpus", default=str(LAB / "corpus.jsonl.xz"))
    t.add_argument("--out", default=str(LAB / "tokenizer"), type=output_folder)
    t.add_argument("--vocab", type=integer(1), default=16384)
    t.add_argument("--max-chars", type=number(1), default=40e6, help="training text read by the BPE trainer")
    f = sub.add_parser("frame")
    f.add_argument("--corpus", default=str(LAB / "corpus.jsonl.xz"))
    f.add_argument("--out", default=str(LAB / "conversations"), type=output_folder)
    f.add_argument("--train-count", type=integer(1), default=16000)
    f.add_argument("--bench-count", type=integer(1), default=64)
    f.add_argument("--seed", type=integer(0), default=0)
    g = sub.add_parser("target")
    g.add_argument("--corpus", default=str(LAB / "corpus.jsonl.xz"))
    g.add_argument("--tokenizer", default=str(LAB / "tokenizer"), type=existing_folder)
    g.add_argument("--conversations", default=str(LAB / "conversations"))
    g.add_argument("--out", default=str(LAB / "target"), type=output_folder)
    g.add_argument("--shape", default="lab")
    g.add_argument("--seq-len", type=integer(1), default=1024)
    g.add_argument("--rows", type=integer(1), default=64, help="rows per step")
    g.add_argument("--lr", type=number(0, above=True), default=1.5e-3)
    g.add_argument("--seconds", type=number(0), default=200,
                   help="pretraining's wall-clock budget (past ~170 s the held-out loss barely moves: docs/quality.md)")
    g.add_argument("--steps", type=integer(1), default=None, help="fixed pretraining steps (repeat a recorded run)")
    g.add_argument("--sft-seconds", type=number(0), default=45)
    g.add_argument("--sft-steps", type=integer(0), default=None)
    g.add_argument("--seed", type=integer(0), default=0)
    g.add_argument("--no-compile", action="store_true")
    g.add_argument("--deadline", type=number(0, above=True), default=510,
                   help="seconds from this command's start by which the target is saved (pretraining yields)")
    r = sub.add_parser("regenerate")
    r.add_argument("recipe", type=existing_file)
    r.add_argument("overrides", nargs="*")
    r.add_argument("--batch-size", type=integer(1), default=4096,
                   help="conversations regenerated together (a group of shards; with data.regenerate.decoder="
                        "generate, its generate batch: the lab target's KV cache at 1,024 x ~1,500 tokens is ~16 GB)")
    r.add_argument("--slots", type=integer(1), default=None,
                   help="the static decoder's rows (default data.regenerate.slots)")
    r.add_argument("--seconds", type=number(0, above=True), default=150)
    n = sub.add_parser("run-settings")
    n.add_argument("name")
    n.add_argument("--lab-dir", default="runs/lab", type=output_folder, help="where the lab's runs live (drafter.init_from of a run that "
                   "starts from another's export)")
    a = sub.add_parser("run-after", help="the run whose export each NAME starts from, one a line (empty: none)")
    a.add_argument("names", nargs="+")
    sub.add_parser("run-names")
    e = sub.add_parser("evaluate", help="the trained runs among NAMES, evaluated in one process (lab/evaluate.py)")
    e.add_argument("out", type=output_folder, help="where each run's summary NAME.json goes")
    e.add_argument("--names", nargs="+", required=True)
    e.add_argument("--lab-dir", default="runs/lab", type=output_folder)
    e.add_argument("--settings", nargs="*", default=[], help="recipe settings before the run's own (the lab's paths)")
    e.add_argument("--overrides", nargs="*", default=[], help="recipe settings after the run's own (LAB_OVERRIDES)")
    e.add_argument("--seconds", type=number(0, above=True), default=None, help="time box: a part starts only while it fits")
    s = sub.add_parser("summarize")
    s.add_argument("run_dir", type=existing_folder)
    s.add_argument("name")
    s.add_argument("out", type=output_file)
    s.add_argument("--wall-s", type=number(0), default=None)
    fl = sub.add_parser("from-logs", help="summaries (NAME.json) from the logs of runs whose evaluation was cut")
    fl.add_argument("folder", type=existing_folder)
    b = sub.add_parser("table")
    b.add_argument("folder", type=existing_folder)
    b.add_argument("out", nargs="?", default=None, type=output_folder)
    return p


STEPS = {"corpus": _corpus, "tokenizer": _tokenizer, "frame": _frame, "target": _target, "regenerate": _regenerate,
         "run-settings": _run_settings, "run-after": _run_after, "run-names": _run_names, "evaluate": _evaluate, "summarize": _summarize, "from-logs": _from_logs, "table": _table}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        result = STEPS[args.step](args)
    except ValueError as e:
        print(f"[lab] error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(result, indent=1) + "\n")
    if args.step not in ("table", "run-settings", "run-after", "run-names"):
        print(json.dumps(result, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
