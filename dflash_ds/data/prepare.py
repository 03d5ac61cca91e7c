"""Chat dataset (hub or local) -> fixed-length training rows, cached and audited.

    python -m dflash_ds.data prepare RECIPE [key=value ...]

Rows are `S = data.row_length` tokens holding whole documents (never split across rows; each document
at most `data.max_length` tokens, cut or dropped per data.truncation):
`input_ids` int32 [S] (pad id on padding), `loss_mask` uint8 [S] (1 on assistant tokens),
`doc_ids` int32 [S] (document index inside the row, -1 on padding). Packing and the per-document
position ids are in `dflash_ds/data/packing.py`; the attention mask a packed row needs is
`dflash_ds/network/attention.py`'s.

Prepared data lives in `data.cache_dir/<fingerprint>/` (`input_ids.npy`, `loss_mask.npy`,
`doc_ids.npy`, `eval.json`, `report.json`, `report.txt`, `lengths.json`: every conversation's
token count, which `python -m dflash_ds.bench --lengths FILE` reads, and `manifest.json`: every
file with its size, written last). An entry whose files do not match its manifest (truncated,
missing, unreadable) is reported in one line naming its folder and rebuilt. The fingerprint covers the dataset's
identity (local files' sizes and mtimes, or the hub dataset's fingerprint), the tokenizer, the chat
template and every setting that changes the rows; anything else reuses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_ds.data.sources import (check_complete, load_rows, load_tokenizer, output_dir,  # noqa: F401
                                    release_freed_memory, source_identity)
from dflash_ds.data.chat import ChatEncoder, SampleError, detect_schema, normalize
from dflash_ds.data.cache import (FORMAT_VERSION, LENGTHS_FILE, MANIFEST_FILE, ROW_FIELDS,  # noqa: F401
                                  cache_damage, discard, write_manifest)
from dflash_ds.io import replace_dir_atomic
from dflash_ds.data.packing import pack_documents
from dflash_ds.libraries import quiet_libraries
from dflash_ds.safety import INTERRUPTED, Exit, interrupt_in_this_process, say



@dataclass
class PreparedData:
    rows: dict  # field -> np.ndarray [num_rows, S]
    eval_prompts: list  # token ids of held-out prompts rendered with the generation prompt
    eval_references: list  # token ids of their reference responses, None where there is none
    report: dict
    fingerprint: str
    cache_path: str | None = None

    @property
    def num_rows(self) -> int:
        return int(self.rows["input_ids"].shape[0])


# ----------------------------------------------------------------------------- fingerprint

def tokenizer_digest(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())  # vocab, merges, normalizer, added tokens
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps({"special": sorted(map(str, tokenizer.all_special_tokens)),
                         "pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id}).encode())
    return h.hexdigest()


def row_length(cfg) -> int:
    """The packed row length: data.row_length, or data.max_length when that is null (or absent)."""
    return int(getattr(cfg, "row_length", None) or cfg.max_length)


def _settings(cfg) -> dict:
    return {"max_samples": cfg.max_samples, "max_length": cfg.max_length, "row_length": row_length(cfg),
            "pack": bool(cfg.pack),
            "truncation": cfg.truncation, "thinking": bool(cfg.thinking), "seed": cfg.seed,
            "num_eval": cfg.num_eval, "split": cfg.split, "eval_split": cfg.eval_split}


def compute_fingerprint(sources: dict, tokenizer, settings: dict) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "sources": sources, "settings": settings,
                       "tokenizer": tokenizer_digest(tokenizer),
                       "chat_template": tokenizer.chat_template}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------- prepare

def _train_source(cfg, recipe: str | None = None) -> tuple[str, str]:
    regen = getattr(cfg, "regenerate", None)
    if regen is not None and getattr(regen, "enabled", False):
        check_complete(output_dir(cfg), recipe or "RECIPE")
        return str(output_dir(cfg)), "data.regenerate.output_dir"
    return str(cfg.path), "data.path"


def _pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _encode_batch(batch: dict, encoder: ChatEncoder, schema: str, max_length: int, *, truncation: str) -> dict:
    out = {"input_ids": [], "loss_mask": [], "drop": [], "turns": [], "probe": [], "truncated": []}
    for i in range(len(next(iter(batch.values())))):
        ids, mask, drop, turns, probe, cut = [], [], "", 0, 0, 0
        try:
            enc = encoder.encode(normalize({k: v[i] for k, v in batch.items()}, schema))
            ids, mask = enc.input_ids, enc.loss_mask
            turns, probe = len(enc.turn_spans), enc.probe_located_turns
            if len(ids) > max_length:
                if truncation == "drop":
                    drop, ids, mask = "too_long", [], []
                else:
                    ids, mask, cut = ids[:max_length], mask[:max_length], 1
            if not drop and not any(a and b for a, b in zip(mask, mask[1:])):
                drop, ids, mask = "no_supervised_pair", [], []  # no valid anchor: nothing to learn from
        except SampleError as e:
            drop = e.reason
        for key, val in zip(out, (ids, mask, drop, turns, probe, cut)):
            out[key].append(val)
    return out


class _Docs:
    """(input_ids, loss_mask) pairs of the kept documents, backed by the encoded arrow table."""

    def __init__(self, table):
        self.table = table.with_format("numpy", columns=["input_ids", "loss_mask"])

    def __len__(self):
        return len(self.table)

    def __getitem__(self, i):
        row = self.table[int(i)]
        return row["input_ids"].astype(np.int32), row["loss_mask"].astype(np.uint8)

    def __iter__(self):
        for row in self.table:
            yield row["input_ids"].astype(np.int32), row["loss_mask"].astype(np.uint8)


def encode_processes(setting: int | None, num_rows: int) -> int:
    """`data.num_proc` (0 = every core), never more than one process per 64 conversations."""
    cores = int(setting or 0) or os.cpu_count() or 1
    return max(1, min(cores, num_rows // 64))


def _encode_docs(encoder: ChatEncoder, rows, schema: str, cfg, *, fp: str,
                 work_dir: Path) -> tuple[_Docs, Counter, Counter]:
    """The kept documents, the encoding counts (assistant turns, probe-located turns, truncated) and
    the dropped samples by reason."""
    import functools

    # Rendering and tokenising are Python bound: one process per core. Rows are written to Arrow files
    # under work_dir as they are encoded (datasets' map writes each batch), and read back memory-mapped,
    # so memory does not grow with the dataset.
    num_proc = encode_processes(getattr(cfg, "num_proc", 0), len(rows))
    if num_proc > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    import datasets

    fn = functools.partial(_encode_batch, encoder=encoder, schema=schema, max_length=cfg.max_length,
                           truncation=cfg.truncation)
    # Explicit types: a first batch of dropped samples (empty lists) must not fix a null type.
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("uint8")),
        "drop": datasets.Value("string"), "turns": datasets.Value("int32"), "probe": datasets.Value("int32"),
        "truncated": datasets.Value("int8")})
    enc = rows.map(fn, batched=True, batch_size=64, remove_columns=rows.column_names, features=features,
                   num_proc=num_proc if num_proc > 1 else None, new_fingerprint=f"{fp}-encoded",
                   cache_file_name=str(work_dir / "encoded.arrow"), writer_batch_size=256,
                   keep_in_memory=False, desc="encoding conversations")
    keep, stats, dropped = [], Counter(), Counter()
    counts = enc.select_columns(["drop", "turns", "probe", "truncated"]).with_format("numpy")
    for start in range(0, len(counts), 65536):  # bounded chunks
        part = counts[start:start + 65536]
        drops = part["drop"]
        dropped.update(str(d) for d in drops if d)
        stats["assistant_turns"] += int(part["turns"].sum())
        stats["probe_located_turns"] += int(part["probe"].sum())
        stats["truncated"] += int(part["truncated"].sum())
        keep.append(np.flatnonzero(drops == "") + start)
    keep = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    return _Docs(enc.select(keep)), stats, dropped


def _eval_set(encoder: ChatEncoder, rows, schema: str, dropped: Counter):
    prompts, refs = [], []
    for sample in rows:
        try:
            msgs = normalize(sample, schema)
            last = max((k for k, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
            if last < 0:
                while msgs and msgs[-1]["role"] != "user":
                    msgs = msgs[:-1]
                if not msgs:
                    raise SampleError("no_user_turn")
                prompts.append(encoder.prompt_ids(msgs))
                refs.append(None)
                continue
            if last == 0:
                raise SampleError("no_prompt")
            enc = encoder.encode(msgs[:last + 1])
            a, b = enc.turn_spans[-1]
            prompts.append(encoder.prompt_ids(msgs[:last]))
            refs.append(enc.input_ids[a:b])
        except SampleError as e:
            dropped[e.reason] += 1
    return prompts, refs


def _write_lengths(path: Path, cfg, lengths: np.ndarray) -> None:
    """lengths.json, written in chunks: no Python list or string the size of the dataset."""
    head = json.dumps({"max_length": cfg.max_length, "row_length": row_length(cfg), "pack": bool(cfg.pack),
                       "lengths": []})
    with path.open("w") as f:
        f.write(head[:-2])  # up to and including "lengths": [
        for start in range(0, len(lengths), 65536):
            f.write((", " if start else "") + ", ".join(map(str, lengths[start:start + 65536].tolist())))
        f.write("]}")


def render_example(tokenizer, ids, mask, limit: int = 3000) -> str:
    """Decoded document with supervised spans wrapped in [[ ]]."""
    out, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or mask[t] != mask[start]:
            text = tokenizer.decode([int(x) for x in ids[start:t]], skip_special_tokens=False)
            out.append(f"[[{text}]]" if mask[start] else text)
            start = t
    text = "".join(out)
    return text if len(text) <= limit else text[:limit] + " ..."


def report_text(report: dict) -> str:
    lines = [f"prepared data {report['fingerprint']} from {report['source']}",
             f"  samples {report['samples']}  documents {report['documents']}  rows {report['rows']} x {report['row_length']}"
             f"  (conversations up to {report.get('max_length', report['row_length'])} tokens)",
             f"  tokens {report['tokens']}  supervised {report['supervised_tokens']} "
             f"({report['supervised_fraction']:.1%} of tokens)  padding {report['padding_fraction']:.1%}",
             f"  assistant turns {report['assistant_turns']} (located by probe: {report['probe_located_turns']})"
             f"  truncated {report['truncated']}",
             f"  dropped {report['dropped'] or 'none'}",
             f"  eval prompts {report['eval_prompts']} (dropped {report['eval_dropped'] or 'none'})",
             "  example (supervised text in [[ ]]):", report.get("example", "")]
    return "\n".join(lines) + "\n"


def _load_cached(final: Path, fp: str) -> PreparedData:
    # Copy-on-write memory maps: the rows stay file-backed pages the kernel can drop (resident memory
    # does not grow with the dataset), yet the arrays are writable; writes never reach the cache.
    rows = {k: np.load(final / f"{k}.npy", mmap_mode="c") for k in ROW_FIELDS}
    ev = json.loads((final / "eval.json").read_text())
    report = json.loads((final / "report.json").read_text())
    return PreparedData(rows, ev["prompts"], ev["references"], report, fp, str(final))


def prepare(cfg, tokenizer, *, verbose: bool = True, recipe: str | None = None) -> PreparedData:
    """Rows for training plus held-out eval prompts, from the cache when nothing changed.

    Packing (data.pack) suits every target: the target forward keeps packed documents apart in
    every layer, Gated DeltaNet layers included (target.packed). Beside the audit, lengths.json
    lists every conversation's token count (the bench's --lengths FILE)."""
    # The recipe's checks (config/checks.py) hold these; a data section from elsewhere must too.
    assert cfg.truncation in ("drop", "truncate") and 2 <= cfg.max_length <= row_length(cfg), cfg
    encoder = ChatEncoder(tokenizer, cfg.thinking)
    path, path_setting = _train_source(cfg, recipe)
    cache_dir = Path(cfg.cache_dir)
    hf_cache = str(cache_dir / "hf_datasets")

    loaded = {}
    sources = {"train": source_identity(path, cfg.split)}
    if sources["train"] is None:
        loaded["train"] = load_rows(path, cfg.split, hf_cache, path_setting=path_setting)
        sources["train"] = {"hub": path, "split": cfg.split, "fingerprint": loaded["train"]._fingerprint}
    if cfg.eval_path:
        sources["eval"] = source_identity(cfg.eval_path, cfg.eval_split)
        if sources["eval"] is None:
            loaded["eval"] = load_rows(cfg.eval_path, cfg.eval_split, hf_cache,
                                       path_setting="data.eval_path", split_setting="data.eval_split")
            sources["eval"] = {"hub": cfg.eval_path, "split": cfg.eval_split,
                               "fingerprint": loaded["eval"]._fingerprint}
    fp = compute_fingerprint(sources, tokenizer, _settings(cfg))
    final = cache_dir / fp
    if final.is_dir():
        damage = cache_damage(final)
        if damage is None:
            try:
                data = _load_cached(final, fp)
            except (OSError, ValueError, KeyError, EOFError) as exc:  # right sizes, unreadable content
                damage = f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            else:
                check_drops(data.report, cfg, final)
                if verbose:
                    say(f"data: reusing {final}")
                return data
        say(f"data: prepared data in {final} is damaged: {damage}; rebuilding it")
        discard(final)

    ds = loaded["train"] if "train" in loaded else load_rows(path, cfg.split, hf_cache, path_setting=path_setting)
    if len(ds) == 0:
        raise ValueError(f"{path_setting}: dataset {path!r} (split {cfg.split!r}) is empty")
    schema = detect_schema(ds.column_names, path_setting, path)
    n = len(ds)
    if cfg.eval_path:
        ev = loaded["eval"] if "eval" in loaded else load_rows(
            cfg.eval_path, cfg.eval_split, hf_cache, path_setting="data.eval_path", split_setting="data.eval_split")
        ev_schema = detect_schema(ev.column_names, "data.eval_path", cfg.eval_path)
        ev = ev.select(range(min(cfg.num_eval, len(ev))))
        train_idx = np.arange(n)
    else:
        if cfg.num_eval >= n:
            raise ValueError(f"data.num_eval: {cfg.num_eval} held-out samples requested from a dataset of {n}")
        ev, ev_schema = ds.select(list(range(n - cfg.num_eval, n))), schema  # a list: empty is fine
        train_idx = np.arange(n - cfg.num_eval)
    train_idx = np.random.default_rng(cfg.seed).permutation(train_idx)
    release_freed_memory()  # before the encode workers fork
    if cfg.max_samples:
        train_idx = train_idx[:cfg.max_samples]

    eval_dropped = Counter()
    # Staged and renamed into place when complete; when another process published the same
    # fingerprint first, theirs is kept.
    with replace_dir_atomic(final, keep_existing=True) as tmp:
        work = tmp / "_work"  # encoded Arrow files; removed before the directory becomes the cache
        work.mkdir()
        docs, stats, dropped = _encode_docs(encoder, ds.select(train_idx), schema, cfg, fp=fp, work_dir=work)
        prompts, refs = _eval_set(encoder, ev, ev_schema, eval_dropped)
        lengths = np.zeros(len(docs), dtype=np.int64)  # 8 bytes per document, the only per-sample state
        supervised = 0
        for k, (ids, mask) in enumerate(docs):
            lengths[k] = len(ids)
            supervised += int(mask.sum())
        if supervised == 0:
            raise ValueError(f"{path_setting}: no supervised (assistant) tokens in {path!r}: "
                             f"{len(train_idx)} samples, dropped {dict(dropped)}. Check the schema, "
                             "data.thinking and data.max_length")
        rows = pack_documents(docs, row_length(cfg), _pad_id(tokenizer), cfg.pack, out_dir=str(tmp),
                              lengths=lengths)
        num_rows = rows["input_ids"].shape[0]
        tokens = int(lengths.sum())
        report = {
            "fingerprint": fp, "source": path, "split": cfg.split, "settings": _settings(cfg),
            "samples": int(len(train_idx)), "documents": len(docs), "rows": int(num_rows),
            "row_length": row_length(cfg), "max_length": cfg.max_length, "tokens": tokens,
            "supervised_tokens": supervised, "supervised_fraction": supervised / max(tokens, 1),
            "padding_fraction": 1 - tokens / max(num_rows * row_length(cfg), 1),
            "assistant_turns": stats["assistant_turns"], "probe_located_turns": stats["probe_located_turns"],
            "truncated": stats["truncated"], "dropped": dict(sorted(dropped.items())),
            "eval_prompts": len(prompts), "eval_dropped": dict(sorted(eval_dropped.items())),
            "example": render_example(tokenizer, *docs[0]),
        }
        for a in rows.values():
            a.flush()
        del rows, docs
        shutil.rmtree(work)
        (tmp / "eval.json").write_text(json.dumps({"prompts": prompts, "references": refs}))
        _write_lengths(tmp / LENGTHS_FILE, cfg, lengths)
        (tmp / "report.txt").write_text(report_text(report))
        (tmp / "report.json").write_text(json.dumps(report, indent=1))
        write_manifest(tmp)  # last: an entry without it was never finished
    data = _load_cached(final, fp)
    if verbose:
        say("data: " + report_text(data.report).rstrip("\n"))
    check_drops(data.report, cfg, final)
    return data


def check_drops(report: dict, cfg, folder: Path) -> None:
    """Stop (one line naming the reasons and counts) when more samples were dropped than
    data.max_drop_fraction allows; the rows stay cached, so raising the setting reuses them."""
    limit = getattr(cfg, "max_drop_fraction", None)
    dropped = report.get("dropped") or {}
    total = sum(dropped.values())
    if limit is None or not report.get("samples") or total <= limit * report["samples"]:
        return
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
    raise ValueError(f"data.max_drop_fraction: {total} of {report['samples']} samples "
                     f"({total / report['samples']:.1%}) were dropped ({reasons}), above {limit:g}; fix the data "
                     f"(audit: {folder / 'report.txt'}) or raise data.max_drop_fraction")


def load_training_data(recipe) -> PreparedData:
    """The rows and held-out prompts a training run reads: prepared now, or read from the cache."""
    return prepare(recipe.data, load_tokenizer(recipe.target.path), recipe=recipe.source or None)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    from dflash_ds.arguments import Parser
    from dflash_ds.config import RecipeError

    parser = Parser(prog="python -m dflash_ds.data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenise, mask, pack and cache the recipe's dataset; print the audit")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted key=value recipe overrides")
    args = parser.parse_args(argv)
    from dflash_ds.config import load_recipe
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:  # before anything starts: one line, not a traceback
        say(f"error: {e}")
        return Exit.USER
    quiet_libraries()
    # The same preparation as a training run, so it writes the cache training reads.
    try:
        with interrupt_in_this_process():
            data = load_training_data(recipe)
    except KeyboardInterrupt:
        say(f"error: {INTERRUPTED}")
        return Exit.of_signal(signal.SIGINT)
    print(f"[data] {data.num_rows} rows in {data.cache_path}")
    lengths = Path(data.cache_path) / LENGTHS_FILE
    if lengths.is_file():
        print(f"[data] conversation lengths: {lengths} (measure on them: python -m dflash_ds.bench --role target "
              f"--lengths {lengths})")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
