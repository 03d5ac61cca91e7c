"""Every trained run of the lab evaluated in one process, after the training: `python -m lab evaluate`.

A run's evaluation is its benchmark table (`eval.benchmark_table`), then the greedy tau with llama.cpp's
and vLLM's counts on the held-out prose and on the in-domain set (what `python -m dflash_ds.eval --prompts
... --out` reports). Evaluated one process per run, each run loads the target again, and every run
generates the same responses again: the target's answers do not depend on the drafter. Here the target is
loaded once and each response is generated once (`eval.batched.SharedResponses`), and the runs are
measured on it with the GPU to themselves once the training is over, breadth first (`evaluate_recipes`):
a part of every run before the next part of any.

What each run leaves is what the per-run path leaves (`benchmarks.json`, `lab_eval.json`,
`lab_eval_indomain.json` in its directory, `OUT/NAME.json`), so a part already done by either is
skipped. With a time box a part starts only while the last part's time still fits; a table cut there
keeps its rows (`benchmarks.partial.json`) and the same command goes on from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from dflash_ds.io import write_json_atomic


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


def lab_recipe(name: str, lab_dir: str, settings: list[str], overrides: list[str]):
    """The recipe a lab run is evaluated with: the same settings, in the same order, as
    scripts/quality_lab.sh gives `python -m dflash_ds.eval.benchmark_table` for it."""
    from dflash_ds.config import load_recipe
    from lab.catalog import settings_lines

    lines = settings_lines(name, lab_dir)
    return load_recipe(lines[0], [*settings, f"run.output_dir={lab_dir}/runs/{name}", *lines[1:], *overrides])


def evaluate(names: list[str], *, out: Path, lab_dir: str, settings: list[str], overrides: list[str],
             seconds: float | None = None, log=print) -> dict:
    """Evaluate the trained runs among `names` (module docstring); returns which were evaluated, which
    the box left unfinished and which are not trained."""
    recipes = {name: lab_recipe(name, lab_dir, settings, overrides) for name in names}  # every name checked first
    return evaluate_recipes(recipes, out=out, lab_dir=lab_dir, seconds=seconds, log=log)


def evaluate_recipes(recipes: dict, *, out: Path, lab_dir: str, seconds: float | None = None, log=print) -> dict:
    """`evaluate` of runs given by name -> recipe (their run.output_dir the run's directory).

    Breadth first: every run's first table row (the lab recipes' held-out greedy one), then every run's
    held-out report (llama.cpp's first and later rounds), then every in-domain report, then the table's
    other rows one at a time across the runs: a box that cuts the evaluation leaves every run with the
    same parts done."""
    import torch

    from dflash_ds.eval.batched import SharedResponses
    from dflash_ds.eval.loading import load_eval_target

    t0 = time.monotonic()
    clock = Clock(None if seconds is None else t0 + seconds)
    untrained = [n for n, r in recipes.items() if not (Path(r.run.output_dir) / ".lab_trained").is_file()]
    todo = [n for n in recipes if n not in untrained]
    paths = {str(recipes[n].target.path) for n in todo}
    if len(paths) > 1:
        raise ValueError(f"lab evaluate: the runs name different targets ({', '.join(sorted(paths))}); "
                         "evaluate the runs of one target together")
    result = {"evaluated": [], "unfinished": [], "untrained": untrained}
    if not todo:
        return result
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_eval_target(paths.pop(), device)
    runs = {n: _Run(n, recipes[n], target, tokenizer, lab_dir=lab_dir, log=log) for n in todo}
    shared = SharedResponses()

    def one_pass(part: str) -> bool:
        """`part` of every run not done, while the box allows; whether any was done."""
        did = False
        for run in runs.values():
            if run.done(part) or clock.stop():
                continue
            started = time.monotonic()
            run.do(part, shared)
            run.eval_s += time.monotonic() - started
            _summary(run.name, run.recipe, out, eval_s=run.eval_s)
            did = True
        return did

    for part in ("row", "heldout", "indomain"):
        one_pass(part)
    while one_pass("row"):  # each pass adds a row to every table not whole
        pass
    for name, run in runs.items():
        whole = all(run.done(part) for part in ("row", "heldout", "indomain"))
        if not run.eval_s:  # no part done in this call, so no summary written yet in this OUT
            _summary(name, run.recipe, out, eval_s=run.eval_s)
        result["evaluated" if whole else "unfinished"].append(name)
        log(f"evaluate: {name} {'done' if whole else 'cut by the time box'} ({run.eval_s:.0f} s)")
    result.update(seconds=time.monotonic() - t0, responses_generated=shared.generated)
    log(f"evaluate: {len(result['evaluated'])} runs done, {len(result['unfinished'])} cut, in {result['seconds']:.0f} s; "
        f"the target generated {shared.generated} responses")
    return result


class _Run:
    """One run's evaluation parts: its table a row at a time ("row"), its held-out and in-domain greedy
    reports ("heldout", "indomain"); each skipped once done, by this process or an earlier one."""

    def __init__(self, name, recipe, target, tokenizer, *, lab_dir: str, log):
        self.name, self.recipe, self.target, self.tokenizer = name, recipe, target, tokenizer
        self.dir = Path(recipe.run.output_dir)
        lab = Path(lab_dir) / "conversations"
        self.reports = {}
        for part, prompts, report in (("heldout", lab / "bench" / "heldout.jsonl", "lab_eval.json"),
                                      ("indomain", lab / "indomain.jsonl", "lab_eval_indomain.json")):
            if prompts.is_file():
                self.reports[part] = (prompts, self.dir / report)
            else:
                log(f"evaluate: {name}: no {prompts} (conversations framed before the in-domain set); "
                    "its evaluation is skipped")
        self.model = None
        self.eval_s = 0.0

    def done(self, part: str) -> bool:
        if part == "row":
            return not self.recipe.eval.benchmarks or (self.dir / "benchmarks.json").is_file()
        return part not in self.reports or self.reports[part][1].is_file()

    def drafter(self):
        from dflash_ds.eval.loading import load_drafter_for

        if self.model is None:
            self.model = load_drafter_for(self.target, str(self.dir / "export"))
        return self.model

    def do(self, part: str, shared) -> None:
        from dflash_ds.eval.benchmark_table import BenchOptions, run_recipe as table_rows, write_table
        from dflash_ds.eval.cli import greedy_report, read_prompts

        r, e = self.recipe, self.recipe.eval
        if part == "row":  # one more row: the table stops before the second it would compute
            asked = []
            rows = table_rows(r, loaded=(self.target, self.tokenizer, self.drafter()), shared=shared,
                              stop=lambda: asked.append(1) or len(asked) > 1)
            if rows is not None:
                write_table(r, rows)
            return
        prompts_file, report = self.reports[part]
        prompts = read_prompts(str(prompts_file), self.tokenizer, limit=e.bench_limit,
                               chat_template_kwargs={"enable_thinking": r.data.thinking})
        opts = BenchOptions(max_new_tokens=e.max_new_tokens, seed=r.run.seed, thinking=r.data.thinking,
                            batch=e.bench_batch)
        got = {"target": str(r.target.path), "drafter": str(self.dir / "export"), "prompts": str(prompts_file),
               "max_new_tokens": e.max_new_tokens, "enable_thinking": r.data.thinking}
        got.update(greedy_report(self.target, self.drafter(), prompts, opts=opts, shared=shared))
        write_json_atomic(report, got, indent=2)


def _summary(name: str, recipe, out: Path, *, eval_s: float) -> None:
    from lab.runs import summarize

    summary = summarize(Path(recipe.run.output_dir), name)
    summary["eval_s"] = eval_s
    write_json_atomic(out / f"{name}.json", summary, indent=1)  # whole or not at all, as each report
