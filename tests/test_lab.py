"""The quality lab's CPU pieces: the corpus and its split rule, the framing, the tokenizer and its chat
template, the table's arithmetic. (tests/test_lab_launcher.py runs the whole pipeline at toy size.)"""

from __future__ import annotations

import hashlib
import json
import math
import random

import pytest

from dflash_ds.eval.benchmarks import load_conversations
from lab import corpus, framing, table, tokenizer
from lab.runs import llama_cpp_summary
from lab.target import Clock, Phase, pack

CODE = '''"""A module."""


def area(width, height):
    """Return the area of a rectangle of the given width and height.

    Both sides must be positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError("sides must be positive")
    return width * height


class Box:
    def volume(self, depth):
        """Return the volume of the box for a given depth value."""
        base = area(self.width, self.height)
        return base * depth
'''

DOC = """Installing the package
======================

""" + "Install it with pip and a supported Python version; the wheel needs no compiler. " * 4 + """

Configuring it
--------------

""" + "Settings live in one file read at start; each key is documented beside its default. " * 4 + "\n"


def make_pins(tmp_path, projects: dict[str, tuple[str, dict[str, str]]]):
    """Local sdists in a cache folder and their pins (split, files) -> (pins, cache)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    pins = []
    for name, (split, files) in projects.items():
        data = corpus.sdist_bytes(files, f"{name}-1.0")
        (cache / f"{name}-1.0.tar.gz").write_bytes(data)
        pins.append(corpus.Pin(name, "1.0", f"{name}-1.0.tar.gz", hashlib.sha256(data).hexdigest(), "MIT", split))
    return tuple(pins), cache


def project_files(tag: str) -> dict[str, str]:
    return {f"{tag}/core.py": CODE.replace("A module.", f"The {tag} module."),
            f"{tag}/util.py": CODE.replace("area", f"{tag}_area"),
            "docs/index.rst": DOC.replace("the package", f"the {tag} package"),
            "docs/notes.txt": DOC.replace("Configuring", f"Configuring {tag}"),
            "README.rst": DOC,  # not under docs/: not taken
            f"{tag}/locale/x.py": CODE,  # a skipped folder
            f"{tag}/tiny.py": "x = 1\n"}  # too short


def test_corpus_split_is_by_whole_project_and_held_out_text_is_never_in_training(tmp_path):
    shared = {"shared/common.py": CODE.replace("A module.", "Shared by two projects.")}
    pins, cache = make_pins(tmp_path, {
        "alpha": ("train", {**project_files("alpha"), **shared}),
        "beta": ("train", project_files("beta")),
        "gamma": ("heldout", {**project_files("gamma"), **shared}),
    })
    out = tmp_path / "corpus.jsonl.xz"
    counts = corpus.build(out, pins, cache, download=False)
    docs = corpus.read_corpus(out)
    by_split = {s: {d["project"] for d in docs if d["split"] == s} for s in ("train", "heldout")}
    assert by_split == {"train": {"alpha", "beta"}, "heldout": {"gamma"}}
    train_texts = {d["text"] for d in docs if d["split"] == "train"}
    assert not train_texts & {d["text"] for d in docs if d["split"] == "heldout"}
    # the copy in both sides is kept once, on the training side
    assert [d["split"] for d in docs if d["path"] == "shared/common.py"] == ["train"]
    assert {d["path"] for d in docs if d["project"] == "alpha"} == {
        "alpha/core.py", "alpha/util.py", "docs/index.rst", "docs/notes.txt", "shared/common.py"}
    assert counts["heldout"]["gamma"]["doc"]["documents"] == 2
    # deterministic bytes
    again = tmp_path / "again.jsonl.xz"
    corpus.build(again, pins, cache, download=False)
    assert again.read_bytes() == out.read_bytes()


def test_corpus_stops_on_a_bad_archive_or_pins(tmp_path):
    pins, cache = make_pins(tmp_path, {"alpha": ("train", project_files("alpha")),
                                       "gamma": ("heldout", project_files("gamma"))})
    bad = corpus.Pin(pins[0].name, "1.0", pins[0].filename, "0" * 64, "MIT", "train")
    with pytest.raises(ValueError, match=r"alpha-1.0.tar.gz has sha256 .* the pin records 0000"):
        corpus.fetch(bad, cache, download=False)
    with pytest.raises(ValueError, match="missing"):
        corpus.fetch(corpus.Pin("nope", "1", "nope-1.tar.gz", "0" * 64, "MIT", "train"), cache, download=False)
    with pytest.raises(ValueError, match="pinned twice"):
        corpus.check_pins((pins[0], corpus.Pin("ALPHA", "2.0", "a", "0", "MIT", "heldout")))
    with pytest.raises(ValueError, match="at least one train and one held-out"):
        corpus.check_pins(pins[:1])
    with pytest.raises(ValueError, match="corpus .* is missing"):
        corpus.read_corpus(tmp_path / "none.jsonl.xz")


def test_shipped_pins_hold_two_whole_projects_out():
    corpus.check_pins(corpus.PINS)
    held = {p.name for p in corpus.PINS if p.split == "heldout"}
    assert held == {"networkx", "flask"}
    assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 for p in corpus.PINS)


def test_kind_of():
    assert corpus.kind_of("pkg-1.0/pkg/mod.py") == "code"
    assert corpus.kind_of("pkg-1.0/docs/guide/intro.rst") == "doc"
    assert corpus.kind_of("pkg-1.0/doc/notes.txt") == "doc"
    assert corpus.kind_of("pkg-1.0/README.rst") is None
    assert corpus.kind_of("pkg-1.0/requirements.txt") is None
    assert corpus.kind_of("pkg-1.0/pkg/migrations/0001.py") is None
    assert corpus.kind_of("pkg-1.0/.github/x.py") is None


def test_functions_give_stub_and_whole_source():
    fns = {f["name"]: f for f in framing.functions(CODE)}
    assert set(fns) == {"area", "volume"}
    assert fns["area"]["stub"] == ('def area(width, height):\n    """Return the area of a rectangle of the given width '
                                   'and height.\n\n    Both sides must be positive.\n    """')
    assert fns["area"]["source"].endswith("    return width * height")
    assert fns["volume"]["source"].startswith("def volume(self, depth):")  # dedented method
    assert fns["area"]["summary"] == "Return the area of a rectangle of the given width and height."
    assert framing.functions("def broken(:\n") == []


