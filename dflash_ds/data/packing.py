"""Documents -> fixed-length rows.

Rows are `S` tokens holding whole documents (never split across rows): `input_ids` int32 [S]
(pad id on padding), `loss_mask` uint8 [S] (1 on assistant tokens), `doc_ids` int32 [S]
(document index inside the row, -1 on padding). Position ids restart at 0 for every document
(`objective.blocks.position_ids_from_doc_ids`, computed where the rows are used). A packed row holds several documents and the target must not attend
across them. With transformers (5.x) the simplest correct call is
`model(input_ids, position_ids=position_ids_from_doc_ids(doc_ids), attention_mask=None, use_cache=False)`:
its masking utilities then detect the restarts and build the block-diagonal mask themselves (with the
default `use_cache=True` they do NOT, and documents leak into each other).
"""

from __future__ import annotations

import os
from array import array

import numpy as np


# ----------------------------------------------------------------------------- packing

def _first_fit(lengths, capacity: int) -> array:
    """Row index of each document: the first row with room (max segment tree over free space).

    Compact int64 arrays (8 bytes a document), not lists of Python ints (about 36)."""
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    tree = array("q", [capacity]) * (2 * size)
    rows = array("q")
    for n in lengths:
        n = int(n)
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= n else 2 * node + 1
        rows.append(node - size)
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def first_fit_rows(lengths, capacity: int) -> list[list[int]]:
    """Indices of the documents each row holds when `lengths` are packed first-fit into rows of
    `capacity` tokens (every length in [1, capacity]), in their order within a row."""
    rows: list[list[int]] = []
    for i, r in enumerate(_first_fit(lengths, capacity)):
        while len(rows) <= r:
            rows.append([])
        rows[r].append(i)
    return rows


def pack_documents(docs, max_length: int, pad_id: int, pack: bool = True, *, out_dir: str | None = None,
                   lengths=None) -> dict:
    """docs: sequence of (input_ids, loss_mask) with len <= max_length -> rows dict of [R, S] arrays
    (`lengths`: their lengths, any int sequence, when already known).

    Documents keep their order within a row. With `out_dir`, arrays are written there as .npy
    (memory-mapped) instead of held in memory."""
    lengths = [len(d[0]) for d in docs] if lengths is None else lengths
    assert all(0 < n <= max_length for n in lengths), "documents must be truncated before packing"
    where = _first_fit(lengths, max_length) if pack else range(len(lengths))
    num_rows = (max(where) + 1) if where else 0
    shape = (num_rows, max_length)
    spec = {"input_ids": (np.int32, pad_id), "loss_mask": (np.uint8, 0), "doc_ids": (np.int32, -1)}
    rows = {}
    for name, (dtype, fill) in spec.items():
        if out_dir is None:
            rows[name] = np.full(shape, fill, dtype=dtype)
        else:
            rows[name] = np.lib.format.open_memmap(os.path.join(out_dir, f"{name}.npy"), "w+", dtype, shape)
            rows[name][:] = fill
    used = array("q", [0]) * num_rows
    count = array("q", [0]) * num_rows
    for (ids, mask), r in zip(docs, where):
        a, b = used[r], used[r] + len(ids)
        rows["input_ids"][r, a:b] = ids
        rows["loss_mask"][r, a:b] = mask
        rows["doc_ids"][r, a:b] = count[r]
        used[r], count[r] = b, count[r] + 1
    return rows
