"""The bench's FP8 drafter parts on CPU: steadiness of the timed steps, the precision modes, the lm_head
A/B and the quality role, at toy size.

FP8 drafters are refused on CPU (no FP8 matmul); the smoke runs of the FP8 modes lift that refusal in
the test's own process (tests/fp8_cpu_bench.py), so the same code runs as on a GPU: torchao's float8
layers under the ZeRO-2 engine, and the FP8 lm_head through its CPU emulation."""

import math
from pathlib import Path

import pytest

from dflash_ds import bench
from dflash_ds.bench.fp8_modes import Mode, parse_mode, parse_modes, with_mode
from dflash_ds.bench.fp8_quality import summarize, summary_text
from dflash_ds.bench.timing import drift_warnings, steadiness
from tests.test_bench import run_concurrently

REPO = Path(__file__).resolve().parent.parent
TOY = ["--device", "cpu", "--geometry", "tiny", "--seq-len", "64", "--rows", "2", "--anchors", "8", "--block-size", "4",
       "--steps", "4", "--warmup", "1"]


def test_steadiness_flags_drift_and_a_mean_pulled_by_slow_steps():
    assert steadiness([1.0, 1.0, 1.0])["steady"] is None  # too few steps to tell
    st = steadiness([1.0, 1.02, 0.99, 1.01, 1.0, 1.0])
    assert st["steady"] is True and abs(st["drift"]) < 0.05 and drift_warnings({"steadiness": st}) == []
    st = steadiness([1.0, 1.0, 1.2, 1.2])
    assert st["halves_median_s"] == [1.0, 1.2] and st["drift"] == pytest.approx(0.2) and st["steady"] is False
    assert "still drift" in drift_warnings({"steadiness": st})[0] and "+20.0%" in drift_warnings({"steadiness": st})[0]
    # One slow step of six: the halves' medians agree, the mean does not.
    st = steadiness([1.0, 1.0, 3.0, 1.0, 1.0, 1.0])
    assert st["steady"] is True and st["mean_over_median"] == pytest.approx(4 / 3)
    assert "median rate" in drift_warnings({"steadiness": st})[0]


def test_modes_parse_and_set_the_recipe_and_seed():
    assert parse_mode("bf16") == Mode("bf16", "none", False, None)
    assert parse_mode("rowwise+lm_head@3") == Mode("rowwise+lm_head@3", "rowwise", True, 3)
    assert parse_mode("lm_head") == Mode("lm_head", "none", True, None)
    assert [m.layers for m in parse_modes("bf16, tensorwise")] == ["none", "tensorwise"]
    for bad in ("rows", "bf16+rowwise", "rowwise@x", "lm_head+lm_head"):
        with pytest.raises(ValueError, match="is not a mode"):
            parse_mode(bad)
    with pytest.raises(ValueError, match="distinct"):
        parse_modes("bf16,bf16")
    args = bench.parse_args(["--role", "drafter", *TOY])
    setup = bench.resolve_setup(args, bench.pick_device("cpu"))
    s = with_mode(setup, parse_mode("rowwise+lm_head@5"))
    assert (s.recipe.drafter.fp8.layers, s.recipe.drafter.fp8.lm_head) == ("rowwise", True)
    assert s.recipe.run.seed == 5 and s.args.seed == 5 and s.run.settings.seed == 5
    assert setup.recipe.drafter.fp8.layers == "none" and setup.args.seed == 0  # the original is untouched


def test_the_lm_head_chunk_is_the_fused_losss():
    from dflash_ds.bench.fp8_head_ab import chunk_rows

    args = bench.parse_args(["--role", "lm_head", "--device", "cpu"])  # the flagship recipe's rows
    setup = bench.resolve_setup(args, bench.pick_device("cpu"))
    assert chunk_rows(setup) == 1 * 2048 * 15 // 16


def _quality(losses: dict[str, list[float]], lm_head=()) -> dict:
    modes = {n: {"layers": "none" if n.startswith("bf16") else "rowwise", "lm_head": n in lm_head, "loss": v,
                 "accept": [1.0] * len(v), "steps_done": len(v)} for n, v in losses.items()}
    return {"modes": modes}


