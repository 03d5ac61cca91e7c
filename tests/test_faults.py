"""What a user can break, each stopped with one line naming the setting or file (issue 46's cases):
non-finite settings, dead objectives, plans that cannot fit, plans without a GPU, a resume's contract,
export write errors, data files, the report's jsonl."""

import re

import pytest

from dflash_ds.config import RecipeError, load_recipe


@pytest.mark.parametrize("key, value", [("optim.lr", "inf"), ("objective.dspark.ce_weight", ".inf"),
                                        ("objective.kl_weight", "nan"), ("run.stop_grace_s", "-.inf"),
                                        ("optim.betas", "[0.9, .nan]")])
def test_a_non_finite_float_setting_is_refused_naming_the_key(key, value):
    with pytest.raises(RecipeError) as err:
        load_recipe("recipes/tiny.yaml", [f"{key}={value}"])
    msg = str(err.value)
    assert msg.startswith(key.split("=")[0]) and "finite" in msg and "\n" not in msg


def test_finite_floats_still_load():
    r = load_recipe("recipes/tiny-dspark.yaml", ["optim.lr=1e-3", "objective.dspark.ce_weight=0"])
    assert r.optim.lr == 1e-3 and r.objective.sections["dspark"].ce_weight == 0.0


DEAD = ["objective.dspark.ce_weight=0", "objective.dspark.l1_weight=0", "objective.dspark.confidence_weight=0"]


@pytest.mark.parametrize("overrides, named, part", [
    (DEAD, "objective.dspark.ce_weight, objective.dspark.l1_weight and objective.kl_weight are all 0", "drafts"),
    # The confidence head's BCE alone trains no draft: the drafter would draft as initialised (tau 1.0).
    (DEAD[:2], "objective.dspark.ce_weight, objective.dspark.l1_weight and objective.kl_weight are all 0", "drafts"),
    # With the head on, its weight alone trains it: at 0 the export carries an untrained head.
    (DEAD[2:], "objective.dspark.confidence_weight is 0", "nothing trains the confidence head"),
    # Without a confidence head its weight trains nothing: the other three are what count.
    (DEAD + ["drafter.dspark.enable_confidence_head=false", "objective.dspark.confidence_weight=1"],
     "objective.dspark.l1_weight and objective.kl_weight are all 0", "trains the drafter"),
])
def test_an_objective_with_every_weight_of_a_part_zero_is_refused_before_launch(overrides, named, part):
    from dflash_ds.resolve.run import resolve_run

    recipe = load_recipe("recipes/tiny-dspark.yaml", overrides)
    with pytest.raises(RecipeError) as err:
        resolve_run(recipe, 2)
    msg = str(err.value)
    assert named in msg and part in msg and "\n" not in msg
    if "enable_confidence_head=false" in overrides:
        assert "confidence_weight" not in msg


@pytest.mark.parametrize("recipe, overrides", [
    ("recipes/tiny-dspark.yaml", DEAD[:2] + ["objective.kl_weight=0.5"]),  # the KL trains the drafts
    ("recipes/tiny-dspark.yaml", DEAD + ["drafter.dspark.enable_confidence_head=false", "objective.kl_weight=0.5"]),
    ("recipes/tiny-dspark.yaml", DEAD[1:2]),  # the cross-entropy alone
    ("recipes/tiny-dflash2.yaml", ["objective.dflash2.selector_alpha=0"]),  # the cross-entropy is always on
])
def test_an_objective_with_one_live_term_resolves(recipe, overrides):
    from dflash_ds.resolve.run import resolve_run

    assert resolve_run(load_recipe(recipe, overrides), 2).plan.total_steps > 0


