"""The lab table's comparisons: each catalog run against its baseline (lab/catalog.py).

A comparison is a list of rows, one per benchmark set and sampling and measure: tau per cycle for
every run; tau per drafting GFLOP for the runs whose drafter does other work per cycle
(`Run.per_flop`); llama.cpp's first round apart from the later rounds for a setting that acts on the
first round only (`Run.rounds`), on the held-out prose and on the in-domain set. The in-domain set
(`indomain_greedy`, conversations of the training projects) is one more set of tau rows. Each row
holds the difference (run - baseline) and its standard error; the runs' responses are independent,
so se = sqrt(se_run^2 + se_baseline^2), and a difference counts only at >= SIGNIFICANT_SE standard
errors. A row whose standard error is unknown (a summary written before llama.cpp's counts had one)
shows its difference and never counts.

The standard error over responses misses the run-to-run noise (initialisation and data order): the
seed twin (`v1-seed1` against `v1`, section "noise") measures it. So every tau row of another
comparison also carries the seed twin's difference on the same set and sampling, and counts *beyond
the noise* only when it is significant and at least NOISE_FACTOR times that difference.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

from lab import catalog

SIGNIFICANT_SE = 2.0
NOISE_FACTOR = 2.0
CONTEXT_TOKENS = 512
"""The context a drafting cycle attends to in `drafting_flops`: a benchmark prompt and part of its
answer are a few hundred lab tokens. Only the attention term depends on it."""
LAB_VOCAB = 16384
"""The lab tokenizer's size (`python -m lab tokenizer --vocab`), the target's vocabulary."""
LLAMA_PROGRAM = "llama_server"
ROOT = Path(__file__).resolve().parents[1]


def _diff(base: float | None, base_se: float | None, value: float | None, se: float | None) -> dict | None:
    """value - base, its standard error and whether it counts; None when either value is missing."""
    if base is None or value is None:
        return None
    delta = value - base
    if base_se is None or se is None:
        return {"delta": delta, "se": None, "z": None, "significant": False}
    s = math.sqrt(base_se ** 2 + se ** 2)
    z = delta / s if s > 0 else (math.inf if delta else 0.0)
    return {"delta": delta, "se": s, "z": z, "significant": abs(z) >= SIGNIFICANT_SE}


def difference(a: dict, b: dict) -> dict | None:
    """b - a in tau_mean of two benchmark rows, its standard error and the ratio (None when either
    lacks a number; a row without a standard error counts as exact)."""
    return _diff(a.get("tau_mean"), a.get("tau_mean_se") or 0.0, b.get("tau_mean"), b.get("tau_mean_se") or 0.0)


INDOMAIN = "indomain"
"""The set name of the in-domain rows: the summary's `indomain_greedy` (conversations of the training
projects, exact greedy tau), read as one more benchmark set."""


def rows_of(summary: dict) -> dict[tuple[str, str], dict]:
    """A summary's tau rows by (set, sampling): its benchmark table, and the in-domain set where the run
    has it (summaries written before it have none)."""
    out = {(r["bench"], r["sampling"]): r for r in summary.get("benchmarks", [])}
    indomain = summary.get("indomain_greedy")
    if indomain and indomain.get("tau_mean") is not None:
        out[INDOMAIN, "greedy"] = {"bench": INDOMAIN, "sampling": "greedy", **indomain}
    return out


# ---------------------------------------------------------------------------- drafting FLOPs


def lab_target_config() -> SimpleNamespace:
    """The lab target's config as `resolve.drafter.drafter_shape` reads it (lab/target.py)."""
    from lab.target import SHAPES

    s = SHAPES["lab"]
    return SimpleNamespace(model_type="qwen3", hidden_size=s.hidden, num_hidden_layers=s.layers,
                           num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                           intermediate_size=s.intermediate, vocab_size=LAB_VOCAB, rms_norm_eps=1e-6,
                           rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False)


