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
                          "drafter_wait_share": 0.1, "target_send_wait_share": 0.25}, 10)
    for part in ("step 5/10", "12,346 tok/s", "ETA 1:02:05", "loss 1.5000", "accept 2.25", "target 9,000",
                 "in flight 2", "data wait 10%", "send wait 25%"):
        assert part in line, (part, line)