def test_sections_and_cut():
    secs = framing.sections(DOC)
    assert [s["title"] for s in secs] == ["Installing the package", "Configuring it"]
    assert secs[0]["text"].startswith("Install it with pip") and "Configuring" not in secs[0]["text"]
    text = "a" * 50 + "\n\n" + "b" * 50 + "\n" + "c" * 50
    assert framing.cut(text, 120) == "a" * 50  # a paragraph end first
    lines = "a" * 50 + "\n" + "b" * 50 + "\n" + "c" * 50
    assert framing.cut(lines, 120) == "a" * 50 + "\n" + "b" * 50  # else a line end
    assert framing.cut(text, 500) == text


def _docs(split: str, project: str) -> list[dict]:
    # each module's functions its own (their own argument names): training turns are not repeated across
    # documents, as in a real corpus, so draws past the training ones give new conversations
    return [{"project": project, "kind": "code", "split": split, "path": f"{project}/m{i}.py",
             "text": CODE.replace("A module.", f"Module {i}.").replace("width", f"width{i}") + "\n" * 3 + "\n".join(f"X{j} = {j}" for j in range(20)) + "\n"}
            for i in range(6)] + [{"project": project, "kind": "doc", "split": split, "path": f"docs/d{i}.rst",
                                   "text": DOC.replace("package", f"package {i}")} for i in range(6)]


