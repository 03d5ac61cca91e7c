"""A run's summary from its log (lab/logs.py): the benchmark rows the table printed, read back
as benchmarks.json has them, and the last training progress line."""

from __future__ import annotations

import pytest

from dflash_ds.eval.benchmark_table import table_lines
from lab.logs import bench_rows, last_progress, summary_from_log

pytestmark = pytest.mark.unit


def _row(bench, sampling, tau, se, *, expected=None, engines=(None, None), pos=(0.5, None)):
    return {"bench": bench, "sampling": sampling, "tau_mean": tau, "tau_mean_se": se, "tau_pooled": round(tau - 0.1, 3),
            "tau_pooled_se": round(se / 2, 3), "tau_expected": expected, "tau_expected_se": None if expected is None else 0.004,
            "position_acceptance": list(pos), "responses": 32, "cycles": 3039, "block_size": len(pos) + 1,
            "llama_server": engines[0], "vllm": engines[1]}


def test_printed_rows_read_back_as_written():
    rows = [_row("heldout", "greedy", 1.208, 0.085, engines=(1.155, 1.154), pos=(0.12, 0.05, 1.0)),
            _row("mt_bench", "T=1", 1.046, 0.008, expected=1.039, pos=(0.04, None, None)),
            _row("humaneval", "T=0.7 top_p=0.9", 2.5, 0.25, pos=(0.75, 0.5, 0.25))]
    text = "\n".join(f"[dflash] {line}" for line in table_lines(rows))
    # a cut evaluation rerun prints a row again: it counts once
    text += "\n[dflash] " + table_lines(rows[:1])[1] + "\nstep 20/700 | 2,235 tok/s | ETA 20:46 | loss 6.3783 | accept 1.07 |"
    assert bench_rows(text) == rows
    assert last_progress(text) == {"step": 20, "max_steps": 700, "loss": 6.3783, "accept": 1.07}


def test_summary_from_a_log_names_the_run_and_its_source(tmp_path):
    log = tmp_path / "dspark-b7.log"
    rows = [_row("heldout", "greedy", 1.694, 0.13, pos=(0.36,) * 6)]
    log.write_text("step 700/700 | 31,979 tok/s | ETA 00:00 | loss 4.6812 | accept 1.38 | l1 1.6886\n"
                   + "\n".join(f"[dflash] {line}" for line in table_lines(rows)) + "\n")
    s = summary_from_log(log, "dspark-b7")
    assert (s["architecture"], s["block_size"], s["seed"]) == ("dspark", 7, 0)
    assert s["benchmarks"] == rows and s["final"]["step"] == 700 and s["final"]["loss"] == 4.6812
    assert s["source"] == "log" and s["benchmarks_complete"] is False
    assert bench_rows("[dflash] bench      sampling   tau_mean\nno rows here") == []
