"""Chat templates -> loss masks, packing, the prepared-data cache and its errors."""

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_ds.data import packing as P
from dflash_ds.data import prepare as D
from dflash_ds.data.chat import ChatEncoder, SampleError, normalize
from dflash_ds.objective.blocks import position_ids_from_doc_ids

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-target"
CHAT = ROOT / "assets" / "tiny_chat.jsonl"
EVAL = ROOT / "assets" / "tiny_eval.jsonl"

# ----------------------------------------------------------------------------- templates under test

# Qwen3: reasoning only on turns after the last user message; the last turn always gets a think block
# (empty without reasoning); earlier turns lose theirs; thinking off pre-fills an empty block.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

# Qwen3.5-style: the generation prompt opens the think block itself (closes it at once when
# thinking is off).
QWEN35 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role in ['system', 'user'] %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{%- set r = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Plain text, no special tokens and no {% generation %} markers.
PLAIN = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- m.content + '\\n\\n' }}"
    "{%- elif m.role == 'user' %}{{- 'User: ' + m.content + '\\n' }}"
    "{%- else %}{{- 'Assistant: ' + m.content + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"
)

CONV = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "Spell the word cat."},
    {"role": "assistant", "content": "cat is spelled c-a-t."},
]



def tokenizer(template=None, extra_specials=()):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    if extra_specials:
        tok.add_tokens(list(extra_specials), special_tokens=True)
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def expected(tok, pieces):
    """Hand-built expectation: (text, supervised) pieces tokenised one by one."""
    ids, mask = [], []
    for text, sup in pieces:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [int(sup)] * len(t)
    return ids, mask


def check(tok, messages, thinking, pieces):
    enc = ChatEncoder(tok, thinking).encode(messages)
    ids, mask = expected(tok, pieces)
    assert "".join(p for p, _ in pieces) == tok.apply_chat_template(
        messages, tokenize=False, enable_thinking=thinking), "expectation text differs from the template"
    assert enc.input_ids == ids
    assert enc.loss_mask == mask
    return enc


# ----------------------------------------------------------------------------- loss masks

def test_qwen3_thinking_off_multiturn_system():
    tok = tokenizer(QWEN3)
    check(tok, CONV, False, [
        ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("2 + 3 = 5.<|im_end|>", 1),
        ("\n<|im_start|>user\nSpell the word cat.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("cat is spelled c-a-t.<|im_end|>", 1),
        ("\n", 0),
    ])


def test_qwen3_thinking_on_with_reasoning():
    tok = tokenizer(QWEN3)
    conv = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2 + 3 = 5."},  # history: reasoning dropped
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "4 + 4 = 8.", "reasoning_content": "double four"},
    ]
    enc = check(tok, conv, True, [
        ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("2 + 3 = 5.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 4 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("double four\n</think>\n\n4 + 4 = 8.<|im_end|>", 1),
        ("\n", 0),
    ])
    assert enc.probe_located_turns == 0  # thinking on: every generation prompt is a prefix of the render
    # Without reasoning the template's empty think block is scaffolding, not output.
    conv[-1] = {"role": "assistant", "content": "4 + 4 = 8."}
    check(tok, conv, True, [
        ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("2 + 3 = 5.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 4 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("4 + 4 = 8.<|im_end|>", 1),
        ("\n", 0),
    ])


def test_qwen3_reasoning_data_with_thinking_off_is_refused():
    tok = tokenizer(QWEN3)
    conv = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}]
    with pytest.raises(SampleError) as e:
        ChatEncoder(tok, False).encode(conv)
    assert e.value.reason == "generation_prompt_mismatch"


