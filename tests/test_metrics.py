import os
from types import SimpleNamespace

import pytest

from dflash_ds.metrics import Metrics, progress_line, read_metrics, read_status, write_status


@pytest.mark.launcher  # wandb starts its wandb-core service process
def test_metrics_jsonl_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline needs no key and no network
    m = Metrics(tmp_path, {"optim": {"lr": 1e-3}}, SimpleNamespace(enabled=True, project="p", mode="offline"), "run")
    m.log({"step": 1, "loss": 2.5, "tau_histogram": [1, 2]})
    m.log({"step": 2, "loss": 2.0})
    m.close()
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["loss"] == 2.5
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, os.listdir(tmp_path)


def test_disabled_on_non_lead_ranks(tmp_path):
    m = Metrics(tmp_path, {}, SimpleNamespace(enabled=False, project="p", mode="offline"), "run", enabled=False)
    m.log({"step": 1})
    assert read_metrics(tmp_path) == []


def test_status_files_and_progress_line(tmp_path):
    write_status(tmp_path, 3, {"tok_per_s": 9000.0, "send_wait_share": 0.25, "in_flight": 2})
    assert read_status(tmp_path) == [{"tok_per_s": 9000.0, "send_wait_share": 0.25, "in_flight": 2}]
    line = progress_line({"step": 5, "tok_per_s": 12345.6, "eta_s": 3725, "loss": 1.5, "accept_proxy": 2.25,
                          "target_tok_per_s": 9000.0, "drafter_tok_per_s": 12345.6, "in_flight": 2,
                          "drafter_wait_share": 0.1, "drafter_sync_share": 0.125, "target_send_wait_share": 0.25}, 10)
    for part in ("step 5/10", "12,346 tok/s", "ETA 1:02:05", "loss 1.5000", "accept 2.25", "target 9,000",
                 "in flight 2", "data wait 10%", "sync stall 12%", "send wait 25%"):
        assert part in line, (part, line)


def test_target_rates_are_windowed_like_the_drafter_figure(tmp_path):
    """A target that starts slowly and then runs at 10K tok/s: the since-start average still shows
    much less after 4 windows, the windowed figure shows 10K from the first steady window on."""
    from dflash_ds.metrics import TargetWindow, target_counters

    win = TargetWindow()
    write_status(tmp_path, 1, target_counters(1, 0, 100.0, 0, send_wait_s=0.0, in_flight=0,
                                              now=100.0))  # the loop-start report
    assert win.update(read_status(tmp_path)) == {}  # nothing measured yet
    # First window: 20 s of warm-up producing 20K tokens while waiting 5 s to send.
    tokens, wait, now = 20_000, 5.0, 120.0
    write_status(tmp_path, 1, target_counters(1, 10, 100.0, tokens, send_wait_s=wait, in_flight=3, now=now))
    first = win.update(read_status(tmp_path))
    assert first["target_tok_per_s"] == 1000.0 and first["target_send_wait_share"] == 0.25 and first["in_flight"] == 3
    for _ in range(4):  # then 10 s windows of 100K tokens, waiting 1 s each
        tokens, wait, now = tokens + 100_000, wait + 1.0, now + 10.0
        write_status(tmp_path, 1, target_counters(1, 0, 100.0, tokens, send_wait_s=wait, in_flight=2, now=now))
        got = win.update(read_status(tmp_path))
        assert got["target_tok_per_s"] == 10_000.0 and abs(got["target_send_wait_share"] - 0.1) < 1e-12
    assert tokens / (now - 100.0) < 7_500  # what the since-start average would have shown
    # A read with no new report keeps the last window's figure instead of dividing by zero.
    assert win.update(read_status(tmp_path))["target_tok_per_s"] == 10_000.0
    # Two target ranks: the per-GPU mean of their windows; a new run in the same directory
    # (another start) is measured from its own start, not against the old run's counters.
    write_status(tmp_path, 2, target_counters(2, 0, 500.0, 30_000, send_wait_s=0.0, in_flight=1, now=510.0))
    tokens, now = tokens + 50_000, now + 10.0
    write_status(tmp_path, 1, target_counters(1, 0, 100.0, tokens, send_wait_s=wait, in_flight=2, now=now))
    got = win.update(read_status(tmp_path))
    assert got["target_tok_per_s"] == (5_000.0 + 3_000.0) / 2 and got["in_flight"] == 3
