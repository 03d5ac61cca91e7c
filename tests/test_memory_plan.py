"""The drafter's memory plan (resolve/plan.py `memory_parts`) against the peaks measured on GPUs.

Every record is the bench's drafter step (`python -m dflash_ds.bench --role drafter --recipe R
--compile-layers`: one drafter rank, one 12,288-token row a micro-batch, 2,048 anchors, grad_accum 1, no
FP8), `torch.cuda.max_memory_allocated` on one H200, as docs/performance.md reports it; the plan is drawn
for the same layout (one drafter rank) from the targets' published geometry, without the hub.
"""

import pytest

from dflash_ds.config import load_recipe
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.run import plan_and_parts
from dflash_ds.target_model.model import target_geometry
from dflash_ds.target_model.presets import published_config

pytestmark = pytest.mark.unit

GIB = 1024 ** 3
ONE_DRAFTER = ["topology.drafters_per_node=1", "topology.targets_per_node=1"]  # world 2: the bench's one drafter rank

# (recipe, overrides, measured peak GiB, where docs/performance.md records it)
RECORDS = [
    ("recipes/qwen27b.yaml", [], 60.8,
     "'The loss: hand-written gradients...' table, v1 fused (bench/loss/, again bench/h200_2026_12_03/v1_after_rooms.json)"),
    ("recipes/qwen27b.yaml", [], 64.3,
     "'Packed rows' table, drafter 12,288 chat (bench/round6/rows_drafter_12288_chat.json: packed rows, older build)"),
    ("recipes/qwen27b-dflash2.yaml", ["drafter.block_size=16"], 75.1,
     "'What LiLiCorr costs' table, DFlash2 at block 16 (bench/h200_2026_12_03/lilicorr_qwen27b-dflash2.json)"),
    ("recipes/qwen27b-dflash2.yaml", [], 53.9,
     "'What DFlash2 costs' table, DFlash2 at the recipe's block 8 (bench/round6/dflash2_recipe_rows_dflash2.json)"),
    ("recipes/qwen27b-dspark.yaml", [], 65.2,
     "'What DSpark costs' table, DSpark block 16 (bench/dspark/block16/dspark16.json)"),
    ("recipes/qwen27b-lilicorr.yaml", [], 79.4,
     "'What LiLiCorr costs' second table, head compiled (bench/h200_2026_12_03b/lilicorr_qwen27b-lilicorr.json)"),
]
PARTS = {"weights", "embedding", "payload", "activations", "architecture", "logits"}


def drafter_parts(recipe: str, overrides: list[str]) -> dict[str, float]:
    r = load_recipe(recipe, overrides + ONE_DRAFTER)
    tcfg = published_config(r.target.path)
    shape = drafter_shape(tcfg, r.drafter)
    _, parts = plan_and_parts(r, 2, shape, target_geometry(tcfg), num_rows=10 ** 6)
    return parts["drafter"]


@pytest.mark.parametrize("recipe, overrides, measured, source", RECORDS, ids=[f"{r[0]}-{r[2]}" for r in RECORDS])
def test_the_plan_is_within_ten_percent_of_each_measured_peak(recipe, overrides, measured, source):
    parts = drafter_parts(recipe, overrides)
    planned = sum(parts.values()) / GIB
    assert abs(planned - measured) <= 0.10 * measured, (
        f"{recipe} {overrides}: the plan {planned:.1f} GiB against {measured} GiB measured ({source}); "
        + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items()))


def test_the_plan_counts_every_part_that_lives_at_the_peak():
    """Each part is there and holds bytes where it applies: the architecture's own activations are zero
    for v1 alone."""
    for recipe, overrides, _, _ in RECORDS:
        parts = drafter_parts(recipe, overrides)
        assert set(parts) == PARTS
        assert all(parts[k] > 0 for k in PARTS - {"architecture"})
        assert (parts["architecture"] > 0) == ("qwen27b.yaml" not in recipe), recipe


@pytest.mark.parametrize("part", ["weights", "activations", "architecture"])
def test_a_plan_without_a_large_part_leaves_a_record_beyond_ten_percent(part):
    """What the bound guards: dropping any of the large parts puts some record outside it."""
    missed = []
    for recipe, overrides, measured, _ in RECORDS:
        parts = drafter_parts(recipe, overrides)
        planned = (sum(parts.values()) - parts[part]) / GIB
        missed.append(abs(planned - measured) > 0.10 * measured)
    assert any(missed)


def test_activation_checkpointing_keeps_only_each_layers_input(tmp_path):
    """A drafter JSON that checkpoints every layer plans less activation memory (the layer inputs only)."""
    import json

    cfg = json.loads(open("ds_configs/drafter_zero2.json").read())
    cfg["activation_checkpointing"].pop("number_checkpoints")
    path = tmp_path / "ckpt.json"
    path.write_text(json.dumps(cfg))
    plain = drafter_parts("recipes/qwen27b.yaml", [])
    ckpt = drafter_parts("recipes/qwen27b.yaml", [f"drafter.ds_config={path}"])
    assert ckpt["activations"] < plain["activations"] / 5
    assert ckpt["weights"] == plain["weights"] and ckpt["logits"] == plain["logits"]


def test_more_drafter_ranks_split_the_optimizer_states_and_gradients():
    """ZeRO-2 (ds_configs/drafter_zero2.json): the recipe's 4 drafter ranks each hold a quarter of the fp32
    masters, Adam's moments and the bf16 gradients, and every bf16 weight."""
    r = load_recipe("recipes/qwen27b.yaml")
    tcfg = published_config(r.target.path)
    shape = drafter_shape(tcfg, r.drafter)
    _, parts = plan_and_parts(r, 8, shape, target_geometry(tcfg), num_rows=10 ** 6)
    one = drafter_parts("recipes/qwen27b.yaml", [])
    p = shape.num_parameters
    assert one["weights"] - parts["drafter"]["weights"] == pytest.approx(p * 14 * 3 / 4)
