"""One row per benchmark set and sampling setting: tau of a drafter on the set's prompts.

At the end of a training run the lead drafter rank evaluates the export on `eval.benchmarks`
(`after_training`, called by train.py, which then redraws the report; `python -m
dflash_ds.eval.benchmark_table RECIPE [key=value ...]` does the same on its own): it writes
`<run.output_dir>/benchmarks.json` and adds the table to the export's model card.

The responses of a row are generated `eval.bench_batch` at a time (eval.batched: one target forward
per new token for the whole batch), then tau is measured on each as before. After each row the rows
so far go to `benchmarks.partial.json`, and a rerun with the same settings resumes after them
(eval.table_progress).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dflash_ds.eval.batched import ResponseKey, SharedResponses, batched_continuations, response_generator
from dflash_ds.eval.benchmarks import HELDOUT, load_conversations, render_prompt
from dflash_ds.eval.engine_count import LlamaCppCounts
from dflash_ds.eval.generate import eos_ids, greedy_continuation, target_taps
from dflash_ds.eval.sampled import (Sampling, SampledTau, mean_se, ratio_se, sampled_continuation,
                                    tau_of_trajectory)
from dflash_ds.eval.table_progress import PARTIAL, drop_partial, rows_done, save_partial, table_settings
from dflash_ds.eval.tau import DEFAULT_BATCH_ANCHORS, TauReport, tau_from_taps
from dflash_ds.eval.vllm_count import VllmCounts
from dflash_ds.libraries import quiet_libraries
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.safety import Exit, say


@dataclass(frozen=True)
class BenchOptions:
    max_new_tokens: int
    samples: int = 1  # sampled responses per prompt (greedy: always 1)
    seed: int = 0
    thinking: bool = False
    batch_anchors: int = DEFAULT_BATCH_ANCHORS
    batch: int = 32  # responses generated at once (eval.bench_batch)
    num_speculative_tokens: int | None = None  # vLLM's count at this many (None: the drafter's all)


COIN_SEED = 0x5EED_C01
"""Added to the run seed for the coin streams (apart from the token streams' seeds)."""


class Responder:
    """The target answering prompts under one sampling setting, with tau measured on each response.

    Every response has its own streams, keyed by `ResponseKey` (item, sample, turn): its sampled
    tokens from `response_generator(seed, key)`, the verification coins of a sampled draft from
    `response_generator(seed + COIN_SEED, key)`. (Before responses were batched, one token stream and
    one coin stream ran through all the responses in order; per-response streams make a response
    independent of its batch and of the order, so the batched and per-prompt paths draw the same.)
    """

    def __init__(self, target, model: DraftModel, sampling: Sampling, opts: BenchOptions, *,
                 shared: SharedResponses | None = None):
        self.target, self.model, self.sampling, self.opts, self.shared = target, model, sampling, opts, shared
        self.device = next(target.parameters()).device
        self.result = SampledTau(sampling, TauReport(block_size=model.max_emitted))
        # The engines' counts of the greedy responses, served with the drafts of one block.
        self.llama_cpp = LlamaCppCounts()
        self.vllm = VllmCounts.of(target, opts.num_speculative_tokens or model.num_drafts)

    @property
    def samples(self) -> int:
        return 1 if self.sampling.greedy else self.opts.samples

    def tokens_generator(self, key: ResponseKey) -> torch.Generator:
        return response_generator(self.opts.seed, key, self.device)

    def coins(self, key: ResponseKey, length: int) -> torch.Tensor:
        """The uniform coins of one response's positions (eval.sampled.tau_of_trajectory)."""
        return torch.rand(length, generator=response_generator(self.opts.seed + COIN_SEED, key), dtype=torch.float64)

    def respond(self, prompt_ids: Sequence[int], key: ResponseKey = ResponseKey()) -> list[int]:
        """One response (ids after the prompt), generated on its own: the reference `respond_batch`
        is held to. Its cycles (and slot probabilities) join the result."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        if self.sampling.greedy:
            x = greedy_continuation(self.target, prompt, max_new_tokens=self.opts.max_new_tokens)
        else:
            x = sampled_continuation(self.target, prompt, self.sampling, self.tokens_generator(key),
                                     max_new_tokens=self.opts.max_new_tokens)
        return self.measure(x, prompt.numel(), key)

    def respond_batch(self, prompts: Sequence[Sequence[int]], keys: Sequence[ResponseKey]) -> list[list[int]]:
        """`respond` for every prompt, the continuations generated together (eval.batched)."""
        gens = None if self.sampling.greedy else [self.tokens_generator(k) for k in keys]
        if self.shared is not None:
            xs = self.shared.continuations(self.target, prompts, keys, max_new_tokens=self.opts.max_new_tokens,
                                           sampling=self.sampling, seed=self.opts.seed, generators=gens)
        else:
            xs = batched_continuations(self.target, prompts, max_new_tokens=self.opts.max_new_tokens,
                                       sampling=self.sampling, generators=gens)
        return [self.measure(x, len(p), k) for x, p, k in zip(xs, prompts, keys)]

    def measure(self, x: torch.Tensor, prompt_len: int, key: ResponseKey) -> list[int]:
        """tau on one response x (prompt + response): its cycles join the result; returns the response."""
        o, n = self.opts, prompt_len
        if self.sampling.greedy:
            taps = target_taps(self.target, x, self.model.layer_ids)
            cycles = tau_from_taps(self.model, taps, x, n, end=x.numel(), batch_anchors=o.batch_anchors)
            probs = []
            self.count_engines(taps, x, n)
        else:
            cycles, probs = tau_of_trajectory(self.target, self.model, x, n, sampling=self.sampling,
                                              batch_anchors=o.batch_anchors,
                                              coins=self.coins(key, n + o.max_new_tokens))
        self.result.report.cycles.append(cycles)
        self.result.slot_probs.append(probs)
        return x[n:].tolist()

    def count_engines(self, taps: torch.Tensor, x: torch.Tensor, prompt_len: int) -> None:
        stop = eos_ids(self.target)
        self.llama_cpp.add(self.model, taps, x, prompt_len, budget=self.opts.max_new_tokens, stop=stop)
        self.vllm.add(self.model, taps, x, prompt_len=prompt_len, budget=self.opts.max_new_tokens)
        self.result.engines = {"llama_server": self.llama_cpp.server.mean_accept_length,
                               "vllm": self.vllm.mean_accept_length}


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


@torch.no_grad()
def tau_on_prompts(responder: Responder, prompts: Sequence[Sequence[int]]) -> SampledTau:
    """Rendered prompts (token ids), `samples` responses each, `opts.batch` responses generated at once.
    Responses join the result prompt by prompt, sample by sample."""
    keys = [ResponseKey(item=i, sample=s) for i in range(len(prompts)) for s in range(responder.samples)]
    for chunk in _batches(keys, responder.opts.batch):
        responder.respond_batch([prompts[k.item] for k in chunk], chunk)
    return responder.result


@torch.no_grad()
def tau_on_conversations(responder: Responder, tokenizer, conversations: list[list[str]]) -> SampledTau:
    """Each conversation turn by turn: a later turn sees the target's own answers to the earlier ones.
    Turn t of every conversation (and sample) is generated in batches of `opts.batch`; responses join
    the result turn by turn (the row's numbers do not depend on the order)."""
    keys = [ResponseKey(item=c, sample=s) for c in range(len(conversations)) for s in range(responder.samples)]
    messages: dict[ResponseKey, list[dict]] = {k: [] for k in keys}
    for turn in range(max((len(t) for t in conversations), default=0)):
        due = [ResponseKey(item=k.item, sample=k.sample, turn=turn) for k in keys if turn < len(conversations[k.item])]
        for chunk in _batches(due, responder.opts.batch):
            prompts = []
            for k in chunk:
                history = messages[ResponseKey(item=k.item, sample=k.sample)]
                history.append({"role": "user", "content": conversations[k.item][turn]})
                prompts.append(render_prompt(tokenizer, history, responder.opts.thinking))
            for k, ids in zip(chunk, responder.respond_batch(prompts, chunk)):
                messages[ResponseKey(item=k.item, sample=k.sample)].append(
                    {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
    return responder.result


def bench_row(name: str, result: SampledTau) -> dict:
    """The table row of one set under one sampling setting (JSON-ready; None for undefined numbers)."""
    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

    rep = result.report
    tau_mean, tau_mean_se = mean_se(rep.per_response)
    pooled, pooled_se = ratio_se([sum(c) for c in rep.cycles], [len(c) for c in rep.cycles])
    expected = (None, None) if result.sampling.greedy else ratio_se(*result.expected_sums())
    s = result.sampling
    return {"bench": name, "sampling": s.label, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "tau_mean": num(tau_mean), "tau_mean_se": num(tau_mean_se), "tau_pooled": num(pooled),
            "tau_pooled_se": num(pooled_se), "tau_expected": num(expected[0]), "tau_expected_se": num(expected[1]),
            "position_acceptance": rep.position_acceptance, "responses": len(rep.cycles), "cycles": rep.num_cycles,
            "block_size": rep.block_size, "llama_server": num(result.engines.get("llama_server")),
            "vllm": num(result.engines.get("vllm"))}


def _pm(x, se) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + (f" ±{se:.3f}" if se is not None else "")


def _engine(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table_lines(rows: list[dict]) -> list[str]:
    """The rows as aligned text: tau mean and pooled with standard errors, the expectation, the mean
    acceptance length as llama-server and vLLM count it (greedy rows), counts, positions."""
    head = (f"{'bench':<10} {'sampling':<22} {'tau_mean':>14} {'tau_pooled':>14} {'expected':>14} "
            f"{'llama.cpp':>9} {'vLLM':>6} {'resp':>5} {'cycles':>6}  acceptance by position")
    lines = [head]
    for r in rows:
        pos = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(r["position_acceptance"], 1))
        lines.append(f"{r['bench']:<10} {r['sampling']:<22} {_pm(r['tau_mean'], r['tau_mean_se']):>14} "
                     f"{_pm(r['tau_pooled'], r['tau_pooled_se']):>14} "
                     f"{_pm(r['tau_expected'], r['tau_expected_se']):>14} "
                     f"{_engine(r.get('llama_server')):>9} {_engine(r.get('vllm')):>6} "
                     f"{r['responses']:>5} {r['cycles']:>6}  {pos}")
    return lines


def settings_of(temperature: float, top_p: float = 1.0, top_k: int = 0) -> list[Sampling]:
    """Greedy, then the sampled setting when the temperature is above 0."""
    sampled = Sampling(temperature, top_p, top_k)
    return [Sampling()] + ([sampled] if not sampled.greedy else [])


def run_recipe(recipe, *, loaded: tuple | None = None, shared: SharedResponses | None = None,
               stop=None) -> list[dict] | None:
    """The end-of-training table of a recipe's export (None when eval.benchmarks is empty). After each
    row the rows so far go to benchmarks.partial.json; rows an earlier run with the same settings
    finished are taken from it (eval.table_progress).

    `loaded`: (target, tokenizer, DraftModel) already loaded (else from the recipe's target and export);
    `shared`: responses kept across drafters (eval.batched.SharedResponses); `stop()`: asked before each
    row still to compute, True ends the table there (its rows so far are in the partial file) and the
    result is None."""
    from dflash_ds.data.prepare import prepare
    from dflash_ds.data.sources import load_tokenizer
    from dflash_ds.eval.loading import load_pair

    e = recipe.eval
    if not e.benchmarks:
        return None
    run_dir = Path(recipe.run.output_dir)
    settings = table_settings(recipe)
    done = rows_done(run_dir, settings)
    target, tokenizer, model = loaded or load_pair(recipe.target.path, str(run_dir / "export"))
    opts = BenchOptions(max_new_tokens=e.max_new_tokens, samples=e.samples, seed=recipe.run.seed,
                        thinking=recipe.data.thinking, batch=e.bench_batch)
    rows = []
    for name in e.benchmarks:
        samplings = settings_of(e.temperature, e.top_p, e.top_k)
        if all((name, s.label) in done for s in samplings):
            pass  # every row of the set is done: its prompts are not even loaded
        elif name == HELDOUT:
            data = prepare(recipe.data, load_tokenizer(recipe.target.path), verbose=False, recipe=recipe.source or None)
            prompts = data.eval_prompts[:e.bench_limit]
        else:
            convs = load_conversations(name, e.bench_dir, e.bench_limit, setting="eval.bench_dir")
        for sampling in samplings:
            earlier = done.get((name, sampling.label))
            if earlier is None and stop is not None and stop():
                return None
            if earlier is None:
                responder = Responder(target, model, sampling, opts, shared=shared)
                result = (tau_on_prompts(responder, prompts) if name == HELDOUT
                          else tau_on_conversations(responder, tokenizer, convs))
            rows.append(earlier or bench_row(name, result))
            save_partial(run_dir, settings, rows)
            say(table_lines(rows[-1:])[1] + (f"  (from {PARTIAL})" if earlier else ""))
    return rows


def after_training(recipe) -> int:
    """The benchmark table of a finished run: printed, written to benchmarks.json and into the card.
    (The report, a layer above, is redrawn by the caller: train.py, or `python -m dflash_ds.report`.)"""
    e = recipe.eval
    say(f"benchmarks {', '.join(e.benchmarks)} on the export (enable_thinking="
        f"{str(recipe.data.thinking).lower()} as data.thinking, {e.bench_limit} prompts each, "
        f"{e.max_new_tokens} new tokens, {e.bench_batch} responses at a time):")
    say(table_lines([])[0])
    try:
        rows = run_recipe(recipe)
    except ValueError as err:
        say(f"error: {err}")
        return Exit.USER
    write_table(recipe, rows)
    return Exit.OK


def write_table(recipe, rows: list[dict]) -> None:
    """A whole table: benchmarks.json, the partial file gone, the rows in the export's model card."""
    from dflash_ds.export.card import add_benchmarks_to_card

    run_dir = Path(recipe.run.output_dir)
    (run_dir / "benchmarks.json").write_text(json.dumps(rows, indent=2) + "\n")
    drop_partial(run_dir)
    add_benchmarks_to_card(run_dir / "export", rows)


def main(argv: list[str] | None = None) -> int:
    from dflash_ds.config import RecipeError, load_recipe

    quiet_libraries()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        say("usage: python -m dflash_ds.eval.benchmark_table RECIPE [key=value ...]")
        return Exit.USER
    try:
        recipe = load_recipe(argv[0], argv[1:])
    except RecipeError as err:
        say(f"error: {err}")
        return Exit.USER
    if not recipe.eval.benchmarks:
        say("eval.benchmarks is empty: nothing to evaluate")
        return Exit.OK
    code = after_training(recipe)
    if code == Exit.OK:
        print(f"the report shows the table once redrawn: python -m dflash_ds.report {recipe.run.output_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
