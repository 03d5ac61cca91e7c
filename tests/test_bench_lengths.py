"""Bench rows from a conversation-length mix and the useful-token figures every role reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_ds.bench.lengths import (CHAT_MEDIAN, add_useful, length_rows, length_sampler, useful_share)

REPO = Path(__file__).resolve().parent.parent


def doc_lengths(doc_ids):
    out = []
    for row in doc_ids:
        ids, counts = np.unique(row[row >= 0], return_counts=True)
        out.append(dict(zip(ids.tolist(), counts.tolist())))
    return out


def test_chat_mix_has_the_documented_median():
    draw = length_sampler("chat", 100_000)
    x = draw(np.random.default_rng(0), 20_000)
    assert abs(np.median(x) - CHAT_MEDIAN) < 0.03 * CHAT_MEDIAN
    assert x.min() >= 32


def test_packed_rows_hold_whole_documents_and_little_padding():
    rows = length_rows(16, 3072, 3072, 1000, spec="chat", pack=True, seed=0)
    share = useful_share(rows["doc_ids"])
    assert share["padding_share"] < 0.03 and share["docs_per_row"] > 2
    for row, lm in zip(rows["doc_ids"], rows["loss_mask"]):
        # Documents are contiguous runs 0, 1, 2, ... then padding; the first 20% of each is prompt.
        starts = np.flatnonzero(np.diff(np.r_[-2, row]) != 0)
        assert row[starts].tolist()[: int(row.max()) + 1] == list(range(int(row.max()) + 1))
        assert lm[row < 0].sum() == 0 and lm[starts[0]] == 0


def test_one_document_per_row_unpacked():
    rows = length_rows(32, 3072, 3072, 1000, spec="chat", pack=False, seed=0)
    assert (rows["doc_ids"].max(axis=1) == 0).all()
    lengths = [d[0] for d in doc_lengths(rows["doc_ids"])]
    assert useful_share(rows["doc_ids"])["padding_share"] == pytest.approx(1 - sum(lengths) / (32 * 3072))


def test_lengths_file_and_errors(tmp_path):
    f = tmp_path / "lengths.json"
    f.write_text(json.dumps({"lengths": [7, 7, 7]}))
    rows = length_rows(4, 64, 64, 100, spec=str(f), pack=True, seed=1)
    assert all(set(d.values()) == {7} for d in doc_lengths(rows["doc_ids"]))
    assert useful_share(rows["doc_ids"])["padding_share"] == pytest.approx(1 - 63 / 64)
    f.write_text("[1]")
    with pytest.raises(ValueError, match="2 or more"):
        length_sampler(str(f), 64)
    with pytest.raises(ValueError, match="--lengths"):
        length_sampler(str(tmp_path / "missing.json"), 64)


def test_useful_rate_is_raw_rate_times_real_share():
    doc_ids = np.array([[0, 0, 1, -1], [0, 0, 0, 0]])
    result = {"tok_s": 100.0}
    add_useful(result, doc_ids)
    assert result["padding_share"] == pytest.approx(1 / 8) and result["useful_tok_s"] == pytest.approx(87.5)
    assert result["docs_per_row"] == pytest.approx(1.5)


@pytest.mark.launcher
def test_target_role_on_a_lengths_file_reports_useful_rate(tmp_path):
    # CPU smoke run of the CLI on the tiny hybrid target with packed rows (the per-segment route).
    f = tmp_path / "lengths.json"
    f.write_text(json.dumps({"lengths": [5, 9, 17, 30, 12]}))
    out = tmp_path / "target.json"
    cmd = [sys.executable, "-m", "dflash_ds.bench", "--role", "target", "--device", "cpu", "--geometry", "tiny",
           "--seq-len", "64", "--rows", "2", "--anchors", "8", "--block-size", "4", "--steps", "2", "--warmup", "1",
           "--lengths", str(f), "--set", "data.pack=true", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())["result"]
    assert 0 < r["padding_share"] < 0.5 and r["docs_per_row"] > 1
    assert r["useful_tok_s"] == pytest.approx(r["tok_s"] * (1 - r["padding_share"]))
    assert "useful tok/s" in p.stdout and "padding share" in p.stdout
