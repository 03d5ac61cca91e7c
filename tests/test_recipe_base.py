"""Recipes that derive (config/derive.py): `base:` names a recipe relative to the file's own folder, the
file is laid over it section by section, and the result loads, checks and is recorded exactly as the
whole recipe it stands for; a missing base, a base that is not a path and a cycle are one line each."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml

from dflash_ds.config import RecipeError, dump_yaml, load_recipe, recipe_mapping
from dflash_ds.config.derive import merged
from dflash_ds.resolve import contract

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def same(a, b) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def test_sections_merge_key_by_key_and_values_lists_and_null_replace():
    base = {"drafter": {"num_layers": 2, "sliding_window": 64, "dspark": {"markov_rank": 32, "markov_head_type": "vanilla"}},
            "eval": {"benchmarks": ["heldout", "gsm8k"], "bench_limit": 8}, "log": {"every_steps": 10}}
    over = {"drafter": {"sliding_window": None, "dspark": {"markov_rank": 8}}, "eval": {"benchmarks": ["mt_bench"]},
            "log": None, "run": {"name": "x"}}
    assert merged(base, over) == {
        "drafter": {"num_layers": 2, "sliding_window": None, "dspark": {"markov_rank": 8, "markov_head_type": "vanilla"}},
        "eval": {"benchmarks": ["mt_bench"], "bench_limit": 8},  # a list replaces the base's whole
        "log": {"every_steps": 10},  # an empty section changes nothing
        "run": {"name": "x"}}
    assert base["drafter"]["dspark"]["markov_rank"] == 32  # the base's mapping is not touched


def test_a_derived_recipe_loads_and_is_recorded_as_the_whole_file(tmp_path):
    # A base in another folder and a base of a base: each path is relative to the file that names it.
    write(tmp_path / "base" / "mid.yaml", f"""\
        base: {TINY}
        drafter:
          block_size: 4
        eval:
          benchmarks: [heldout]
        """)
    child = write(tmp_path / "runs" / "child.yaml", """\
        base: ../base/mid.yaml
        run:
          name: child
        drafter:
          num_layers: 1
        optim:
        """)
    whole = yaml.safe_load(TINY.read_text())
    whole["run"]["name"] = "child"
    whole["drafter"].update(block_size=4, num_layers=1)
    whole["eval"]["benchmarks"] = ["heldout"]
    assert recipe_mapping(child) == whole
    write(tmp_path / "whole.yaml", yaml.safe_dump(whole))
    derived, written = load_recipe(child), load_recipe(tmp_path / "whole.yaml")
    assert same(derived, written) and derived.source == str(child)
    # Overrides apply to the whole recipe, after the bases.
    assert load_recipe(child, ["drafter.block_size=8"]).drafter.block_size == 8
    # The run directory's record is the whole recipe: no base, and it loads back unchanged.
    out = tmp_path / "out"
    path = contract.record(load_recipe(child, [f"run.output_dir={out}"]), 0)
    text = path.read_text()
    assert "base" not in yaml.safe_load(text) and text == dump_yaml(load_recipe(child, [f"run.output_dir={out}"]))
    assert same(load_recipe(path), load_recipe(child, [f"run.output_dir={out}"]))


def test_an_unknown_key_in_a_derived_recipe_names_its_dotted_path(tmp_path):
    child = write(tmp_path / "child.yaml", f"base: {TINY}\ndrafter:\n  blok_size: 4\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key 'drafter\.blok_size'; known keys here: .*block_size"):
        load_recipe(child)


def test_a_missing_base_is_one_line_naming_the_file_and_where_it_looked(tmp_path):
    child = write(tmp_path / "sub" / "child.yaml", "base: tiny.yaml\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(child)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{child}: base: tiny.yaml not found (looked for {tmp_path}/sub/tiny.yaml)")
    assert f"relative to {tmp_path}/sub/" in line


@pytest.mark.parametrize("value", ["3", "[a.yaml, b.yaml]", "''", "null"])
def test_a_base_that_is_not_one_path_is_refused(tmp_path, value):
    child = write(tmp_path / "child.yaml", f"base: {value}\n")
    with pytest.raises(RecipeError, match=rf"^{child}: base: .* is not a recipe file; set base: to one recipe's path"):
        load_recipe(child)


def test_a_cycle_of_bases_is_one_line_naming_the_chain(tmp_path):
    a = write(tmp_path / "a.yaml", "base: sub/b.yaml\n")
    b = write(tmp_path / "sub" / "b.yaml", "base: ../a.yaml\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(a)
    assert str(e.value) == (f"{b}: base: ../a.yaml closes a cycle of bases ({a} -> {b} -> {a}); "
                            "remove one of these base: keys")
    itself = write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(RecipeError, match=r"closes a cycle of bases \(.*self\.yaml -> .*self\.yaml\)"):
        load_recipe(itself)


def test_a_base_that_is_not_yaml_is_named(tmp_path):
    write(tmp_path / "broken.yaml", "run: [\n")
    child = write(tmp_path / "child.yaml", "base: broken.yaml\n")
    with pytest.raises(RecipeError, match=rf"^{tmp_path}/broken.yaml:\d+:\d+: the recipe is not valid YAML"):
        load_recipe(child)
