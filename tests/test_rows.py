"""Rows decoupled from conversations: data.max_length (longest conversation) and data.row_length
(packed row length) are separate, anchors follow the row length, and long answers pack into long rows
with almost no padding (preparation and the bench's length mixes)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_ds.bench.lengths import LONG_ROW, length_rows, length_sampler, useful_share
from dflash_ds.config import RecipeError, default_anchors, load_recipe
from dflash_ds.objective.blocks import anchor_quota, sample_anchors, valid_anchor_mask

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
FLAGSHIP = REPO / "recipes" / "qwen27b.yaml"


# ----------------------------------------------------------------------------- settings

def test_row_length_defaults_to_the_longest_conversation_and_anchors_follow_it():
    r = load_recipe(TINY, ["data.row_length=null", "objective.num_anchors=null", "data.max_length=300"])
    assert r.data.row_length == 300 and r.objective.num_anchors == default_anchors(300) == 50
    r = load_recipe(TINY, ["data.row_length=3072", "objective.num_anchors=null"])
    assert r.objective.num_anchors == 512
    r = load_recipe(TINY, ["data.row_length=12288", "objective.num_anchors=null"])
    assert (r.data.max_length, r.data.row_length, r.objective.num_anchors) == (256, 12288, 2048)
    # Without packing a row holds one conversation: the row is the longest conversation.
    r = load_recipe(TINY, ["data.pack=false", "objective.num_anchors=null"])
    assert r.data.row_length == r.data.max_length == 256 and r.objective.num_anchors == 43


def test_row_shorter_than_a_conversation_or_fewer_slots_than_anchors_is_refused():
    with pytest.raises(RecipeError, match=r"data\.row_length \(200\) is shorter than data\.max_length \(256\)"):
        load_recipe(TINY, ["data.row_length=200"])
    with pytest.raises(RecipeError, match=r"objective\.num_anchors \(2000\) exceeds data\.row_length \(1024\)"):
        load_recipe(TINY, ["objective.num_anchors=2000"])


@pytest.mark.parametrize("name, old_steps_tokens", [("qwen27b", 4 * 3072), ("qwen3-8b", 4 * 3072),
                                                     ("qwen27b-2node", 2 * 3072), ("tiny", 4 * 256),
                                                     ("qwen27b-dflash2", 4 * 3072), ("tiny-dflash2", 4 * 256),
                                                     ("qwen36-35b-a3b", 4 * 3072)])
def test_shipped_recipes_pack_one_row_per_micro_batch_at_the_same_tokens_and_anchor_density(name, old_steps_tokens):
    r = load_recipe(REPO / "recipes" / f"{name}.yaml")
    o, d = r.optim, r.data
    # The same tokens per optimizer step as rows of the longest conversation did (4 x 3,072 before).
    assert o.rows_per_micro_batch * o.grad_accum * d.row_length == old_steps_tokens
    assert o.rows_per_micro_batch == 1 and d.row_length > d.max_length and d.pack
    # Anchors per row token unchanged: 512 per 3,072 for the paper's recipes, 64 per 256 for tiny.
    density = 64 / 256 if name.startswith("tiny") else 512 / 3072
    assert r.objective.num_anchors == round(density * d.row_length)
    assert d.max_length == (256 if name.startswith("tiny") else 3072)


# ----------------------------------------------------------------------------- the long-answer mix

def test_long_mix_is_mostly_between_half_and_one_row():
    x = length_sampler("long", 3072)(np.random.default_rng(0), 20_000)
    share = ((x >= LONG_ROW // 2) & (x <= LONG_ROW)).mean()
    assert 0.8 <= share < 0.9 and x.max() <= 3072  # the long ones plus the chat mix's own tail
    assert length_sampler("long", 2000)(np.random.default_rng(0), 1000).max() == 2000  # cut to max_length


def test_long_answers_waste_a_fifth_of_short_rows_and_almost_nothing_of_long_ones():
    short = useful_share(length_rows(64, 3072, 3072, 1000, spec="long", pack=True, seed=0)["doc_ids"])
    long = useful_share(length_rows(16, 12288, 3072, 1000, spec="long", pack=True, seed=0)["doc_ids"])
    assert short["padding_share"] > 0.12, short
    assert long["padding_share"] <= 0.03 and long["docs_per_row"] > 4, long
    chat = useful_share(length_rows(16, 12288, 3072, 1000, spec="chat", pack=True, seed=0)["doc_ids"])
    assert chat["padding_share"] <= 0.03, chat
    rows = length_rows(8, 12288, 3072, 1000, spec="long", pack=True, seed=1)
    for row in rows["doc_ids"]:  # whole documents, none longer than the longest conversation
        assert np.bincount(row[row >= 0]).max() <= 3072


def test_lengths_above_the_row_are_refused():
    with pytest.raises(ValueError, match="exceeds the row length"):
        length_rows(2, 1024, 3072, 100, spec="chat", pack=True, seed=0)


# ----------------------------------------------------------------------------- preparation


def _long_answer_chats(path: Path, n: int, seed: int = 0) -> None:
    """Chats whose answers make most conversations half a 3,072-token row to a whole one (each ' the'
    is one token of the tiny tokenizer), the rest short."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for k in range(n):
            words = int(rng.integers(1500, 3000)) if rng.random() < 0.8 else int(rng.integers(50, 600))
            msgs = [{"role": "user", "content": f"Question {k}: think it through."},
                    {"role": "assistant", "content": "the" + " the" * words}]
            f.write(json.dumps({"messages": msgs}) + "\n")