def test_frame_writes_sets_the_evaluator_reads_from_held_out_projects_only(tmp_path):
    docs = _docs("train", "alpha") + _docs("heldout", "gamma")
    counts = framing.frame(docs, tmp_path, train_count=12, bench_count=5, seed=0)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert counts["train"] == len(train) == 12
    assert {c["project"] for c in train} == {"alpha"}
    assert sum(counts["train_kinds"].values()) == 12 and counts["train_kinds"]["instruct"] > 0
    # a small corpus gives fewer conversations, never repeats
    many = framing.conversations([d for d in docs if d["split"] == "train"], 1000, seed=0)
    assert 12 < len(many) < 1000 and len({json.dumps(c["messages"]) for c in many}) == len(many)
    assert {c["kind"] for c in many} == {"instruct", "complete", "docqa", "continue", "multiturn"}
    for c in train:
        roles = [m["role"] for m in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) in (2, 4)
    for name in ("humaneval", "mbpp", "mt_bench"):
        convs = load_conversations(name, str(tmp_path / "bench"), None)
        assert len(convs) == 5
        rows = [json.loads(line) for line in (tmp_path / "bench" / f"{name}.jsonl").read_text().splitlines()]
        assert all(r.get("project", "gamma") == "gamma" for r in rows)
    # the completion set, once the evaluator wraps it, asks exactly what training's completions ask
    wrapped = load_conversations("humaneval", str(tmp_path / "bench"), 1)[0][0]
    assert framing.kind_of_prompt({"content": wrapped}) == "complete"
    assert "def " in wrapped and '"""' in wrapped
    assert all(len(t) == 2 for t in load_conversations("mt_bench", str(tmp_path / "bench"), None))
    held = [json.loads(line) for line in (tmp_path / "bench" / "heldout.jsonl").read_text().splitlines()]
    assert {h["project"] for h in held} == {"gamma"} and all(h["kind"] == "docqa" for h in held)
    assert all(any(t in h["messages"][0]["content"] for t in ("Installing the package", "Configuring it")) for h in held)
    with pytest.raises(ValueError, match="both splits"):
        framing.frame(_docs("train", "alpha"), tmp_path / "x", train_count=4, bench_count=2, seed=0)


# sha256 of train.jsonl as framing wrote it before the in-domain set existed (same documents and arguments):
# the GPU side's target fine-tuning and regeneration read this file, so adding a set must not move it
TRAIN_SHA256_BEFORE_INDOMAIN = "32df7ec4e8399b418aec6e2ebfe79bede72f30d8d45b63a90dfbfc0584e83726"


def test_frame_writes_an_in_domain_set_and_leaves_train_as_it_was(tmp_path):
    docs = _docs("train", "alpha") + _docs("heldout", "gamma")
    counts = framing.frame(docs, tmp_path, train_count=12, bench_count=5, seed=0)
    data = (tmp_path / "train.jsonl").read_bytes()
    assert hashlib.sha256(data).hexdigest() == TRAIN_SHA256_BEFORE_INDOMAIN
    # ... which is the draw of train_count conversations alone
    alone = framing.conversations([d for d in docs if d["split"] == "train"], 12, seed=0)
    framing.write_jsonl(tmp_path / "alone.jsonl", alone)
    assert (tmp_path / "alone.jsonl").read_bytes() == data
    train = [json.loads(line) for line in data.decode().splitlines()]
    indomain = [json.loads(line) for line in (tmp_path / "indomain.jsonl").read_text().splitlines()]
    assert counts["indomain"] == len(indomain) and 1 <= len(indomain) <= 5
    assert counts["indomain_kinds"] == {k: sum(c["kind"] == k for c in indomain) for k in counts["train_kinds"]}
    # the record form of heldout.jsonl, from the training projects, no turn of them a training turn
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert {frozenset(c) for c in indomain + held} == {frozenset({"messages", "kind", "project"})}
    assert {c["project"] for c in indomain} == {"alpha"}
    trained = {m["content"] for c in train for m in c["messages"]}
    assert not any(m["content"] in trained for c in indomain for m in c["messages"])
    assert all(c["messages"][-1]["role"] == "assistant" for c in indomain)
    # they are the draw's next conversations, those repeating a training turn passed over (this small
    # corpus's documentation repeats sections, so some do)
    later = framing.conversations([d for d in docs if d["split"] == "train"], 22, seed=0)[12:]
    fresh = [c for c in later if not any(m["content"] in trained for m in c["messages"])]
    assert indomain == fresh[:5] and len(fresh) < len(later)
    # the evaluator reads it as prompts (the trailing answer dropped)
    from dflash_ds.eval.cli import read_prompts

    class Tok:
        def apply_chat_template(self, messages, **_):
            assert messages[-1]["role"] == "user"
            return [len(m["content"]) for m in messages]

    assert len(read_prompts(str(tmp_path / "indomain.jsonl"), Tok())) == len(indomain)
    # every training conversation the documents give is asked for: nothing is left for the in-domain set
    with pytest.raises(ValueError, match="gave 27 conversations and none past --train-count 27 .* lower --train-count"):
        framing.frame(docs, tmp_path / "all", train_count=27, bench_count=5, seed=0)


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    words = ["def", "return", "class", "self", "value", "import", "None", "the", "module", "width", "area"]
    texts = [" ".join(rng.choice(words) for _ in range(40)) + "\n    return x\n" for _ in range(200)]
    return tokenizer.train_tokenizer(texts, 400)


