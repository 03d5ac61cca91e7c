"""Regeneration: turn-by-turn conditioning, sharding over ranks, interruption and resume."""

import json
import types
from pathlib import Path

import pytest
import torch

from dflash_ds.data import prepare as D
from dflash_ds.data import regenerate as R
from dflash_ds.data.chat import ChatEncoder, normalize

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-target"
CHAT = ROOT / "assets" / "tiny_chat.jsonl"



@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def make_cfg(tmp_path, path, out="regen", **rs):
    regen = dict(enabled=False, output_dir=str(tmp_path / out), max_new_tokens=24, temperature=0.0,
                 top_p=1.0, backend="hf")
    regen.update(rs)
    return types.SimpleNamespace(
        path=str(path), split="train", max_samples=None, max_length=256, pack=True, truncation="drop",
        thinking=False, cache_dir=str(tmp_path / "cache"), seed=0, eval_path=None, eval_split="train",
        num_eval=2, regenerate=types.SimpleNamespace(**regen))


def read_shards(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("part-*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def test_split_reasoning():
    assert R.split_reasoning("plain answer") == "plain answer"
    assert R.split_reasoning("think hard\n</think>\n\nDone.") == "<think>\nthink hard\n</think>\n\nDone."
    assert R.split_reasoning("<think>\nx\n</think>\nY") == "<think>\nx\n</think>\n\nY"


def test_turn_by_turn_with_recorded_prompts(tok):
    enc = ChatEncoder(tok, False)
    convs = [
        [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "old A"},
         {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "old B"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "old C"}],
        [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "old D"}],
        [{"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "old E"},
         {"role": "user", "content": "Again"}, {"role": "assistant", "content": "old F"}],
    ]
    seen = []

    def fake(prompts, seed):
        seen.append(prompts)
        outs = []
        for k, p in enumerate(prompts):
            text = f"new {len(seen)}.{k}"
            finished = not (len(seen) == 1 and k == 2) and not (len(seen) == 2 and k == 1)
            outs.append((tok(text, add_special_tokens=False)["input_ids"], finished))
        return outs

    kept, unfinished = R.regenerate_conversations(convs, enc, fake, seed=0)
    assert unfinished == 2
    # turn 0: convs 0,1,2,3 (conv 2 unfinished -> dropped); turn 1: convs 0,3 (conv 3 unfinished -> cut)
    assert len(seen) == 2 and len(seen[0]) == 4 and len(seen[1]) == 2
    assert kept[0] == [convs[0][0], {"role": "assistant", "content": "new 1.0"}, convs[0][2],
                       {"role": "assistant", "content": "new 2.0"}]
    assert kept[1] == convs[1][:2] + [{"role": "assistant", "content": "new 1.1"}]
    assert kept[2] == [convs[3][0], {"role": "assistant", "content": "new 1.3"}, convs[3][2]]
    assert len(kept) == 3
    # The second turn's prompt is the regenerated history, rendered with the generation prompt.
    want = enc.prompt_ids([convs[0][0], {"role": "assistant", "content": "new 1.0"}, convs[0][2]])
    assert seen[1][0] == want
    assert "new 1.0" in tok.decode(seen[1][0]) and "old A" not in tok.decode(seen[1][0])


def test_keep_unfinished_keeps_the_cut_turn_and_drops_what_follows(tok):
    enc = ChatEncoder(tok, False)
    convs = [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "old A"},
         {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "old B"}],
        [{"role": "user", "content": "Q3"}, {"role": "assistant", "content": "old C"},
         {"role": "user", "content": "Q4"}, {"role": "assistant", "content": "old D"}],
    ]

    def run(**kw):
        seen = []

        def fake(prompts, seed):  # conversation 0's first turn and conversation 1's second turn run out
            seen.append(len(prompts))
            return [(tok(f"new {len(seen)}.{k}", add_special_tokens=False)["input_ids"], k != 0)
                    for k in range(len(prompts))]

        return R.regenerate_conversations(convs, enc, fake, seed=0, **kw), seen

    (kept, unfinished), seen = run(keep_unfinished=True)
    assert unfinished == 2 and seen == [2, 1]  # the cut conversation 0 asks for no second turn
    assert kept[0] == [convs[0][0], {"role": "assistant", "content": "new 1.0", "truncated": True}]
    assert kept[1] == [convs[1][0], {"role": "assistant", "content": "new 1.1"}, convs[1][2],
                       {"role": "assistant", "content": "new 2.0", "truncated": True}]
    (dropped, unfinished), seen = run()  # the default drops them
    assert unfinished == 2 and seen == [2, 1]
    assert dropped == [[convs[1][0], {"role": "assistant", "content": "new 1.1"}, convs[1][2]]]


