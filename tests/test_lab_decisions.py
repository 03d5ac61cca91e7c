"""The lab table's comparisons (lab/decisions.py): drafting FLOPs counted by hand, the
standard errors of llama.cpp's rounds against the plain formulas, and the decisions, ordering and
noise sections drawn from synthetic NAME.json summaries."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from lab import decisions, table
from lab.runs import llama_cpp_summary, pooled_mean_se


def test_drafting_flops_of_the_lab_v1_by_hand():
    shape = decisions.run_shape("v1", {})
    # 5 layers: q and o 768 x 768, k and v 256 (4 KV heads of 64) x 768, the MLP 3 x 2,048 x 768; block 16
    per_layer = 2 * 768 * 768 + 2 * 256 * 768 + 3 * 2048 * 768
    # 4 sliding (causal: 16 x 17 / 2 own pairs) layers and 1 full (bidirectional: 16 x 16), context 512
    pairs = 4 * (16 * 512 + 16 * 17 // 2) + (16 * 512 + 16 * 16)
    expect = {"matmul": 2 * 5 * per_layer * 16, "attention": 4 * pairs * 12 * 64, "lm_head": 2 * 16384 * 768 * 15}
    got = decisions.drafting_flops(shape, context_tokens=512)
    assert {k: got[k] for k in expect} == expect and got["total"] == sum(expect.values())
    # a context longer than the window (682) reaches the sliding layers only up to it
    long = decisions.drafting_flops(shape, context_tokens=1000)["attention"]
    assert long == 4 * (4 * (16 * 682 + 136) + (16 * 1000 + 256)) * 12 * 64


def test_drafting_flops_follow_the_block():
    b16, b7 = decisions.run_shape("dspark", {}), decisions.run_shape("dspark-b7", {})
    f16, f7 = decisions.drafting_flops(b16), decisions.drafting_flops(b7)
    assert b16.num_drafts == 16 and b7.num_drafts == 7  # DSpark drafts from slot 0 (anchor-first)
    assert f16["lm_head"] * 7 == f7["lm_head"] * 16 and f16["matmul"] * 7 == f7["matmul"] * 16
    assert f7["total"] < f16["total"] / 2
    # a summary whose block says it was not the catalog's run gets no shape (and no per-FLOP rows)
    assert decisions.run_shape("dspark-b7", {"block_size": 16}) is None
    assert decisions.run_shape("not-a-run", {}) is None


def test_pooled_mean_se_against_the_plain_formulas():
    values = [1.0, 3.0, 2.0, 0.0, 4.0]
    mean, se = pooled_mean_se([[v] for v in values])  # one value a response: the ordinary SE of a mean
    assert mean == pytest.approx(2.0) and se == pytest.approx(statistics.stdev(values) / math.sqrt(5))
    groups = [[1, 3], [2, 2], [0, 4], [5, 1]]  # equal sizes: the SE of the responses' means
    mean, se = pooled_mean_se(groups)
    means = [sum(g) / 2 for g in groups]
    assert mean == pytest.approx(18 / 8) and se == pytest.approx(statistics.stdev(means) / 2)
    assert pooled_mean_se([[2, 4]]) == (3.0, None) and pooled_mean_se([[], []]) == (None, None)
    s = llama_cpp_summary({"llama_server": {"rounds": [[1, 3, 5], [2], [0, 1]]}})["llama_server"]
    assert s["first_round_accepted"] == pytest.approx(1.0)
    assert s["first_round_se"] == pytest.approx(statistics.stdev([1, 2, 0]) / math.sqrt(3))
    assert s["later_rounds_accepted"] == pytest.approx(3.0) and s["later_rounds_se"] is not None


def _row(bench, sampling, tau, se):
    return {"bench": bench, "sampling": sampling, "tau_mean": tau, "tau_mean_se": se}


def _write(folder, name, rows, **extra):
    summary = {"name": name, "benchmarks": rows, "final": {}, **extra}
    (folder / f"{name}.json").write_text(json.dumps(summary))


def test_decisions_ordering_and_noise_from_summaries(tmp_path):
    base = [_row("heldout", "greedy", 2.0, 0.1), _row("mbpp", "greedy", 1.5, 0.05)]
    _write(tmp_path, "v1", base, llama_cpp=llama_cpp_summary({"llama_server": {"rounds": [[4, 1], [2, 1, 0]]}}))
    _write(tmp_path, "v1-seed1", [_row("heldout", "greedy", 2.05, 0.1), _row("mbpp", "greedy", 1.45, 0.05)])
    _write(tmp_path, "dflash2", [_row("heldout", "greedy", 2.5, 0.1), _row("mbpp", "greedy", 1.6, 0.05)])
    _write(tmp_path, "dspark", [_row("heldout", "greedy", 1.6, 0.1), _row("mbpp", "greedy", 1.5, 0.05)],
           block_size=16)
    # the anchor: later rounds unchanged, first round lower; summaries of the first GPU run lack the SEs
    _write(tmp_path, "v1-noanchor", base, llama_cpp=llama_cpp_summary({"llama_server": {"rounds": [[1, 1], [1, 1, 0]]}}))
    _write(tmp_path, "dspark-b7", [_row("heldout", "greedy", 1.5, 0.1), _row("mbpp", "greedy", 1.4, 0.05)],
           block_size=7)
    _write(tmp_path, "lilicorr", [_row("heldout", "greedy", 2.7, 0.1), _row("mbpp", "greedy", 1.5, 0.05)])
    _write(tmp_path, "v1-kl", [_row("heldout", "greedy", 2.0, 0.1)], llama_cpp={
        "llama_server": {"first_round_accepted": 1.0, "later_rounds_accepted": 0.5}})
    md, js = table.write(tmp_path, tmp_path / "out")
    dec = json.loads(js.read_text())["decisions"]

    order = {(e["run"], r["bench"]): r for e in dec["ordering"] for r in e["rows"]}
    assert order["dflash2", "heldout"]["delta"] == pytest.approx(0.5)
    assert order["dflash2", "heldout"]["se"] == pytest.approx(math.sqrt(0.02)) and order["dflash2", "heldout"]["significant"]
    assert not order["dflash2", "mbpp"]["significant"]  # 0.1 / 0.0707 = 1.4 SE
    assert order["dspark", "heldout"]["z"] == pytest.approx(-0.4 / math.sqrt(0.02))
    verdicts = {e["run"]: (e["better"], e["worse"], e["tau_rows"]) for e in dec["ordering"] + dec["noise"]}
    assert verdicts == {"dflash2": (1, 0, 2), "dspark": (0, 1, 2), "lilicorr": (1, 0, 2), "v1-seed1": (0, 0, 2)}
    assert order["lilicorr", "heldout"]["delta"] == pytest.approx(0.7)
    # against the seed twin's own difference on each row (+0.05 held-out, -0.05 mbpp)
    assert order["dflash2", "heldout"]["seed_delta"] == pytest.approx(0.05) and order["dflash2", "heldout"]["beyond_noise"]
    assert order["dflash2", "mbpp"]["beyond_noise"] is False  # not significant to begin with
    beyond = {e["run"]: (e["better_beyond_noise"], e["worse_beyond_noise"], e["noise_rows"]) for e in dec["ordering"]}
    assert beyond == {"dflash2": (1, 0, 2), "dspark": (0, 1, 2), "lilicorr": (1, 0, 2)}

    decided = {e["run"]: e for e in dec["decision"]}
    assert set(decided) == {"v1-noanchor", "dspark-b7", "v1-kl", "lilicorr"}
    # LiLiCorr's second comparison, against DFlash2: +0.2 at 1.4 SE, -0.1 at 1.4 SE
    assert decided["lilicorr"]["against"] == "dflash2" and decided["lilicorr"]["question"] == "LiLiCorr against DFlash2"
    assert (decided["lilicorr"]["better"], decided["lilicorr"]["worse"], decided["lilicorr"]["tau_rows"]) == (0, 0, 2)
    assert {r["bench"]: r["delta"] for r in decided["lilicorr"]["rows"]} == pytest.approx({"heldout": 0.2, "mbpp": -0.1})
    missing = [(m["run"], m["against"], m["lacks"]) for m in dec["missing"]]
    assert sorted(missing) == [("dflash2-b16", "dflash2", ["dflash2-b16"]), ("dflash2-b16", "v1", ["dflash2-b16"]),
                               ("dflash2-noanchor", "dflash2", ["dflash2-noanchor"]),
                               ("dspark-sizing", "dspark", ["dspark-sizing"]), ("lilicorr-v1", "dflash2", ["lilicorr-v1"]),
                               ("lilicorr-v1", "lilicorr", ["lilicorr-v1"]), ("lilicorr-v1", "v1", ["lilicorr-v1"]),
                               ("v1-b8", "dflash2", ["v1-b8"]), ("v1-b8", "v1", ["v1-b8"]), ("v1-fp8", "v1", ["v1-fp8"]),
                               ("v1-full", "v1", ["v1-full"])]
    rounds = {r["measure"]: r for r in decided["v1-noanchor"]["rows"] if r["measure"].startswith("llama_server")}
    first = rounds["llama_server first round accepted"]
    assert (first["baseline"], first["value"]) == (3.0, 1.0)
    se_v1 = statistics.stdev([4, 2]) / math.sqrt(2)  # v1-noanchor's first rounds are all 1: SE 0
    assert first["se"] == pytest.approx(se_v1) and first["z"] == pytest.approx(-2.0 / se_v1)
    assert first["significant"] is (2.0 / se_v1 >= 2)
    assert rounds["llama_server later rounds accepted"]["delta"] == pytest.approx(0.0)
    assert all(r["measure"] == "tau" for r in decided["v1-kl"]["rows"])  # no rounds asked of this decision

    b7 = decided["dspark-b7"]
    f16 = decisions.drafting_flops(decisions.run_shape("dspark", {}))["total"]
    f7 = decisions.drafting_flops(decisions.run_shape("dspark-b7", {}))["total"]
    assert b7["drafting_gflops"] == pytest.approx({"baseline": f16 / 1e9, "run": f7 / 1e9})
    per = {r["bench"]: r for r in b7["rows"] if r["measure"] == "tau per drafting GFLOP"}
    assert per["heldout"]["baseline"] == pytest.approx(1.6e9 / f16) and per["heldout"]["value"] == pytest.approx(1.5e9 / f7)
    assert per["heldout"]["se"] == pytest.approx(math.hypot(0.1e9 / f16, 0.1e9 / f7))
    assert per["heldout"]["significant"]  # fewer drafts a cycle: less tau, far more tau per FLOP
    cycle = {r["bench"]: r for r in b7["rows"] if r["measure"] == "tau"}
    assert not cycle["heldout"]["significant"] and cycle["mbpp"]["delta"] == pytest.approx(-0.1)

    text = md.read_text()
    assert "| instruction -> code | greedy | 1.500 ± 0.050 | +0.100 ± 0.071 (+1.4) | +0.000 ± 0.071 (+0.0) | " \
           "+0.000 ± 0.071 (+0.0) | -0.050 ± 0.071 (-0.7) |" in text
    assert "- `lilicorr` against `v1`: better at >= 2 SE on 1 of 2 set/sampling rows, worse on 0" in text
    assert "| prose (held-out docs) | greedy | 2.000 ± 0.100 | +0.500 ± 0.141 (+3.5) *† |" in text
    assert "beyond 2x the seed twin's difference: better on 1 of 2, worse on 0" in text
    assert "- `dspark` against `v1`: better at >= 2 SE on 0 of 2 set/sampling rows, worse on 1" in text
    assert "| llama_server later rounds accepted | 0.667 | 0.667 | +0.000 ± " in text
    assert "| v1-kl | v1 | prose (held-out docs) | greedy | tau | 2.000 | 2.000 | +0.000 ± 0.141 (+0.0) |" in text
    assert "not in this folder: `v1-fp8` against `v1`" in text
    assert f"(drafting GFLOPs a cycle: `dspark` {f16 / 1e9:.3f}, `dspark-b7` {f7 / 1e9:.3f})" in text


def test_rounds_without_standard_errors_never_count(tmp_path):
    old = {"llama_server": {"first_round_accepted": 3.0, "later_rounds_accepted": 1.0}}  # the first run's format
    _write(tmp_path, "v1", [_row("heldout", "greedy", 2.0, 0.1)], llama_cpp=old)
    _write(tmp_path, "v1-noanchor", [_row("heldout", "greedy", 2.0, 0.1)],
           llama_cpp={"llama_server": {"first_round_accepted": 1.0, "later_rounds_accepted": 1.0}})
    md, js = table.write(tmp_path, tmp_path)
    rows = json.loads(js.read_text())["decisions"]["decision"][0]["rows"]
    first = next(r for r in rows if r["measure"] == "llama_server first round accepted")
    assert first["delta"] == pytest.approx(-2.0) and first["se"] is None and first["significant"] is False
    assert "-2.000 (no SE)" in md.read_text()


def _eval_report(taus_cycles: list[list[int]], rounds: list[list[int]]) -> dict:
    """The parts of `python -m dflash_ds.eval --out`'s report the summary reads (eval/tau.py as_dict)."""
    per = [sum(c) / len(c) for c in taus_cycles]
    return {"tau_mean": sum(per) / len(per), "tau_pooled": sum(map(sum, taus_cycles)) / sum(map(len, taus_cycles)),
            "num_responses": len(per), "position_acceptance": [0.5, 0.25], "tau_per_response": per,
            "cycles": taus_cycles, "llama_cpp": {"spec_draft_n_max": 15, "llama_server": {"rounds": rounds}}}