def test_qwen35_style_thinking_on_and_off():
    tok = tokenizer(QWEN35)
    conv = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "pick one"},
    ]
    check(tok, conv, True, [
        ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCount to 3.<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("1, 2, 3.<|im_end|>", 1),
        ("\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("pick one\n</think>\n\nBlue.<|im_end|>", 1),
        ("\n", 0),
    ])
    conv[-1] = {"role": "assistant", "content": "Blue."}
    # The empty block is never supervised. Tokens are cut where the generation prompt ends, as a
    # server tokenises the prompt alone: thinking on, "<think>\n" | "\n</think>..." (not "\n\n").
    head = [("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCount to 3.<|im_end|>\n"
             "<|im_start|>assistant\n", 0), ("1, 2, 3.<|im_end|>", 1)]
    check(tok, conv, True, head + [
        ("\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("\n</think>\n\n", 0), ("Blue.<|im_end|>", 1), ("\n", 0)])
    check(tok, conv, False, head + [
        ("\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("Blue.<|im_end|>", 1), ("\n", 0)])
    ids_on = ChatEncoder(tok, True).encode(conv).input_ids
    assert ids_on != ChatEncoder(tok, False).encode(conv).input_ids  # the cut matters for this tokenizer


def test_llama3_style_template():
    tok = tokenizer(LLAMA3, LLAMA3_SPECIALS)
    hdr = lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n"  # noqa: E731
    check(tok, CONV, False, [
        ("<|begin_of_text|>" + hdr("system") + "Answer briefly.<|eot_id|>" + hdr("user") + "What is 2 + 3?<|eot_id|>"
         + hdr("assistant"), 0),
        ("2 + 3 = 5.<|eot_id|>", 1),
        (hdr("user") + "Spell the word cat.<|eot_id|>" + hdr("assistant"), 0),
        ("cat is spelled c-a-t.<|eot_id|>", 1),
    ])


def test_plain_template_without_markers():
    tok = tokenizer(PLAIN)
    conv = [{"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "is red"}]
    # The space after "Assistant:" is template text outside the generation prompt. As its own token
    # (" " + "Hello") it is scaffolding; merged with the reply's first word (" is") the token is the
    # model's output and supervised. No end-of-turn special token, so nothing after the text.
    assert tok.tokenize(" Hello")[0] == "Ġ" and tok.tokenize(" is") == ["Ġis"]
    check(tok, conv, False, [
        ("Be kind.\n\nUser: Say hi\nAssistant:", 0), (" ", 0), ("Hello there", 1),
        ("\nUser: Colour?\nAssistant:", 0), (" is red", 1), ("\n", 0),
    ])


def test_tiny_target_template_and_schemas(tok):
    enc = ChatEncoder(tok, False)
    msgs = normalize({"messages": CONV}, "messages")
    sharegpt = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                   "value": m["content"]} for m in CONV]}
    assert normalize(sharegpt, "conversations") == msgs
    pr = normalize({"prompt": "What is 2 + 3?", "response": "2 + 3 = 5.", "system": "Answer briefly."},
                   "prompt_response")
    assert pr == msgs[:3]
    ids, mask = expected(tok, [
        ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
         "<|im_start|>assistant\n<think>\n\n</think>\n\n", 0), ("2 + 3 = 5.<|im_end|>", 1), ("\n", 0)])
    got = enc.encode(pr)
    assert (got.input_ids, got.loss_mask) == (ids, mask)
    with pytest.raises(SampleError, match="unknown_role"):
        normalize({"messages": [{"role": "narrator", "content": "x"}]}, "messages")
    with pytest.raises(SampleError, match="no_assistant_turn"):
        enc.encode([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- positions, masks, packing

def packed_attention_mask(doc_ids, dtype=None):
    """The explicit mask that restarting position ids stand for (the tests' reference): causal,
    block-diagonal per document, bool [b, 1, S, S], True = attend. numpy or torch.

    With a torch float `dtype`, the additive form (0 / dtype min) that eager attention needs: it adds
    the mask to the scores, so a bool mask would be silently wrong there (SDPA takes either)."""
    if isinstance(doc_ids, np.ndarray):
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        return (same & np.tril(np.ones((doc_ids.shape[1],) * 2, dtype=bool)))[:, None]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(doc_ids.shape[1], doc_ids.shape[1], dtype=torch.bool, device=doc_ids.device).tril()
    mask = (same & causal)[:, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def test_position_ids_and_packed_mask_against_loops():
    doc_ids = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]], dtype=np.int32)
    pos = position_ids_from_doc_ids(torch.from_numpy(doc_ids))
    mask_np = packed_attention_mask(doc_ids)
    mask_t = packed_attention_mask(torch.from_numpy(doc_ids))
    for b in range(2):
        for i in range(8):
            run_start = i
            while run_start > 0 and doc_ids[b, run_start - 1] == doc_ids[b, i]:
                run_start -= 1
            assert pos[b, i] == i - run_start
            for j in range(8):
                want = j <= i and doc_ids[b, j] == doc_ids[b, i]
                assert mask_np[b, 0, i, j] == mask_t[b, 0, i, j] == want
    add = packed_attention_mask(torch.from_numpy(doc_ids), dtype=torch.float32)
    assert torch.equal(add == 0, mask_t) and (add[~mask_t] < -1e30).all()


def test_packing_keeps_documents_whole():
    rng = np.random.default_rng(1)
    S = 32
    docs = []
    for k in range(60):
        n = int(rng.integers(1, S + 1))
        docs.append((rng.integers(10, 1000, n).astype(np.int32), rng.integers(0, 2, n).astype(np.uint8)))
    rows = P.pack_documents(docs, S, pad_id=7, pack=True)
    ids, mask, doc_ids = rows["input_ids"], rows["loss_mask"], rows["doc_ids"]
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and doc_ids.dtype == np.int32
    assert rows["input_ids"].shape[1] == S
    # Every document appears exactly once, contiguous, inside one row, in placement order.
    found = []
    for r in range(ids.shape[0]):
        d = doc_ids[r]
        pad = d == -1
        assert (ids[r][pad] == 7).all() and (mask[r][pad] == 0).all()
        assert not pad.any() or pad[np.argmax(pad):].all(), "padding only at the end"
        for k in range(int(d.max()) + 1):
            where = np.flatnonzero(d == k)
            assert len(where) and (np.diff(where) == 1).all()
            found.append((ids[r, where].tolist(), mask[r, where].tolist()))
    want = sorted((a.tolist(), m.tolist()) for a, m in docs)
    assert sorted(found) == want
    total = sum(len(a) for a, _ in docs)
    assert ids.shape[0] <= total // S + 12  # first fit is dense (not one row per document)
    # First fit: no document would have fitted in an earlier row that was open when it was placed.
    rows1 = P.pack_documents(docs, S, pad_id=7, pack=False)
    assert rows1["input_ids"].shape[0] == len(docs) and (rows1["doc_ids"] <= 0).all()
    where = P._first_fit([len(a) for a, _ in docs], S)
    free = [S] * (max(where) + 1)
    for (a, _), r in zip(docs, where):
        assert all(free[q] < len(a) for q in range(r)) and free[r] >= len(a)
        free[r] -= len(a)


def test_packed_row_through_qwen3_matches_separate_documents():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    lens = [5, 1, 7, 3]
    docs = [(np.random.default_rng(k).integers(0, 96, n).astype(np.int32), np.ones(n, np.uint8))
            for k, n in enumerate(lens)]
    rows = P.pack_documents(docs, 20, pad_id=0, pack=True)
    assert rows["input_ids"].shape[0] == 1
    ids = torch.from_numpy(rows["input_ids"]).long()
    doc_ids = torch.from_numpy(rows["doc_ids"])
    pos = position_ids_from_doc_ids(doc_ids)

    def errors(model, **kw):
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=pos, **kw).logits[0]
            errs = []
            for k in range(len(lens)):
                where = (doc_ids[0] == k).nonzero().flatten()
                alone = model(input_ids=ids[:, where], use_cache=False).logits[0]
                errs.append((packed[where] - alone).abs().max().item())
        return max(errs)

    sdpa = Qwen3ForCausalLM(cfg).eval()
    # transformers detects packing from restarting position_ids, but only without a mask and a cache.
    assert errors(sdpa, use_cache=False) < 1e-5
    assert errors(sdpa) > 1e-3  # the default use_cache=True disables that detection
    assert errors(sdpa, attention_mask=packed_attention_mask(doc_ids), use_cache=False) < 1e-5
    cfg._attn_implementation = "eager"
    eager = Qwen3ForCausalLM(cfg).eval()
    eager.load_state_dict(sdpa.state_dict())
    assert errors(eager, use_cache=False) < 1e-5
    # eager adds the mask to the scores: it needs the additive form, a bool mask is silently wrong
    assert errors(eager, attention_mask=packed_attention_mask(doc_ids, dtype=torch.float32),
                  use_cache=False) < 1e-5
    assert errors(eager, attention_mask=packed_attention_mask(doc_ids), use_cache=False) > 1e-3


# ----------------------------------------------------------------------------- prepare, cache, audit

def make_cfg(tmp_path, **kw):
    base = dict(path=str(CHAT), split="train", max_samples=120, max_length=128, pack=True,
                truncation="drop", thinking=False, cache_dir=str(tmp_path / "cache"), seed=0,
                eval_path=None, eval_split="train", num_eval=4,
                regenerate=types.SimpleNamespace(enabled=False, output_dir=str(tmp_path / "regen"),
                                                 max_new_tokens=32, temperature=0.0, top_p=1.0, backend="hf"))
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_prepare_rows_report_and_eval(tmp_path, tok, capsys):
    cfg = make_cfg(tmp_path)
    data = D.prepare(cfg, tok)
    rows, rep = data.rows, data.report
    assert "supervised text in [[ ]]" in capsys.readouterr().err
    assert set(rows) == {"input_ids", "loss_mask", "doc_ids"}
    n = rows["input_ids"].shape[0]
    assert rep["rows"] == n and rep["row_length"] == 128 and rep["samples"] == 120
    assert rep["documents"] + sum(rep["dropped"].values()) == 120
    assert rep["tokens"] == int((rows["doc_ids"] >= 0).sum())
    assert rep["supervised_tokens"] == int(rows["loss_mask"].sum()) > 0
    assert rep["documents"] == sum(int(d.max()) + 1 for d in rows["doc_ids"])
    assert abs(rep["padding_fraction"] - (rows["doc_ids"] < 0).mean()) < 1e-9
    assert "[[" in rep["example"] and "<|im_end|>]]" in rep["example"]
    cache = Path(data.cache_path)
    assert cache.parent == tmp_path / "cache" and cache.name == data.fingerprint
    assert json.loads((cache / "report.json").read_text())["rows"] == n
    assert (cache / "report.txt").read_text().startswith("prepared data")
    src = [json.loads(line) for line in CHAT.read_text().splitlines()]
    # Eval: the last num_eval samples, prompt = render with generation prompt, reference = reply.
    assert len(data.eval_prompts) == 4
    for conv, prompt, ref in zip(src[-4:], data.eval_prompts, data.eval_references):
        msgs = conv["messages"]
        want = tok(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False), add_special_tokens=False)["input_ids"]
        assert prompt == want
        assert tok.decode(ref) == msgs[-1]["content"] + "<|im_end|>"


def test_prepare_shuffles_deterministically_and_packs_in_order(tmp_path, tok):
    a = D.prepare(make_cfg(tmp_path, pack=False), tok, verbose=False)
    b = D.prepare(make_cfg(tmp_path / "other", pack=False), tok, verbose=False)
    assert a.fingerprint == b.fingerprint
    assert np.array_equal(a.rows["input_ids"], b.rows["input_ids"])
    enc = ChatEncoder(tok, False)
    src = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()][:-4]
    order = np.random.default_rng(0).permutation(len(src))[:120]
    kept = []
    for k in order:
        e = enc.encode(src[k])
        if len(e.input_ids) <= 128:
            kept.append(e)
    assert len(kept) == a.num_rows
    for r, e in enumerate(kept):  # unpacked: row r is the r-th kept sample of the seeded shuffle
        n = len(e.input_ids)
        assert a.rows["input_ids"][r, :n].tolist() == e.input_ids
        assert a.rows["loss_mask"][r, :n].tolist() == e.loss_mask
        assert (a.rows["doc_ids"][r, n:] == -1).all()
    c = D.prepare(make_cfg(tmp_path, pack=False, seed=1), tok, verbose=False)
    assert c.fingerprint != a.fingerprint
    assert not np.array_equal(c.rows["input_ids"][:5], a.rows["input_ids"][:5])


def test_cache_reused_and_rebuilt_on_change(tmp_path, tok, monkeypatch):
    cfg = make_cfg(tmp_path, max_samples=40)
    first = D.prepare(cfg, tok, verbose=False)

    def boom(*a, **k):
        raise AssertionError("re-encoded although nothing changed")
    with monkeypatch.context() as m:
        m.setattr(ChatEncoder, "encode", boom)
        again = D.prepare(cfg, tok, verbose=False)
    assert again.fingerprint == first.fingerprint and again.cache_path == first.cache_path
    assert np.array_equal(np.asarray(again.rows["input_ids"]), np.asarray(first.rows["input_ids"]))

    changed = {
        "template": (cfg, tokenizer(QWEN3)),
        "max_length": (make_cfg(tmp_path, max_samples=40, max_length=96), tok),
        "thinking": (make_cfg(tmp_path, max_samples=40, thinking=True), tok),
        "truncation": (make_cfg(tmp_path, max_samples=40, truncation="truncate"), tok),
    }
    prints = {first.fingerprint}
    for what, (c, t) in changed.items():
        d = D.prepare(c, t, verbose=False)
        assert d.fingerprint not in prints, what
        prints.add(d.fingerprint)
    # Touching the data file (new mtime) changes the dataset identity.
    local = tmp_path / "chat.jsonl"
    local.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:60]))
    d1 = D.prepare(make_cfg(tmp_path, path=str(local), max_samples=40), tok, verbose=False)
    with local.open("a") as f:
        f.write(CHAT.read_text().splitlines(keepends=True)[60])
    d2 = D.prepare(make_cfg(tmp_path, path=str(local), max_samples=40), tok, verbose=False)
    assert d1.fingerprint != d2.fingerprint
    assert not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_truncation_modes(tmp_path, tok):
    drop = D.prepare(make_cfg(tmp_path, max_length=40, max_samples=60), tok, verbose=False)
    trunc = D.prepare(make_cfg(tmp_path, max_length=40, max_samples=60, truncation="truncate"), tok, verbose=False)
    assert drop.report["dropped"].get("too_long", 0) > 0
    assert "too_long" not in trunc.report["dropped"] and trunc.report["truncated"] > 0
    assert trunc.report["documents"] > drop.report["documents"]


