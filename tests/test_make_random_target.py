"""scripts/make_random_target.py: long synthetic chats that fill a row, and a vocabulary check."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script():
    spec = importlib.util.spec_from_file_location("make_random_target", ROOT / "scripts" / "make_random_target.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chats_have_about_the_requested_length(tmp_path):
    from transformers import AutoTokenizer

    script().write_chats(tmp_path, 3, 600)
    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-target")
    chats = [json.loads(line) for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    assert len(chats) == 3 and all(c["messages"][1]["role"] == "assistant" for c in chats)
    for c in chats:
        n = len(tok(tok.apply_chat_template(c["messages"], tokenize=False))["input_ids"])
        assert 450 <= n <= 750, n
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 8


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="outside the embedding"):
        script().write_model("tiny", None, tmp_path, "cpu", "5GB")
