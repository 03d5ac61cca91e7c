"""Every entry point's command-line arguments are checked as they are parsed, before anything loads:
a wrong value is one `[dflash] error:` line naming the argument and what it takes, exit 2 (issue 60)."""

import json

import pytest

TARGET, DRAFTER, PROMPTS = "assets/tiny-target", "assets/tiny-target", "assets/tiny_eval.jsonl"
EVAL = ["--target", TARGET, "--drafter", DRAFTER, "--prompts", PROMPTS]


def refused(main, argv, capsys) -> str:
    """The one line `main(argv)` says on refusing its arguments with status 2."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[dflash] error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


@pytest.mark.parametrize("extra, words", [
    (["--chat-template-kwargs", "[1]"], "argument --chat-template-kwargs: expected a JSON object"),
    (["--chat-template-kwargs", '"x"'], "argument --chat-template-kwargs: expected a JSON object"),
    (["--chat-template-kwargs", "{x"], "argument --chat-template-kwargs: is not JSON"),
    (["--chat-template-kwargs", '{"enable_thinking": "maybe"}'], 'enable_thinking must be true or false, got "maybe"'),
    (["--chat-template-kwargs", '{"enable_thinking": 1}'], "enable_thinking must be true or false, got 1"),
    (["--limit", "0"], "argument --limit: expected an integer >= 1, got '0'"),
    (["--limit", "two"], "argument --limit: expected an integer >= 1, got 'two'"),
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: expected an integer >= 1"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number >= 0, got 'nan'"),
    (["--temperature", "-1"], "argument --temperature: expected a finite number >= 0"),
    (["--top-p", "0"], "argument --top-p: expected a finite number > 0"),
    (["--top-k", "-1"], "argument --top-k: expected an integer >= 0"),
    (["--samples", "0"], "argument --samples: expected an integer >= 1"),
    (["--batch-anchors", "inf"], "argument --batch-anchors: expected an integer >= 1"),
    (["--out", "assets"], "argument --out: assets is a folder; pass a file path to write"),
    (["--out", "README.md/tau.json"], "argument --out: README.md/tau.json: README.md is a file"),
    (["--prompts", "assets"], "argument --prompts: assets is a folder; pass a file"),
    (["--prompts", "no/such.jsonl"], "argument --prompts: no/such.jsonl does not exist"),
    (["--bench-dir", "assets/tiny_eval.jsonl"], "argument --bench-dir: assets/tiny_eval.jsonl is a file; pass a folder"),
    (["--drafter", "README.md"], "argument --drafter: README.md is a file; pass a folder"),
    (["--target", "README.md"], "argument --target: README.md is a file; pass the model's folder"),
])
def test_eval_refuses_a_bad_argument_before_a_model_loads(extra, words, capsys, monkeypatch):
    from dflash_ds.eval import cli

    monkeypatch.setattr(cli, "load_pair", lambda *a: pytest.fail("a model was loaded"))
    line = refused(cli.main, EVAL + extra, capsys)
    assert words in line and "python -m dflash_ds.eval --help" in line


def test_eval_takes_a_template_object_and_its_thinking_flag():
    from dflash_ds.arguments import json_object

    assert json_object('{"enable_thinking": false, "tools": []}') == {"enable_thinking": False, "tools": []}


@pytest.mark.parametrize("module, argv, words", [
    ("dflash_ds.data.regenerate", ["recipes/tiny.yaml", "optim.lr=abc"], "regenerate: error: optim.lr: expected a number"),
    ("dflash_ds.data.regenerate", ["recipes/nope.yaml"], "recipe file 'recipes/nope.yaml' not found"),
    ("dflash_ds.data.prepare", ["prepare", "recipes/nope.yaml"], "recipe file 'recipes/nope.yaml' not found"),
])
def test_regenerate_and_prepare_name_a_bad_recipe_in_one_line(module, argv, words, capsys):
    import importlib

    # Before: the RecipeError escaped main as a traceback (exit 1).
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


@pytest.mark.parametrize("module, argv, words", [
    ("dflash_ds.data.regenerate", [], "the following arguments are required: recipe"),
    ("dflash_ds.bench.cli", ["--role", "drafter", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    ("dflash_ds.bench.cli", ["--role", "drafter", "--transport-timeout", "nan"], "argument --transport-timeout"),
    ("dflash_ds.bench.cli", ["--role", "plan", "--target-rate", "-5"], "argument --target-rate: expected a finite number > 0"),
    ("dflash_ds.bench.cli", ["--role", "drafter", "--out", "assets"], "argument --out: assets is a folder"),
    ("dflash_ds.bench.cli", ["--role", "drafter", "--recipe", "recipes"], "argument --recipe: recipes is a folder"),
    ("dflash_ds.bench.cli", ["--role", "data", "--prepare-sizes", "2000,x"], "argument --prepare-sizes: expected integers"),
    ("dflash_ds.bench.cli", ["--role", "data", "--chats", "-1"], "argument --chats: expected an integer >= 1"),
    ("lab.__main__", ["table", "README.md"], "argument folder: README.md is a file; pass a folder"),
    ("lab.__main__", ["evaluate", "README.md", "--names", "v1"], "argument out: README.md is a file"),
    ("lab.__main__", ["target", "--tokenizer", "assets", "--seconds", "abc"], "argument --seconds: expected a finite"),
    ("lab.__main__", ["target", "--tokenizer", "assets", "--deadline", "inf"], "argument --deadline"),
    ("lab.__main__", ["regenerate", "recipes/tiny.yaml", "--batch-size", "0"], "argument --batch-size"),
    ("lab.__main__", ["summarize", "runs/none", "v1", "x.json"], "argument run_dir: runs/none does not exist"),
    ("lab.__main__", ["--record", "assets", "run-names"], "argument --record: assets is a folder"),
    ("dflash_ds.train", ["recipes/tiny.yaml", "--dry-run", "--world-size", "0"], "argument --world-size"),
    ("dflash_ds.report", ["README.md"], "argument run_dir: README.md is a file"),
])
def test_each_entry_point_refuses_a_bad_argument_in_one_line(module, argv, words, capsys):
    import importlib

    line = refused(importlib.import_module(module).main, argv, capsys)
    assert words in line, line


@pytest.mark.parametrize("text, kind, ok", [("3", "integer", 3), ("0.5", "number", 0.5), ("1,2", "integers", [1, 2]),
                                            ("", "integers", [])])
def test_the_converters_take_what_they_should(text, kind, ok):
    from dflash_ds import arguments

    parse = {"integer": arguments.integer(1), "number": arguments.number(0, above=True),
             "integers": arguments.integers(1)}[kind]
    assert parse(text) == ok


def test_an_output_folder_may_be_new_or_existing_but_not_a_file(tmp_path):
    import argparse

    from dflash_ds.arguments import output_folder

    assert output_folder(str(tmp_path / "new" / "deeper")) and output_folder(str(tmp_path))
    (tmp_path / "f").write_text(json.dumps({}))
    for bad in (tmp_path / "f", tmp_path / "f" / "under"):
        with pytest.raises(argparse.ArgumentTypeError, match="is a file"):
            output_folder(str(bad))


@pytest.mark.parametrize("argv, words", [
    (["recipes/tiny.yaml", "--dryrun"], "launch.sh: unknown option --dryrun; usage: bash launch.sh RECIPE"),
    (["recipes/tiny.yaml", "--world-size", "3", "optim.lr=1e-3"], "unknown option --world-size"),
    (["--dry_run"], "unknown option --dry_run"),
])
def test_launch_sh_refuses_an_option_it_does_not_take(argv, words, capsys, monkeypatch):
    # A mistyped --dry-run used to be dropped without a word, and the real run started.
    from dflash_ds.guard import launch

    monkeypatch.setattr(launch, "prelaunch", lambda recipe: pytest.fail("the pre-launch checks ran"))
    assert launch.main(argv) == 0  # shell text for launch.sh's eval: one line, then exit 2
    shell = capsys.readouterr().out.strip()
    assert shell.startswith("echo '[dflash] error: ") and shell.endswith(">&2; exit 2") and words in shell
    assert "\n" not in shell
