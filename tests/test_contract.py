"""The run's recipe as a contract: recorded once and never overwritten, compared before every resume
(the drafter's shape, the data stream and the taps must not change; the rest may, and is listed), and
a checkpoint that still does not load says why without advising a fallback that cannot help."""

from pathlib import Path

import pytest
import torch
import yaml

from dflash_ds.config import RecipeError, dump_yaml, load_recipe
from dflash_ds.runtime import checkpoint
from dflash_ds.resolve import contract

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"


def tiny(run_dir, *over):
    return load_recipe(TINY, [f"run.output_dir={run_dir}", *over])


def test_the_data_and_tap_settings_are_in_the_contract():
    for key in ("data.row_length", "data.max_length", "data.path", "run.seed", "optim.grad_accum", "target.path",
                "objective.kl_weight"):
        assert key in contract.CONTRACT
    flat = contract.flat(load_recipe(TINY))
    assert all(k in flat for k in contract.CONTRACT), [k for k in contract.CONTRACT if k not in flat]


def test_every_field_of_the_drafters_shape_is_compared_even_one_added_later():
    """The shape is compared field by field from the dataclass itself: a field added later (here to a
    subclass made on the fly) and an architecture's own fields cannot be forgotten."""
    import dataclasses

    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.resolve.drafter import drafter_shape
    from dflash_ds.target_model.model import load_config

    recipe = load_recipe(REPO / "recipes" / "tiny-dflash2.yaml", ["run.output_dir=unused"])
    base = drafter_shape(load_config(recipe.target.path), recipe.drafter)
    Later = dataclasses.make_dataclass("Later", [("window_stride", int, dataclasses.field(default=0))],
                                       bases=(DrafterShape,), frozen=True)
    then = Later(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DrafterShape)})
    assert contract.shape_differences(then, then) == []
    kernel = base.arch_fields.conv_kernel_size
    now = dataclasses.replace(then, window_stride=4, mask_token_id=base.mask_token_id + 1,
                              arch_fields=dataclasses.replace(base.arch_fields, conv_kernel_size=kernel + 1))
    assert contract.shape_differences(then, now) == [
        ("mask_token_id", base.mask_token_id, base.mask_token_id + 1), ("window_stride", 0, 4),
        ("conv_kernel_size", kernel, kernel + 1)]


@pytest.mark.parametrize("change, key", [
    ("drafter.dflash2.conv_kernel_size=3", "drafter.dflash2.conv_kernel_size 2 -> 3"),
    ("drafter.dflash2.conv_group_size=8", "drafter.dflash2.conv_group_size 16 -> 8"),
    ("drafter.dflash2.selector_rank=16", "drafter.dflash2.selector_rank 32 -> 16"),
    # The export's dflash_config carries it: a selector trained with one top-k would be exported with another.
    ("drafter.dflash2.selector_top_k=8", "drafter.dflash2.selector_top_k 10 -> 8"),
])
def test_a_resume_that_changes_a_dflash2_field_is_refused(tmp_path, change, key):
    dflash2 = REPO / "recipes" / "tiny-dflash2.yaml"
    contract.record(load_recipe(dflash2, [f"run.output_dir={tmp_path}"]), 0)
    with pytest.raises(RecipeError) as e:
        contract.check_resume(load_recipe(dflash2, [f"run.output_dir={tmp_path}", change]), 100)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_record_with_an_older_versions_flat_keys_resumes_at_their_sections(tmp_path):
    """A run recorded before the architectures' sections (drafter.selector_rank, objective.selector_alpha flat)
    resumes under the same recipe written in sections, and a changed section key is still refused."""
    dflash2 = REPO / "recipes" / "tiny-dflash2.yaml"
    recipe = load_recipe(dflash2, [f"run.output_dir={tmp_path}"])
    raw = yaml.safe_load(dump_yaml(recipe))
    for kind in ("drafter", "objective"):
        raw[kind].update(raw[kind].pop("dflash2"))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert contract.recorded(tmp_path).drafter == recipe.drafter
    assert contract.check_resume(recipe, 4) is None
    with pytest.raises(RecipeError, match=r"drafter\.dflash2\.selector_rank 32 -> 16"):
        contract.check_resume(load_recipe(dflash2, [f"run.output_dir={tmp_path}", "drafter.dflash2.selector_rank=16"]), 4)


@pytest.mark.parametrize("changes, keys", [
    (["drafter.block_size=4"], ["drafter.block_size 8 -> 4"]),
    (["drafter.num_layers=3", "data.row_length=512"], ["drafter.num_layers 2 -> 3", "data.row_length 1024 -> 512"]),
    (["drafter.target_layer_ids=[0,3]"], ["drafter.target_layer_ids [1,3] -> [0,3]"]),
    (["optim.grad_accum=2", "run.seed=5"], ["run.seed 0 -> 5", "optim.grad_accum 1 -> 2"]),
])
def test_a_resume_that_changes_the_contract_stops_in_one_line_naming_each_key(tmp_path, changes, keys):
    contract.record(tiny(tmp_path), 0)
    with pytest.raises(RecipeError) as e:
        contract.check_resume(tiny(tmp_path, *changes, "optim.lr=1e-3"), 40)
    msg = str(e.value)
    assert "\n" not in msg and "at step 40" in msg and str(tmp_path / "recipe.yaml") in msg
    for k in keys:
        assert k in msg, msg
    assert "optim.lr" not in msg  # allowed changes are not part of the refusal