@pytest.mark.parametrize("lr", ["1e30", "1e4", "1.5"])
def test_a_learning_rate_above_one_is_refused_naming_it(lr):
    with pytest.raises(RecipeError, match=rf"^optim\.lr = {re.escape(f'{float(lr):g}')} is above 1: .*such as 6e-4$"):
        load_recipe("recipes/tiny.yaml", [f"optim.lr={lr}"])
    assert load_recipe("recipes/tiny.yaml", ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("recipe, override, named", [
    ("recipes/tiny.yaml", "drafter.intermediate_size=100000000000", "drafter.intermediate_size 100,000,000,000"),
    ("recipes/tiny-dspark.yaml", "drafter.dspark.markov_rank=1000000000", "drafter.dspark.markov_rank 1,000,000,000"),
])
def test_a_plan_beyond_the_host_memory_is_refused_naming_the_setting(recipe, override, named):
    from dflash_ds.resolve.run import resolve_run

    with pytest.raises(RecipeError) as err:
        resolve_run(load_recipe(recipe, [override]), 2)
    msg = str(err.value)
    assert "memory plan" in msg and "this host's" in msg and named in msg and "\n" not in msg


def test_each_gpu_rank_is_held_to_its_own_memory_and_a_zero3_target_is_left_out(monkeypatch):
    import torch

    from dflash_ds.resolve import fit
    from dflash_ds.resolve.topology import Layout

    gib = fit.GIB
    monkeypatch.setattr(fit, "device_memory", lambda device: (100 * gib, "the GPU's 100.0 GiB (test)"))
    layout, cuda = Layout(8, 4, 4), torch.device("cuda", 0)
    parts = {"drafter": {"weights": 60 * gib, "logits": 30 * gib},
             "target": {"weights": 90 * gib, "payload": 5 * gib, "activations": 10 * gib}}
    with pytest.raises(RecipeError, match=r"105\.0 GiB for a target rank.*90\.0 GiB of it is the target weights"):
        fit.check_fits(parts, layout, cuda, None)
    fit.check_fits(parts, layout, cuda, None, zero3_target=True)  # the drafter rank's 90 GiB fit
    # Colocated, one rank holds both roles.
    with pytest.raises(RecipeError, match="for a colocated rank"):
        fit.check_fits(parts, Layout(4, 4, 0, colocated=True), cuda, None)


def test_a_gpu_plan_without_a_gpu_is_held_to_a_bound_no_gpu_has(monkeypatch):
    import torch

    from dflash_ds.resolve import fit
    from dflash_ds.resolve.topology import Layout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parts = {"drafter": {"weights": 900 * fit.GIB}, "target": {"weights": 10 * fit.GIB}}
    fit.check_fits(parts, Layout(8, 4, 4), torch.device("cuda", 0), None)
    parts["drafter"]["logits"] = 1000 * fit.GIB
    parts["drafter"]["weights"] = 100 * fit.GIB
    with pytest.raises(RecipeError, match="none has 1,024 GiB.*1,000.0 GiB of it is the drafter logits.*loss_chunks"):
        fit.check_fits(parts, Layout(8, 4, 4), torch.device("cuda", 0), None)


@pytest.mark.parametrize("recipe, extra", [("recipes/qwen27b.yaml", []), ("recipes/qwen36-35b-a3b.yaml", []),
                                           ("recipes/qwen27b.yaml", ["run.device=cuda"])])
def test_dry_run_plans_a_gpu_recipe_without_a_gpu_or_the_hub(monkeypatch, capsys, recipe, extra):
    import torch

    from dflash_ds.resolve import run
    from dflash_ds.target_model.model import TargetError
    from dflash_ds.train import main

    def unreachable(path):
        raise TargetError(f"the target {path!r} cannot be loaded (no hub)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(run, "load_config", unreachable)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([recipe, "--dry-run", *extra]) == 0
    out = capsys.readouterr()
    assert "memory estimate per rank: drafter" in out.out and "no GPU is visible here" in out.out
    assert "published geometry" in out.out and "error" not in out.err
    # A run (not a plan) still needs the GPU it asks for, and the target's own config.
    with pytest.raises(ValueError, match="no GPU is visible"):
        run.resolve_run(load_recipe(recipe, ["run.device=cuda"]), 8)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("loads", [False, True])
def test_the_runs_contract_is_recorded_only_once_the_drafter_has_resumed(tmp_path, monkeypatch, loads):
    """A resume whose checkpoint does not load (another shape, recipe.yaml gone) records nothing: the
    correct command is then not refused against the failed one's settings."""
    from types import SimpleNamespace

    from dflash_ds.resolve.run import resolve_run
    from dflash_ds.runtime import checkpoint, engines, trainer
    from dflash_ds.safety import CheckpointError

    run = tmp_path / "run"
    spec = resolve_run(load_recipe("recipes/tiny.yaml", [f"run.output_dir={run}"]), 2)

    def load(*args, **kwargs):
        if not loads:
            raise CheckpointError("the checkpoint holds another drafter")
        return 4

    def source(*args, **kwargs):
        raise _Stop  # past the point this test is about
    monkeypatch.setattr(engines, "build_drafter_engine", lambda *a, **k: (None, None))
    monkeypatch.setattr(checkpoint, "load", load)
    monkeypatch.setattr(trainer, "received_source", source)
    control = SimpleNamespace(start={"step": 4, "tag": "step00000004"}, start_step=4)
    with pytest.raises(_Stop if loads else CheckpointError):
        trainer.DrafterTrainer.load(spec, None, 0, SimpleNamespace(drafter=None), control=control)
    assert (run / "recipe.yaml").is_file() == loads


def test_a_safetensors_error_writing_the_export_is_one_line_and_keeps_the_previous_export(tmp_path, monkeypatch):
    """A full disk under safetensors raises its own SafetensorError (not an OSError): one line naming
    the export and the cause, the previous export untouched, the checkpoint complete."""
    from types import SimpleNamespace

    from safetensors import SafetensorError

    from dflash_ds.export import drafter as export
    from dflash_ds.resolve.run import resolve_run
    from dflash_ds.runtime import checkpoint, trainer
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.safety import CheckpointError

    run = tmp_path / "run"
    spec = resolve_run(load_recipe("recipes/tiny.yaml", [f"run.output_dir={run}"]), 2)
    drafter = build_drafter(spec)
    export.save_drafter(drafter, run / "export")
    before = {p.name: p.read_bytes() for p in (run / "export").iterdir()}

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: "step00000004")
    monkeypatch.setattr(export, "save_file", full)
    me = SimpleNamespace(spec=spec, lead=True, engine=None, group=None, last_tau=None,
                         model=SimpleNamespace(drafter=drafter))
    with pytest.raises(CheckpointError) as err:
        trainer.DrafterTrainer.save(me, 4)
    msg = str(err.value)
    assert "\n" not in msg and f"could not write the export {run / 'export'}" in msg
    assert "No space left on device" in msg and "checkpoint step 4 is complete" in msg
    assert {p.name: p.read_bytes() for p in (run / "export").iterdir()} == before
    assert sorted(p.name for p in run.iterdir()) == ["export"]  # no staging directory left


def _chat_file(path, n, tag):
    import json

    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{tag} {i}?"},
                                                     {"role": "assistant", "content": f"{tag} {i}."}]}) + "\n"
                            for i in range(n)))