def drafting_flops(shape, *, context_tokens: int = CONTEXT_TOKENS) -> dict[str, int]:
    """Forward FLOPs of one drafting cycle of a drafter `shape` (network/shape.py DrafterShape): the
    block's B tokens through every matmul weight the block uses (2 x weights x B; an architecture's
    own block weights included), attention of the B queries over `context_tokens` (a sliding layer:
    at most its window) and the block's own keys (all B; a causal layer B(B+1)/2 pairs), and the
    target's lm_head over the drafting slots (2 x vocab x D x num_drafts). Left out: the projection
    of the tokens the target committed (fc and their K/V, once per committed token, not per cycle)."""
    b = shape.block_size
    matmul = sum(2 * t.numel * b for t in shape.tensors().values() if t.use in ("block", "context+block"))
    pairs = 0
    for att in shape.layer_attentions():
        ctx = context_tokens if att.window is None else min(context_tokens, att.window)
        pairs += b * ctx + (b * (b + 1) // 2 if att.causal else b * b)
    attention = 4 * pairs * shape.num_attention_heads * shape.head_dim  # QK^T and AV, 2 FLOPs a multiply-add
    lm_head = 2 * shape.vocab_size * shape.hidden_size * shape.num_drafts
    return {"matmul": matmul, "attention": attention, "lm_head": lm_head, "total": matmul + attention + lm_head}


def run_shape(name: str, summary: dict):
    """The drafter shape of catalog run `name` on the lab target, or None when the summary's block or
    architecture says the run was not the catalog's (other settings were passed on the command line)."""
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.drafter import drafter_shape

    if name not in catalog.RUNS:
        return None
    lines = catalog.settings_lines(name)
    shape = drafter_shape(lab_target_config(), load_recipe(ROOT / lines[0], lines[1:]).drafter)
    if summary.get("block_size") not in (None, shape.block_size) or \
            summary.get("architecture") not in (None, shape.architecture):
        return None
    return shape


# ---------------------------------------------------------------------------- comparisons


def _row(measure: str, bench: str, sampling: str, base, *, base_se, value, se) -> dict | None:
    d = _diff(base, base_se, value, se)
    if d is None:
        return None
    return {"measure": measure, "bench": bench, "sampling": sampling, "baseline": base, "baseline_se": base_se,
            "value": value, "value_se": se, **d}


def _tau_rows(mine: dict, base: dict, *, measure: str = "tau", scale: tuple[float, float] = (1.0, 1.0)) -> list[dict]:
    out = []
    for key in sorted(set(mine) & set(base), key=lambda k: (k[0], k[1] != "greedy", k[1])):
        a, b = base[key], mine[key]
        if a.get("tau_mean") is None or b.get("tau_mean") is None:
            continue
        out.append(_row(measure, *key, a["tau_mean"] * scale[0], base_se=(a.get("tau_mean_se") or 0.0) * scale[0],
                        value=b["tau_mean"] * scale[1], se=(b.get("tau_mean_se") or 0.0) * scale[1]))
    return out


ROUND_SETS = (("llama_cpp", "heldout"), ("llama_cpp_indomain", INDOMAIN))
"""Each summary key of llama.cpp's counts and the set they were counted on (greedy)."""


def _round_rows(mine: dict, base: dict) -> list[dict]:
    """llama.cpp's first round and later rounds (mean accepted drafts a round, greedy) on the held-out
    prose and on the in-domain set, where both runs have the count."""
    out = []
    for key, bench in ROUND_SETS:
        a, b = ((s.get(key) or {}).get(LLAMA_PROGRAM) for s in (base, mine))
        if not a or not b:
            continue
        for part in ("first_round", "later_rounds"):
            r = _row(f"{LLAMA_PROGRAM} {part.replace('_', ' ')} accepted", bench, "greedy",
                     a.get(f"{part}_accepted"), base_se=a.get(f"{part}_se"), value=b.get(f"{part}_accepted"),
                     se=b.get(f"{part}_se"))
            if r is not None:
                out.append(r)
    return out


def _compare_one(summaries: dict[str, dict], name: str, run: catalog.Run, *, baseline: str, question: str) -> dict:
    """One run against one baseline: its rows and counts, or what it lacks."""
    lacks = [n for n in (name, baseline) if n not in summaries]
    if lacks:
        return {"run": name, "against": baseline, "question": question, "lacks": lacks}
    mine, base = summaries[name], summaries[baseline]
    rows = _tau_rows(rows_of(mine), rows_of(base))
    entry = {"run": name, "against": baseline, "question": question}
    if run.per_flop:
        shapes = run_shape(baseline, base), run_shape(name, mine)
        if None not in shapes:
            flops = [drafting_flops(s)["total"] for s in shapes]
            entry["drafting_gflops"] = {"baseline": flops[0] / 1e9, "run": flops[1] / 1e9}
            rows += _tau_rows(rows_of(mine), rows_of(base), measure="tau per drafting GFLOP",
                              scale=(1e9 / flops[0], 1e9 / flops[1]))
    if run.rounds:
        rows += _round_rows(mine, base)
    taus = [r for r in rows if r["measure"] == "tau"]
    entry.update(rows=rows, tau_rows=len(taus), better=sum(r["significant"] and r["delta"] > 0 for r in taus),
                 worse=sum(r["significant"] and r["delta"] < 0 for r in taus))
    return entry


def compare(summaries: dict[str, dict]) -> dict:
    """Every catalog run with a baseline, both summaries present, against it: {"noise": [...],
    "ordering": [...], "decision": [...], "missing": [...]}. Each comparison: run, against, question,
    rows, and the count of tau rows where the run is better / worse at >= SIGNIFICANT_SE."""
    out: dict = {"noise": [], "ordering": [], "decision": [], "missing": [],
                 "significant_se": SIGNIFICANT_SE, "context_tokens": CONTEXT_TOKENS}
    for name, run in catalog.RUNS.items():
        if run.baseline is None:
            continue
        pairs = [(run.baseline, run.question, run.section)] + [(b, q, "decision") for b, q in run.also]
        for baseline, question, section in pairs:
            entry = _compare_one(summaries, name, run, baseline=baseline, question=question)
            out["missing" if "lacks" in entry else section].append(entry)
    _against_noise(out)
    return out


def _against_noise(out: dict) -> None:
    """Each tau row of the ordering and decision comparisons: the seed twin's difference on its set and
    sampling (`seed_delta`), and whether it counts beyond that noise; each comparison's counts of them."""
    noise = {(r["bench"], r["sampling"]): r["delta"] for e in out["noise"] for r in e["rows"] if r["measure"] == "tau"}
    for e in out["ordering"] + out["decision"]:
        for r in e["rows"]:
            if r["measure"] != "tau":
                continue
            seed = noise.get((r["bench"], r["sampling"]))
            r["seed_delta"] = seed
            r["beyond_noise"] = None if seed is None else bool(
                r["significant"] and abs(r["delta"]) >= NOISE_FACTOR * abs(seed))
        taus = [r for r in e["rows"] if r["measure"] == "tau" and r.get("beyond_noise") is not None]
        e["noise_rows"] = len(taus)
        e["better_beyond_noise"] = sum(r["beyond_noise"] and r["delta"] > 0 for r in taus)
        e["worse_beyond_noise"] = sum(r["beyond_noise"] and r["delta"] < 0 for r in taus)