def test_eval_path_with_references(tmp_path, tok):
    data = D.prepare(make_cfg(tmp_path, eval_path=str(EVAL), num_eval=5), tok, verbose=False)
    assert data.report["samples"] == 120
    ev = [json.loads(line)["messages"] for line in EVAL.read_text().splitlines()][:5]
    assert len(data.eval_prompts) == 5
    for msgs, ref in zip(ev, data.eval_references):
        assert tok.decode(ref) == msgs[-1]["content"] + "<|im_end|>"


def test_regenerated_output_must_be_complete(tmp_path, tok):
    cfg = make_cfg(tmp_path)
    cfg.regenerate.enabled = True
    with pytest.raises(ValueError, match="data.regenerate.output_dir"):
        D.prepare(cfg, tok, verbose=False)


# ----------------------------------------------------------------------------- bad input

def test_tokenizer_without_chat_template(tmp_path):
    tok = tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="target.path.*chat template"):
        D.prepare(make_cfg(tmp_path), tok)


def test_unknown_schema_names_fields(tmp_path, tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"data.path.*\['answer', 'question'\].*messages"):
        D.prepare(make_cfg(tmp_path, path=str(bad), num_eval=0), tok)


def test_empty_dataset(tmp_path, tok):
    empty = tmp_path / "empty.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": pa.array([], type=pa.list_(pa.struct([("role", pa.string()),
                                                                              ("content", pa.string())])))}), empty)
    with pytest.raises(ValueError, match="data.path.*empty"):
        D.prepare(make_cfg(tmp_path, path=str(empty), num_eval=0), tok)