@pytest.mark.parametrize("names, split, rows, read, named", [
    (("train.jsonl", "test.jsonl"), "train", 2, "train", "test.jsonl (test)"),
    (("train.jsonl", "test.jsonl"), "train+test", 5, "train test", None),
    # A file named for no split is train's, as datasets reads a directory without split names.
    (("shard0.jsonl", "test_cases.jsonl"), "train", 2, "shard0", "test_cases.jsonl (test)"),
    (("shard0.jsonl", "test_cases.jsonl"), "test", 3, "test", "shard0.jsonl (train)"),
])
def test_a_data_directorys_files_are_all_read_or_the_skip_is_named(tmp_path, capsys, names, split, rows, read, named):
    from dflash_ds.data.sources import load_rows

    d = tmp_path / "data"
    d.mkdir()
    _chat_file(d / names[0], 2, names[0].split(".")[0])
    _chat_file(d / names[1], 3, names[1].split(".")[0])
    ds = load_rows(str(d), split, str(tmp_path / "hf"))
    assert len(ds) == rows
    assert {m[0]["content"].split()[0].split("_")[0] for m in ds["messages"]} == set(read.split())
    err = capsys.readouterr().err
    if named is None:
        assert "not read" not in err
    else:
        (line,) = [line for line in err.splitlines() if "not read" in line]
        assert named in line and "data.split=" in line


def test_a_split_a_data_directory_lacks_names_the_splits_it_has(tmp_path):
    from dflash_ds.data.sources import load_rows

    d = tmp_path / "data"
    d.mkdir()
    _chat_file(d / "shard0.jsonl", 2, "a")
    _chat_file(d / "test_cases.jsonl", 2, "b")
    with pytest.raises(ValueError) as err:
        load_rows(str(d), "validation", str(tmp_path / "hf"))
    msg = str(err.value)
    assert msg.startswith("data.split: split 'validation'") and "test: test_cases.jsonl" in msg and "train+test" in msg


