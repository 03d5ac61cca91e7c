"""A run that trains nothing stops at a log step, before its export, naming the settings to lower
(dflash_ds/runtime/untrained.py; issue 60): every step skipped for non-finite gradients, or a loss that
is no longer finite. An fp16 loss scale that skips a few steps first is not stopped."""

from types import SimpleNamespace

import pytest
import torch

from dflash_ds.config import load_recipe
from dflash_ds.runtime.untrained import MOST_SKIPPED, TrainingWatch
from dflash_ds.safety import Exit, SettingError


def spec_of(recipe, overrides, steps):
    """The run's spec, as if its plan had `steps` optimizer steps (the tiny data has fewer)."""
    from dflash_ds.resolve.run import resolve_run

    spec = resolve_run(load_recipe(recipe, overrides), 2)
    return SimpleNamespace(recipe=spec.recipe, settings=spec.settings, plan=SimpleNamespace(total_steps=steps))


def test_every_step_skipped_stops_naming_the_large_weight():
    spec = spec_of("recipes/tiny-dspark.yaml", ["objective.dspark.confidence_weight=1e30"], steps=400)
    engine = SimpleNamespace(skipped_steps=0)
    watch = TrainingWatch(spec, engine, start=0)
    with pytest.raises(SettingError) as err:
        for step in range(10, 400, 10):  # logged every 10 steps, every one of them skipped
            engine.skipped_steps = step
            watch.check(step, 2.5)
    msg = str(err.value)
    assert step == MOST_SKIPPED and err.value.code == Exit.USER and "\n" not in msg
    assert msg.startswith(f"the last {MOST_SKIPPED} optimizer steps (to step {MOST_SKIPPED}) were all skipped")
    assert "OVERFLOW! Skipping step" in msg and "lower objective.dspark.confidence_weight = 1e+30" in msg
    assert "optim.lr = 0.003" in msg and "objective.dspark.ce_weight" not in msg  # weights of 1 are not named


def test_a_short_run_whose_every_step_is_skipped_stops_at_its_last_step_before_the_export():
    spec = spec_of("recipes/tiny.yaml", [], steps=8)
    engine = SimpleNamespace(skipped_steps=0)
    watch = TrainingWatch(spec, engine, start=0)
    for step in range(1, 8):
        engine.skipped_steps = step
        watch.check(step, 2.5)  # fewer than MOST_SKIPPED so far: it may still start training
    engine.skipped_steps = 8
    with pytest.raises(SettingError, match=r"^the last 8 optimizer steps \(to step 8\) were all skipped.*optim\.lr"):
        watch.check(8, 2.5)


def test_a_loss_that_is_not_finite_stops_the_run():
    spec = spec_of("recipes/tiny.yaml", [], steps=8)
    watch = TrainingWatch(spec, SimpleNamespace(skipped_steps=0), start=0)
    watch.check(1, 3.0)
    with pytest.raises(SettingError, match=r"^the loss is nan at step 2: the drafter's weights are no longer finite"):
        watch.check(2, float("nan"))


def test_a_loss_scale_that_skips_the_first_steps_then_trains_is_left_alone():
    spec = spec_of("recipes/tiny.yaml", [], steps=2 * MOST_SKIPPED)
    engine = SimpleNamespace(skipped_steps=0)
    watch = TrainingWatch(spec, engine, start=0)
    for step in range(1, 2 * MOST_SKIPPED + 1):
        engine.skipped_steps = min(step, MOST_SKIPPED - 1)  # 49 skipped, then every step applied
        watch.check(step, 3.0)
    # a resumed run counts from its own start: the steps skipped before it are not its own
    resumed = TrainingWatch(spec, SimpleNamespace(skipped_steps=MOST_SKIPPED - 1), start=60)
    resumed.check(2 * MOST_SKIPPED, 3.0)


def test_the_trainer_checks_every_log_step_on_every_drafter_rank(monkeypatch):
    """log_step calls the check after the all-reduce and before the lead's logging: a rank that is not the
    lead stops as well, so that the ranks stop together."""
    from dflash_ds.runtime import trainer

    spec = spec_of("recipes/tiny.yaml", [], steps=8)
    spec.device, spec.layout = "cpu", SimpleNamespace(drafter_ranks=[0])
    engine = SimpleNamespace(skipped_steps=0)
    me = SimpleNamespace(spec=spec, lead=False, group=None, watch=TrainingWatch(spec, engine, start=0))
    monkeypatch.setattr(trainer.dist, "all_reduce", lambda vec, group=None: None)
    stats = trainer.StepStats(torch.tensor(float("inf")), torch.tensor(4.0), torch.tensor(0.0), torch.tensor(1.0))
    with pytest.raises(SettingError, match="the loss is inf at step 3"):
        trainer.DrafterTrainer.log_step(me, 3, stats, 1.0, 3, t0=0.0, start=0)
    stats = trainer.StepStats(torch.tensor(8.0), torch.tensor(4.0), torch.tensor(0.0), torch.tensor(1.0))
    me.watch, engine.skipped_steps = TrainingWatch(spec, engine, start=0), 8
    with pytest.raises(SettingError, match="the last 8 optimizer steps"):  # every step of the run skipped
        trainer.DrafterTrainer.log_step(me, 8, stats, 1.0, 8, t0=0.0, start=0)
