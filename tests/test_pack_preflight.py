"""Packed rows with a hybrid target: allowed everywhere except on GPU without flash-linear-attention."""

import importlib.util

import pytest
import torch

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.resolve.run import resolve_run

TINY = "recipes/tiny.yaml"


@pytest.fixture
def hybrid_target(tmp_path):
    from dflash_ds.target_model.presets import target_config

    target_config("tiny").save_pretrained(tmp_path)
    return str(tmp_path)


def recipe(hybrid_target, pack):
    return load_recipe(TINY, [f"target.path={hybrid_target}", f"data.pack={str(pack).lower()}"])


def test_hybrid_target_packs_on_cpu(hybrid_target):
    spec = resolve_run(recipe(hybrid_target, True), world_size=2)
    assert spec.geometry.hybrid and spec.recipe.data.pack


def test_gpu_without_fla_refuses_packing_and_names_the_fix(hybrid_target, monkeypatch):
    import dflash_ds.resolve.run as run

    real = importlib.util.find_spec
    monkeypatch.setattr(run, "resolve_device", lambda name, setting: torch.device("cuda"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a))
    with pytest.raises(RecipeError, match=r"data\.pack.*flash-linear-attention.*data\.pack=false"):
        resolve_run(recipe(hybrid_target, True), world_size=2)
    assert not resolve_run(recipe(hybrid_target, False), world_size=2).recipe.data.pack
