"""What a user can break, each stopped with one line naming the setting or file (issue 46's cases):
non-finite settings, dead objectives, plans that cannot fit, plans without a GPU, a resume's contract,
export write errors, data files, the report's jsonl."""

import pytest

from dflash_ds.config import RecipeError, load_recipe


@pytest.mark.parametrize("key, value", [("optim.lr", "inf"), ("objective.ce_weight", ".inf"),
                                        ("objective.kl_weight", "nan"), ("run.stop_grace_s", "-.inf"),
                                        ("optim.betas", "[0.9, .nan]")])
def test_a_non_finite_float_setting_is_refused_naming_the_key(key, value):
    with pytest.raises(RecipeError) as err:
        load_recipe("recipes/tiny.yaml", [f"{key}={value}"])
    msg = str(err.value)
    assert msg.startswith(key.split("=")[0]) and "finite" in msg and "\n" not in msg


def test_finite_floats_still_load():
    r = load_recipe("recipes/tiny.yaml", ["optim.lr=1e-3", "objective.ce_weight=0"])
    assert r.optim.lr == 1e-3 and r.objective.ce_weight == 0.0


DEAD = ["objective.ce_weight=0", "objective.l1_weight=0", "objective.confidence_weight=0"]


@pytest.mark.parametrize("extra, named", [
    ([], "objective.confidence_weight"),
    # Without a confidence head its weight trains nothing: the other three are what count.
    (["drafter.enable_confidence_head=false", "objective.confidence_weight=1"], "objective.l1_weight"),
])
def test_an_objective_with_every_weight_zero_is_refused_before_launch(extra, named):
    from dflash_ds.resolve.run import resolve_run

    recipe = load_recipe("recipes/tiny-dspark.yaml", DEAD + extra)
    with pytest.raises(RecipeError) as err:
        resolve_run(recipe, 2)
    msg = str(err.value)
    assert "all 0" in msg and named in msg and "objective.kl_weight" in msg and "\n" not in msg
    if extra:
        assert "confidence_weight" not in msg


@pytest.mark.parametrize("recipe, overrides", [
    ("recipes/tiny-dspark.yaml", DEAD[:2]),  # the confidence head alone still trains the drafter
    ("recipes/tiny-dspark.yaml", DEAD + ["objective.kl_weight=0.5"]),
    ("recipes/tiny.yaml", ["objective.ce_weight=0", "objective.l1_weight=0"]),  # v1 reads neither
    ("recipes/tiny-dflash2.yaml", ["objective.selector_alpha=0"]),
])
def test_an_objective_with_one_live_term_resolves(recipe, overrides):
    from dflash_ds.resolve.run import resolve_run

    assert resolve_run(load_recipe(recipe, overrides), 2).plan.total_steps > 0
