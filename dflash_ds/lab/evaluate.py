"""Every trained run of the lab evaluated in one process, after the training: `python -m dflash_ds.lab evaluate`.

A run's evaluation is its benchmark table (`eval.benchmark_table`), then the greedy tau with llama.cpp's
and vLLM's counts on the held-out prose and on the in-domain set (what `python -m dflash_ds.eval --prompts
... --out` reports). Evaluated one process per run, each run loads the target again, and every run
generates the same responses again: the target's answers do not depend on the drafter. Here the target is
loaded once and each response is generated once (`eval.batched.SharedResponses`), and the runs are
measured one after another on it, with the GPU to themselves once the training is over.

What each run leaves is what the per-run path leaves (`benchmarks.json`, `lab_eval.json`,
`lab_eval_indomain.json` in its directory, `OUT/NAME.json`), so a part already done by either is
skipped. With a time box a part starts only while the last part's time still fits; a table cut there
keeps its rows (`benchmarks.partial.json`) and the same command goes on from them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Clock:
    """Whether the next part fits the box: it is guessed to take as long as the last one did."""

    deadline: float | None
    last: float = 0.0
    started: float = 0.0

    def stop(self) -> bool:
        now = time.monotonic()
        if self.started:
            self.last = now - self.started
        self.started = now
        return self.deadline is not None and now + self.last > self.deadline

    def left(self) -> bool:
        return self.deadline is None or time.monotonic() < self.deadline


def run_recipe(name: str, lab_dir: str, settings: list[str], overrides: list[str]):
    """The recipe a lab run is evaluated with: the same settings, in the same order, as
    scripts/quality_lab.sh gives `python -m dflash_ds.eval.benchmark_table` for it."""
    from dflash_ds.config import load_recipe
    from dflash_ds.lab.catalog import settings_lines

    lines = settings_lines(name, lab_dir)
    return load_recipe(lines[0], [*settings, f"run.output_dir={lab_dir}/runs/{name}", *lines[1:], *overrides])


def evaluate(names: list[str], *, out: Path, lab_dir: str, settings: list[str], overrides: list[str],
             seconds: float | None = None, log=print) -> dict:
    """Evaluate the trained runs among `names` (module docstring); returns which were evaluated, which
    the box left unfinished and which are not trained."""
    recipes = {name: run_recipe(name, lab_dir, settings, overrides) for name in names}  # every name checked first
    return evaluate_recipes(recipes, out=out, lab_dir=lab_dir, seconds=seconds, log=log)


def evaluate_recipes(recipes: dict, *, out: Path, lab_dir: str, seconds: float | None = None, log=print) -> dict:
    """`evaluate` of runs given by name -> recipe (their run.output_dir the run's directory)."""
    import torch

    from dflash_ds.eval.batched import SharedResponses
    from dflash_ds.eval.loading import load_eval_target

    t0 = time.monotonic()
    clock = Clock(None if seconds is None else t0 + seconds)
    names = list(recipes)
    untrained = [n for n, r in recipes.items() if not (Path(r.run.output_dir) / ".lab_trained").is_file()]
    todo = [n for n in names if n not in untrained]
    paths = {str(recipes[n].target.path) for n in todo}
    if len(paths) > 1:
        raise ValueError(f"lab evaluate: the runs name different targets ({', '.join(sorted(paths))}); "
                         "evaluate the runs of one target together")
    result = {"evaluated": [], "unfinished": [], "untrained": untrained}
    if not todo:
        return result
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_eval_target(paths.pop(), device)
    shared = SharedResponses()
    for name in todo:
        started = time.monotonic()
        whole = _evaluate_run(name, recipes[name], target, tokenizer, shared=shared, clock=clock, lab_dir=lab_dir,
                              log=log)
        _summary(name, recipes[name], out, eval_s=time.monotonic() - started)
        result["evaluated" if whole else "unfinished"].append(name)
        log(f"evaluate: {name} {'done' if whole else 'cut by the time box'} ({time.monotonic() - started:.0f} s; "
            f"{shared.generated} responses generated so far)")
    result.update(seconds=time.monotonic() - t0, responses_generated=shared.generated)
    return result


def _evaluate_run(name, recipe, target, tokenizer, *, shared, clock: Clock, lab_dir: str, log) -> bool:
    """One run's parts, each skipped when done; False when the box stopped it."""
    from dflash_ds.eval.benchmark_table import BenchOptions, run_recipe as table_rows, write_table
    from dflash_ds.eval.cli import greedy_report, read_prompts
    from dflash_ds.eval.loading import load_drafter_for

    run_dir, e = Path(recipe.run.output_dir), recipe.eval
    model = load_drafter_for(target, str(run_dir / "export"))
    if e.benchmarks and not (run_dir / "benchmarks.json").is_file():
        rows = table_rows(recipe, loaded=(target, tokenizer, model), shared=shared, stop=clock.stop)
        if rows is None:
            return False
        write_table(recipe, rows)
    thinking = recipe.data.thinking
    opts = BenchOptions(max_new_tokens=e.max_new_tokens, seed=recipe.run.seed, thinking=thinking, batch=e.bench_batch)
    lab = Path(lab_dir) / "conversations"
    for prompts_file, report in ((lab / "bench" / "heldout.jsonl", "lab_eval.json"),
                                 (lab / "indomain.jsonl", "lab_eval_indomain.json")):
        if (run_dir / report).is_file():
            continue
        if not prompts_file.is_file():
            log(f"evaluate: {name}: no {prompts_file} (conversations framed before the in-domain set); "
                "its evaluation is skipped")
            continue
        if clock.stop():
            return False
        prompts = read_prompts(str(prompts_file), tokenizer, limit=e.bench_limit,
                               chat_template_kwargs={"enable_thinking": thinking})
        got = {"target": str(recipe.target.path), "drafter": str(run_dir / "export"), "prompts": str(prompts_file),
               "max_new_tokens": e.max_new_tokens, "enable_thinking": thinking}
        got.update(greedy_report(target, model, prompts, opts=opts, shared=shared))
        _write(run_dir / report, got)
    return True


def _summary(name: str, recipe, out: Path, *, eval_s: float) -> None:
    from dflash_ds.lab.runs import summarize

    summary = summarize(Path(recipe.run.output_dir), name)
    summary["eval_s"] = eval_s
    out.mkdir(parents=True, exist_ok=True)
    _write(out / f"{name}.json", summary, indent=1)


def _write(path: Path, data: dict, indent: int = 2) -> None:
    """Whole or not at all: a command cut while writing leaves the part to be done again."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)