def test_missing_split_and_path(tmp_path, tok):
    with pytest.raises(ValueError, match="data.split.*'validation'"):
        D.prepare(make_cfg(tmp_path, split="validation"), tok)
    with pytest.raises(ValueError, match="data.path.*does not exist"):
        D.prepare(make_cfg(tmp_path, path=str(tmp_path / "nothing.jsonl")), tok)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="data.path.*extension"):
        D.prepare(make_cfg(tmp_path, path=str(tmp_path / "notes.txt")), tok)


def test_no_supervised_tokens(tmp_path, tok):
    with pytest.raises(ValueError, match="data.path.*no supervised"):
        D.prepare(make_cfg(tmp_path, max_length=8), tok)  # every sample too long, dropped


def test_lengths_file_lists_every_conversation(tmp_path, tok):
    data = D.prepare(make_cfg(tmp_path, max_samples=10), tok, verbose=False)
    saved = json.loads((Path(data.cache_path) / D.LENGTHS_FILE).read_text())
    doc_ids = np.asarray(data.rows["doc_ids"])
    from_rows = sorted(int((row == d).sum()) for row in doc_ids for d in range(int(row.max()) + 1))
    assert sorted(saved["lengths"]) == from_rows and len(from_rows) == data.report["documents"]
    assert saved["max_length"] == data.report["row_length"] and data.num_rows < 10  # packed


