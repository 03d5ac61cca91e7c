"""Loss curves of the drafter's precision modes, trained from the same initialisation on the same data.

    python -m dflash_ds.bench --role quality --compile-layers --layers 8 --seq-len 1024 --steps 300 \
        --fp8-modes bf16,bf16@1,rowwise,rowwise+lm_head --out quality.json

The recipe's drafter (default recipes/qwen27b.yaml: the flagship's width and layers) learns from the
taps of a random-weight target of the geometry cut to --layers layers, colocated: the target fills
every micro-batch in this process (trainer.LocalSource) from the bundled conversations
(assets/tiny_chat.jsonl: arithmetic, counting, repetition), tokenized with the bundled tokenizer
(its ids are a prefix of the geometry's vocabulary) and packed into --seq-len rows by the project's
data preparation. The drafter reads the target's own embedding and lm_head. Each mode (fp8_modes.py)
trains --steps optimizer steps of DrafterTrainer.train_step with the recipe's optimiser and schedule
(warm-up and cosine decay over --steps), from the drafter initialised by --seed; MODE@SEED starts from
another seed, which also moves the anchors and the data order: two bf16 seeds give the run-to-run noise
the FP8 differences are read against. Per step: the loss sum(w * CE) / sum(w) and the acceptance
proxy. --out is rewritten every 25 steps, so a run cut short keeps its curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

from .setup import REPO, Setup, init_single_process, resolve_setup
from .timing import synchronize

DATA = REPO / "assets" / "tiny_chat.jsonl"
TOKENIZER = REPO / "assets" / "tiny-target"
SAVE_EVERY = 25


def quality_setup(setup: Setup) -> tuple[Setup, dict]:
    """The setup with the bundled conversations as its rows (prepared now) and --steps optimizer steps."""
    from dflash_ds.data.prepare import prepare
    from dflash_ds.data.sources import load_tokenizer

    a = setup.args
    data = [f"data.path={DATA}", f"data.eval_path={REPO / 'assets' / 'tiny_eval.jsonl'}", "data.split=train",
            "data.regenerate.enabled=false", "data.num_eval=4", "data.pack=true",
            # A cache of its own: two quality runs side by side would both write one.
            f"data.cache_dir={Path(tempfile.gettempdir()) / f'dflash_quality_data_{os.getpid()}'}", "optim.epochs=100000",
            f"optim.max_steps={a.steps}"]
    args = argparse.Namespace(**{**vars(a), "set": data + list(a.set or [])})
    setup = resolve_setup(args, setup.device)
    tokenizer = load_tokenizer(str(TOKENIZER))
    if len(tokenizer) > setup.drafter_config.vocab_size:
        raise ValueError(f"--role quality: the bundled tokenizer has {len(tokenizer)} tokens, more than the "
                         f"{setup.drafter_config.vocab_size} of {setup.geometry_name}; use a larger geometry")
    rows = prepare(setup.recipe.data, tokenizer, verbose=False).rows
    run = setup.run.with_rows(int(rows["input_ids"].shape[0]))
    return dataclasses.replace(setup, run=run), rows


def train_mode(setup: Setup, group, worker, matrices, *, out: dict) -> Iterator[None]:
    """One mode's --steps steps into `out` (its curves), yielding after every SAVE_EVERY steps (the
    caller writes what there is); its engine is freed at the end."""
    from dflash_ds.runtime.trainer import LocalSource

    from .fp8_modes import allocated_gib, free_memory
    from .roles import build_drafter, drafter_step

    model, engine, _ = build_drafter(setup, group, matrices, setup.args.seed)
    worker.spec = setup.run  # its run.seed orders the rows
    step = drafter_step(setup, engine, model, LocalSource(worker, 0, 0), group=group)
    pending = []
    t0 = time.perf_counter()
    for i in range(setup.args.steps):
        ce, weight, accept, anchors = step(i)
        pending.append(torch.stack([(ce / weight).float(), (accept / anchors).float()]))
        if (i + 1) % SAVE_EVERY == 0 or i + 1 == setup.args.steps:
            loss, acc = torch.stack(pending).T.tolist()
            out["loss"] += loss
            out["accept"] += acc
            pending = []
            out["steps_done"] = i + 1
            out["train_s"] = time.perf_counter() - t0
            out["save_s"].append(out["train_s"])  # the steady rate, apart from the first steps' compiles
            yield
    synchronize(setup.device)
    out["peak_gib"] = torch.cuda.max_memory_allocated(setup.device) / 2**30 if setup.device.type == "cuda" else 0.0
    engine.destroy()
    del model, step, engine
    free_memory()
    out["allocated_after_gib"] = allocated_gib(setup.device)  # what the next mode starts beside


def run_quality(setup: Setup, ceiling: dict) -> dict:
    from dflash_ds.runtime.target_worker import TargetWorker

    from .fp8_modes import allow_recompiles, parse_modes, with_mode
    from .target_side import build_target_model

    a = setup.args
    modes = parse_modes(a.fp8_modes or "bf16")  # checked against the machine by the CLI, before the ceiling
    setup, rows = quality_setup(setup)
    group = init_single_process(setup.device)
    allow_recompiles()
    target, _ = build_target_model(setup, True)
    worker = TargetWorker(setup.run, target, rows)
    matrices = (target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    result = {"rows": len(rows["input_ids"]), "seq_len": a.seq_len, "anchors": setup.run.settings.num_anchors,
              "steps": a.steps, "target_layers": setup.target_config.num_hidden_layers, "taps": setup.tap_ids,
              "lr": setup.recipe.optim.lr, "modes": {}}
    for mode in modes:
        s = with_mode(setup, mode)
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        entry = result["modes"][mode.name] = {"seed": s.args.seed, "layers": mode.layers, "lm_head": mode.lm_head,
                                              "loss": [], "accept": [], "steps_done": 0,
                                              "save_s": []}
        for _ in train_mode(s, group, worker, matrices, out=entry):
            if a.out:  # what has been trained so far survives a run cut short
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps({"role": "quality", "partial": True, "result": result}) + "\n")
    result["summary"] = summarize([result])
    return result


# ---------------------------------------------------------------------------- reading the curves


def _final(losses: list[float], n: int) -> float:
    """The mean loss over the last tenth of the first `n` steps (at least one step): one step's loss
    moves with its micro-batch."""
    tail = max(1, n // 10)
    return statistics.fmean(losses[n - tail:n])


def summarize(results: list[dict]) -> dict:
    """Final losses of every mode over the steps all of them reached, their differences from `bf16` (the
    first bf16 mode), and the run-to-run noise: the difference between the first two bf16 modes."""
    modes = {name: m for r in results for name, m in r["modes"].items() if m["steps_done"] > 0}
    if not modes:
        return {"steps": 0}
    n = min(m["steps_done"] for m in modes.values())
    final = {name: _final(m["loss"], n) for name, m in modes.items()}
    bf16 = [name for name, m in modes.items() if m["layers"] == "none" and not m["lm_head"]]
    out = {"steps": n, "tail_steps": max(1, n // 10), "final_loss": final,
           "final_accept": {name: _final(m["accept"], n) for name, m in modes.items()}}
    if bf16:
        base = final[bf16[0]]
        out["baseline"] = bf16[0]
        out["vs_baseline"] = {name: v - base for name, v in final.items()}
    if len(bf16) >= 2:
        noise = abs(final[bf16[1]] - final[bf16[0]])
        out["noise"] = noise
        out["vs_baseline_over_noise"] = {name: d / noise if noise else None for name, d in out["vs_baseline"].items()}
    w = max(1, n // 12)
    out["curve_steps"] = list(range(w, n + 1, w))
    out["curves"] = {name: [statistics.fmean(m["loss"][k - w:k]) for k in out["curve_steps"]]
                     for name, m in modes.items()}
    return out


def summary_text(s: dict) -> str:
    if not s.get("steps"):
        return "no mode trained a step"
    lines = [f"{s['steps']} steps each (final = mean over the last {s['tail_steps']})"]
    if "noise" in s:
        lines.append(f"run-to-run noise (|{s['baseline']} - second bf16 seed|): {s['noise']:.4f}")
    for name, loss in s["final_loss"].items():
        row = f"  {name:<22} final loss {loss:.4f}  acceptance proxy {s['final_accept'][name]:.3f}"
        if "vs_baseline" in s:
            row += f"  vs {s['baseline']} {s['vs_baseline'][name]:+.4f}"
        ratio = s.get("vs_baseline_over_noise", {}).get(name)
        if ratio is not None:
            row += f" ({ratio:+.2f} x noise)"
        lines.append(row)
    w = s["curve_steps"][0]
    lines.append(f"loss, mean over each {w} steps, up to step: " + "  ".join(f"{k:>5}" for k in s["curve_steps"]))
    for name, curve in s["curves"].items():
        lines.append(f"  {name:<22} " + "  ".join(f"{v:5.3f}" for v in curve))
    return "\n".join(lines)