@pytest.mark.parametrize("inside", [False, True])
def test_an_empty_or_damaged_parquet_file_is_named_not_its_directory(tmp_path, inside):
    from dflash_ds.data.sources import load_rows

    d = tmp_path / "data"
    d.mkdir()
    _chat_file(d / "a.jsonl", 2, "a")
    (d / "b.parquet").write_bytes(b"")
    target = d if inside else d / "b.parquet"
    with pytest.raises(ValueError, match=f"data.path: {d / 'b.parquet'} is empty \\(0 bytes\\)"):
        load_rows(str(target), "train", str(tmp_path / "hf"))
    (d / "b.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    with pytest.raises(ValueError, match=f"data.path: {d / 'b.parquet'} is not a readable Parquet file"):
        load_rows(str(target), "train", str(tmp_path / "hf"))


def test_a_bench_dir_that_is_a_file_is_called_a_file(tmp_path):
    from dflash_ds.eval.benchmarks import load_conversations

    with pytest.raises(ValueError) as err:
        load_conversations("gsm8k", "assets/bench/gsm8k.jsonl", setting="eval.bench_dir")
    msg = str(err.value)
    assert msg.startswith("eval.bench_dir assets/bench/gsm8k.jsonl is a file, not a directory") and "assets/bench" in msg
    with pytest.raises(ValueError, match="does not exist"):
        load_conversations("gsm8k", str(tmp_path / "nope"), setting="eval.bench_dir")
    assert load_conversations("gsm8k", "assets/bench", limit=2, setting="eval.bench_dir")


def test_expert_parallel_on_a_dense_target_names_the_dense_target_first():
    from dflash_ds.resolve.run import resolve_run

    # targets_per_node 1 is not divisible by 2 either: the dense target is the problem to name.
    with pytest.raises(RecipeError) as err:
        resolve_run(load_recipe("recipes/tiny.yaml", ["target.expert_parallel=2"]), 2)
    assert "is a dense model" in str(err.value) and "target.expert_parallel=1" in str(err.value)


def test_the_evaluator_prints_the_exports_own_block_size(tmp_path, capsys):
    """A DSpark export of block 7 emits up to 8 tokens a cycle; the line names its block size, 7."""
    from dflash_ds.eval.cli import main
    from dflash_ds.export import save_drafter
    from dflash_ds.resolve.run import resolve_run
    from dflash_ds.runtime.trainer import build_drafter

    spec = resolve_run(load_recipe("recipes/tiny-dspark.yaml", ["drafter.block_size=7"]), 2)
    save_drafter(build_drafter(spec), tmp_path / "export", num_anchors=spec.recipe.objective.num_anchors)
    assert main(["--target", "assets/tiny-target", "--drafter", str(tmp_path / "export"), "--prompts",
                 "assets/tiny_eval.jsonl", "--limit", "1", "--max-new-tokens", "8"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tau_mean")]
    assert line.endswith("block size 7)"), line


def test_a_metrics_jsonl_with_a_cut_last_line_is_reported_naming_the_line(tmp_path, capsys):
    import json

    from dflash_ds.report import main, report_contents

    recs = [{"step": s, "loss": 3.0 / s, "accept_proxy": 1 + s / 10, "lr": 1e-3, "tok_per_s": 1000.0} for s in range(1, 6)]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps(dict(recs[-1], step=6))[:17])
    contents = report_contents(tmp_path)
    assert [r["step"] for r in contents.steps] == [1, 2, 3, 4, 5]
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}:6 is cut short" in err
    # A damaged line before the last is the user's to repair: one line naming it, exit 2.
    lines = text.splitlines()
    lines[2] = lines[2][:10]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main([str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'metrics.jsonl'}:3 is not a JSON record" in line


def test_an_interrupt_in_the_block_is_a_keyboard_interrupt_whatever_unwinds_over_it():
    import os
    import signal

    from dflash_ds.safety import interrupt_in_this_process

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN when run as `nohup ... &`
    try:
        interrupts_raise_keyboard_interrupt()
        # a process that ignores SIGINT keeps ignoring it: the block installs nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupt_in_this_process():
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def interrupts_raise_keyboard_interrupt():
    import os
    import signal

    from dflash_ds.safety import interrupt_in_this_process

    with pytest.raises(KeyboardInterrupt):
        with interrupt_in_this_process():
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where the handler runs
    # A library that raises its own error while unwinding from the interrupt (datasets' pool: TimeoutError).
    with pytest.raises(KeyboardInterrupt):
        with interrupt_in_this_process():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])
            finally:
                raise TimeoutError("the pool's own error")
    with pytest.raises(TimeoutError):  # no interrupt: errors pass unchanged
        with interrupt_in_this_process():
            raise TimeoutError("not an interrupt")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # what the process had, given back


