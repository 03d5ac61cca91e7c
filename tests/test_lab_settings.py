"""scripts/quality_lab.sh's folder and LAB_* settings, checked by lab/settings.py before the
script makes or starts anything: one line naming the setting and what it takes, exit 2 (issue 60)."""

from pathlib import Path

import pytest

from lab.settings import KNOWN, SettingError, check, main

HERE = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, value, words", [
    ("LAB_SWEEP_STAGGER", "abc", "LAB_SWEEP_STAGGER='abc': expected a finite number of seconds >= 0"),
    ("LAB_SWEEP_STAGGER", "-1", "LAB_SWEEP_STAGGER='-1': expected a finite number of seconds >= 0"),
    ("LAB_SWEEP_SECONDS", "xyz", "LAB_SWEEP_SECONDS='xyz': expected a whole number >= 0"),
    ("LAB_SWEEP_SECONDS", "1.5", "LAB_SWEEP_SECONDS='1.5': expected a whole number >= 0"),  # shell arithmetic
    ("LAB_COMMAND_SECONDS", "abc", "LAB_COMMAND_SECONDS='abc': expected a whole number >= 0"),
    ("LAB_COMMAND_SECONDS", "-5", "LAB_COMMAND_SECONDS='-5': expected a whole number >= 0"),
    ("LAB_STEPS", "0", "LAB_STEPS='0': expected a whole number >= 1"),
    ("LAB_STOP_GRACE", "sixty", "LAB_STOP_GRACE='sixty': expected a whole number >= 0"),
    ("LAB_STOP_GRACE", "6_0", "LAB_STOP_GRACE='6_0': expected a whole number >= 0"),
    ("LAB_SWEEP_STAGGER", "infinity", "LAB_SWEEP_STAGGER='infinity': expected a finite number"),
    ("LAB_EVAL_RESERVE", "1e3", "LAB_EVAL_RESERVE='1e3'"),
    ("LAB_REGEN_SECONDS", "nan", "LAB_REGEN_SECONDS='nan': expected a finite number of seconds > 0"),
    ("LAB_EVAL_SECONDS", "0", "LAB_EVAL_SECONDS='0': expected a finite number of seconds > 0"),
    ("LAB_TARGET_ARGS", "--seconds abc", "LAB_TARGET_ARGS='--seconds abc' (arguments of python -m lab "
                                         "target): argument --seconds: expected a finite number >= 0, got 'abc'"),
    ("LAB_TARGET_ARGS", "--secnds 3", "unrecognized arguments: --secnds 3"),
    ("LAB_FRAME_ARGS", "--train-count -2", "argument --train-count: expected an integer >= 1"),
    ("LAB_REGEN_ARGS", "--batch-size 0", "argument --batch-size: expected an integer >= 1, got '0'"),
    ("LAB_REGEN_ARGS", "--seconds 'unclosed", "not a list of arguments"),
    ("LAB_OVERRIDES", "optim.lr=abc", "LAB_OVERRIDES: optim.lr: expected a number, got 'abc'"),
    ("LAB_OVERRIDES", "optim.max_steps", "LAB_OVERRIDES: 'optim.max_steps' is not a recipe setting key.sub=value"),
    ("LAB_OVERRIDES", "optim.epochz=3", "LAB_OVERRIDES: unknown recipe key 'optim.epochz'"),
    ("LAB_DIR", "README.md", "LAB_DIR README.md is a file; pass a folder"),
])
def test_a_lab_setting_the_script_cannot_use_is_named(name, value, words):
    with pytest.raises(SettingError) as err:
        check({name: value}, HERE, "runs/out", ["sweep", "train", "v1"])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_out_that_is_a_file_is_named_before_mkdir(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(SettingError, match=r"^OUT out is a file; pass a folder"):
        check({}, tmp_path, "out", ["table"])
    with pytest.raises(SettingError, match=r"^OUT out/deeper: .*out is a file, so no folder can be made under it"):
        check({}, tmp_path, "out/deeper", ["table"])
    assert check({}, tmp_path, "new/out", ["table"]) == []  # a folder still to make is fine


def test_a_wait_limit_is_a_whole_number_detached_or_not(tmp_path):
    for step in (["wait", "abc"], ["detach", "wait", "-1"]):
        with pytest.raises(SettingError, match=r"wait SECONDS='(abc|-1)': expected a whole number >= 0"):
            check({}, tmp_path, "out", step)
    assert check({}, tmp_path, "out", ["wait", "30"]) == []
    assert check({"LAB_STOP_GRACE": "", "LAB_STEPS": ""}, tmp_path, "out", ["table"]) == []  # empty: the default


def test_the_settings_the_lab_tests_use_pass_and_a_mistyped_name_is_a_warning(tmp_path):
    env = {"LAB_DIR": str(tmp_path / "lab"), "LAB_STEPS": "2", "LAB_SWEEP_STAGGER": "0.5", "LAB_SWEEP_SECONDS": "400",
           "LAB_STOP_GRACE": "0", "LAB_REGEN_SECONDS": "60", "LAB_TARGET_ARGS": "--shape tiny --seconds 8 --no-compile",
           "LAB_FRAME_ARGS": "--train-count 120", "LAB_REGEN_ARGS": "--batch-size 2048",
           "LAB_OVERRIDES": "run.device=cpu optim.max_steps=4 target.dtype=float32", "LAB_SWEEP_SECOND": "3"}
    warnings = check(env, tmp_path, "out", ["sweep", "train", "v1"])
    assert len(warnings) == 1 and warnings[0].startswith("LAB_SWEEP_SECOND is not a setting of scripts/quality_lab.sh")
    assert set(KNOWN) - set(env) == {"LAB_COMMAND_SECONDS", "LAB_EVAL_RESERVE", "LAB_SWEEP_MIN", "LAB_REGEN_MIN",
                                     "LAB_EVAL_MIN", "LAB_EVAL_SECONDS", "LAB_START_MARGIN", "LAB_TRAIN_SECONDS",
                                     "LAB_REGEN_BENCH", "LAB_REGEN_BENCH_ARGS"}


def test_every_setting_the_script_reads_is_checked():
    import re

    read = set(re.findall(r"\bLAB_[A-Z_]+\b", (HERE / "scripts" / "quality_lab.sh").read_text()))
    assert read == set(KNOWN), read ^ set(KNOWN)


def test_main_says_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAB_SWEEP_STAGGER", "abc")
    assert main([str(tmp_path), "out", "sweep", "train", "v1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["[dflash] error: LAB_SWEEP_STAGGER='abc': expected a finite number of seconds >= 0; set e.g. "
                   "LAB_SWEEP_STAGGER=5; nothing was started"]


def test_a_summary_cut_short_is_named_by_the_table(tmp_path):
    from lab.table import load_summaries

    (tmp_path / "v1.json").write_text('{"name": "v1", "benchmarks": [')
    with pytest.raises(ValueError, match=rf"^lab table: {tmp_path / 'v1.json'} is not JSON \(.*\); write it again"):
        load_summaries(tmp_path)
