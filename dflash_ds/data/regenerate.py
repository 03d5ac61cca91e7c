"""Replace every assistant turn of a chat dataset by the target's own generation.

    python -m dflash_ds.regenerate RECIPE [key=value ...]                       # one process
    deepspeed --num_gpus 8 --module dflash_ds.regenerate RECIPE [key=value ...]  # one process per GPU

A drafter learns to predict what the target would say; training on the target's own responses
(paper: all ~800K samples regenerated) is worth more than on another model's. Multi-turn
conversations are regenerated turn by turn, each turn conditioned on the regenerated history.

Input: `data.path` / `data.split` (the first `data.max_samples` (+ `data.num_eval` when the eval set is
taken from the same data) samples when set). Sampling: `data.regenerate.{temperature, top_p,
max_new_tokens}`; `data.thinking` picks the generation prompt. Backends: `server` (any
OpenAI-compatible server: `vllm serve`, SGLang, `transformers serve`; `data.regenerate.urls`, see
dflash_ds/data/server.py), the way to regenerate at scale; `hf`, the target's own `generate` in this
process (batched, left padding), for small targets and tests; `auto` is `server` when URLs are set.

Output: `data.regenerate.output_dir/part-NNNNN.jsonl` in `messages` format (what `prepare` reads) plus
`.manifest.json`. Input samples are cut into fixed shards of `SHARD_SIZE` (independent of the number
of ranks); rank r handles shards i with i % world_size == r (RANK / WORLD_SIZE from the launcher). A
shard file is written to a temporary name and renamed when complete, so an interrupted run resumes
by skipping finished shards, without duplicating or losing samples. A turn that hits
`max_new_tokens` without ending is dropped together with the rest of its conversation (the sample
is dropped when it is the first assistant turn): an unfinished response followed by an end-of-turn
token would teach the drafter a wrong ending. With `data.regenerate.keep_unfinished` the cut turn is
kept instead, marked `truncated: true` (data/chat.py then leaves the template's end-of-turn token
after it out of the loss), and only the turns after it are dropped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_ds.libraries import quiet_libraries
from dflash_ds.data.sources import MANIFEST, check_complete, load_rows, load_tokenizer, output_dir, shard_name, source_identity  # noqa: F401
from dflash_ds.data.chat import ChatEncoder, SampleError, detect_schema, normalize
from dflash_ds.data.decoders import HFGenerator, StaticGenerator, hf_generator, stop_ids  # noqa: F401
from dflash_ds.io import write_text_atomic
from dflash_ds.safety import Exit, say

SHARD_SIZE = 256
FORMAT_VERSION = 1


def split_reasoning(text: str) -> str:
    """Generated text -> message content, with reasoning (if any) as an inline <think> block.

    With Qwen3.5-style prompts the opening <think> is part of the prompt, so the output starts inside
    the block; chat templates that understand reasoning parse the inline form."""
    if "</think>" not in text:
        return text
    reasoning, answer = text.split("</think>", 1)
    reasoning = reasoning.split("<think>")[-1].strip("\n")
    return f"<think>\n{reasoning}\n</think>\n\n{answer.lstrip(chr(10))}"


# ----------------------------------------------------------------------------- backends

def make_generator(cfg, target_path: str, tokenizer):
    """The in-process HF generator (the server backend does not use one)."""
    backend = cfg.regenerate.backend
    if backend not in ("auto", "hf", "server"):
        raise ValueError(f"data.regenerate.backend: {backend!r}; use 'server' (with data.regenerate.urls), "
                         "'hf' or 'auto'")
    return hf_generator(target_path, tokenizer, cfg.regenerate)


def uses_server(rs) -> bool:
    """backend 'server', or 'auto' with URLs set."""
    return rs.backend == "server" or (rs.backend == "auto" and bool(getattr(rs, "urls", ())))


# ----------------------------------------------------------------------------- the shard loop

def regenerate_conversations(convs: list[list[dict]], encoder: ChatEncoder, generate, seed: int, *,
                             keep_unfinished: bool = False):
    """Regenerate all assistant turns, turn by turn; returns (kept conversations, unfinished count).
    An unfinished turn is dropped with what follows it, or with `keep_unfinished` kept as a truncated
    answer (the conversation's last message)."""
    out, unfinished = _regenerate_turns(convs, encoder, generate, seed, keep_unfinished=keep_unfinished)
    return _kept(out), sum(unfinished)


def _kept(convs: list[list[dict]]) -> list[list[dict]]:
    return [c for c in convs if any(m["role"] == "assistant" for m in c)]


def _regenerate_turns(convs, encoder: ChatEncoder, generate, seed: int, *, keep_unfinished: bool):
    """-> (every conversation regenerated or cut, unfinished turns per conversation), in input order."""
    convs = [list(c) for c in convs]
    alive = list(range(len(convs)))
    unfinished = [0] * len(convs)
    turn = 0
    while alive:
        todo = []  # (conversation, message index) of each conversation's `turn`-th assistant message
        for c in alive:
            pos = [k for k, m in enumerate(convs[c]) if m["role"] == "assistant"]
            if turn < len(pos):
                todo.append((c, pos[turn]))
        if not todo:
            break
        prompts, ok = [], []
        for c, k in todo:
            try:
                prompts.append(encoder.prompt_ids(convs[c][:k]))
                ok.append((c, k))
            except SampleError:  # e.g. an assistant message with no turn before it
                convs[c] = convs[c][:k]
        todo = ok
        outs = generate(prompts, seed * 1000 + turn) if prompts else []
        for (c, k), (ids, finished) in zip(todo, outs):
            if not finished:
                unfinished[c] += 1
                convs[c] = convs[c][:k]  # the turn and what follows it are lost ...
                if keep_unfinished:  # ... or the turn is kept as cut, and the conversation ends there
                    text = encoder.tokenizer.decode(ids, skip_special_tokens=False)
                    convs[c].append({"role": "assistant", "content": split_reasoning(text), "truncated": True})
                continue
            text = encoder.tokenizer.decode(ids, skip_special_tokens=False)
            convs[c][k] = {"role": "assistant", "content": split_reasoning(text)}
        alive = [c for c, k in todo if k < len(convs[c]) and not convs[c][k].get("truncated")]
        turn += 1
    return convs, unfinished


def _manifest(cfg, num_samples: int, num_shards: int) -> dict:
    rs = cfg.regenerate
    settings = {"max_new_tokens": rs.max_new_tokens, "temperature": rs.temperature,
                "top_p": rs.top_p, "thinking": bool(cfg.thinking), "seed": cfg.seed}
    if getattr(rs, "keep_unfinished", False):  # only when on: regenerations written before the key still match
        settings["keep_unfinished"] = True
    return {"format": FORMAT_VERSION, "source": source_identity(cfg.path, cfg.split) or {"hub": cfg.path, "split": cfg.split},
            "num_samples": num_samples, "shard_size": SHARD_SIZE, "num_shards": num_shards, "settings": settings}


@dataclass(frozen=True)
class Shards:
    """Which shards this process writes: those with index % world_size == rank that are not written yet,
    at most `max_shards` of them (None = all; a number makes a partial run), `per_call` at a time."""

    rank: int = 0
    world_size: int = 1
    max_shards: int | None = None
    per_call: int = 1
    """Shards regenerated together: their conversations share each turn's generate batches, so that a
    small target fills a large GPU (SHARD_SIZE conversations alone do not). The shards, their files and
    their greedy answers do not depend on it; sampled answers draw from the group's first shard's seed."""

    @classmethod
    def from_env(cls) -> "Shards":
        """This process's share under a launcher (RANK / WORLD_SIZE; one process without them)."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def regenerate(cfg, target_path: str, *, shards: Shards = Shards(), generator=None, tokenizer=None,
               verbose: bool = True) -> dict:
    """Regenerate this process's `shards`.

    `generator(prompts, seed) -> [(ids, finished)]` and `tokenizer` may be passed in (tests, reuse)."""
    rank, world_size = shards.rank, shards.world_size
    out = output_dir(cfg)
    ds = load_rows(cfg.path, cfg.split, str(Path(cfg.cache_dir) / "hf_datasets"))
    if len(ds) == 0:
        raise ValueError(f"data.path: dataset {cfg.path!r} (split {cfg.split!r}) is empty")
    schema = detect_schema(ds.column_names, "data.path", cfg.path)
    n = len(ds)
    if cfg.max_samples:
        n = min(n, cfg.max_samples + (0 if cfg.eval_path else cfg.num_eval))
    num_shards = (n + SHARD_SIZE - 1) // SHARD_SIZE
    manifest = _manifest(cfg, n, num_shards)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        old = json.loads((out / MANIFEST).read_text())
        if old != manifest:
            raise ValueError(f"data.regenerate.output_dir: {out} holds a regeneration with other inputs or "
                             f"settings ({old.get('settings')}, {old.get('num_samples')} samples); choose "
                             "another output_dir or delete it")
    else:
        write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))

    mine = [i for i in range(num_shards) if i % world_size == rank and not (out / shard_name(i)).exists()]
    if shards.max_shards is not None:
        mine = mine[:shards.max_shards]
    summary = {"shards_written": 0, "samples_in": 0, "samples_out": 0, "unfinished_turns": 0, "bad_samples": 0,
               "failed_samples": 0}
    rs = cfg.regenerate
    client = encoder = None
    if mine and generator is None and uses_server(rs):
        from dflash_ds.data.server import ServerClient

        client = ServerClient(rs, cfg.thinking, getattr(rs, "served_model", None) or target_path)
    elif mine:
        tokenizer = tokenizer or load_tokenizer(target_path)
        encoder = ChatEncoder(tokenizer, cfg.thinking)
        generator = generator or make_generator(cfg, target_path, tokenizer)
    t_start = time.time()
    keep = getattr(rs, "keep_unfinished", False)
    for g in range(0, len(mine), max(1, shards.per_call)):
        group, t0 = mine[g:g + max(1, shards.per_call)], time.time()
        batches = [_read_shard(ds, i, n, schema, summary=summary) for i in group]
        seeds = [cfg.seed * 100_003 + i for i in group]
        if client is not None:
            results = [client.shard(convs, seed) for convs, seed in zip(batches, seeds)]
        else:
            results = _regenerate_group(batches, encoder, generator, seeds[0], keep_unfinished=keep)
        for i, convs, (kept, unfinished, failed) in zip(group, batches, results):
            summary["samples_in"] += len(convs)
            summary["failed_samples"] += failed
            limit = getattr(rs, "max_failed_fraction", 0.0)
            if failed and summary["failed_samples"] > limit * summary["samples_in"]:
                raise RuntimeError(
                    f"data.regenerate.max_failed_fraction: {summary['failed_samples']} of {summary['samples_in']} "
                    f"samples failed (limit {limit}); last error: {client.stats.last_failure}. Check the servers "
                    f"({', '.join(rs.urls)}) and rerun: finished shards are kept, {shard_name(i)} is redone")
            write_text_atomic(out / shard_name(i), "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in kept))
            summary["shards_written"] += 1
            summary["samples_out"] += len(kept)
            summary["unfinished_turns"] += unfinished
            if verbose:
                line = (f"regenerate: rank {rank}: {shard_name(i)} ({summary['shards_written']}/{len(mine)}) "
                        f"{len(kept)}/{len(convs)} samples, {unfinished} unfinished turns, {time.time() - t0:.1f} s")
                if client is not None:
                    st, dt = client.stats, max(time.time() - t_start, 1e-9)
                    line += (f" | {st.completion_tokens / dt:,.0f} generated tok/s, {st.prompt_tokens:,} prompt + "
                             f"{st.completion_tokens:,} generated tokens, {st.requests} requests, {st.retries} retries, "
                             f"{summary['failed_samples']} failed samples")
                say(line)
    if client is not None:
        summary.update(requests=client.stats.requests, retries=client.stats.retries,
                       prompt_tokens=client.stats.prompt_tokens, completion_tokens=client.stats.completion_tokens)
    return summary


def _read_shard(ds, i: int, n: int, schema: str, *, summary: dict) -> list[list[dict]]:
    convs = []
    for row in ds.select(range(i * SHARD_SIZE, min(n, (i + 1) * SHARD_SIZE))):
        try:
            convs.append(normalize(row, schema))
        except SampleError:
            summary["bad_samples"] += 1
    return convs


def _regenerate_group(batches, encoder, generator, seed: int, *, keep_unfinished: bool) -> list[tuple]:
    """Several shards' conversations regenerated as one list, split back -> [(kept, unfinished, 0)]."""
    flat = [c for b in batches for c in b]
    done, cut = _regenerate_turns(flat, encoder, generator, seed, keep_unfinished=keep_unfinished)
    results, pos = [], 0
    for b in batches:
        results.append((_kept(done[pos:pos + len(b)]), sum(cut[pos:pos + len(b)]), 0))
        pos += len(b)
    return results


def main(argv=None) -> int:
    from dflash_ds.arguments import Parser

    parser = Parser(prog="python -m dflash_ds.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value recipe overrides")
    argv = sys.argv[1:] if argv is None else argv
    # Under `deepspeed --module dflash_ds.regenerate` every rank also gets --local_rank=N.
    args = parser.parse_args([a for a in argv if not a.startswith("--local_rank")])
    from dflash_ds.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:  # before anything starts: one line, not a traceback
        say(f"regenerate: error: {e}")
        return Exit.USER
    quiet_libraries()
    shards = Shards.from_env()
    rank = shards.rank
    try:
        summary = regenerate(recipe.data, recipe.target.path, shards=shards)
    except (ValueError, RuntimeError) as e:  # settings, data, or too many failed requests: one line
        say(f"regenerate: error: {e}")
        return Exit.USER if isinstance(e, ValueError) else Exit.FAILED
    print(f"[regenerate] rank {rank} done: {summary}")
    if rank == 0:
        out = output_dir(recipe.data)
        if recipe.data.regenerate.enabled:
            print(f"[regenerate] wrote {out}; training reads it: deepspeed launch.sh {args.recipe}")
        else:
            print(f"[regenerate] wrote {out}; note: data.regenerate.enabled is false, so training will not read it")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