@pytest.mark.integration  # the whole data preparation of 300 long chats at the flagship's rows: seconds
@pytest.mark.parametrize("row_length, bound", [(None, 0.03), (3072, None)], ids=["flagship_rows", "rows3072"])
def test_prepare_long_answers_with_the_flagship_recipe_pads_little(tmp_path, row_length, bound):
    from transformers import AutoTokenizer

    from dflash_ds.data.prepare import prepare

    chats = tmp_path / "long.jsonl"
    _long_answer_chats(chats, 300)
    over = [f"data.path={chats}", "data.split=train", "data.regenerate.enabled=false", f"data.cache_dir={tmp_path / 'cache'}",
            "data.num_eval=4", "data.num_proc=1"]
    if row_length:
        over.append(f"data.row_length={row_length}")
    recipe = load_recipe(FLAGSHIP, over)
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-target")
    data = prepare(recipe.data, tok, verbose=False)
    rep = data.report
    assert rep["row_length"] == recipe.data.row_length == data.rows["input_ids"].shape[1]
    assert rep["max_length"] == 3072 and not rep["dropped"]
    doc_ids = np.asarray(data.rows["doc_ids"])
    assert max(int((row == d).sum()) for row in doc_ids for d in range(int(row.max()) + 1)) <= 3072
    if bound:
        assert rep["row_length"] == 12288 and rep["padding_fraction"] <= bound, rep["padding_fraction"]
    else:  # the same chats in 3,072-token rows: a long conversation leaves most of its row's gap empty
        assert rep["padding_fraction"] > 0.10, rep["padding_fraction"]


# ----------------------------------------------------------------------------- anchors in long rows


def test_anchor_quotas_in_a_long_row_match_the_density_of_full_short_rows():
    """A 12,288-token row of whole documents with 2,048 anchors gives every document its proportional
    share of the row's anchors (within one), all drawn inside it: 2,048 / C per supervised token, as a
    full 3,072-token row gives at 512."""
    rows = length_rows(4, 12288, 3072, 100, spec="long", pack=True, seed=3)
    doc_ids = torch.as_tensor(rows["doc_ids"])
    loss_mask = torch.as_tensor(rows["loss_mask"]).bool()
    valid = valid_anchor_mask(loss_mask, doc_ids)
    quota = anchor_quota(valid, doc_ids, 2048)
    c = torch.stack([torch.bincount(doc_ids[r][valid[r]].long(), minlength=12288) for r in range(4)])
    exact = 2048 * c.double() / c.sum(1, keepdim=True)
    assert ((quota.double() - exact).abs() < 1).all() and (quota.sum(1) == 2048).all()
    anchors, ok = sample_anchors(loss_mask, doc_ids, 2048, torch.Generator().manual_seed(0))
    assert ok.all() and valid.gather(1, anchors).all()


# ----------------------------------------------------------------------------- the planner


def test_planner_warns_when_rates_were_measured_on_other_rows(tmp_path):
    from dflash_ds import bench
    from dflash_ds.bench.cli import run_plan

    def bench_json(name, role, seq_len):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"role": role, "args": {"seq_len": seq_len}, "env": {"device": "cuda"},
                                 "result": {"tok_s": 10000.0}}))
        return str(f)

    args = bench.parse_args(["--role", "plan", "--from", bench_json("t", "target", 3072),
                             bench_json("d", "drafter", 12288)])
    warnings = run_plan(args)["warnings"]
    assert len(warnings) == 1 and "target measured on 3072-token rows" in warnings[0]
    assert "12288-token rows (data.row_length)" in warnings[0]
    args = bench.parse_args(["--role", "plan", "--from", bench_json("t", "target", 3072),
                             bench_json("d", "drafter", 3072), "--set", "data.row_length=3072"])
    assert run_plan(args)["warnings"] == []
