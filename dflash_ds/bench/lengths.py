"""Bench rows filled from a conversation-length distribution, and the useful-token accounting.

`--lengths chat` and `--lengths long` are built-in mixes; `--lengths FILE` reads the lengths that
`python -m dflash_ds.data prepare` writes beside its audit (lengths.json), so a user measures on the
length mix of their own data. Rows are then built exactly as data preparation builds them:
first-fit packing of whole documents when the recipe packs (data.pack), one document per row
otherwise. Useful tokens are the non-padding ones (doc id >= 0).

Conversations are cut to the recipe's longest conversation (data.max_length, `max_length` below) and
packed into rows of the bench's row length (--seq-len, data.row_length): the two differ when a row
holds several whole conversations.

The `chat` mix (an assumption, not a measurement of any one dataset): conversation length
(prompt + response, chat template included) is log-normal with median 800 tokens and log-sd 0.8,
cut to [32, max_length]; the first 20% of each conversation is prompt (no loss). This is a rough fit of
the length shape of typical chat SFT data (ShareGPT / UltraChat style: a few hundred to a few
thousand tokens per conversation, median ~700-900, a long right tail).

The `long` mix (long answers, as responses regenerated with thinking on): LONG_SHARE of the
conversations are uniform between half of LONG_ROW and LONG_ROW tokens (3,072, the paper's longest
conversation), the rest drawn from `chat`; all cut to max_length. Packed into 3,072-token rows, every
long conversation needs most of a row and the short ones are too few to fill the gaps (about a fifth
of every row is padding); rows several conversations long pack it almost without loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT_MEDIAN = 800
CHAT_LOG_SD = 0.8
CHAT_PROMPT_SHARE = 0.2
MIN_LENGTH = 32
POOL_ROWS = 256
LONG_SHARE = 0.8
LONG_ROW = 3072
MIXES = ("chat", "long")


def _chat(rng, n, max_length):
    x = rng.lognormal(np.log(CHAT_MEDIAN), CHAT_LOG_SD, size=n)
    return np.clip(np.rint(x), MIN_LENGTH, max_length).astype(np.int64)


def _long(rng, n, max_length):
    x = _chat(rng, n, max_length)
    long = rng.random(n) < LONG_SHARE
    x[long] = rng.integers(LONG_ROW // 2, LONG_ROW + 1, size=int(long.sum()))
    return np.minimum(x, max_length)


def length_sampler(spec: str, max_length: int):
    """rng, count -> int lengths in [MIN_LENGTH or 2, max_length] drawn from a built-in mix (MIXES) or
    a lengths file."""
    if spec in MIXES:
        mix = _chat if spec == "chat" else _long
        return lambda rng, n: mix(rng, n, max_length)
    path = Path(spec)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--lengths {spec!r}: neither a built-in mix ({', '.join(MIXES)}) nor a readable lengths JSON "
                         f"({exc}); pass one of those or the lengths.json that `python -m dflash_ds.data prepare` "
                         "writes") from None
    lengths = data["lengths"] if isinstance(data, dict) else data
    pool = np.asarray([int(n) for n in lengths if int(n) >= 2], dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"--lengths {spec!r}: no conversation of 2 or more tokens in the file")

    def draw(rng, n):
        return np.minimum(rng.choice(pool, size=n, replace=True), max_length)
    return draw


def length_rows(num_rows: int, seq_len: int, max_length: int, vocab: int, *, spec: str, pack: bool,
                seed: int) -> dict[str, np.ndarray]:
    """`num_rows` rows of `seq_len` random ids holding whole documents of at most `max_length` tokens
    with lengths from `spec`.

    Packed rows are a uniform sample of the rows that first-fit packing (data preparation's) makes of
    a pool of at least POOL_ROWS rows' worth of documents, like the rows of a prepared dataset: most
    are full, the last few part-empty."""
    from dflash_ds.data.packing import pack_documents

    rng = np.random.default_rng(seed)
    if not pack:
        max_length = min(max_length, seq_len)  # one document per row
    if max_length > seq_len:
        raise ValueError(f"the longest conversation ({max_length}, data.max_length) exceeds the row length {seq_len} "
                         "(--seq-len); raise --seq-len or set data.max_length lower")
    draw = length_sampler(spec, max_length)
    if pack:
        lengths = []
        while sum(lengths) < max(POOL_ROWS, 2 * num_rows) * seq_len:
            lengths += draw(rng, 64).tolist()
    else:
        lengths = draw(rng, num_rows).tolist()
    docs = []
    for n in lengths:
        ids = rng.integers(0, vocab, size=n, dtype=np.int64)
        mask = np.ones(n, dtype=np.uint8)
        mask[:int(round(n * CHAT_PROMPT_SHARE))] = 0
        docs.append((ids, mask))
    rows = pack_documents(docs, seq_len, pad_id=0, pack=pack)
    if pack:
        pick = np.sort(rng.choice(len(rows["input_ids"]), size=num_rows, replace=False))
        rows = {k: v[pick] for k, v in rows.items()}
    return {"input_ids": rows["input_ids"].astype(np.int64), "loss_mask": rows["loss_mask"].astype(np.int32),
            "doc_ids": rows["doc_ids"].astype(np.int32)}


def useful_share(doc_ids: np.ndarray) -> dict:
    """Padding share and documents per row of the rows a role ran on."""
    doc_ids = np.asarray(doc_ids)
    real = doc_ids >= 0
    return {"padding_share": float(1.0 - real.mean()), "docs_per_row": float((doc_ids.max(axis=1) + 1).mean()),
            "rows_measured": int(doc_ids.shape[0])}


def add_useful(result: dict, doc_ids: np.ndarray) -> None:
    """Useful (non-padding) tok/s beside the raw figure. Every role's step costs the same whatever a
    row holds (static shapes), so useful tok/s = raw tok/s x (1 - padding share)."""
    share = useful_share(doc_ids)
    result.update(share)
    result["useful_tok_s"] = result["tok_s"] * (1.0 - share["padding_share"])