def test_tokenizer_markup_mask_and_eos(tok):
    assert tok.convert_tokens_to_ids(tokenizer.MASK) == tokenizer.MASK_ID == 5
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert len(tokenizer.MARKUP) + 256 < len(tok) <= 400  # merges up to the size (this text runs out first)
    ids = tok("<|im_start|>user\nhi<|mask|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 5  # markup strings are single tokens
    assert tok.decode(tok("def area(self):\n    return x", add_special_tokens=False)["input_ids"]) == \
        "def area(self):\n    return x"


def test_tokenizer_is_deterministic(tok):
    rng = random.Random(0)
    words = ["def", "return", "class", "self", "value", "import", "None", "the", "module", "width", "area"]
    texts = [" ".join(rng.choice(words) for _ in range(40)) + "\n    return x\n" for _ in range(200)]
    again = tokenizer.train_tokenizer(texts, 400)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_chat_template_is_qwen3_style_and_masks_the_answers(tok, tmp_path):
    from dflash_ds.data.chat import ChatEncoder

    msgs = [{"role": "user", "content": "area?"}, {"role": "assistant", "content": "return x"}]
    off = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "<|im_start|>user\narea?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert on == "<|im_start|>user\narea?<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.save(tok, tmp_path / "tok")
    loaded = tokenizer.load(tmp_path / "tok")
    two = msgs + [{"role": "user", "content": "self?"}, {"role": "assistant", "content": "the value"}]
    enc = ChatEncoder(loaded, thinking=False).encode(two)
    supervised = [loaded.decode([i for i, m in zip(enc.input_ids[a:b], enc.loss_mask[a:b]) if m])
                  for a, b in enc.turn_spans]
    assert supervised == ["return x<|im_end|>", "the value<|im_end|>"]
    assert sum(enc.loss_mask) == sum(b - a for a, b in enc.turn_spans)


def test_pack_and_lr_schedule():
    rows, flags = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, masks=[[0, 1, 1], [1, 0], [1, 1, 1, 0]])
    assert rows.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and flags.tolist() == [[0, 1, 1, 1], [0, 1, 1, 1]]
    rows, flags = pack([[1, 2, 3], [4, 5]], 2)
    assert rows.tolist() == [[1, 2], [3, 4]] and flags.tolist() == [[1, 1], [1, 1]]
    clock = Clock(Phase(seconds=60, steps=100, lr=1.0, rows=2, warmup=0.1), rows=50)
    assert clock.total == 100 and clock.lr(0) == pytest.approx(0.1) and clock.lr(9) == pytest.approx(1.0)
    assert clock.lr(10) == pytest.approx(1.0) and clock.lr(100) == pytest.approx(0.1)
    assert clock.lr(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))


def _row(bench, sampling, tau, se, pos=(0.5,)):
    return {"bench": bench, "sampling": sampling, "tau_mean": tau, "tau_mean_se": se, "position_acceptance": list(pos)}


