"""DFlash2 recipes and settings: the published shape from recipes/qwen27b-dflash2.yaml against z-lab's public
config fixture, the tap preset, one-line errors for bad DFlash2 settings, and `drafter.init_from` with a
DFlash2 export (accepted by a DFlash2 recipe, refused by a v1 one, and the other way round)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ds.config import DrafterConfig, RecipeError, load_recipe
from dflash_ds.export import save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.run import resolve_run
from dflash_ds.target_model.presets import target_config

TINY2 = "recipes/tiny-dflash2.yaml"
SMALL = ["data.num_proc=1", "optim.max_steps=3", "log.progress=false"]


def test_qwen27b_dflash2_recipe_is_the_published_shape():
    recipe = load_recipe("recipes/qwen27b-dflash2.yaml")
    shape = drafter_shape(target_config("qwen3.6-27b"), recipe.drafter)
    config = shape.to_hf_config()
    # The fields of z-lab's tests/fixtures/dflash2-config.json (its values where they are the shape).
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    d = config["dflash_config"]
    assert (d["block_size"], d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) \
        == (8, 2, 16, 256, 16)
    assert d["target_layer_ids"] == [5, 19, 33, 47, 61] and d["mask_token_id"] == 248070
    assert config["layer_types"] == ["sliding_attention"] * 5 and config["sliding_window"] == 2048
    assert config["use_sliding_window"] is True and config["max_window_layers"] == 5
    assert config["is_causal"] is False and config["num_target_layers"] == 64
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (5, 5120, 32, 8, 128)
    # Parameters: the two codebooks are 2 * V * r = 127M at V = 248,320, r = 256.
    assert 2 * shape.vocab_size * shape.arch_fields.selector_rank == 127_139_840


def test_dflash2_tap_preset_for_the_64_layer_geometry():
    base = dict(num_layers=5, block_size=8, mask_token_id=248070, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=17408)
    cfg = target_config("qwen3.6-27b")
    v2 = drafter_shape(cfg, DrafterConfig(**base, architecture="dflash2"))
    v1 = drafter_shape(cfg, DrafterConfig(**base))
    assert v2.target_layer_ids == (5, 19, 33, 47, 61)
    assert v1.target_layer_ids == (1, 16, 31, 46, 61)
    # Other geometries keep the general rule.
    small = drafter_shape(target_config("qwen3.6-27b", layers=36), DrafterConfig(**base, architecture="dflash2"))
    assert small.target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize("override, words", [
    ("drafter.architecture=dflash3", "drafter.architecture"),
    ("drafter.dflash2.conv_kernel_size=9", "drafter.dflash2.conv_kernel_size"),
    ("drafter.dflash2.selector_top_k=0", "drafter.dflash2.selector_top_k"),
    ("objective.dflash2.selector_alpha=-1", "objective.dflash2.selector_alpha"),
    ("objective.dflash2.selector_ramp_ratio=2", "objective.dflash2.selector_ramp_ratio"),
])
def test_bad_dflash2_settings_stop_with_one_line(override, words):
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe(TINY2, SMALL + [override]), world_size=2)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_group_size_that_does_not_divide_the_width_is_refused_before_launch():
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe(TINY2, SMALL + ["drafter.dflash2.conv_group_size=48"]), world_size=2)
    assert "drafter.dflash2.conv_group_size" in str(e.value)


def test_a_selector_too_wide_for_llama_cpp_is_refused_before_launch():
    # llama.cpp packs k candidates and k x k scores into one hidden-width row: 10 * 11 <= 128 < 11 * 12.
    assert resolve_run(load_recipe(TINY2, SMALL), world_size=2).drafter.arch_fields.selector_top_k == 10
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe(TINY2, SMALL + ["drafter.dflash2.selector_top_k=11"]), world_size=2)
    msg = str(e.value)
    assert "drafter.dflash2.selector_top_k" in msg and "132" in msg and "10 or less" in msg and "\n" not in msg
    v1 = resolve_run(load_recipe(TINY2, SMALL + ["drafter.architecture=dflash", "drafter.dflash2.selector_top_k=11"]), 2)
    assert v1.drafter.architecture == "dflash"  # a v1 drafter has no selector to refuse


def _export(tmp_path, recipe, overrides=()):
    spec = resolve_run(load_recipe(recipe, SMALL + list(overrides)), world_size=2)
    torch.manual_seed(7)
    drafter = DFlashDrafter(spec.drafter)
    if hasattr(drafter, "candidate_selector"):
        with torch.no_grad():  # a selector that has learnt something, so loading it is visible
            drafter.candidate_selector.successor_codebook.normal_()
    return drafter, save_drafter(drafter, tmp_path / "export")


def test_init_from_a_dflash2_export(tmp_path):
    from dflash_ds.runtime.trainer import build_drafter

    exported, path = _export(tmp_path, TINY2)
    recipe = load_recipe(TINY2, SMALL + [f"drafter.init_from={path}", f"run.output_dir={tmp_path / 'run'}"])
    spec = resolve_run(recipe, world_size=2)
    drafter = build_drafter(spec)
    assert drafter.config == spec.drafter and drafter.config.architecture == "dflash2"
    sel = drafter.candidate_selector.successor_codebook
    assert torch.allclose(sel, exported.candidate_selector.successor_codebook, atol=1e-2) and sel.abs().sum() > 0
    # A v1 recipe cannot continue it, nor a DFlash2 recipe a v1 export: one line naming the setting.
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe("recipes/tiny.yaml", SMALL + [f"drafter.init_from={path}"]), world_size=2)
    assert "selector" in str(e.value) or "drafter.architecture" in str(e.value)
    _, v1 = _export(tmp_path / "v1", TINY2, ["drafter.architecture=dflash"])
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe(TINY2, SMALL + [f"drafter.init_from={v1}"]), world_size=2)
    assert "drafter.architecture" in str(e.value)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
