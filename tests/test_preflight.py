"""User-caused failures found before launch, each in one line: a recipe that is not YAML, locations
the run cannot write, wandb's service out of reach (or offline instead, when the recipe says so)."""

import http.server
import socket
import threading
import time
from pathlib import Path

import pytest

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.guard import launch

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"


# ----------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("text, where", [
    ("run:\n  name: x\n target: [\n", ":3:2:"),  # a section indented wrong
    ("run:\n  name: \"x\n", ":2:9:"),  # an unclosed quote: where it opens, not the end of the file
    ("data:\n  path: a\n  pack true\n  num_eval: 2\n", ":3:"),  # a missing ':' on line 3 (PyYAML sees it on 4)
    ("data:\n  pack true\n  path: a\n", ":2:"),  # a missing ':' that runs on into the next key
    ("data:\n  path: a\n    pack: true\n", ":2:"),  # a key indented too far runs on from the line above
])
def test_a_recipe_that_is_not_yaml_is_one_line_with_file_line_and_column(tmp_path, text, where):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{bad}{where}") and "not valid YAML" in msg


@pytest.mark.parametrize("text, key, lines", [
    ("optim:\n  lr: 1.0e-3\n  epochs: 3\nrun:\n  name: x\noptim:\n  warmup_ratio: 0.1\n", "optim", (1, 6)),
    ("optim:\n  lr: 1.0e-3\n  epochs: 3\n  lr: 2.0e-3\n", "optim.lr", (2, 4)),
    ("data:\n  path: a\neval:\n  benchmarks:\n    - heldout\n  max_new_tokens: 8\n  max_new_tokens: 9\n",
     "eval.max_new_tokens", (6, 7)),
])
def test_a_key_given_twice_in_a_recipe_names_the_key_and_both_lines(tmp_path, text, key, lines):
    # PyYAML keeps the second silently: a second optim: section would drop the first one's epochs and rate.
    bad = tmp_path / "twice.yaml"
    bad.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{bad}:{lines[1]}: key '{key}' is given twice")
    assert f"(lines {lines[0]} and {lines[1]})" in msg and "merge them" in msg


def test_anchors_and_merge_keys_are_not_taken_for_keys_given_twice(tmp_path):
    from dflash_ds.config.yaml_text import read_yaml

    assert read_yaml("a: &x {b: 1}\nc: *x\nd:\n  <<: *x\n  e: 2\n", "r.yaml") == {
        "a": {"b": 1}, "c": {"b": 1}, "d": {"b": 1, "e": 2}}
    assert read_yaml("", "r.yaml") is None


def test_an_override_that_is_not_yaml_names_the_override():
    with pytest.raises(RecipeError, match=r"override 'optim\.betas=\[0\.9': the value is not valid YAML"):
        load_recipe(TINY, ["optim.betas=[0.9"])


# ----------------------------------------------------------------------------- locations


def tiny(run_dir, *over):
    return load_recipe(TINY, [f"run.output_dir={run_dir}", *over])


