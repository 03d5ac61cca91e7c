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