def _run_dir(folder, *, indomain: dict | None):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 1.5, "time": 1.0}) + "\n")
    (folder / "lab_eval.json").write_text(json.dumps(_eval_report([[2, 3], [1]], [[1, 2], [0]])))
    if indomain is not None:
        (folder / "lab_eval_indomain.json").write_text(json.dumps(indomain))
    return folder


def test_summary_with_and_without_the_in_domain_evaluation(tmp_path):
    from lab.runs import summarize

    cycles = [[3, 1, 2], [4], [1, 1]]
    s = summarize(_run_dir(tmp_path / "new", indomain=_eval_report(cycles, [[2, 1], [3], [0, 0]])), "v1")
    g = s["indomain_greedy"]
    per = [2.0, 4.0, 1.0]
    assert g["tau_mean"] == pytest.approx(7 / 3) and g["tau_mean_se"] == pytest.approx(statistics.stdev(per) / math.sqrt(3))
    assert g["tau_pooled"] == pytest.approx(12 / 6) and g["responses"] == 3 and g["position_acceptance"] == [0.5, 0.25]
    assert (g["tau_pooled"], g["tau_pooled_se"]) == pytest.approx(pooled_mean_se(cycles))
    first = s["llama_cpp_indomain"]["llama_server"]
    assert first["first_round_accepted"] == pytest.approx(5 / 3) and first["responses"] == 3
    assert s["heldout_greedy"]["tau_mean"] == pytest.approx(1.75)  # the held-out one, unchanged
    # a run evaluated before the in-domain set existed (or from an older archive): none, and it still draws
    old = summarize(_run_dir(tmp_path / "old", indomain=None), "v1-noanchor")
    assert old["indomain_greedy"] is None and old["llama_cpp_indomain"] is None
    assert ("indomain", "greedy") in decisions.rows_of(s) and ("indomain", "greedy") not in decisions.rows_of(old)
    out = tmp_path / "out"
    out.mkdir()
    for x in (s, old):
        (out / f"{x['name']}.json").write_text(json.dumps(x))
    md, _ = table.write(out, out)
    assert "llama.cpp's count (in-domain, greedy)" in md.read_text()
    (out / "v1.json").write_text(json.dumps(dict(s, indomain_greedy=None, llama_cpp_indomain=None)))
    md, js = table.write(out, out)
    text = md.read_text()
    assert "(in-domain, greedy)" not in text and "in-domain (training projects)" not in text
    assert "## llama.cpp's count (held-out prose, greedy)" in text and json.loads(js.read_text())["sets"] == []


