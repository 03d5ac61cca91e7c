"""Data a user gets wrong is read or refused, never silently halved: chat formats decided per record,
drops above data.max_drop_fraction stop before launch, and the prepared-data cache verifies itself."""

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_ds.data import prepare as D
from dflash_ds.data.chat import SampleError, normalize

from .test_data import make_cfg, tokenizer

MESSAGES = [{"role": "user", "content": "What is {k} + 1?"}, {"role": "assistant", "content": "It is {k} plus one."}]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _as(fmt: str, k: int) -> dict:
    """Conversation k in one of the accepted formats (the same conversation whatever the format)."""
    user, answer = (m["content"].format(k=k) for m in MESSAGES)
    if fmt == "messages":
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    if fmt == "conversations":
        return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}
    if fmt == "sharegpt_in_messages":  # ShareGPT-style messages under the OpenAI key
        return {"messages": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}
    return {"prompt": user, "response": answer}


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


FORMATS = ("messages", "conversations", "prompt_response", "sharegpt_in_messages")


def test_a_file_mixing_formats_record_by_record_trains_on_every_record(tmp_path, tok):
    n = 80
    mixed = _write(tmp_path / "mixed.jsonl", [_as(FORMATS[k % 4], k) for k in range(n)])
    plain = _write(tmp_path / "plain.jsonl", [_as("messages", k) for k in range(n)])
    a = D.prepare(make_cfg(tmp_path / "a", path=str(mixed), max_samples=None), tok, verbose=False)
    b = D.prepare(make_cfg(tmp_path / "b", path=str(plain), max_samples=None), tok, verbose=False)
    assert a.report["dropped"] == {} and a.report["documents"] == n - 4  # 4 held out for eval
    for k in D.ROW_FIELDS:  # the very rows of the same conversations written in one format
        assert np.array_equal(np.asarray(a.rows[k]), np.asarray(b.rows[k])), k
    assert a.eval_prompts == b.eval_prompts


def test_records_of_no_known_format_are_dropped_by_name():
    with pytest.raises(SampleError) as e:
        normalize({"messages": None, "conversations": None, "text": "hello"}, "messages")
    assert e.value.reason == "unknown_format"
    with pytest.raises(SampleError) as e:
        normalize({"messages": [{"content": "no role"}]}, "messages")
    assert e.value.reason == "bad_message"


def test_files_of_formats_that_cannot_be_one_table_are_refused_with_counts(tmp_path, tok):
    d = tmp_path / "data"
    d.mkdir()
    _write(d / "a.jsonl", [_as("messages", k) for k in range(7)])
    _write(d / "b.jsonl", [_as("conversations", k) for k in range(5)])
    with pytest.raises(ValueError) as e:
        D.prepare(make_cfg(tmp_path, path=str(d), max_samples=None), tok, verbose=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.path: ")
    assert "messages 7, conversations 5" in msg and "own file" in msg


def test_a_directory_of_parquet_json_and_jsonl_files_loads_every_file(tmp_path):
    """`datasets` reads a directory as one format (the most common extension) and skips the rest."""
    import datasets

    from dflash_ds.data.sources import load_rows

    d = tmp_path / "data"
    d.mkdir()
    _write(d / "a.jsonl", [_as("messages", k) for k in range(4)])
    _write(d / "b.jsonl", [_as("messages", k) for k in range(4, 8)])
    (d / "c.json").write_text(json.dumps([_as("messages", k) for k in range(8, 11)]))
    datasets.Dataset.from_list([_as("messages", k) for k in range(11, 16)]).to_parquet(str(d / "d.parquet"))
    ds = load_rows(str(d), "train", str(tmp_path / "hf"))
    got = sorted(int(r["messages"][0]["content"].split()[2]) for r in ds)
    assert got == list(range(16))


def test_drops_above_the_threshold_stop_naming_reasons_and_counts(tmp_path, tok):
    records = [_as("messages", k) for k in range(60)]
    for k in range(0, 60, 4):  # 15 of 60 with a role the chat format does not have
        records[k]["messages"][0]["role"] = "tool"
    for k in range(2, 60, 12):  # 5 with no conversation at all
        records[k] = {"text": "just text"}
    data = _write(tmp_path / "d.jsonl", records)
    cfg = make_cfg(tmp_path, path=str(data), max_samples=None, num_eval=2, max_drop_fraction=0.05)
    with pytest.raises(ValueError) as e:
        D.prepare(cfg, tok, verbose=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.max_drop_fraction: ")
    dropped = {"unknown_role": 15, "unknown_format": 5}  # of the 58 training samples (2 held out)
    assert "20 of 58 samples" in msg and "unknown_role 15, unknown_format 5" in msg and "report.txt" in msg
    # Allowed: the cached rows are reused, nothing is encoded again.
    calls = []
    real = D._encode_docs
    D._encode_docs = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ok = D.prepare(make_cfg(tmp_path, path=str(data), max_samples=None, num_eval=2, max_drop_fraction=0.5),
                       tok, verbose=False)
    finally:
        D._encode_docs = real
    assert ok.report["dropped"] == dropped and calls == []


@pytest.mark.parametrize("damage", ["truncate_rows", "remove_eval", "corrupt_manifest", "garbage_same_size"])
def test_a_damaged_cache_entry_is_reported_in_one_line_and_rebuilt(tmp_path, tok, capsys, damage):
    cfg = make_cfg(tmp_path, max_samples=40)
    first = D.prepare(cfg, tok, verbose=False)
    folder = Path(first.cache_path)
    want = {k: np.array(first.rows[k]) for k in D.ROW_FIELDS}
    del first
    if damage == "truncate_rows":
        p = folder / "input_ids.npy"
        p.write_bytes(p.read_bytes()[:-100])
    elif damage == "remove_eval":
        (folder / "eval.json").unlink()
    elif damage == "corrupt_manifest":
        (folder / D.MANIFEST_FILE).write_text("{not json")
    else:  # the right size, unreadable content
        p = folder / "doc_ids.npy"
        p.write_bytes(b"\0" * p.stat().st_size)
    assert D.cache_damage(folder) is not None or damage == "garbage_same_size"
    capsys.readouterr()
    again = D.prepare(cfg, tok, verbose=False)
    out = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(out) == 1 and str(folder) in out[0] and "rebuilding" in out[0], out
    assert Path(again.cache_path) == folder and D.cache_damage(folder) is None
    for k in D.ROW_FIELDS:
        assert np.array_equal(np.asarray(again.rows[k]), want[k])
    capsys.readouterr()
    D.prepare(cfg, tok, verbose=True)  # and the rebuilt entry is reused
    assert "reusing" in capsys.readouterr().err
