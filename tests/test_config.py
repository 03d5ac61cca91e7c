import json
import math

import pytest

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.resolve.ds_config import checkpointed_layers, drafter_ds_config, target_ds_config
from dflash_ds.resolve.plan import lr_factor, resolve
from dflash_ds.resolve.run import resolve_run

TINY = "recipes/tiny.yaml"


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("override, words", [
    ("drafter.dsprak.markov_rank=4", "unknown recipe key 'drafter.dsprak'; known keys here: "),
    ("drafter.dspark.markov_rank=abc", "drafter.dspark.markov_rank: expected an integer, got 'abc'"),
    ("drafter.dspark.rank=4", "unknown recipe key 'drafter.dspark.rank'; known keys here: confidence_head_with_markov, "),
    ("drafter.dspark=3", "drafter.dspark: expected a mapping of dspark settings, got 3"),
    ("objective.dflash2.selector_warmup_ratio=2", "objective.dflash2.selector_warmup_ratio must be in [0, 1], got 2.0"),
])
def test_an_architectures_section_is_read_and_checked_like_the_rest(override, words):
    """Overrides of an architecture's section (config/architectures.py) go through the same typed reading,
    each error one line naming the dotted key."""
    with pytest.raises(RecipeError) as e:
        load_recipe("recipes/tiny-dspark.yaml", [override])
    assert words in str(e.value) and "\n" not in str(e.value)
    if "dsprak" in override:
        from dflash_ds.architectures import VARIANTS

        from dflash_ds.network.contract import NoFields

        sections = sorted(n for n, v in VARIANTS.items() if v.spec.fields is not NoFields)
        assert str(e.value).endswith("; architecture sections: " + ", ".join(sections)) and "xpress" in sections


def test_unknown_key_names_dotted_path(tmp_path):
    p = write(tmp_path, "target: {path: x}\ndata: {path: y}\ndrafter: {mask_token_id: 1, blok_size: 8}\n")
    with pytest.raises(RecipeError, match=r"drafter\.blok_size"):
        load_recipe(p)


def test_a_removed_key_stops_in_one_line_saying_it_is_gone(tmp_path):
    with pytest.raises(RecipeError, match=r"^recipe key 'objective\.fused_loss' is gone: .*delete the key$"):
        load_recipe(TINY, ["objective.fused_loss=false"])
    p = write(tmp_path, "target: {path: x}\ndata: {path: y}\nobjective: {fused_loss: true}\n")
    with pytest.raises(RecipeError, match="is gone"):
        load_recipe(p)


def test_overrides_are_typed_and_validated():
    r = load_recipe(TINY, ["optim.lr=1e-4", "drafter.target_layer_ids=[0,2]", "data.pack=false"])
    assert r.optim.lr == 1e-4 and r.drafter.target_layer_ids == (0, 2) and r.data.pack is False
    with pytest.raises(RecipeError, match=r"optim\.lrr"):
        load_recipe(TINY, ["optim.lrr=1"])
    with pytest.raises(RecipeError, match=r"optim\.grad_accum"):
        load_recipe(TINY, ["optim.grad_accum=two"])
    # A drafter value is checked where it becomes a shape (before launch, resolve_run), once.
    with pytest.raises(RecipeError, match=r"^drafter\.block_size must be >= 2"):
        resolve_run(load_recipe(TINY, ["drafter.block_size=1"]), world_size=2)
    with pytest.raises(RecipeError, match="num_anchors"):
        load_recipe(TINY, ["objective.num_anchors=100000"])
    with pytest.raises(RecipeError, match="key.sub=value"):
        load_recipe(TINY, ["optim.lr"])


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("recipes/nope.yaml")