def test_table_differences_and_files(tmp_path):
    runs = {"v1": [_row("heldout", "greedy", 2.0, 0.1), _row("mbpp", "greedy", 1.5, 0.05)],
            "v1-seed1": [_row("heldout", "greedy", 2.1, 0.1), _row("mbpp", "greedy", 1.52, 0.05)],
            "dflash2": [_row("heldout", "greedy", 2.5, 0.1), _row("mbpp", "greedy", 1.6, 0.05)]}
    for name, rows in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"name": name, "architecture": name.split("-")[0], "block_size": 16, "seed": 0, "benchmarks": rows,
             "final": {"step": 10, "loss": 1.0}, "llama_cpp": llama_cpp_summary(
                 {"spec_draft_n_max": 15, "llama_server": {"mean_accept_length": 2.0, "rounds": [[1, 3], [2]]},
                  "llama_speculative_simple": {"mean_accept_length": 1.5, "rounds": [[0, 1]]}})}))
    (tmp_path / "target.json").write_text("{}")  # other JSON files are not runs
    md, js = table.write(tmp_path, tmp_path / "out")
    t = json.loads(js.read_text())
    d = {(x["run"], x["bench"]): x for x in t["differences"]}
    assert d["dflash2", "heldout"]["delta"] == pytest.approx(0.5)
    assert d["dflash2", "heldout"]["se"] == pytest.approx(math.sqrt(0.02))
    assert d["dflash2", "heldout"]["significant"] is True  # 3.5 se
    assert d["dflash2", "mbpp"]["significant"] is False  # 0.1 / 0.0707 = 1.4 se
    assert d["v1-seed1", "heldout"]["significant"] is False
    text = md.read_text()
    assert "| prose (held-out docs) | greedy | 2.000 ± 0.100 | 2.100 ± 0.100 | 2.500 ± 0.100 |" in text
    assert "| dflash2 | 15 | 2.000 | 1.500 | 3.000 | 1.500 | 0.000 | 1.000 |" in text  # server: first 1, 2; later 3
    with pytest.raises(ValueError, match="no run summaries"):
        table.load_summaries(tmp_path / "out" / "none")


def test_summary_takes_the_rows_of_a_cut_benchmark_table_and_says_so(tmp_path):
    from dflash_ds.eval.table_progress import save_partial
    from lab.runs import summarize

    with pytest.raises(ValueError, match="no metrics.jsonl"):
        summarize(tmp_path, "v1")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.5, "time": 1.0}) + "\n")
    none = summarize(tmp_path, "v1")
    assert none["benchmarks"] == [] and none["benchmarks_complete"] is False
    done = [_row("heldout", "greedy", 2.0, 0.1)]
    save_partial(tmp_path, {"seed": 0}, done)
    cut = summarize(tmp_path, "v1")
    assert cut["benchmarks"] == done and cut["benchmarks_complete"] is False and cut["final"]["loss"] == 1.5
    whole = done + [_row("heldout", "T=1", 1.8, 0.1)]
    (tmp_path / "benchmarks.json").write_text(json.dumps(whole))
    full = summarize(tmp_path, "v1")
    assert full["benchmarks"] == whole and full["benchmarks_complete"] is True


@pytest.mark.parametrize("lab, shipped", [("v1", "qwen27b"), ("dflash2", "qwen27b-dflash2"), ("dspark", "qwen27b-dspark")])
def test_lab_recipes_are_the_shipped_ones_scaled(lab, shipped):
    from pathlib import Path

    from dflash_ds.config import load_recipe

    root = Path(__file__).resolve().parents[1] / "recipes"
    a, b = load_recipe(root / "lab" / f"{lab}.yaml"), load_recipe(root / f"{shipped}.yaml")
    same = ("num_layers", "block_size", "architecture", "layer_types", "is_causal", "sections")  # sections: the
    assert {k: getattr(a.drafter, k) for k in same} == {k: getattr(b.drafter, k) for k in same}  # architecture's own
    from dataclasses import replace

    assert replace(a.objective, num_anchors=0) == replace(b.objective, num_anchors=0)  # loss terms, weights
    assert a.objective.num_anchors / a.data.row_length == pytest.approx(512 / 3072, rel=1e-3)  # anchors per token
    assert b.objective.num_anchors / b.data.row_length == pytest.approx(512 / 3072, rel=1e-3)
    # the optimiser's, at the lab's rows a step (the rate by the square root of the rows), held until the
    # held-out plateau ends the run (wsd, its cooldown: runtime/stopping.py)
    assert a.optim.lr == pytest.approx(b.optim.lr * math.sqrt(a.optim.rows_per_micro_batch), rel=0.01)
    assert a.optim.weight_decay == b.optim.weight_decay and a.optim.schedule == "wsd"
    assert a.eval.plateau_evals and a.eval.every_steps and a.eval.train_probe
    # four conversations per row as the flagship, the window scaled with the conversation length
    assert a.data.row_length // a.data.max_length == b.data.row_length // b.data.max_length == 4
    if b.drafter.sliding_window:
        assert a.drafter.sliding_window == b.drafter.sliding_window * a.data.max_length // b.data.max_length
    assert a.drafter.mask_token_id == tokenizer.MASK_ID
    assert a.topology.colocated and a.data.regenerate.enabled and a.data.thinking == b.data.thinking
    assert set(a.eval.benchmarks) == {"heldout", "humaneval", "mbpp", "mt_bench"}


