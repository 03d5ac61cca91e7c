"""The lab's GPU-side steps around the project's own tools: the target's regeneration of the training
conversations (the project's regeneration with a larger generate batch and a time box), and one
summary file per drafter run (what comes back from the GPU machine: the run's benchmark table, final
losses, the greedy tau and llama.cpp's counts on the held-out prose and on the in-domain set, wall time).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def regenerate(recipe_path: str, overrides: list[str], *, batch_size: int, seconds: float, log,
               slots: int | None = None) -> dict:
    """`python -m dflash_ds.regenerate RECIPE` over groups of `batch_size` conversations (as many shards
    at a time as hold them; their conversations share each turn's decoding), with the recipe's hf
    decoder (`data.regenerate.decoder`: the static decoder with `slots` rows by default; generate with
    that batch). A group starts only while the last one's time still fits in `seconds` (a group cut by
    the command's limit would lose all its shards); a rerun resumes at the next shard. Returns the
    summary, with `complete` saying whether every shard is written, and the decoder's rate."""
    from dflash_ds.config import load_recipe
    from dflash_ds.data.regenerate import SHARD_SIZE, Shards, hf_generator
    from dflash_ds.data.regenerate import regenerate as run_shards
    from dflash_ds.data.sources import check_complete, load_tokenizer, output_dir

    recipe = load_recipe(recipe_path, overrides)
    cfg = recipe.data
    if not cfg.regenerate.enabled:
        raise ValueError(f"{recipe_path}: data.regenerate.enabled is false; the lab trains on the target's own answers")
    if batch_size < 1:
        raise ValueError(f"regenerate --batch-size {batch_size}: must be >= 1")
    if slots is not None and slots < 1:
        raise ValueError(f"regenerate --slots {slots}: must be >= 1")
    tokenizer = load_tokenizer(recipe.target.path)
    # generate (the fallback, or decoder=generate) holds a group's KV cache padded to its longest answer:
    # no larger batch than the lab target's ~16 GB at 1,024 conversations
    generator = hf_generator(recipe.target.path, tokenizer, cfg.regenerate, batch_size=min(batch_size, 1024),
                             slots=slots)
    counted = _TokenCount(generator)
    per_call = -(-batch_size // SHARD_SIZE)
    t0, total = time.monotonic(), {"shards_written": 0, "samples_out": 0, "unfinished_turns": 0}
    while True:
        started = time.monotonic()
        done = run_shards(cfg, recipe.target.path, shards=Shards(max_shards=per_call, per_call=per_call),
                          generator=counted, tokenizer=tokenizer, verbose=True)
        for k in total:
            total[k] += done.get(k, 0)
        last = time.monotonic() - started  # the estimate of the next group's time
        if done["shards_written"] == 0 or time.monotonic() - t0 + last > seconds:
            break
    total["wall_s"] = time.monotonic() - t0
    total["batch_size"] = batch_size
    total["decoder"] = type(generator).__name__
    total.update(counted.record())
    total["complete"] = _complete(check_complete, output_dir(cfg))
    log(f"regenerate: {total}")
    return total


class _TokenCount:
    """The generator, counting the tokens it generated and the seconds it took (the decoder's rate,
    apart from the shards' reading, rendering and writing)."""

    def __init__(self, generator):
        self.generator, self.tokens, self.seconds, self.prompts = generator, 0, 0.0, 0

    def __call__(self, prompts, seed):
        t0 = time.monotonic()
        out = self.generator(prompts, seed)
        self.seconds += time.monotonic() - t0
        self.prompts += len(prompts)
        self.tokens += sum(len(ids) + int(fin) for ids, fin in out)
        return out

    def record(self) -> dict:
        return {"generated_tokens": self.tokens, "decode_s": self.seconds, "turns": self.prompts,
                "decode_tok_s": self.tokens / self.seconds if self.seconds else None}


def _complete(check, out: Path) -> bool:
    try:
        check(out)
    except ValueError:
        return False
    return True


def last_training_record(metrics: Path) -> dict:
    """The last logged training step of metrics.jsonl (losses, rate), without its timing fields."""
    last = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "loss" in rec and "eval" not in rec:
                    last = rec
    return {k: v for k, v in last.items() if k not in ("time", "eta_s")}


def training_seconds(metrics: Path) -> float | None:
    """Wall time between the first and the last logged training step (compilation before the first
    logged step excluded)."""
    times = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "loss" in rec and "eval" not in rec and "time" in rec:
                times.append(rec["time"])
    return times[-1] - times[0] if len(times) > 1 else None


def tau_records(metrics: Path) -> list[dict]:
    """The in-training tau evaluations of metrics.jsonl (label, step, tau, per-position acceptance)."""
    out = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "eval" in rec:
                out.append({k: rec.get(k) for k in ("eval", "step", "tau", "tau_pooled", "tau_position_acceptance",
                                                    "train_tau", "train_tau_pooled")})
    return out


def early_end_record(metrics: Path) -> dict | None:
    """The run's early end (runtime/stopping.py: a plateau or the time box, where its cooldown started and
    where the run ended), None when it ran its planned steps."""
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "early_end" in rec:
                return {k: v for k, v in rec.items() if k != "time"}
    return None


def pooled_mean_se(groups: list[list[float]]) -> tuple[float | None, float | None]:
    """The mean of every value of every group and its standard error with the groups (responses) as
    the independent units: a response's rounds share its text, so they are not independent draws (the
    evaluator's ratio estimator, as for tau_pooled). None where undefined (the SE: below two non-empty
    groups)."""
    from dflash_ds.eval.sampled import ratio_se

    mean, se = ratio_se([sum(g) for g in groups], [len(g) for g in groups])
    return tuple(None if math.isnan(x) else x for x in (mean, se))


def llama_cpp_summary(counts: dict | None) -> dict | None:
    """llama.cpp's mean acceptance length per program, and its first round apart from the later ones
    (mean accepted drafts per round, each with its standard error over responses)."""
    if not counts:
        return None
    out = {"spec_draft_n_max": counts.get("spec_draft_n_max")}
    for program in ("llama_server", "llama_speculative_simple"):
        rounds = (counts.get(program) or {}).get("rounds") or []
        first, first_se = pooled_mean_se([r[:1] for r in rounds])
        later, later_se = pooled_mean_se([r[1:] for r in rounds])
        out[program] = {
            "mean_accept_length": (counts.get(program) or {}).get("mean_accept_length"),
            "first_round_accepted": first, "first_round_se": first_se,
            "later_rounds_accepted": later, "later_rounds_se": later_se,
            "rounds": sum(len(r) for r in rounds), "responses": len(rounds)}
    return out


def greedy_summary(eval_json: dict) -> dict | None:
    """The exact greedy tau of `python -m dflash_ds.eval --out`'s report: tau_mean with its standard
    error over the responses' own taus, tau_pooled with its ratio standard error over responses, the
    responses counted and the acceptance by position; None for no report."""
    from dflash_ds.eval.sampled import mean_se

    if not eval_json:
        return None
    tau_se = mean_se(eval_json.get("tau_per_response") or [])[1]
    pooled_se = pooled_mean_se(eval_json.get("cycles") or [])[1]
    return {"tau_mean": eval_json.get("tau_mean"), "tau_mean_se": None if math.isnan(tau_se) else tau_se,
            "tau_pooled": eval_json.get("tau_pooled"), "tau_pooled_se": pooled_se,
            "responses": eval_json.get("num_responses"), "position_acceptance": eval_json.get("position_acceptance")}


def benchmark_rows(run_dir: Path) -> tuple[list[dict], bool]:
    """The run's benchmark rows and whether the table is whole: benchmarks.json, else the rows a cut
    evaluation finished (benchmarks.partial.json, eval.table_progress), else none."""
    from dflash_ds.eval.table_progress import read_partial

    bench = run_dir / "benchmarks.json"
    if bench.is_file():
        return json.loads(bench.read_text()), True
    partial = read_partial(run_dir)
    return (partial["rows"] if partial else []), False


def summarize(run_dir: Path, name: str, *, wall_s: float | None = None) -> dict:
    """One run's summary: recipe identity, final training record, benchmark rows (`benchmarks_complete`
    false when only a cut evaluation's rows exist), llama.cpp counts."""
    import yaml

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"lab summarize: {run_dir} has no metrics.jsonl; train it first "
                         f"(bash scripts/quality_lab.sh OUT train {name})")
    resolved = run_dir / "recipe.yaml"
    recipe = yaml.safe_load(resolved.read_text()) if resolved.is_file() else {}
    drafter, run = recipe.get("drafter", {}), recipe.get("run", {})
    rows, complete = benchmark_rows(run_dir)
    lab_eval = run_dir / "lab_eval.json"
    eval_json = json.loads(lab_eval.read_text()) if lab_eval.is_file() else {}
    lab_indomain = run_dir / "lab_eval_indomain.json"
    indomain = json.loads(lab_indomain.read_text()) if lab_indomain.is_file() else {}
    return {"name": name, "architecture": drafter.get("architecture", "dflash"),
            "block_size": drafter.get("block_size"), "seed": run.get("seed"),
            "objective": recipe.get("objective", {}), "optim": recipe.get("optim", {}),
            "final": last_training_record(run_dir / "metrics.jsonl"),
            "tau_evals": tau_records(run_dir / "metrics.jsonl"),
            "early_end": early_end_record(run_dir / "metrics.jsonl"),
            "benchmarks": rows, "benchmarks_complete": complete,
            "heldout_greedy": {k: eval_json.get(k) for k in ("tau_mean", "tau_pooled", "num_responses", "position_acceptance")}
            if eval_json else None,
            "llama_cpp": llama_cpp_summary(eval_json.get("llama_cpp")),
            # the same evaluation on conversations of the training projects (absent from older runs)
            "indomain_greedy": greedy_summary(indomain), "llama_cpp_indomain": llama_cpp_summary(indomain.get("llama_cpp")),
            "train_s": training_seconds(run_dir / "metrics.jsonl"), "wall_s": wall_s}