def test_ds_config_injection_and_conflicts(tmp_path):
    r = load_recipe(TINY, ["optim.grad_accum=3", "optim.rows_per_micro_batch=2"])
    cfg = drafter_ds_config(r, num_drafters=4)
    assert cfg["train_batch_size"] == 24 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_clipping"] == r.optim.grad_clip
    assert cfg["checkpoint"]["tag_validation"] == "Ignore"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 5, "zero_optimization": {"stage": 2}}))
    with pytest.raises(RecipeError, match="train_batch_size"):
        drafter_ds_config(load_recipe(TINY, [f"drafter.ds_config={bad}"]), 1)
    bad.write_text(json.dumps({"optimizer": {"type": "AdamW"}}))
    with pytest.raises(RecipeError, match="optimizer"):
        drafter_ds_config(load_recipe(TINY, [f"drafter.ds_config={bad}"]), 1)
    with pytest.raises(RecipeError, match="not found"):
        drafter_ds_config(load_recipe(TINY, ["drafter.ds_config=ds_configs/missing.json"]), 1)
    bad.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        target_ds_config(load_recipe(TINY, [f"target.ds_config={bad}"]), 1)


def test_activation_checkpointing_section_controls_layers(tmp_path):
    assert checkpointed_layers({}, 5) == 0
    assert checkpointed_layers({"activation_checkpointing": {}}, 5) == 5
    assert checkpointed_layers({"activation_checkpointing": {"number_checkpoints": 2}}, 5) == 2


def test_target_engine_kinds():
    r = load_recipe(TINY)
    assert target_ds_config(r, 1)[0] == "replica"
    r3 = load_recipe(TINY, ["target.ds_config=ds_configs/target_zero3.json"])
    kind, cfg = target_ds_config(r3, 2)
    assert kind == "zero3" and cfg["train_batch_size"] == 2 * r3.optim.rows_per_micro_batch
    r3b = load_recipe(TINY, ["target.ds_config=ds_configs/target_zero3.json", "topology.targets_per_node=2"])
    with pytest.raises(RecipeError, match="lock-step"):
        target_ds_config(r3b, 2)


def test_resolve_batch_arithmetic_and_schedule():
    r = load_recipe(TINY, ["optim.epochs=2", "optim.grad_accum=2", "optim.rows_per_micro_batch=3"])
    plan = resolve(r, world_size=2, num_rows=100)
    assert plan.steps_per_epoch == 100 // (2 * 3) and plan.total_steps == 2 * plan.steps_per_epoch
    # Every row of an epoch is used at most once, and each epoch uses a different order.
    per_epoch = plan.steps_per_epoch * plan.micro_per_step
    e0 = [int(x) for m in range(per_epoch) for x in plan.rows_of(m, 0)]
    e1 = [int(x) for m in range(per_epoch, 2 * per_epoch) for x in plan.rows_of(m, 0)]
    assert len(set(e0)) == len(e0) == per_epoch * 3 and e0 != e1
    with pytest.raises(RecipeError, match="rows"):
        resolve(r, world_size=2, num_rows=3)
    capped = resolve(load_recipe(TINY, ["optim.max_steps=3"]), 2, 1000)
    assert capped.total_steps == 3


def test_lr_schedule_warmup_then_cosine():
    r = load_recipe(TINY, ["optim.max_steps=100", "optim.warmup_ratio=0.1", "optim.min_lr_ratio=0.1"])
    plan = resolve(r, 2, 10_000)
    f = [lr_factor(s, plan, 0.1) for s in range(plan.total_steps)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] == pytest.approx(0.1, abs=1e-3)