def test_summary_reads_final_losses_against_the_seed_noise():
    a = [5.0] * 90 + [2.0] * 10  # final (last tenth): 2.0
    b = [5.0] * 90 + [2.1] * 10  # the second seed: noise 0.1
    c = [5.0] * 90 + [2.3] * 10 + [0.0] * 20  # 120 steps: read on the 100 all reached
    s = summarize([_quality({"bf16": a, "bf16@1": b}), _quality({"rowwise+lm_head": c}, lm_head=("rowwise+lm_head",))])
    assert s["steps"] == 100 and s["tail_steps"] == 10 and s["baseline"] == "bf16"
    assert s["final_loss"] == pytest.approx({"bf16": 2.0, "bf16@1": 2.1, "rowwise+lm_head": 2.3})
    assert s["noise"] == pytest.approx(0.1)
    assert s["vs_baseline_over_noise"]["rowwise+lm_head"] == pytest.approx(3.0)
    assert len(s["curves"]["bf16"]) == len(s["curve_steps"]) == 12
    text = summary_text(s)
    assert "(+3.00 x noise)" in text and "run-to-run noise" in text


def test_fp8_modes_are_refused_on_cpu_before_anything_is_built(capsys):
    rc = bench.main(["--role", "drafter", *TOY, "--compile-layers", "--fp8-modes", "bf16,rowwise"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--fp8-modes rowwise: drafter.fp8.layers=rowwise needs an FP8 GPU" in err
    rc = bench.main(["--role", "drafter", *TOY, "--fp8-modes", "tensorwise"])
    assert rc == 2 and "--compile-layers" in capsys.readouterr().err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_concurrently({
        "modes": [str(REPO / "tests" / "fp8_cpu_bench.py"), "--role", "drafter", *TOY, "--compile-layers",
                  "--fp8-modes", "bf16,rowwise,tensorwise+lm_head"],
        "lm_head": ["-m", "dflash_ds.bench", "--role", "lm_head", *TOY],
        "quality": ["-m", "dflash_ds.bench", "--role", "quality", "--device", "cpu", "--recipe", "recipes/tiny.yaml",
                    "--seq-len", "256", "--rows", "1", "--anchors", "16", "--block-size", "4", "--steps", "12",
                    "--fp8-modes", "bf16,bf16@1"],
    }, tmp_path_factory.mktemp("bench_fp8"), 300)


@pytest.mark.launcher
def test_every_mode_builds_its_own_drafter_and_is_timed(runs):
    r = runs["modes"]["result"]
    table = r["fp8_modes"]
    assert list(table) == ["bf16", "rowwise", "tensorwise+lm_head"]
    layers = 2 * 7  # the tiny geometry's two drafter layers, 7 projections each
    assert [table[m]["fp8_layers"] for m in table] == [0, layers, layers]
    assert [table[m]["lm_head_fp8"] for m in table] == [False, False, True]
    assert table["bf16"]["vs_first"] == 1.0
    for row in table.values():
        assert len(row["step_s"]["all"]) == 4 and row["compile"]["timed"]["unique_graphs"] == 0
        assert row["vs_first"] == pytest.approx(row["tok_s"] / table["bf16"]["tok_s"])
    assert r["tok_s"] == table["tensorwise+lm_head"]["tok_s"]  # the JSON's rate is the last mode's
    assert "mode rowwise" in runs["modes"]["log"]


@pytest.mark.launcher
def test_lm_head_role_times_every_variant_against_float64(runs):
    r = runs["lm_head"]["result"]
    assert r["chunk_rows"] == 3 and r["vocab"] == 512  # ceil(2 rows x 8 anchors x 3 slots / 16 loss chunks)
    v = r["lm_head"]
    assert set(v) == {"bf16", "fp8", "fp8 fast-accum grad"}  # torchao's float8 inference is a GPU path
    assert v["bf16"]["logits_rel_rms"] < 1e-5 and v["bf16"]["speedup_vs_bf16"] == 1.0  # float32 on CPU
    for name in ("fp8", "fp8 fast-accum grad"):
        assert 5e-3 < v[name]["logits_rel_rms"] < 0.1 and 5e-3 < v[name]["input_grad_rel_rms"] < 0.1
        assert v[name]["logits_ms"] > 0 and v[name]["input_grad_ms"] > 0


@pytest.mark.launcher
def test_quality_role_trains_each_mode_on_the_bundled_conversations(runs):
    r = runs["quality"]["result"]
    assert r["rows"] > 10 and r["steps"] == 12
    for mode in ("bf16", "bf16@1"):
        m = r["modes"][mode]
        assert m["steps_done"] == 12 and len(m["loss"]) == 12 and all(math.isfinite(x) for x in m["loss"])
    assert r["modes"]["bf16@1"]["seed"] == 1
    assert r["modes"]["bf16"]["loss"] != r["modes"]["bf16@1"]["loss"]
    assert r["summary"]["steps"] == 12 and r["summary"]["noise"] > 0
    assert "run-to-run noise" in runs["quality"]["log"]
