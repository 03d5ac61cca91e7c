"""Bench rows filled from a conversation-length distribution, and the useful-token accounting.

`--lengths chat` is a built-in mix; `--lengths FILE` reads the lengths that
`python -m dflash_ds.data prepare` writes beside its audit (lengths.json), so a user measures on the
length mix of their own data. Rows are then built exactly as data preparation builds them:
first-fit packing of whole documents when the recipe packs (data.pack), one document per row
otherwise. Useful tokens are the non-padding ones (doc id >= 0).

The `chat` mix (an assumption, not a measurement of any one dataset): conversation length
(prompt + response, chat template included) is log-normal with median 800 tokens and log-sd 0.8,
cut to [32, seq_len]; the first 20% of each conversation is prompt (no loss). This is a rough fit of
the length shape of typical chat SFT data (ShareGPT / UltraChat style: a few hundred to a few
thousand tokens per conversation, median ~700-900, a long right tail).
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


def length_sampler(spec: str, seq_len: int):
    """rng, count -> int lengths in [MIN_LENGTH or 2, seq_len] drawn from `chat` or a lengths file."""
    if spec == "chat":
        def draw(rng, n):
            x = rng.lognormal(np.log(CHAT_MEDIAN), CHAT_LOG_SD, size=n)
            return np.clip(np.rint(x), MIN_LENGTH, seq_len).astype(np.int64)
        return draw
    path = Path(spec)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--lengths {spec!r}: neither 'chat' nor a readable lengths JSON ({exc}); pass 'chat' or the "
                         "lengths.json that `python -m dflash_ds.data prepare` writes") from None
    lengths = data["lengths"] if isinstance(data, dict) else data
    pool = np.asarray([int(n) for n in lengths if int(n) >= 2], dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"--lengths {spec!r}: no conversation of 2 or more tokens in the file")

    def draw(rng, n):
        return np.minimum(rng.choice(pool, size=n, replace=True), seq_len)
    return draw


def length_rows(num_rows: int, seq_len: int, vocab: int, spec: str, pack: bool, seed: int) -> dict[str, np.ndarray]:
    """`num_rows` rows of random ids holding whole documents with lengths from `spec`.

    Packed rows are a uniform sample of the rows that first-fit packing (data preparation's) makes of
    a pool of at least POOL_ROWS rows' worth of documents, like the rows of a prepared dataset: most
    are full, the last few part-empty."""
    from dflash_ds.data.packing import pack_documents

    rng = np.random.default_rng(seed)
    draw = length_sampler(spec, seq_len)
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