def test_locations_that_are_files_or_not_writable_are_named(tmp_path):
    launch.check_locations(tiny(tmp_path / "new" / "run", f"data.cache_dir={tmp_path / 'cache'}"))  # creatable
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(RecipeError, match=rf"^run\.output_dir: {afile} is a file, not a directory"):
        launch.check_locations(tiny(afile))
    with pytest.raises(RecipeError, match=r"cannot be created \(.*afile is a file\)"):
        launch.check_locations(tiny(afile / "run"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "export").write_text("not a directory")
    with pytest.raises(RecipeError, match=r"^run\.output_dir \(export\): .*export is a file"):
        launch.check_locations(tiny(run))
    # /proc takes no new files, whoever asks (permissions would not stop root).
    with pytest.raises(RecipeError, match=r"^run\.output_dir: /proc/dflash-test/run is not writable"):
        launch.check_locations(tiny("/proc/dflash-test/run"))
    with pytest.raises(RecipeError, match=r"^data\.cache_dir: /proc/dflash-cache is not writable"):
        launch.check_locations(tiny(tmp_path / "ok", "data.cache_dir=/proc/dflash-cache"))
    assert not list(tmp_path.glob("**/.dflash-write-test-*"))  # the probes are gone


def test_an_export_directory_holding_something_else_is_refused_before_launch(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    launch.check_locations(tiny(run))  # empty: the first checkpoint writes the export there
    (run / "export" / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError) as e:
        launch.check_locations(tiny(run))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("run.output_dir (export): ") and "not a DFlash drafter export" in msg
    assert "notes.txt" in msg


# ----------------------------------------------------------------------------- the files a recipe names


def _copy_target(tmp_path, weights: bytes | None = None) -> Path:
    """assets/tiny-target with its own model.safetensors (`weights`: other bytes)."""
    model = tmp_path / "model"
    model.mkdir(parents=True)
    for f in (REPO / "assets" / "tiny-target").iterdir():
        (model / f.name).symlink_to(f)
    (model / "model.safetensors").unlink()
    data = (REPO / "assets" / "tiny-target" / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data if weights is None else weights)
    return model


def test_truncated_or_unreadable_weights_are_named_before_launch(tmp_path):
    from dflash_ds.resolve.run import resolve_run

    whole = (REPO / "assets" / "tiny-target" / "model.safetensors").read_bytes()
    for name, weights, needle in [("cut", whole[:len(whole) // 2], "is truncated"),
                                  ("garbage", b"\xff" * 64, "not a safetensors file"),
                                  ("empty", b"", "not a safetensors file")]:
        model = _copy_target(tmp_path / name, weights)
        with pytest.raises(RecipeError) as e:
            resolve_run(tiny(tmp_path / "run", f"target.path={model}"), 2)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("target.path: ") and str(model / "model.safetensors") in msg, msg
        assert needle in msg, msg
    resolve_run(tiny(tmp_path / "run", f"target.path={_copy_target(tmp_path / 'whole')}"), 2)


def test_a_sharded_checkpoint_names_the_missing_or_truncated_shard(tmp_path):
    import json

    from dflash_ds.resolve.run import resolve_run

    model = _copy_target(tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(RecipeError, match=r"model-00002-of-00002\.safetensors.*(missing|does not exist)"):
        resolve_run(tiny(tmp_path / "run", f"target.path={model}"), 2)


def test_a_truncated_init_from_export_is_named_before_launch(tmp_path):
    from dflash_ds.export import save_drafter
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.resolve.run import resolve_run

    spec = resolve_run(tiny(tmp_path / "run"), 2)
    out = save_drafter(DFlashDrafter(spec.drafter), tmp_path / "export")
    resolve_run(tiny(tmp_path / "run", f"drafter.init_from={out}"), 2)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(RecipeError) as e:
        resolve_run(tiny(tmp_path / "run", f"drafter.init_from={out}"), 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("drafter.init_from: ") and str(weights) in msg and "truncated" in msg


def test_a_relative_path_typo_is_one_line_without_the_hub(tmp_path):
    from dflash_ds.resolve.run import resolve_run

    t = time.monotonic()
    with pytest.raises(RecipeError) as e:
        resolve_run(tiny(tmp_path / "run", "target.path=assets/tiny-targt"), 2)
    msg = str(e.value)
    assert time.monotonic() - t < 3 and "\n" not in msg
    assert msg.startswith("target.path: assets/tiny-targt does not exist") and "assets exists" in msg, msg


# ----------------------------------------------------------------------------- wandb


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


KEY = "0" * 40


class Answers(http.server.BaseHTTPRequestHandler):
    """wandb's service as far as the probe sees it: GraphQL answering `viewer` for the right key only."""

    def do_GET(self):  # noqa: N802 - the handler's API
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        import base64

        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        good = "Basic " + base64.b64encode(f"api:{KEY}".encode()).decode()
        body = b'{"data": {"viewer": {"id": "u1"}}}' if self.headers.get("Authorization") == good else b""
        self.send_response(200 if body else 401)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Answers)
    # shutdown() waits for the serving loop's next poll: 0.5 s a test at the default interval.
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


WANDB = ["log.wandb.enabled=true", "log.wandb.mode=online"]


@pytest.fixture(autouse=True)
def wandb_key(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)  # credentials present: the service is what is checked


def test_unreachable_wandb_stops_in_one_line_offering_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    t = time.monotonic()
    with pytest.raises(RecipeError) as e:
        launch.check_wandb(tiny(tmp_path, *WANDB), timeout=2)
    msg = str(e.value)
    assert time.monotonic() - t < 5 and "\n" not in msg
    assert msg.startswith("log.wandb: http://127.0.0.1:") and "log.wandb.mode=offline" in msg
    assert launch.check_wandb(tiny(tmp_path, *WANDB, "log.wandb.offline_fallback=true"),
                                         timeout=2) == {"WANDB_MODE": "offline"}


def test_a_silent_wandb_service_is_given_up_after_the_timeout(tmp_path, monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts, never answers
    try:
        monkeypatch.delenv("WANDB_MODE", raising=False)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
        t = time.monotonic()
        # A short timeout: the check waits it out in full.
        with pytest.raises(RecipeError, match="did not answer within 0.2 s"):
            launch.check_wandb(tiny(tmp_path, *WANDB), timeout=0.2)
        assert time.monotonic() - t < 3.2
    finally:
        listener.close()


def test_reachable_offline_or_disabled_wandb_needs_nothing(tmp_path, monkeypatch, server):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", server)
    assert launch.check_wandb(tiny(tmp_path, *WANDB)) == {}
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    assert launch.check_wandb(tiny(tmp_path, "log.wandb.enabled=true", "log.wandb.mode=offline")) == {}
    assert launch.check_wandb(tiny(tmp_path)) == {}  # not enabled
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert launch.check_wandb(tiny(tmp_path, *WANDB)) == {}


def test_a_service_that_rejects_the_key_stops_before_launch_or_logs_offline(tmp_path, monkeypatch, server):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", server)
    monkeypatch.setenv("WANDB_API_KEY", "1" * 40)
    with pytest.raises(RecipeError) as e:
        launch.check_wandb(tiny(tmp_path, *WANDB))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"log.wandb: {server} rejected the API key (HTTP 401)"), msg
    assert "WANDB_API_KEY" in msg and "log.wandb.mode=offline" in msg
    assert launch.check_wandb(tiny(tmp_path, *WANDB, "log.wandb.offline_fallback=true")) == {"WANDB_MODE": "offline"}


def test_a_failing_wandb_init_is_one_line_or_falls_back_offline(tmp_path, monkeypatch):
    """What the probe cannot see (a project the key may not write to, a service failing after it answered)
    surfaces in wandb.init: one line, exit 2, or offline logging with log.wandb.offline_fallback."""
    import wandb
    from wandb.errors import CommError

    from dflash_ds.metrics import Metrics
    from dflash_ds.safety import Exit, RunFailure

    calls = []

    def init(**kw):
        calls.append(kw["mode"])
        if kw["mode"] == "online":
            raise CommError("Error uploading run: returned error 403: permission denied")
        return type("Run", (), {"finish": lambda self: None, "log": lambda self, *a, **k: None})()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    r = tiny(tmp_path, *WANDB)
    with pytest.raises(RunFailure) as e:
        Metrics(tmp_path, {}, r.log.wandb, "run")
    assert e.value.code == Exit.USER and "\n" not in str(e.value) and str(e.value).startswith("log.wandb: ")
    assert "CommError" in str(e.value) and "403" in str(e.value) and "log.wandb.offline_fallback" in str(e.value)
    r = tiny(tmp_path, *WANDB, "log.wandb.offline_fallback=true")
    calls.clear()
    m = Metrics(tmp_path, {}, r.log.wandb, "run")
    assert calls == ["online", "offline"] and m.wandb is not None