def test_hybrid_targets_pack_like_any_other(tmp_path, capsys):
    """A hybrid (Gated DeltaNet) target takes packed rows: its forward keeps the documents apart
    (target.packed); the pre-launch check refuses packing only on a GPU without fla."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from dflash_ds.train import main

    target = tmp_path / "hybrid-target"
    Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=256).save_pretrained(target)
    args = ["recipes/tiny.yaml", "--dry-run", "--world-size", "2", f"target.path={target}"]
    assert main(args + ["data.pack=true"]) == 0
    assert main(args + ["data.pack=false"]) == 0


@pytest.mark.launcher
def test_parallel_encoding_matches_serial(tmp_path, tok):
    serial = D.prepare(make_cfg(tmp_path / "a", max_samples=80), tok, verbose=False)
    parallel = D.prepare(make_cfg(tmp_path / "b", max_samples=80, num_proc=2), tok, verbose=False)
    assert serial.fingerprint == parallel.fingerprint
    for k in D.ROW_FIELDS:
        assert np.array_equal(np.asarray(serial.rows[k]), np.asarray(parallel.rows[k]))


def test_drop_reasons_counted(tmp_path, tok):
    rows = [
        {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "Only a question?"}]},
        {"messages": [{"role": "user", "content": "Who?"}, {"role": "narrator", "content": "x"}]},
        {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "1 + 1 = 2."}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = D.prepare(make_cfg(tmp_path, path=str(path), num_eval=0, max_samples=None), tok, verbose=False)
    # An empty reply leaves one supervised token (<|im_end|>): no anchor with a next token, dropped.
    assert data.report["dropped"] == {"no_assistant_turn": 1, "no_supervised_pair": 1, "unknown_role": 1}
    assert data.report["documents"] == 1 and data.num_rows == 1
    assert tok.decode(np.asarray(data.rows["input_ids"][0])[np.asarray(data.rows["loss_mask"][0]) == 1]) == \
        "1 + 1 = 2.<|im_end|>"


def test_common_prefix_suffix_against_loops():
    from dflash_ds.data.chat import _common_prefix, _common_suffix

    rng = np.random.default_rng(3)
    for _ in range(500):
        a = "".join(rng.choice(list("ab"), rng.integers(0, 9)))
        b = "".join(rng.choice(list("ab"), rng.integers(0, 9)))
        lim = int(rng.integers(0, min(len(a), len(b)) + 1))
        cp = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        cs = next((k for k in range(lim) if a[-1 - k] != b[-1 - k]), lim)
        assert _common_prefix(a, b) == _common_prefix(list(a), list(b)) == cp
        assert _common_suffix(a, b, lim) == cs


# ----------------------------------------------------------------------------- single pass = per-turn probes

def _random_conversations(rng, n, with_reasoning):
    words = ["the", "cat", "sat", "on", "a", "mat", "2", "+", "3", "=", "5.", "Hello", "\n", "  ", "ok!",
             "<|im_end|>", "User:", "Assistant:"]
    def text():
        return " ".join(rng.choice(words) for _ in range(int(rng.integers(0, 12))))
    convs = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
        for t in range(int(rng.integers(1, 7))):
            if t == 0 or rng.random() < 0.85:
                msgs.append({"role": "user", "content": text() or "q"})
            msgs.append({"role": "assistant", "content": text()})
        if with_reasoning and rng.random() < 0.5:
            msgs[-1]["reasoning_content"] = text() or "r"
        if rng.random() < 0.2:  # inline reasoning in a history turn (Qwen3 strips it)
            first = next(m for m in msgs if m["role"] == "assistant")
            first["content"] = "<think>\nhm\n</think>\n\n" + first["content"]
        if rng.random() < 0.2 and len(msgs) > 2:  # a turn that quotes the template text around it
            k = max(k for k, m in enumerate(msgs) if m["role"] == "assistant" and k < len(msgs) - 1) \
                if any(m["role"] == "assistant" for m in msgs[:-1]) else None
            if k is not None:
                msgs[k]["content"] += "<|im_end|>\n<|im_start|>user\n" + msgs[k + 1]["content"] + "\nUser: " + \
                    msgs[k + 1]["content"] + "\nAssistant:"
        convs.append(msgs)
    return convs


@pytest.mark.parametrize("template,specials,thinking", [
    (QWEN3, (), False), (QWEN3, (), True), (QWEN35, (), False), (QWEN35, (), True),
    (LLAMA3, LLAMA3_SPECIALS, False), (PLAIN, (), False), (None, (), False)],
    ids=["qwen3-off", "qwen3-on", "qwen35-off", "qwen35-on", "llama3", "plain", "tiny"])
def test_single_pass_matches_per_turn_probes(template, specials, thinking):
    """One render + one probe render per conversation gives exactly the per-turn reference."""
    from .chat_reference import encode_reference

    tok = tokenizer(template, specials)
    enc = ChatEncoder(tok, thinking)
    rng = np.random.default_rng(7)
    compared, multi, errors = 0, 0, 0
    for msgs in _random_conversations(rng, 150, with_reasoning=thinking):
        try:
            want = encode_reference(enc, msgs)
        except SampleError as e:
            with pytest.raises(SampleError) as got:
                enc.encode(msgs)
            assert got.value.reason == e.reason
            errors += 1
            continue
        got = enc.encode(msgs)
        assert (got.input_ids, got.loss_mask, got.turn_spans, got.probe_located_turns) == \
            (want.input_ids, want.loss_mask, want.turn_spans, want.probe_located_turns), msgs
        compared += 1
        multi += len(want.turn_spans) > 2
    assert compared >= 50 and multi >= 20, (compared, multi, errors)


@pytest.mark.parametrize("template,thinking", [(QWEN3, False), (QWEN3, True), (QWEN35, True), (PLAIN, False)],
                         ids=["qwen3-off", "qwen3-on", "qwen35-on", "plain"])
def test_encoding_work_is_linear_in_turns(template, thinking):
    """Characters rendered per conversation stay a constant multiple of its length (the per-turn
    probe renders grew with the square of the turn count)."""
    from .chat_reference import encode_reference

    enc = ChatEncoder(tokenizer(template), thinking)
    rendered = []
    real = enc.render
    enc.render = lambda m, g: rendered.append(len(real(m, g))) or real(m, g)  # noqa: E731
    ratios = {}
    for turns in (4, 48):  # per-turn probes render every prefix: about turns / 2 conversations, 24 at 48
        conv = []
        for t in range(turns):
            conv += [{"role": "user", "content": f"Question {t}: what is {t} + {t}?"},
                     {"role": "assistant", "content": f"{t} + {t} = {2 * t}."}]
        if thinking:  # a content-dependent think block on the last turn
            conv[-1]["reasoning_content"] = "add"
        rendered.clear()
        got = enc.encode(conv)
        ratios[turns] = sum(rendered) / len(real(conv, False))
        assert got == encode_reference(enc, conv)
    assert ratios[48] < 8 and ratios[48] < 2 * ratios[4], ratios


def test_prepared_rows_are_writable_copy_on_write_maps(tmp_path, tok):
    """Rows are file-backed (resident memory independent of the dataset) but writable; a write
    changes the caller's array only, never the cache a later run reads."""
    cfg = make_cfg(tmp_path, max_samples=40)
    first = D.prepare(cfg, tok, verbose=False)
    ids = first.rows["input_ids"]
    assert isinstance(ids, np.memmap) and ids.flags.writeable
    before = np.array(ids[0, :4])
    ids[0, :4] = before + 1
    again = D.prepare(cfg, tok, verbose=False)
    assert np.array_equal(np.asarray(again.rows["input_ids"][0, :4]), before)
    assert np.array_equal(np.asarray(ids[0, :4]), before + 1)


def test_first_fit_lengths_from_int64_array():
    lengths = np.random.default_rng(3).integers(1, 33, 500)
    assert list(P._first_fit(lengths, 32)) == list(P._first_fit([int(n) for n in lengths], 32))


@pytest.mark.launcher
def test_anon_memory_sampler_sums_the_process_tree():
    """The data bench's RssAnon sampler sees anonymous memory held by a grandchild process."""
    import subprocess
    import sys

    from dflash_ds.bench.data import AnonPeak

    hold = ("import sys, time; b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(1.0)")
    parent = f"import subprocess, sys; p = subprocess.run([sys.executable, '-c', {hold!r}]); sys.exit(p.returncode)"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    sampler = AnonPeak(proc.pid, interval=0.02)
    out, _ = proc.communicate(timeout=60)
    peak_mib = sampler.stop() / 1024
    assert proc.returncode == 0 and "ready" in out
    assert sampler.peak_procs >= 2 and 256 <= peak_mib < 256 + 200, (peak_mib, sampler.peak_procs)
