"""Data preparation speed: `python -m dflash_ds.bench --role data [--chats 1000] [--tokenizer PATH]`.

On generated chats (seeded; words of 2-9 letters with punctuation):
- ordinary mix: 1-4 exchanges, an optional system prompt, 50-400 characters per user message and
  600-3,000 per answer. Conversations/s and tokens/s of `ChatEncoder.encode` (ids + loss mask) on one
  core, against plain `tokenizer.apply_chat_template(..., tokenize=True)` on the same conversations.
- long threads: 200 exchanges of 20-200 / 50-400 characters against 2 exchanges of the same kind:
  microseconds per token of each (cost linear in the length: the ratio stays near 1).
- end to end: `prepare()` with the default `data.num_proc` (every core) on `--prepare-sizes` chats of
  the ordinary mix, each in a fresh process: conversations/s, the peak anonymous resident memory
  (RssAnon of the process plus its live workers, sampled every 50 ms) and, for comparison, ru_maxrss
  (largest single process, file-backed pages of memory maps included). Anonymous memory is what must
  not grow with the number of chats: mapped Arrow and .npy pages are file-backed and reclaimable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from dflash_ds.safety import Exit

REPO = Path(__file__).resolve().parents[2]


def _text(rng, lo: int, hi: int) -> str:
    n, out, size = int(rng.integers(lo, hi + 1)), [], 0
    while size < n:
        w = "".join(chr(97 + c) for c in rng.integers(0, 26, int(rng.integers(2, 10))))
        w += "" if rng.random() < 0.85 else str(rng.choice([",", ".", "?", ".\n"]))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def iter_chats(n: int, turns: tuple[int, int], user: tuple[int, int], answer: tuple[int, int], *, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        msgs = [{"role": "system", "content": _text(rng, 30, 120)}] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            msgs += [{"role": "user", "content": _text(rng, *user)},
                     {"role": "assistant", "content": _text(rng, *answer)}]
        yield msgs


def chats(n: int, turns: tuple[int, int], user: tuple[int, int], answer: tuple[int, int], *, seed: int = 0):
    return list(iter_chats(n, turns, user, answer, seed=seed))


def _time(fn, convs) -> tuple[float, int]:
    t0, tokens = time.perf_counter(), 0
    for c in convs:
        tokens += fn(c)
    return time.perf_counter() - t0, tokens


def serial(tok, convs, thinking: bool) -> dict:
    from dflash_ds.data.chat import ChatEncoder

    enc = ChatEncoder(tok, thinking)
    plain_s, plain_tok = _time(lambda c: len(tok.apply_chat_template(c, tokenize=True, enable_thinking=thinking,
                                                                    return_dict=False)), convs)
    ours_s, ours_tok = _time(lambda c: len(enc.encode(c).input_ids), convs)
    return {"conversations": len(convs), "tokens": ours_tok, "plain_tokens": plain_tok,
            "plain_conv_s": len(convs) / plain_s, "encode_conv_s": len(convs) / ours_s,
            "plain_tok_s": plain_tok / plain_s, "encode_tok_s": ours_tok / ours_s, "ratio": plain_s / ours_s}


def _rss_anon_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass  # the process ended between listing and reading
    return 0


def _tree(pid: int) -> list[int]:
    """pid and its live descendants (the encode workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass  # ended meanwhile
    return out


class AnonPeak:
    """Peak of the summed RssAnon over a process tree, sampled every `interval` s in a thread."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid, self.interval, self.peak_kib, self.peak_procs = pid, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            pids = _tree(self.pid)
            total = sum(_rss_anon_kib(p) for p in pids)
            if total > self.peak_kib:
                self.peak_kib, self.peak_procs = total, len(pids)
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib


def prepare_run(tokenizer: str, n: int, work: Path, num_proc: int) -> dict:
    """prepare() on n ordinary chats in a fresh process; wall time, peak anonymous memory and ru_maxrss."""
    src = work / f"chats-{n}.jsonl"
    with src.open("w") as f:
        for c in iter_chats(n, (1, 4), (50, 400), (600, 3000), seed=1):  # streamed to the file
            f.write(json.dumps({"messages": c}) + "\n")
    code = (
        "import sys, time, types; from transformers import AutoTokenizer; from dflash_ds.data.prepare import prepare\n"
        f"cfg = types.SimpleNamespace(path={str(src)!r}, split='train', max_samples=None, max_length=8192, pack=True,"
        f" truncation='truncate', thinking=False, cache_dir={str(work / f'cache-{n}')!r}, seed=0, eval_path=None,"
        f" eval_split='train', num_eval=8, num_proc={num_proc},"
        " regenerate=types.SimpleNamespace(enabled=False))\n"
        f"tok = AutoTokenizer.from_pretrained({tokenizer!r}); t = time.perf_counter()\n"
        "d = prepare(cfg, tok, verbose=False); import resource as r\n"
        "rss = max(r.getrusage(r.RUSAGE_SELF).ru_maxrss, r.getrusage(r.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print('RESULT', time.perf_counter() - t, d.report['tokens'], rss)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    sampler = AnonPeak(proc.pid)
    out, err = proc.communicate()
    anon = sampler.stop()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    secs, tokens, rss = next(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT"))
    return {"chats": n, "seconds": float(secs), "conv_s": n / float(secs), "tok_s": int(tokens) / float(secs),
            "peak_rss_mib": int(rss) / 1024, "peak_anon_mib": anon / 1024, "peak_anon_processes": sampler.peak_procs,
            "processes": num_proc}


def run(argv: list[str]) -> dict:
    from dflash_ds.arguments import Parser, integer, integers, model_folder, output_file

    p = Parser(prog="python -m dflash_ds.bench --role data", description=__doc__.splitlines()[0])
    p.add_argument("--role", default="data")
    p.add_argument("--tokenizer", default=str(REPO / "assets" / "tiny-target"), type=model_folder, help="a tokenizer with a chat template")
    p.add_argument("--chats", type=integer(1), default=1000, help="ordinary-mix conversations for the one-core comparison")
    p.add_argument("--long", type=integer(1), default=10, help="200-exchange conversations (and 100x as many 2-exchange)")
    p.add_argument("--thinking", action="store_true")
    p.add_argument("--prepare-sizes", default="2000,8000", type=integers(1), help="comma list of dataset sizes for prepare(); empty = skip")
    p.add_argument("--num-proc", type=integer(0), default=0, help="prepare processes (0 = every core)")
    p.add_argument("--out", default=None, type=output_file)
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tok.model_max_length = 1 << 30  # no length warnings: these are not model inputs
    report = {"role": "data", "args": vars(args), "cores": os.cpu_count()}
    report["ordinary"] = serial(tok, chats(args.chats, (1, 4), (50, 400), (600, 3000)), args.thinking)
    long = serial(tok, chats(args.long, (200, 200), (20, 200), (50, 400), seed=2), args.thinking)
    short = serial(tok, chats(args.long * 100, (2, 2), (20, 200), (50, 400), seed=3), args.thinking)
    report["per_token_us"] = {"turns_200": 1e6 / long["encode_tok_s"], "turns_2": 1e6 / short["encode_tok_s"],
                              "ratio": short["encode_tok_s"] / long["encode_tok_s"]}  # 200-turn cost / 2-turn cost
    sizes = args.prepare_sizes
    with tempfile.TemporaryDirectory() as d:
        report["prepare"] = [prepare_run(args.tokenizer, n, Path(d), args.num_proc) for n in sizes]
    return report


def main(argv: list[str]) -> int:
    r = run(argv)
    o = r["ordinary"]
    print(f"data preparation | tokenizer {r['args']['tokenizer']} | {r['cores']} cores")
    print(f"  ordinary mix, 1 core: encode {o['encode_conv_s']:,.1f} conv/s ({o['encode_tok_s']:,.0f} tok/s); plain "
          f"apply_chat_template {o['plain_conv_s']:,.1f} conv/s ({o['plain_tok_s']:,.0f} tok/s); ratio {o['ratio']:.2f}x")
    t = r["per_token_us"]
    print(f"  per token: 200 exchanges {t['turns_200']:.2f} us, 2 exchanges {t['turns_2']:.2f} us "
          f"(200-turn cost {t['ratio']:.2f}x the 2-turn cost)")
    for q in r["prepare"]:
        print(f"  prepare {q['chats']:,} chats on {q['processes'] or r['cores']} processes: {q['seconds']:.1f} s, "
              f"{q['conv_s']:,.1f} conv/s ({q['conv_s'] / r['cores']:,.1f} per core), {q['tok_s']:,.0f} tok/s, "
              f"peak anonymous {q['peak_anon_mib']:,.0f} MiB ({q['peak_anon_processes']} processes), "
              f"ru_maxrss {q['peak_rss_mib']:,.0f} MiB")
    if r["args"]["out"]:
        Path(r["args"]["out"]).write_text(json.dumps(r, indent=1) + "\n")
    return Exit.OK
