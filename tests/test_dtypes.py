"""Payload dtype: decided once from the recipe (the drafter's compute dtype), checked before launch,
and the target's taps cast once at the sender."""

import pytest
import torch

from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.resolve.run import resolve_run
from dflash_ds.resolve.ds_config import drafter_ds_config, target_ds_config
from dflash_ds.resolve.dtypes import payload_dtype
from dflash_ds.runtime.target_worker import TargetWorker
from dflash_ds.resolve.payload import PayloadLayout, unpack

from .test_target import tiny_qwen3

TINY = "recipes/tiny.yaml"
CUDA = torch.device("cuda", 0)  # only a name here: nothing is allocated on it


def dtype_for(overrides, device):
    r = load_recipe(TINY, overrides)
    kind, tcfg = target_ds_config(r, 1)
    return payload_dtype(r, kind, tcfg, drafter_ds_config(r, 1), device=device)


@pytest.mark.parametrize("overrides, device, want", [
    ([], torch.device("cpu"), torch.float32),
    # The GPU case that crashed in the drafter's fc: a float32 target feeding a bf16 drafter.
    (["drafter.ds_config=ds_configs/drafter_zero2.json"], CUDA, torch.bfloat16),
    (["drafter.ds_config=ds_configs/drafter_zero2.json", "target.dtype=bfloat16",
      "target.ds_config=ds_configs/target_replica.json"], CUDA, torch.bfloat16),
    (["target.dtype=bfloat16", "target.ds_config=ds_configs/target_replica.json"], torch.device("cpu"), torch.float32),
    (["target.dtype=bfloat16", "target.ds_config=ds_configs/target_zero3.json",
      "drafter.ds_config=ds_configs/drafter_zero2.json"], CUDA, torch.bfloat16),
])
def test_payload_dtype_is_the_drafter_compute_dtype(overrides, device, want):
    assert dtype_for(overrides, device) == want


@pytest.mark.parametrize("overrides, needle", [
    (["drafter.ds_config=ds_configs/drafter_zero2.json"], "drafter.ds_config"),  # bf16 drafter on CPU
    (["target.ds_config=ds_configs/target_zero3.json"], "target.dtype is float32"),  # zero3 JSON stores bf16
    (["target.ds_config=ds_configs/target_replica.json"], "target.dtype is float32"),  # replica JSON says bf16
    (["target.dtype=bfloat16"], "target.dtype is bfloat16"),  # replica_cpu JSON says fp32
])
def test_unworkable_dtypes_are_refused_before_launch(overrides, needle):
    r = load_recipe(TINY, overrides)
    with pytest.raises(RecipeError, match=needle) as info:
        resolve_run(r, 2)
    assert "\n" not in str(info.value)


def test_both_half_sections_refused(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('{"bf16": {"enabled": true}, "fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    with pytest.raises(RecipeError, match="both bf16 and fp16"):
        dtype_for([f"drafter.ds_config={p}"], CUDA)


def test_run_spec_carries_the_payload_dtype():
    spec = resolve_run(load_recipe(TINY, []), 2)
    assert spec.dtype == spec.payload.dtype == torch.float32


def test_float32_target_taps_are_cast_once_at_the_sender():
    """A float32 target fills a bf16 payload: taps equal its float32 states rounded to bf16, the
    metadata survives, and a bf16 drafter consumes them (the uncast float32 taps raise in its fc)."""
    from dflash_ds.config import DrafterConfig
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.network.shape import DrafterShape

    target = tiny_qwen3()
    taps = [0, 2]
    layout = PayloadLayout(rows=2, seq_len=9, num_taps=2, hidden=32, dtype=torch.bfloat16)
    from types import SimpleNamespace

    run = SimpleNamespace(drafter=SimpleNamespace(target_layer_ids=taps), payload=layout, device=torch.device("cpu"))
    worker = TargetWorker(run, target, None)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    loss_mask = (torch.arange(9) >= 4).int().expand(2, 9).contiguous()
    doc_ids = torch.zeros(2, 9, dtype=torch.int32)
    buf = layout.empty("cpu")
    with torch.no_grad():
        worker._forward(buf, ids, loss_mask, doc_ids)  # what fill() does with a micro-batch's rows
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    mb = unpack(buf, layout, layout.dtype)
    assert mb.taps.dtype == torch.bfloat16
    want = torch.cat([hs[k + 1] for k in taps], -1).to(torch.bfloat16)
    assert torch.equal(mb.taps, want)
    assert torch.equal(mb.input_ids, ids) and torch.equal(mb.loss_mask, loss_mask.bool())
    shape = DrafterConfig(num_layers=1, block_size=4, mask_token_id=1, target_layer_ids=taps)
    cfg = drafter_shape(target.config, shape)
    drafter = DFlashDrafter(cfg).to(torch.bfloat16)
    assert drafter.fuse(mb.taps).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="dtype"):
        drafter.fuse(torch.cat([hs[k + 1] for k in taps], -1))