def test_allowed_changes_are_listed_in_one_line_and_recorded_beside_the_first(tmp_path):
    first = tiny(tmp_path)
    assert contract.record(first, 0) == tmp_path / "recipe.yaml"
    original = (tmp_path / "recipe.yaml").read_text()
    assert contract.check_resume(first, 10) is None  # nothing changed
    later = tiny(tmp_path, "optim.lr=1e-3", "optim.max_steps=99", "log.every_steps=5", "eval.every_steps=7")
    line = contract.check_resume(later, 10)
    assert "\n" not in line and line.startswith("resuming at step 10 with changed settings (allowed on resume): ")
    for part in ("optim.lr 0.003 -> 0.001", "optim.max_steps null -> 99", "log.every_steps 10 -> 5",
                 "eval.every_steps 0 -> 7"):
        assert part in line
    assert contract.record(later, 10) == tmp_path / "recipe.resume-10.yaml"
    assert (tmp_path / "recipe.yaml").read_text() == original  # never overwritten
    assert yaml.safe_load((tmp_path / "recipe.resume-10.yaml").read_text())["optim"]["lr"] == 1e-3
    assert contract.record(first, 20) == tmp_path / "recipe.yaml"  # the same recipe again: nothing new


def test_a_universal_checkpoint_may_change_the_number_of_drafter_ranks(tmp_path):
    contract.record(tiny(tmp_path), 0)
    with pytest.raises(RecipeError, match=r"topology\.drafters_per_node 1 -> 2"):
        contract.check_resume(tiny(tmp_path, "topology.drafters_per_node=2"), 4)
    line = contract.check_resume(tiny(tmp_path, "topology.drafters_per_node=2", "checkpoint.universal=true"), 4)
    assert "topology.drafters_per_node 1 -> 2" in line and "checkpoint.universal false -> true" in line


def test_restart_keeps_the_previous_runs_records(tmp_path):
    contract.record(tiny(tmp_path), 0)
    contract.record(tiny(tmp_path, "optim.lr=1e-3"), 8)
    contract.record(tiny(tmp_path, "drafter.block_size=4", "checkpoint.resume=restart"), 0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["recipe.before-restart-1.recipe.resume-8.yaml", "recipe.before-restart-1.yaml", "recipe.yaml"]
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text())["drafter"]["block_size"] == 4
    assert yaml.safe_load((tmp_path / "recipe.before-restart-1.yaml").read_text())["drafter"]["block_size"] == 8


def test_a_record_from_an_older_version_is_compared_on_what_both_know(tmp_path):
    raw = yaml.safe_load(dump_yaml(tiny(tmp_path)))
    del raw["data"]["row_length"]  # written before rows and conversations were separate settings
    del raw["objective"]["num_anchors"]
    raw["data"]["retired_setting"] = 1  # a key this version no longer has
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    # Its rows were its conversations (256 tokens): resuming it with 1,024-token rows changes the data stream.
    with pytest.raises(RecipeError, match=r"data\.row_length 256 -> 1024"):
        contract.check_resume(tiny(tmp_path), 4)
    assert contract.check_resume(tiny(tmp_path, "data.row_length=256", "objective.num_anchors=43"), 4) is None
    (tmp_path / "recipe.yaml").write_text("run: [unclosed")
    with pytest.raises(RecipeError, match="recorded recipe cannot be read"):
        contract.check_resume(tiny(tmp_path), 4)


# ----------------------------------------------------------------------------- checkpoints that do not load


def _state_dict_error(saved: torch.nn.Module, loading: torch.nn.Module) -> RuntimeError:
    try:
        loading.load_state_dict(saved.state_dict())
    except RuntimeError as exc:
        return exc
    raise AssertionError("loaded")


def test_a_checkpoint_of_another_drafter_names_keys_and_shapes_and_no_fallback(tmp_path):
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    line = checkpoint.load_failure(_state_dict_error(small, big), tmp_path, "step00000004")
    assert "\n" not in line and "fallback" not in line
    assert "2 missing from the checkpoint: 2.weight, 2.bias" in line
    assert "1.weight [8, 4] in the checkpoint, [4, 4] now" in line and "recipe.yaml" in line
    line = checkpoint.load_failure(_state_dict_error(big, small), tmp_path, "step00000004")
    assert "2 unexpected: 2.weight, 2.bias" in line and "fallback" not in line


def _complete(run_dir: Path, tag: str) -> None:
    d = checkpoint.checkpoint_dir(run_dir) / tag
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    checkpoint.write_json_atomic(d / checkpoint.MANIFEST, {"files": checkpoint.file_sizes(d)})


def test_a_damaged_checkpoint_advises_fallback_only_when_an_earlier_one_exists(tmp_path):
    damaged = OSError(5, "Input/output error")
    _complete(tmp_path, "step00000004")
    line = checkpoint.load_failure(damaged, tmp_path, "step00000004")
    assert "fallback" not in line and "checkpoint.resume=restart" in line
    _complete(tmp_path, "step00000002")
    line = checkpoint.load_failure(damaged, tmp_path, "step00000004")
    assert "checkpoint.resume=fallback" in line


def test_a_checkpoint_of_another_drafter_advises_the_record_only_where_there_is_one(tmp_path):
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    line = checkpoint.load_failure(_state_dict_error(small, big), tmp_path, "step00000004")
    assert f"no {tmp_path / 'recipe.yaml'} records them" in line and "settings recorded in" not in line
    (tmp_path / "recipe.yaml").write_text("run: {}\n")
    line = checkpoint.load_failure(_state_dict_error(small, big), tmp_path, "step00000004")
    assert f"resume with the settings recorded in {tmp_path / 'recipe.yaml'}," in line
