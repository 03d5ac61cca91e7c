"""The quality lab end to end at toy size on CPU, through scripts/quality_lab.sh and the real launcher:
a corpus of three local sdists made of this project's own code and documentation (the download is
replaced by archives already in the cache, checked against their pins' sha256), the tokenizer, the
conversations and benchmark sets, a tiny target trained for seconds and its regeneration, one v1
drafter trained for a few steps with its benchmark table and llama.cpp's count, three runs swept at once
(LiLiCorr's, colocated with the target's final-norm states, started from v1's export once v1 has trained), the lab's table, and the whole lab as one command (`all`: the runs trained, then evaluated in one process)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import sys

import pytest

from lab import corpus, tokenizer

from .launch_util import ROOT, cpu_env, output, run

pytestmark = pytest.mark.launcher

CPU = ["run.device=cpu", "target.dtype=float32", "target.ds_config=ds_configs/target_replica_cpu.json",
       "drafter.ds_config=ds_configs/drafter_zero2_cpu.json", "drafter.num_layers=2", "drafter.layer_types=null",
       "drafter.sliding_window=null", "data.max_samples=16", "data.num_eval=2", "data.max_length=512",
       "data.row_length=1024", "data.max_drop_fraction=0.5", "data.regenerate.max_new_tokens=24", "objective.num_anchors=32",
       "objective.loss_chunks=2", "optim.max_steps=4", "eval.bench_limit=2", "eval.max_new_tokens=12",
       "log.every_steps=1", "log.progress=false"]


def rst(markdown: str) -> str:
    """This project's markdown docs with their headings in reStructuredText form."""
    return re.sub(r"^#+ (.+)$", lambda m: m.group(1) + "\n" + "-" * len(m.group(1)), markdown, flags=re.M)


def sdists(cache):
    groups = {"alpha": ("train", ["dflash_ds/data", "dflash_ds/eval"], "docs/architecture.md"),
              "beta": ("train", ["dflash_ds/network", "dflash_ds/resolve"], "docs/performance.md"),
              "gamma": ("heldout", ["dflash_ds/runtime", "dflash_ds/target_model"], "docs/algorithm.md")}
    pins = []
    for name, (split, folders, doc) in groups.items():
        files = {str(p.relative_to(ROOT)): p.read_text() for f in folders for p in sorted((ROOT / f).glob("*.py"))}
        files[f"docs/{name}.rst"] = rst((ROOT / doc).read_text())
        data = corpus.sdist_bytes(files, f"{name}-0.1")
        (cache / f"{name}-0.1.tar.gz").write_bytes(data)
        pins.append(corpus.Pin(name, "0.1", f"{name}-0.1.tar.gz", hashlib.sha256(data).hexdigest(), "MIT", split))
    return tuple(pins)


def step(env, out, *args, timeout=300):
    proc = run(["bash", "scripts/quality_lab.sh", str(out), *args], timeout, env)
    assert proc.returncode == 0, output(proc)[-6000:]
    return output(proc)