def test_run_catalog_names_recipes_overrides_and_baselines(capsys):
    from dataclasses import replace
    from pathlib import Path

    from dflash_ds.config import load_recipe
    from lab import catalog
    from lab.__main__ import main
    from lab.target import SHAPES
    from dflash_ds.objective.blocks import default_gamma

    root = Path(__file__).resolve().parents[1]
    assert {"v1", "v1-seed1", "dflash2", "dspark", "v1-noanchor", "dspark-b7", "v1-fp8", "v1-kl",
            "dspark-sizing", "lilicorr"} <= set(catalog.RUNS)
    recipes = {}
    for name, r in catalog.RUNS.items():
        lines = catalog.settings_lines(name)
        assert lines[0] == r.recipe and all(" " not in o and "=" in o for o in lines[1:])
        recipes[name] = load_recipe(root / r.recipe, lines[1:])  # every key exists and every value is valid
        assert r.baseline is None or (r.baseline in catalog.RUNS and r.question)
        assert all(b in catalog.RUNS and b != name and q for b, q in r.also)
    base = {n: load_recipe(root / catalog.RUNS[n].recipe) for n in ("v1", "dspark")}
    assert recipes["v1"] == load_recipe(root / "recipes/lab/v1.yaml", ["run.seed=0"])
    assert recipes["v1-seed1"].run.seed == 1 and recipes["v1"].run.seed == 0
    assert base["v1"].objective.anchor_last_prompt_token and not recipes["v1-noanchor"].objective.anchor_last_prompt_token
    # the same decision on DFlash2: its recipe with the anchor off, read against DFlash2 round by round
    d2 = catalog.RUNS["dflash2-noanchor"]
    assert d2.recipe == catalog.RUNS["dflash2"].recipe and d2.baseline == "dflash2" and d2.rounds
    assert recipes["dflash2"].objective.anchor_last_prompt_token and not recipes["dflash2-noanchor"].objective.anchor_last_prompt_token
    assert recipes["dflash2-noanchor"].drafter == recipes["dflash2"].drafter
    # LiLiCorr on v1's backbone (block, layers, anchors), the reranker at Model-Optimizer's shape
    lili, v1 = recipes["lilicorr"], recipes["v1"]
    assert lili.drafter.architecture == "lilicorr" and lili.drafter.block_size == v1.drafter.block_size
    assert lili.drafter.layer_types == v1.drafter.layer_types and lili.objective.num_anchors == v1.objective.num_anchors
    assert catalog.RUNS["lilicorr"].also == (("dflash2", "LiLiCorr against DFlash2"),)
    # LiLiCorr on v1's trained backbone: the same recipe, started from v1's export under the lab's folder
    assert catalog.RUNS["lilicorr-v1"].starts_from == "v1" and catalog.RUNS["lilicorr-v1"].recipe == catalog.RUNS["lilicorr"].recipe
    assert recipes["lilicorr-v1"].drafter.init_from == "runs/lab/runs/v1/export"
    assert catalog.settings_lines("lilicorr-v1", "/x/lab")[-1] == "drafter.init_from=/x/lab/runs/v1/export"
    assert all(r.starts_from in (None, *catalog.RUNS) for r in catalog.RUNS.values())
    assert [n for n, r in catalog.RUNS.items() if r.starts_from] == ["lilicorr-v1"]
    assert all(recipes[n].drafter.init_from is None for n in catalog.RUNS if n != "lilicorr-v1")
    full = recipes["v1-full"].drafter
    assert full.layer_types is None and full.sliding_window is None and full.block_size == v1.drafter.block_size
    # the blocks swapped between v1 and DFlash2: each the other's block, nothing else changed, and each read
    # against the other architecture at the same block as well as against its own recipe
    d2 = recipes["dflash2"]
    for name, own, other in (("v1-b8", v1, d2), ("dflash2-b16", d2, v1)):
        swapped = recipes[name]
        assert swapped.drafter.block_size == other.drafter.block_size != own.drafter.block_size
        assert swapped.drafter.architecture == own.drafter.architecture and swapped.objective == own.objective
        assert replace(swapped.drafter, block_size=own.drafter.block_size) == own.drafter
        r = catalog.RUNS[name]
        assert r.per_flop and r.also[0][0] == ("dflash2" if name == "v1-b8" else "v1")
    b7 = recipes["dspark-b7"]
    assert b7.drafter.block_size == 7 and b7.objective.gamma is None and default_gamma(7 + 1) == 4  # DeepSpec's
    assert b7.objective.num_anchors == base["dspark"].objective.num_anchors
    assert recipes["v1-fp8"].drafter.fp8.layers == "rowwise" and recipes["v1-fp8"].drafter.fp8.lm_head
    assert recipes["v1-kl"].objective.kl_weight > 0 and base["v1"].objective.kl_weight == 0
    shape, sz = SHAPES["lab"], recipes["dspark-sizing"].drafter
    assert (sz.num_attention_heads, sz.num_key_value_heads, sz.head_dim) == (shape.heads, shape.kv_heads, shape.head_dim)
    assert sz.num_layers == 6 and sz.intermediate_size == 3 * shape.hidden and sz.layer_types is None  # all full
    taps = list(sz.target_layer_ids)
    assert len(taps) == 8 == len(set(taps)) and taps == sorted(taps) and taps[0] == 1 and taps[-1] < shape.layers - 1
    assert recipes["dspark-sizing"].optim.min_lr_ratio == 1.0  # cosine to a floor of lr: constant after warmup
    assert recipes["dspark-sizing"].drafter.block_size == base["dspark"].drafter.block_size
    # unknown names: one line listing the runs there are
    with pytest.raises(ValueError, match=r"unknown lab run 'v2'; one of: v1, v1-seed1, dflash2"):
        catalog.run("v2")
    assert main(["run-settings", "v2"]) == 2
    assert "one of: v1," in capsys.readouterr().err
    assert main(["run-settings", "v1-kl"]) == 0
    assert capsys.readouterr().out.splitlines() == catalog.settings_lines("v1-kl")
    assert main(["run-after", "lilicorr-v1"]) == 0 and capsys.readouterr().out == "v1\n"
    assert main(["run-after", "lilicorr"]) == 0 and capsys.readouterr().out == "\n"
    assert main(["run-after", "v1", "lilicorr-v1", "dflash2"]) == 0 and capsys.readouterr().out == "\nv1\n\n"
    assert main(["run-after", "v2"]) == 2


def test_launch_port_from_the_environment(monkeypatch, capsys):
    from dflash_ds.guard import launch

    monkeypatch.setenv("DFLASH_REQUESTED_PORT", "")
    assert launch.requested_port() == ""
    monkeypatch.setenv("DFLASH_REQUESTED_PORT", "29731")
    assert launch.requested_port() == "29731"
    for bad in ("80", "abc", "70000"):
        monkeypatch.setenv("DFLASH_REQUESTED_PORT", bad)
        with pytest.raises(ValueError, match=f"DFLASH_PORT={bad} is not a port"):
            launch.requested_port()
        assert launch.main(["recipes/tiny.yaml"]) == 0  # shell text that stops launch.sh, before anything else
        assert capsys.readouterr().out.strip() == launch._fail(f"DFLASH_PORT={bad} is not a port: set a number in "
                                                               "1024-65535, or unset it for a free one")