def _indomain(tau, se, first_rounds):
    return {"indomain_greedy": {"tau_mean": tau, "tau_mean_se": se, "tau_pooled": tau, "responses": 4,
                                "position_acceptance": [0.6]},
            "llama_cpp_indomain": llama_cpp_summary({"llama_server": {"rounds": [[f, 1] for f in first_rounds]}})}


def test_the_anchor_decision_is_read_in_domain_as_well(tmp_path):
    held = [_row("heldout", "greedy", 2.0, 0.1)]
    _write(tmp_path, "v1", held, **_indomain(3.0, 0.1, [4, 2, 3, 3]))
    _write(tmp_path, "v1-seed1", held, **_indomain(3.1, 0.1, [3, 3, 3, 3]))
    _write(tmp_path, "v1-noanchor", held, **_indomain(2.5, 0.1, [1, 1, 2, 0]))
    md, js = table.write(tmp_path, tmp_path / "out")
    dec = json.loads(js.read_text())["decisions"]
    anchor = next(e for e in dec["decision"] if e["run"] == "v1-noanchor")
    rows = {(r["measure"], r["bench"]): r for r in anchor["rows"]}
    tau = rows["tau", "indomain"]
    assert tau["delta"] == pytest.approx(-0.5) and tau["se"] == pytest.approx(math.sqrt(0.02)) and tau["significant"]
    # read against the seed twin's own in-domain difference (+0.1): -0.5 is more than twice it
    assert tau["seed_delta"] == pytest.approx(0.1) and tau["beyond_noise"] is True
    assert (anchor["tau_rows"], anchor["worse"], anchor["worse_beyond_noise"]) == (2, 1, 1)
    first = rows["llama_server first round accepted", "indomain"]
    assert (first["baseline"], first["value"]) == pytest.approx((3.0, 1.0))
    se_first = math.hypot(statistics.stdev([4, 2, 3, 3]) / 2, statistics.stdev([1, 1, 2, 0]) / 2)
    assert first["se"] == pytest.approx(se_first) and first["significant"]
    assert rows["llama_server later rounds accepted", "indomain"]["delta"] == pytest.approx(0.0)
    assert ("llama_server first round accepted", "heldout") not in rows  # no held-out count in these summaries
    text = md.read_text()
    assert "| in-domain (training projects) | greedy | 3.000 ± 0.100 | 3.100 ± 0.100 | 2.500 ± 0.100 |" in text
    assert "| in-domain (training projects) | greedy | llama_server first round accepted | 3.000 | 1.000 |" in text
    assert "## llama.cpp's count (in-domain, greedy)" in text