def test_lab_pipeline_on_cpu(tmp_path):
    lab, out, cache = tmp_path / "lab", tmp_path / "out", tmp_path / "cache"
    cache.mkdir()
    counts = corpus.build(lab / "corpus.jsonl.xz", sdists(cache), cache, download=False)
    assert set(counts) == {"train", "heldout"} and set(counts["heldout"]) == {"gamma"}
    docs = corpus.read_corpus(lab / "corpus.jsonl.xz")
    tokenizer.save(tokenizer.train_tokenizer(tokenizer.tokenizer_texts(docs, 2e6), 1024), lab / "tokenizer")
    env = cpu_env(LAB_DIR=lab, DFLASH_PYTHON=sys.executable, LAB_OVERRIDES=" ".join(CPU), LAB_REGEN_SECONDS=60,
                  LAB_FRAME_ARGS="--train-count 120 --bench-count 6",
                  LAB_TARGET_ARGS="--shape tiny --seq-len 256 --rows 8 --lr 3e-3 --seconds 8 --sft-seconds 4 --no-compile")

    step(env, out, "target")
    target = json.loads((out / "target.json").read_text())
    assert target["pretrain"]["steps"] > 3 and target["sft"]["steps"] > 3
    # The curve starts at the first step (near ln 1024 = 6.93 for the fresh model); one batch's loss is noisy,
    # but a few dozen steps at lr 3e-3 take it well below that however soon the clock stops the phase.
    first_step, first_loss = target["pretrain"]["losses"][0]
    assert first_step == 1 and target["pretrain"]["final_loss"] < first_loss - 0.3, target["pretrain"]
    assert math.isfinite(target["heldout_document_loss"])
    assert (lab / "target" / "model.safetensors").is_file() and (lab / "target" / "tokenizer.json").is_file()
    regen = json.loads((out / "regenerate.json").read_text())
    assert regen["complete"] is True and regen["shards_written"] == 1
    # data.regenerate.keep_unfinished (the lab recipes): an answer cut at 24 tokens keeps its conversation
    assert regen["samples_out"] == 16
    for name in ("humaneval", "mbpp", "mt_bench", "heldout"):
        assert (lab / "conversations" / "bench" / f"{name}.jsonl").is_file()

    # A tiny target trained for seconds rarely ends an answer within 24 tokens, so the drafter trains on
    # the framed answers here; the GPU lab trains on the regenerated ones (the recipes' setting).
    log = step(env, out, "train", "v1", "data.regenerate.enabled=false")
    assert "tau after training" in log
    summary = json.loads((out / "v1.json").read_text())
    assert summary["architecture"] == "dflash" and summary["block_size"] == 16 and summary["seed"] == 0
    assert summary["final"]["step"] == 4 and math.isfinite(summary["final"]["loss"])
    rows = {(r["bench"], r["sampling"]) for r in summary["benchmarks"]}
    assert {b for b, _ in rows} == {"heldout", "humaneval", "mbpp", "mt_bench"} and len(rows) == 8
    assert summary["llama_cpp"]["spec_draft_n_max"] == 15
    greedy = summary["heldout_greedy"]
    assert summary["llama_cpp"]["llama_server"]["responses"] == greedy["num_responses"] >= 1
    assert greedy["tau_mean"] >= 1.0
    # the same evaluation on the in-domain set (training projects' conversations that training did not use)
    indomain = [json.loads(x) for x in (lab / "conversations" / "indomain.jsonl").read_text().splitlines()]
    assert indomain and {c["project"] for c in indomain} <= {"alpha", "beta"}
    inside = summary["indomain_greedy"]
    assert inside["tau_mean"] >= 1.0 and inside["responses"] == min(2, len(indomain))
    assert len(inside["position_acceptance"]) == 15 and inside["tau_pooled"] >= 1.0
    assert summary["llama_cpp_indomain"]["llama_server"]["responses"] == inside["responses"]
    assert summary["wall_s"] > 0 and summary["train_s"] > 0

    # Three runs swept on the regenerated answers (cut ones included), each with its own port and log,
    # staggered: training only, two steps each. LiLiCorr from v1's export waits for v1, which is trained
    # afresh here (the trained one set aside); a run from an export not trained and not swept stops first.
    sweep_env = dict(env, LAB_STEPS="2", LAB_SWEEP_STAGGER="1")
    (lab / "runs" / "v1").rename(tmp_path / "v1-trained")
    proc = run(["bash", "scripts/quality_lab.sh", str(out), "sweep", "train", "lilicorr-v1", "v1-noanchor"], 60, sweep_env)
    assert proc.returncode == 2 and "lilicorr-v1 starts from v1's export, which is not trained" in output(proc)
    assert "started" not in output(proc)
    log = step(sweep_env, out, "sweep", "train", "lilicorr-v1", "v1", "v1-noanchor", timeout=900)
    ports = set()
    for name in ("lilicorr-v1", "v1", "v1-noanchor"):
        assert f"[lab] sweep: {name} done (train)" in log
        records = [json.loads(x) for x in (lab / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert max(r.get("step", 0) for r in records if "loss" in r) == 2
        assert (lab / "runs" / name / ".lab_trained").is_file()
        ports |= set(re.findall(r"port (\d+), log " + re.escape(str(out / name)), log))
    assert len(ports) == 3 and not (out / "lilicorr-v1.json").exists()
    # started only after v1 finished, from its export (v1's step-2 export, not the one set aside)
    assert log.index("sweep: lilicorr-v1 started") > log.index("sweep: v1-noanchor started") and "from v1's export" in log
    started = (lab / "runs" / "lilicorr-v1" / "recipe.yaml").stat().st_mtime  # written as the run starts
    assert (lab / "runs" / "v1" / ".lab_trained").stat().st_mtime <= started
    resolved = (lab / "runs" / "lilicorr-v1" / "recipe.yaml").read_text()
    assert "architecture: lilicorr" in resolved and f"init_from: {lab}/runs/v1/export" in resolved
    assert "anchor_last_prompt_token: false" in (lab / "runs" / "v1-noanchor" / "recipe.yaml").read_text()
    # trained runs are not started again (no launch, no stagger)
    log = step(sweep_env, out, "sweep", "train", "lilicorr-v1", "v1-noanchor")
    assert "lilicorr-v1 done (train; trained before)" in log and "v1-noanchor done (train; trained before)" in log
    assert "started" not in log
    # The box stops a run still starting (no step yet): resumable (75), not failed, and untrained.
    proc = run(["bash", "scripts/quality_lab.sh", str(out), "sweep", "train", "v1-seed1"], 120,
               dict(sweep_env, LAB_SWEEP_SECONDS="2", LAB_STOP_GRACE="0"))
    assert proc.returncode == 75 and "v1-seed1 stopped (it resumes" in output(proc), output(proc)[-3000:]
    assert not (lab / "runs" / "v1-seed1" / ".lab_trained").exists()
    shutil.rmtree(lab / "runs" / "v1")
    (tmp_path / "v1-trained").rename(lab / "runs" / "v1")
    # A run that fails is named, and the sweep's status says so; an unknown name stops before any start.
    # (A setting the script cannot use, LAB_STEPS=zero, stops the sweep before any start, lab/settings.py:
    # these runs fail on a target that is not there, which only their launch finds.)
    proc = run(["bash", "scripts/quality_lab.sh", str(out), "sweep", "train", "v1-kl", "v1-fp8"], 300,
               dict(sweep_env, LAB_OVERRIDES=f"{sweep_env['LAB_OVERRIDES']} target.path={tmp_path}/no-target"))
    assert proc.returncode == 1, output(proc)[-3000:]
    assert "failed: v1-kl v1-fp8" in output(proc)
    proc = run(["bash", "scripts/quality_lab.sh", str(out), "sweep", "train", "v1", "v9"], 60, sweep_env)
    assert proc.returncode == 2 and "unknown lab run 'v9'; one of: v1, v1-seed1" in output(proc)
    assert "started" not in output(proc)

    step(env, out, "table")
    md = (out / "quality_lab.md").read_text()
    assert "| v1 | dflash | 16 | 0 | 4 |" in md and "| code completion | greedy |" in md
    table = json.loads((out / "quality_lab_table.json").read_text())
    assert list(table["runs"]) == ["v1"] and table["differences"] == []

    # The whole lab as one command: the target and its regeneration are found done, the named run is
    # trained and evaluated, and the table is drawn again with it. Conversations framed before the
    # in-domain set (an older archive) have no indomain.jsonl: that evaluation is skipped, saying so.
    # It evaluates along training and ends at its plateau (plateau_delta so large that no evaluation is a
    # rise: the second one, at step 2 of 4, with no cooldown at two steps), its curve in the table.
    (lab / "conversations" / "indomain.jsonl").rename(tmp_path / "indomain.jsonl")
    plateau = " ".join(CPU + ["eval.every_steps=1", "eval.plateau_evals=1", "eval.plateau_delta=100", "eval.train_probe=4"])
    log = step(dict(env, LAB_STEPS="4", LAB_OVERRIDES=plateau), out, "all", "v1-kl", timeout=600)
    assert "[lab] sweep: v1-kl done (train)" in log and f"the table: {out}/quality_lab.md" in log
    assert "lab target" not in log and "regenerate:" not in log
    # each phase's start is logged with its time from the command's, in order (for logs of a lost machine)
    marks = re.findall(r"\[lab\] all: at (\d+) s: (the runs|the evaluation)", log)
    assert [m[1] for m in marks] == ["the runs", "the evaluation"] and int(marks[0][0]) <= int(marks[1][0]), marks
    # evaluated after the training, in the one evaluation process (lab/evaluate.py)
    assert "evaluate: v1-kl done" in log and json.loads((out / "evaluate.json").read_text())["evaluated"] == ["v1-kl"]
    assert "(conversations framed before the in-domain set); its evaluation is skipped" in (out / "evaluate.log").read_text()
    table = json.loads((out / "quality_lab_table.json").read_text())
    assert list(table["runs"]) == ["v1", "v1-kl"]
    kl = json.loads((out / "v1-kl.json").read_text())
    assert kl["final"]["step"] == 2 and kl["indomain_greedy"] is None and kl["heldout_greedy"]["tau_mean"] >= 1.0
    assert kl["benchmarks_complete"] is True and len(kl["benchmarks"]) == 8 and kl["eval_s"] > 0
    assert kl["early_end"]["early_end"] == "plateau" and kl["early_end"]["end_step"] == 2
    curve = [e for e in kl["tau_evals"] if e["eval"] == "periodic"]
    assert [e["step"] for e in curve] == [1, 2] and all(e["train_tau"] >= 1.0 for e in curve)
    assert "| v1-kl | plateau at 2, ended 2 |" in (out / "quality_lab.md").read_text()
    assert "| in-domain (training projects) | greedy |" in (out / "quality_lab.md").read_text()
