"""DSpark recipes and settings: recipes/qwen27b-dspark.yaml is DeepSpec's drafter at the 27B's depth and
exports what the engines read, bad DSpark settings stop with one line, `drafter.init_from` takes a
DSpark export (and a v1 recipe refuses it), and the tiny recipe trains in-process through the same
target-side payload (final-norm states included) and loss a run uses."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_ds.config import RecipeError, load_recipe, recipe_mapping
from dflash_ds.export import save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.drafter_loss import StepSettings
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.run import resolve_run, wants_target_logits
from dflash_ds.target_model.presets import target_config

TINY = "recipes/tiny-dspark.yaml"
SMALL = ["data.num_proc=1", "optim.max_steps=3", "log.progress=false"]


def test_qwen27b_dspark_recipe_is_deepspecs_drafter_at_the_flagship_block():
    recipe = load_recipe("recipes/qwen27b-dspark.yaml")
    shape = drafter_shape(target_config("qwen3.6-27b"), recipe.drafter)
    config = shape.to_hf_config()
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 16
    assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"],
            config["confidence_head_with_markov"], config["sample_from_anchor"]) == (256, "vanilla", True, True, True)
    assert config["target_layer_ids"] == [1, 16, 31, 46, 61] and config["layer_types"] == ["full_attention"] * 5
    assert (config["num_hidden_layers"], config["hidden_size"]) == (5, 5120) and "is_causal" not in config
    assert shape.num_drafts == 16
    tensors = shape.tensors()
    assert tensors["markov_head.markov_w1.weight"].shape == (248320, 256)
    assert tensors["confidence_head.proj.weight"].shape == (1, 5120 + 256)
    # The flagship's anchors are v1's (recipes/qwen27b.yaml), so the two compare at the same block and anchors.
    v1 = load_recipe("recipes/qwen27b.yaml")
    assert (recipe.drafter.block_size, recipe.objective.num_anchors, recipe.data.row_length) == \
        (v1.drafter.block_size, v1.objective.num_anchors, v1.data.row_length)
    settings = StepSettings.of(shape, recipe.objective, 0, torch.device("cpu"))
    assert math.isclose(settings.gamma, 22 / 3) and recipe.objective.gamma is None
    keys = settings.keys
    assert (keys.ce_weight, keys.l1_weight, keys.confidence_weight) == (0.1, 0.9, 1.0)
    assert wants_target_logits(recipe, shape)  # the target ranks send their final-norm states


def test_qwen27b_dspark_recipe_at_deepspecs_block_is_one_override():
    recipe = load_recipe("recipes/qwen27b-dspark.yaml", ["drafter.block_size=7"])
    shape = drafter_shape(target_config("qwen3.6-27b"), recipe.drafter)
    assert shape.to_hf_config()["block_size"] == 7 and shape.num_drafts == 7
    assert StepSettings.of(shape, recipe.objective, 0, torch.device("cpu")).gamma == 4.0  # DeepSpec's loss_decay_gamma at its block 7


@pytest.mark.parametrize("override, words", [
    ("drafter.dspark.markov_head_type=gated", "drafter.dspark.markov_head_type"),
    ("drafter.dspark.markov_rank=0", "drafter.dspark.markov_rank"),
    ("objective.dspark.l1_weight=-1", "objective.dspark.l1_weight"),
    ("objective.dspark.confidence_weight=-0.5", "objective.dspark.confidence_weight"),
])
def test_bad_dspark_settings_stop_with_one_line(override, words):
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe(TINY, SMALL + [override]), world_size=2)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("recipe, keys, named", [
    ("recipes/tiny.yaml", ["drafter.dspark.markov_rank=64"], ["drafter.dspark.markov_rank"]),
    # The objective's keys of another architecture were ignored without a word.
    ("recipes/tiny.yaml", ["objective.dspark.l1_weight=0.5", "objective.dflash2.selector_alpha=0.5"],
     ["objective.dspark.l1_weight", "objective.dflash2.selector_alpha"]),
    ("recipes/tiny-dflash2.yaml", ["drafter.dspark.markov_rank=64", "objective.dspark.ce_weight=1"],
     ["drafter.dspark.markov_rank, objective.dspark.ce_weight"]),
    # DFlash2's convolution is no part of a DSpark drafter (llama.cpp builds it only for DFlash2).
    (TINY, ["drafter.dflash2.conv_kernel_size=3"], ["drafter.dflash2.conv_kernel_size"]),
])
def test_another_architectures_settings_are_named_once(recipe, keys, named, capsys):
    """One line per other architecture whose sections the recipe sets, naming its keys and the fix, said by
    the launch once (it was said by every rank's resolve step: three times on the tiny recipes)."""
    loaded = load_recipe(recipe, SMALL + keys)
    arch = loaded.drafter.architecture
    assert len(loaded.notes) == len(named)
    for line, words in zip(loaded.notes, named):
        assert line.startswith(words + ":") and f"drafter.architecture: {arch}" in line and "remove the" in line
    resolve_run(loaded, world_size=2)
    assert "markov_rank" not in capsys.readouterr().err  # the resolve step (every rank's) says nothing
    # A section at its defaults is still named (the recipe wrote it), by its name.
    section = keys[0].split("=")[0].rsplit(".", 1)[0]
    assert load_recipe(recipe, SMALL + [section + "={}"]).notes[0].startswith(section + ":")


def test_the_launch_says_the_notes_once(tmp_path, capsys, monkeypatch):
    """guard.launch.main, the pre-launch step, is the one place that says them (train.main's ranks do not)."""
    from dflash_ds.guard import launch

    monkeypatch.setattr(launch, "prelaunch", lambda recipe: {})
    monkeypatch.setattr(launch, "free_port", lambda: 1234)
    assert launch.main(["recipes/tiny.yaml", "drafter.dspark.markov_rank=64", f"run.output_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert err.count("drafter.dspark.markov_rank") == 1 and "warning:" in err


def test_an_older_recipes_flat_keys_load_at_their_sections(tmp_path):
    """A recipe written before the sections: each flat key is read at its new place, one line naming both."""
    import yaml

    old = tmp_path / "old.yaml"
    raw = recipe_mapping(TINY)  # the whole recipe, its base laid under it
    for kind in ("drafter", "objective"):
        raw[kind].update(raw[kind].pop("dspark"))
    old.write_text(yaml.safe_dump(raw, sort_keys=False))
    recipe, new = load_recipe(old, SMALL), load_recipe(TINY, SMALL)
    assert recipe.drafter == new.drafter and recipe.objective == new.objective
    assert recipe.notes[0] == ("recipe key 'drafter.markov_rank' moved to 'drafter.dspark.markov_rank'; read there "
                               "for now: move it in the recipe") and len(recipe.notes) == 7
    # One of another architecture's: one line, saying both.
    v1 = load_recipe("recipes/tiny.yaml", SMALL + ["drafter.selector_top_k=8"])
    assert v1.notes == ("recipe key 'drafter.selector_top_k' moved to 'drafter.dflash2.selector_top_k', a dflash2 "
                        "setting: this drafter is drafter.architecture: dflash and trains without it (remove it, or "
                        "set drafter.architecture: dflash2); read there for now: move it in the recipe",)
    with pytest.raises(RecipeError, match="drafter.markov_rank and drafter.dspark.markov_rank are both set"):
        load_recipe(TINY, SMALL + ["drafter.markov_rank=8"])


def test_init_from_a_dspark_export(tmp_path):
    from dflash_ds.runtime.trainer import build_drafter

    spec = resolve_run(load_recipe(TINY, SMALL), world_size=2)
    torch.manual_seed(7)
    exported = DFlashDrafter(spec.drafter)
    with torch.no_grad():
        exported.markov_head.markov_w2.weight.normal_()
    path = save_drafter(exported, tmp_path / "export")
    recipe = load_recipe(TINY, SMALL + [f"drafter.init_from={path}", f"run.output_dir={tmp_path / 'run'}"])
    drafter = build_drafter(resolve_run(recipe, world_size=2))
    assert drafter.config.architecture == "dspark"
    assert torch.allclose(drafter.markov_head.markov_w2.weight, exported.markov_head.markov_w2.weight, atol=1e-2)
    with pytest.raises(RecipeError) as e:
        resolve_run(load_recipe("recipes/tiny.yaml", SMALL + [f"drafter.init_from={path}"]), world_size=2)
    assert "drafter." in str(e.value) and "\n" not in str(e.value)


@pytest.mark.integration  # the tiny target and its data, trained in this process (README, "Tests")
def test_tiny_dspark_trains_in_process(tmp_path):
    from dflash_ds.data.prepare import load_training_data
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.runtime.trainer import build_drafter
    from dflash_ds.target_model.model import embed_and_head, load_target

    from .reference import reference_losses

    recipe = load_recipe(TINY, ["data.num_proc=1", "optim.max_steps=6", "log.progress=false", f"run.output_dir={tmp_path}"])
    data = load_training_data(recipe)
    spec = resolve_run(recipe, world_size=2).with_rows(data.num_rows)
    target = load_target(recipe.target.path, dtype="float32")
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    drafter = build_drafter(spec)
    before = drafter.markov_head.markov_w2.weight.detach().clone()
    losses = reference_losses(spec, target, DraftModel(drafter, embed, head), data.rows, steps=6)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert not torch.equal(drafter.markov_head.markov_w2.weight, before)


def test_bench_counts_dsparks_matmuls():
    """The Markov projection and the confidence head per block token (forward, input and weight
    gradient), and the target's logits through the lm_head (forward only); the table is gathered."""
    from dflash_ds.bench.flops import drafter_step_flops

    spec = resolve_run(load_recipe(TINY, SMALL), world_size=2)
    shape = spec.drafter
    v, d, r, block_tokens = shape.vocab_size, shape.hidden_size, shape.arch_fields.markov_rank, 70
    plain = drafter_step_flops(shape.replace(architecture="dflash", arch_fields=None), 100, block_tokens, 1234)
    flops = drafter_step_flops(shape, 100, block_tokens, 1234)
    assert flops["dspark"] == (6 * (v * r + d + r) + 2 * v * d) * block_tokens
    # Every slot drafts anchor-first: the lm_head runs on the anchor slot too (10 blocks of 7).
    assert flops["lm_head"] == plain["lm_head"] + 4 * v * d * block_tokens // shape.block_size
    assert flops["total"] == plain["total"] + flops["dspark"] + 4 * v * d * block_tokens // shape.block_size


def test_progress_line_and_report_show_dsparks_fields():
    from dflash_ds.architectures import VARIANTS
    from dflash_ds.metrics import progress_line
    from dflash_ds.report import _summary

    logs = VARIANTS["dspark"].spec.logs
    rec = {"step": 5, "loss": 1.0, "accept_proxy": 2.0, "l1": 0.5, "tau_probabilistic": 2.25,
           "confidence_mae": 0.125, "confidence_bias": -0.0625}
    assert "accept 2.00 | l1 0.5000 | tau_p 2.25 | confidence MAE 0.125 | drafter" in progress_line(rec, 10, logs.progress)
    rows = dict(_summary([rec], [], logs))
    assert rows["final probabilistic tau"] == "2.25" and rows["final confidence calibration"] == "MAE 0.125, bias -0.062"
    # A drafter without a confidence head logs none of its fields, and nothing shows them (it showed "MAE 0.000").
    bare = {k: v for k, v in rec.items() if not k.startswith("confidence")}
    assert "confidence" not in progress_line(bare, 10, logs.progress) and "tau_p 2.25" in progress_line(bare, 10, logs.progress)
    assert "final confidence calibration" not in dict(_summary([bare], [], logs))