def test_truncated_answer_is_trained_without_an_end_of_turn(tok):
    """The template renders <|im_end|> after every assistant turn; a truncated answer's loss mask must
    stop before it (the target never generated it), a finished answer's includes it."""
    enc = ChatEncoder(tok, False)
    conv = [{"role": "user", "content": "Say something long."}, {"role": "assistant", "content": "It was a"}]
    full = enc.encode(conv)
    # what a shard line reads back as (normalize keeps the mark)
    cut_msgs = normalize({"messages": conv[:1] + [dict(conv[1], truncated=True)]}, "messages")
    assert cut_msgs[1]["truncated"] is True
    cut = enc.encode(cut_msgs)
    assert cut.input_ids == full.input_ids  # the same text; only the supervision differs
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    sup_full = [t for t, m in zip(full.input_ids, full.loss_mask) if m]
    sup_cut = [t for t, m in zip(cut.input_ids, cut.loss_mask) if m]
    assert sup_full[-1] == end_id and end_id not in sup_cut
    assert sup_cut == sup_full[:-1]
    assert tok.decode(sup_cut) == "It was a"
    assert cut.turn_spans[-1][1] == full.turn_spans[-1][1] - 1
    # a mark on a user message, or a non-true value, is not a truncation
    assert "truncated" not in normalize({"messages": [dict(conv[0], truncated=True), conv[1]]}, "messages")[0]
    assert "truncated" not in normalize({"messages": [conv[0], dict(conv[1], truncated="yes")]}, "messages")[1]


def test_keep_unfinished_is_part_of_the_manifest(tmp_path):
    src = tmp_path / "x.jsonl"
    off = R._manifest(make_cfg(tmp_path, src), 4, 1)
    on = R._manifest(make_cfg(tmp_path, src, keep_unfinished=True), 4, 1)
    assert "keep_unfinished" not in off["settings"] and on["settings"]["keep_unfinished"] is True


def greedy(model, ids, stop, max_new):
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt in stop:
                return out, True
            out.append(nxt)
    return out, False


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_regenerate_end_to_end_interrupted_and_resumed(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(R, "SHARD_SIZE", 3)
    lines = CHAT.read_text().splitlines(keepends=True)
    src = tmp_path / "src.jsonl"
    picked = [ln for ln in lines if len(json.loads(ln)["messages"]) >= 4][:3] + lines[:7]
    src.write_text("".join(picked))  # 10 samples, 4 shards, multi-turn ones first
    cfg = make_cfg(tmp_path, src, "full")

    # Uninterrupted reference run (builds its own HF generator).
    summary = R.regenerate(cfg, str(TINY), verbose=False)
    assert summary["shards_written"] == 4 and summary["samples_in"] == 10
    full = read_shards(tmp_path / "full")
    assert R.check_complete(tmp_path / "full")["num_shards"] == 4

    # The same by hand: greedy decoding, turn by turn on the regenerated history.
    model = R.HFGenerator(str(TINY), tok, cfg.regenerate).model
    enc = ChatEncoder(tok, False)
    stop = R.stop_ids(str(TINY), tok)
    expect = []
    for ln in picked:
        msgs = json.loads(ln)["messages"]
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                ids, finished = greedy(model, enc.prompt_ids(msgs[:k]), stop, 24)
                if not finished:
                    msgs = msgs[:k]
                    break
                msgs[k] = {"role": "assistant", "content": tok.decode(ids)}
        if any(m["role"] == "assistant" for m in msgs):
            expect.append({"messages": msgs})
    assert full == expect
    assert any(len(r["messages"]) >= 4 for r in full)
    user_in = [[m for m in json.loads(ln)["messages"] if m["role"] != "assistant"] for ln in picked]
    for r in full:
        assert [m for m in r["messages"] if m["role"] != "assistant"] in user_in

    # Interrupted: one shard, then a crash in the middle of the next one, then two ranks resume.
    gen = R.HFGenerator(str(TINY), tok, cfg.regenerate)
    cfg2 = make_cfg(tmp_path, src, "resumed")
    out = tmp_path / "resumed"
    one = R.Shards(max_shards=1)
    assert R.regenerate(cfg2, str(TINY), shards=one, generator=gen, tokenizer=tok, verbose=False)["shards_written"] == 1
    with pytest.raises(ValueError, match="incomplete"):
        R.check_complete(out)
    calls = []

    def crashing(prompts, seed):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("node lost")
        return gen(prompts, seed)
    with pytest.raises(RuntimeError, match="node lost"):
        R.regenerate(cfg2, str(TINY), generator=crashing, tokenizer=tok, verbose=False)
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.jsonl"]  # nothing half-written
    done = [R.regenerate(cfg2, str(TINY), shards=R.Shards(rank=r, world_size=2), generator=gen, tokenizer=tok,
                         verbose=False)
            for r in (1, 0)]
    assert [d["shards_written"] for d in done] == [2, 1]  # rank 1: shards 1, 3; rank 0: shard 2
    assert read_shards(out) == full
    assert not list(out.glob(".*.tmp-*"))
    assert R.regenerate(cfg2, str(TINY), generator=gen, tokenizer=tok, verbose=False)["shards_written"] == 0

    # prepare() reads the regenerated directory when regeneration is enabled.
    cfg2.regenerate.enabled = True
    data = D.prepare(cfg2, tok, verbose=False)
    assert data.report["source"] == str(out)
    assert data.report["samples"] == len(full) - cfg2.num_eval
    ref = full[-1]["messages"][-1]["content"]
    assert tok.decode(data.eval_references[-1]) == ref + "<|im_end|>"


def test_changed_settings_refuse_to_mix(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(R, "SHARD_SIZE", 2)
    src = tmp_path / "src.jsonl"
    src.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:4]))

    def fake(prompts, seed):
        return [(tok("ok", add_special_tokens=False)["input_ids"], True) for _ in prompts]
    cfg = make_cfg(tmp_path, src)
    R.regenerate(cfg, str(TINY), shards=R.Shards(max_shards=1), generator=fake, tokenizer=tok, verbose=False)
    with pytest.raises(ValueError, match="data.regenerate.output_dir.*other inputs or settings"):
        R.regenerate(make_cfg(tmp_path, src, temperature=0.7), str(TINY), generator=fake, tokenizer=tok)
    with pytest.raises(ValueError, match="data.regenerate.backend"):
        R.make_generator(make_cfg(tmp_path, src, backend="tgi"), str(TINY), tok)
    with pytest.raises(ValueError, match="data.regenerate.output_dir.*no regenerated data"):
        R.check_complete(tmp_path / "nowhere")


