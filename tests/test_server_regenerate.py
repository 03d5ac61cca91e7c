"""Regeneration through a real OpenAI-compatible server (`transformers serve` running the tiny target on
CPU): agreement with in-process greedy generation, a server killed and restarted mid-run, failure
accounting, and the recipe flow regenerate -> prepare."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import pytest

from dflash_ds.data import prepare as D
from dflash_ds.data import regenerate as R

from .launch_util import cpu_env, free_port

# Each test starts a `transformers serve` process.
pytestmark = pytest.mark.launcher

ROOT = Path(__file__).resolve().parents[1]
TINY = "assets/tiny-target"  # the server pins this exact string as its model name
CHAT = ROOT / "assets" / "tiny_chat.jsonl"


class Server:
    """`transformers serve` on a fixed port; start, SIGKILL, restart."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
        assert exe, "transformers serve is not installed (pip install 'transformers[serving]')"
        self.cmd = [exe, "serve", TINY, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                    "--dtype", "float32"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> None:
        with self.log.open("a") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=cpu_env(HF_HUB_DISABLE_UPDATE_CHECK="1"),
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("server did not become ready:\n" + self.log.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(free_port(), tmp_path_factory.mktemp("server") / "serve.log")
    s.start()
    yield s
    s.kill()


def make_cfg(tmp_path, src, out, urls, **rs):
    regen = dict(enabled=False, output_dir=str(tmp_path / out), max_new_tokens=16, temperature=0.0, top_p=1.0,
                 backend="server", urls=tuple(urls), served_model=None, concurrency=2, timeout_s=60.0,
                 max_retries=8, backoff_s=0.5, max_failed_fraction=0.0)
    regen.update(rs)
    return types.SimpleNamespace(
        path=str(src), split="train", max_samples=None, max_length=256, pack=True, truncation="drop",
        thinking=False, cache_dir=str(tmp_path / "cache"), seed=0, eval_path=None, eval_split="train",
        num_eval=2, num_proc=1, regenerate=types.SimpleNamespace(**regen))


def read_shards(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("part-*.jsonl")) for line in f.read_text().splitlines()]


def source(tmp_path, n_multi=3, n=9) -> Path:
    lines = CHAT.read_text().splitlines(keepends=True)
    picked = [ln for ln in lines if len(json.loads(ln)["messages"]) >= 4][:n_multi] + lines[:n - n_multi]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(picked))
    return src


def test_server_matches_in_process_greedy_and_survives_a_kill(tmp_path, server, monkeypatch):
    monkeypatch.setattr(R, "SHARD_SIZE", 3)
    src = source(tmp_path, n_multi=3, n=6)
    # Reference: in-process greedy generation (the hf backend), same prompts and thinking switch.
    ref = R.regenerate(make_cfg(tmp_path, src, "hf", (), backend="hf"), TINY, verbose=False)
    want = read_shards(tmp_path / "hf")
    assert ref["samples_in"] == 6 and len(want) >= 4 and any(len(r["messages"]) >= 4 for r in want)

    # transformers serve counts the end-of-turn token against max_tokens and reports "length" when the
    # budget is used exactly, even if that last token ended the turn: one more token gives the same
    # finished/unfinished verdicts as generate(max_new_tokens=16).
    got = R.regenerate(make_cfg(tmp_path, src, "server", [server.url], max_new_tokens=17), TINY, verbose=False)
    assert read_shards(tmp_path / "server") == want  # enable_thinking reached the template; greedy agrees
    assert got["failed_samples"] == 0 and got["completion_tokens"] > 0 and got["requests"] >= 6

    # Killed (SIGKILL) after the first shard and restarted on the same port: nothing lost or repeated.
    out = tmp_path / "killed"
    cfg = make_cfg(tmp_path, src, "killed", [server.url], max_new_tokens=17)
    result = {}
    runner = threading.Thread(target=lambda: result.update(R.regenerate(cfg, TINY, verbose=False)))
    runner.start()
    deadline = time.time() + 60
    while not (out / "part-00000.jsonl").exists():
        assert time.time() < deadline and runner.is_alive(), "the first shard never appeared"
        time.sleep(0.02)
    server.kill()
    time.sleep(1.0)  # requests now meet a refused connection and back off
    server.start()
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert result["retries"] > 0 and result["failed_samples"] == 0, result
    assert read_shards(out) == want
    assert R.check_complete(out)["num_shards"] == 2
    assert not list(out.glob(".*.tmp-*"))


def test_failures_are_counted_and_fatal_above_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "SHARD_SIZE", 3)
    src = source(tmp_path, n_multi=0, n=6)
    dead = [f"http://127.0.0.1:{free_port()}"]
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)  # backoff waits recorded, not slept
    with pytest.raises(RuntimeError, match="data.regenerate.max_failed_fraction.*3 of 3"):
        R.regenerate(make_cfg(tmp_path, src, "a", dead, max_retries=3, backoff_s=0.5), TINY, verbose=False)
    assert sorted(sleeps) == sorted([0.5, 1.0, 2.0] * 3)  # exponential backoff, per request
    assert not list((tmp_path / "a").glob("part-*"))  # the failed shard was not written
    done = R.regenerate(make_cfg(tmp_path, src, "b", dead, max_retries=0, max_failed_fraction=1.0), TINY,
                        verbose=False)
    assert done["failed_samples"] == 6 and done["samples_out"] == 0 and done["shards_written"] == 2


def test_recipe_flow_regenerate_then_prepare(tmp_path, server, capsys, monkeypatch):
    """`python -m dflash_ds.regenerate RECIPE` writes where `python -m dflash_ds.data prepare RECIPE` (and
    training) reads; before it ran, preparation names the command."""
    monkeypatch.chdir(ROOT)
    src = source(tmp_path, n_multi=2, n=8)
    overrides = [f"data.path={src}", "data.eval_path=null", "data.num_eval=2", "data.regenerate.enabled=true",
                 f"data.regenerate.urls=[{server.url}]", "data.regenerate.max_new_tokens=16",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ValueError, match=r"python -m dflash_ds\.regenerate recipes/tiny\.yaml"):
        D.main(["prepare", "recipes/tiny.yaml"] + overrides)
    assert R.main(["recipes/tiny.yaml"] + overrides) == 0
    assert "training reads it: deepspeed launch.sh recipes/tiny.yaml" in capsys.readouterr().out
    regenerated = tmp_path / "cache" / "regenerated"
    assert D.main(["prepare", "recipes/tiny.yaml"] + overrides) == 0
    report = json.loads(next((tmp_path / "cache").glob("*/report.json")).read_text())
    assert report["source"] == str(regenerated) and report["samples"] == len(read_shards(regenerated)) - 2
