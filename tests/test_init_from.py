"""`drafter.init_from`: an export is compared with the recipe before launch, and a run starts from it."""

from __future__ import annotations

import pytest
import torch

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.run import resolve_run

TINY = "recipes/tiny.yaml"
SMALL = ["data.num_proc=1", "optim.max_steps=3", "log.progress=false", "optim.rows_per_micro_batch=1",
         "objective.num_anchors=16"]


def _export(tmp_path, overrides=(), seed=123):
    """An export of the drafter the tiny recipe (plus `overrides`) describes, with weights of its own."""
    spec = resolve_run(load_recipe(TINY, SMALL + list(overrides)), world_size=2)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(spec.drafter)
    return drafter, save_drafter(drafter, tmp_path / "export")


@pytest.mark.integration  # the tiny target and its data, trained in this process (README, "Tests")
def test_a_matching_export_passes_and_the_run_trains_from_its_weights(tmp_path):
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.network.draft_model import DraftModel
    from .reference import reference_losses
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model.model import embed_and_head, load_target

    exported, path = _export(tmp_path)
    recipe = load_recipe(TINY, SMALL + [f"drafter.init_from={path}", f"run.output_dir={tmp_path / 'run'}"])
    data = load_training_data(recipe)
    spec = resolve_run(recipe, world_size=2).with_rows(data.num_rows)
    drafter = build_drafter(spec)
    # The module is the export's weights under the run's shape (so later exports carry the run's shape).
    assert drafter.config == spec.drafter
    stored = load_drafter(path, dtype=torch.float32).state_dict()  # the export's dtype, read back
    for name, value in exported.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], stored[name]), name
        assert torch.allclose(stored[name], value, atol=1e-2), name
    target = load_target(recipe.target.path, dtype="float32")
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    got = reference_losses(spec, target, DraftModel(drafter, embed, head), data.rows, steps=3)
    fresh_spec = resolve_run(load_recipe(TINY, SMALL + [f"run.output_dir={tmp_path / 'fresh'}"]), 2).with_rows(data.num_rows)
    fresh = reference_losses(fresh_spec, target, DraftModel(build_drafter(fresh_spec), embed, head), data.rows, steps=1)
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0], got
    assert got[0] != fresh[0]  # it really started from the export, not from run.seed's weights


@pytest.mark.parametrize("override, field, theirs, ours", [
    ("drafter.block_size=16", "block_size", "8", "16"),
    ("drafter.mask_token_id=6", "mask_token_id", "5", "6"),
    ("drafter.num_layers=3", "num_hidden_layers", "2", "3"),
    ("drafter.intermediate_size=48", "intermediate_size", None, "48"),
    ("drafter.target_layer_ids=[1,2]", "target_layer_ids", None, "[1, 2]"),
])
def test_a_mismatched_export_is_refused_naming_both_values(tmp_path, override, field, theirs, ours):
    _, path = _export(tmp_path)
    recipe = load_recipe(TINY, SMALL + [f"drafter.init_from={path}", override])
    with pytest.raises(RecipeError) as err:
        resolve_run(recipe, world_size=2)
    msg = str(err.value)
    assert "\n" not in msg and "drafter.init_from" in msg and f"recipe gives {field}={ours}" in msg, msg
    assert theirs is None or f"has {field}={theirs}" in msg, msg


def test_a_mismatch_stops_the_entry_point_with_exit_2(tmp_path, capsys):
    from dflash_ds.train import main

    _, path = _export(tmp_path)
    code = main([TINY, f"drafter.init_from={path}", "drafter.block_size=16", "--dry-run", "--world-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "block_size=8" in err[0] and "block_size=16" in err[0], err


def test_init_from_that_is_not_an_export_is_refused(tmp_path):
    recipe = load_recipe(TINY, SMALL + [f"drafter.init_from={tmp_path}"])
    with pytest.raises(RecipeError, match="drafter.init_from: .* is not a DFlash drafter export"):
        resolve_run(recipe, world_size=2)