@pytest.mark.launcher
def test_regenerate_under_the_deepspeed_launcher(tmp_path):
    """`deepspeed --module dflash_ds.regenerate` (every rank gets --local_rank=N) spreads the shards."""
    import json as _json

    from .launch_util import deepspeed_cmd, free_port, output, run, cpu_env

    out = tmp_path / "regen"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), "--module", "dflash_ds.regenerate",
                             "recipes/tiny.yaml", "data.max_samples=12", "data.regenerate.max_new_tokens=64",
                             f"data.regenerate.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = run(cmd, 180, cpu_env())
    assert proc.returncode == 0, output(proc)[-4000:]
    rows = [_json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
    assert len(rows) == 12 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


def test_shards_regenerated_together_write_the_same_shards(tmp_path, tok, monkeypatch):
    """Shards(per_call=k) puts k shards' conversations in each generate batch; the files are those of
    one shard at a time (a deterministic generator: the greedy case)."""
    monkeypatch.setattr(R, "SHARD_SIZE", 3)
    src = tmp_path / "src.jsonl"
    src.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:11]))  # 4 shards, the last of 2
    batches = []

    def fake(prompts, seed):  # the answer depends on the prompt only; every third one runs out
        batches.append(len(prompts))
        return [(tok(f"a{len(p)}", add_special_tokens=False)["input_ids"], len(p) % 3 != 0) for p in prompts]

    one = R.regenerate(make_cfg(tmp_path, src, out="one", keep_unfinished=True), str(TINY), generator=fake,
                       tokenizer=tok, verbose=False)
    first_turns_one = batches[0]
    batches.clear()
    grouped = R.regenerate(make_cfg(tmp_path, src, out="grouped", keep_unfinished=True), str(TINY),
                           shards=R.Shards(per_call=3), generator=fake, tokenizer=tok, verbose=False)
    assert first_turns_one == 3 and batches[0] == 9  # three shards' first turns in one batch
    assert one["shards_written"] == grouped["shards_written"] == 4
    assert one["unfinished_turns"] == grouped["unfinished_turns"] > 0
    for name in sorted(p.name for p in (tmp_path / "one").glob("part-*.jsonl")):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "grouped" / name).read_text()
    assert any(m.get("truncated") for row in read_shards(tmp_path / "grouped") for m in row["messages"])