def test_lr_schedules_match_hand_computed_values():
    # 10 steps, warmup 2: cosine over the 8 remaining steps to 0; wsd holds 1.0, then decays over
    # the last 3 steps (30%) linearly to 0.1 (the last step runs at exactly min_lr_ratio).
    base = ["optim.max_steps=10", "optim.warmup_ratio=0.2"]
    cos = resolve(load_recipe(TINY, base + ["optim.schedule=cosine"]), 2, 10_000)
    assert (cos.total_steps, cos.warmup_steps, cos.decay_steps) == (10, 2, 0)
    want_cos = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert [lr_factor(s, cos, 0.0) for s in range(10)] == pytest.approx(want_cos)
    assert lr_factor(9, cos, 0.0) == pytest.approx(0.0380602, abs=1e-6)
    wsd = resolve(load_recipe(TINY, base + ["optim.schedule=wsd", "optim.decay_ratio=0.3", "optim.min_lr_ratio=0.1"]),
                  2, 10_000)
    assert (wsd.schedule, wsd.decay_steps) == ("wsd", 3)
    assert [lr_factor(s, wsd, 0.1) for s in range(10)] == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 0.7, 0.4, 0.1])
    assert lr_factor(10, wsd, 0.1) == pytest.approx(0.1)  # LambdaLR's call after the last step
    for bad, match in (("optim.schedule=linear", "optim.schedule"), ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio"),
                       ("optim.decay_ratio=0", "optim.decay_ratio")):
        with pytest.raises(RecipeError, match=match):
            load_recipe(TINY, [bad])
    with pytest.raises(RecipeError, match="exceed 1"):
        load_recipe(TINY, ["optim.schedule=wsd", "optim.warmup_ratio=0.5", "optim.decay_ratio=0.6"])


def test_dry_run_prints_the_plan_without_distributed(capsys):
    from dflash_ds.train import main

    assert main(["recipes/tiny.yaml", "--dry-run", "--world-size", "3", "topology.targets_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: node 0 local 0 role drafter" in out and "rank 2: node 0 local 2 role target" in out
    assert "target 1: ->0:m0" in out and "memory estimate" in out


# Errors found before the process group exists: every rank runs these checks first, so they are
# tested here in-process through the entry point (`--dry-run` never starts a process group, so a
# check that wrongly passes returns 0 instead of hanging). test_runtime.py proves once that
# `bash launch.sh` turns such an error into one line and exit code 2.
@pytest.mark.parametrize("overrides, world, needle", [
    (["drafter.blok_size=4"], 2, "drafter.blok_size"),
    (["drafter.ds_config=ds_configs/nope.json"], 2, "drafter.ds_config"),
    (["target.path=/nonexistent/model"], 2, "target.path"),
    ([], 3, "world size 3"),
    (["drafter.ds_config={bad}"], 2, "train_micro_batch_size_per_gpu"),
])
def test_errors_before_launch_print_one_line_and_exit_2(tmp_path, capsys, overrides, world, needle):
    from dflash_ds.train import main

    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 7, "zero_optimization": {"stage": 2}}))
    args = [TINY, "--dry-run", "--world-size", str(world), f"run.output_dir={tmp_path / 'run'}"]
    assert main(args + [o.format(bad=bad) for o in overrides]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("[dflash] error:"), out.err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,setting", [
    ("data.regenerate.urls=[localhost:8000]", r"data\.regenerate\.urls\[0\]"),
    ("data.regenerate.urls=[ftp://host/x]", r"data\.regenerate\.urls\[0\]"),
    ("data.regenerate.backend=server", r"data\.regenerate\.urls is empty"),
    ("data.regenerate.backend=vllm", r"data\.regenerate\.backend.*vllm serve"),
    ("data.regenerate.concurrency=0", r"data\.regenerate\.concurrency must be >= 1"),
    ("data.regenerate.timeout_s=0", r"data\.regenerate\.timeout_s"),
    ("data.regenerate.max_retries=-1", r"data\.regenerate\.max_retries"),
    ("data.regenerate.max_failed_fraction=1.5", r"data\.regenerate\.max_failed_fraction"),
    ("data.num_proc=-2", r"data\.num_proc"),
    ("topology.payload_ctas=-1", r"topology\.payload_ctas must be in \[0, 64\]"),
    ("topology.payload_ctas=65", r"topology\.payload_ctas must be in \[0, 64\]"),
])
def test_regenerate_settings_validated(override, setting):
    with pytest.raises(RecipeError, match=setting):
        load_recipe(TINY, [override])
    ok = load_recipe(TINY, ["data.regenerate.backend=server", "data.regenerate.urls=[http://10.0.0.5:8000/v1]"])
    assert ok.data.regenerate.urls == ("http://10.0.0.5:8000/v1",)