def test_ctrl_c_in_the_pre_launch_step_is_one_line_and_the_shells_status(monkeypatch, capsys):
    from dflash_ds.guard import launch

    def interrupted(recipe):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "prelaunch", interrupted)
    assert launch.main(["recipes/tiny.yaml"]) == 0
    shell = capsys.readouterr().out.strip()
    assert shell.startswith("echo '[dflash] error: interrupted (Ctrl-C) before launch") and shell.endswith("exit 130")


@pytest.mark.launcher  # a real process group and a real Ctrl-C
@pytest.mark.parametrize("entry", ["launch.sh", "prepare"])
def test_ctrl_c_during_data_preparation_prints_one_line(tmp_path, entry):
    import os
    import signal
    import subprocess
    import sys
    import time

    from .launch_util import ROOT, cpu_env

    # The tiny data 20 times over: its encoding takes tens of seconds, so the Ctrl-C lands in it even on a
    # loaded machine (the bundled file alone is encoded in about 3 s, which a busy machine's output lag
    # can outrun).
    big = tmp_path / "chat.jsonl"
    big.write_text((ROOT / "assets" / "tiny_chat.jsonl").read_text() * 20)
    args = ["recipes/tiny.yaml", f"data.path={big}", f"data.cache_dir={tmp_path / 'cache'}",
            f"run.output_dir={tmp_path / 'run'}", "data.num_proc=2"]
    cmd = ["bash", "launch.sh", *args] if entry == "launch.sh" else [sys.executable, "-m", "dflash_ds.data", "prepare", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(DFLASH_PYTHON=sys.executable), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    os.set_blocking(p.stdout.fileno(), False)
    out, deadline = b"", time.time() + 240
    while p.poll() is None and time.time() < deadline:
        out += p.stdout.read() or b""
        if b"encoding conversations" in out:
            time.sleep(0.3)
            os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
            break
        time.sleep(0.05)
    p.wait(timeout=120)
    os.set_blocking(p.stdout.fileno(), True)
    text = (out + p.stdout.read()).decode(errors="replace")
    assert p.returncode == 130, text[-3000:]
    assert "Traceback" not in text and text.count("[dflash] error: interrupted (Ctrl-C)") == 1, text[-3000:]
    assert not (tmp_path / "run").exists()
    assert [q.name for q in (tmp_path / "cache").iterdir()] == ["hf_datasets"]


@pytest.mark.launcher  # a fresh interpreter: transformers' import is what is under test
@pytest.mark.parametrize("fp8", [False, True])
def test_a_cpu_run_without_fp8_loads_the_target_without_torchao_and_its_lines(fp8):
    """torchao's import prints a "Failed to load" line per GPU kernel it cannot load on CPU, and torch
    two deprecation warnings; only the FP8 drafter layers use it."""
    import importlib.util
    import subprocess
    import sys

    from .launch_util import ROOT, cpu_env

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed: nothing to keep out")
    code = ("import sys\nfrom dflash_ds.libraries import quiet_libraries\n"
            f"quiet_libraries(torchao={fp8})\n"
            "from dflash_ds.target_model.model import load_target\n"
            "load_target('assets/tiny-target', dtype='float32')\n"
            "print('torchao imported:', 'torchao' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"torchao imported: {fp8}" in p.stdout
    assert "is an Enum subclass" not in p.stderr
    if not fp8:
        assert "Failed to load" not in p.stderr


def test_the_known_pytree_enum_deprecation_is_filtered_and_other_lines_kept():
    import logging

    from dflash_ds.libraries import quiet_libraries

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    quiet_libraries(torchao=True)
    log, keep = logging.getLogger("torch.utils._pytree"), Keep()
    log.addHandler(keep)
    try:
        log.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "E")
        log.warning("something else")
    finally:
        log.removeHandler(keep)
    assert keep.lines == ["something else"]
