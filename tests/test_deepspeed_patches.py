"""The two-group DeepSpeed workarounds, each proven by a real multi-process run on CPU/gloo.

Every launch runs a script from tests/ds_scripts through the real `deepspeed` launcher with one
"drafter" group and one "target" group in one world: one group works while the other waits in a
point-to-point receive, then all meet at a WORLD barrier. Without the workaround under test the
working group's WORLD collective never completes, and the launch times out.

To re-check that a workaround is still needed (e.g. after a DeepSpeed upgrade), run its script by
hand with `--without NAME` and a short timeout; it must hang (`--dump_after 40` prints where):
    deepspeed --num_gpus 3 tests/ds_scripts/zero3_target.py --model M --without trace_check
    deepspeed --num_gpus 3 tests/ds_scripts/zero3_target.py --model M --without zero_init
    deepspeed --num_gpus 3 tests/ds_scripts/hf_zero_init.py --model M --without zero_init
    deepspeed --num_gpus 3 tests/ds_scripts/hf_zero_init.py --model M --without loader_rank   (fails, wrong weights)
    deepspeed --num_gpus 3 tests/ds_scripts/drafter_ckpt.py --drafters 2 --run_dir D --without barriers
    deepspeed --num_gpus 3 tests/ds_scripts/drafter_ckpt.py --drafters 2 --run_dir D --without tag_validation
    deepspeed --num_gpus 3 tests/ds_scripts/drafter_mpu.py --drafters 2 --without mpu
(M: a directory written by the `tiny_checkpoint` fixture below; DS_ACCELERATOR=cpu OMP_NUM_THREADS=1.)
"""

from __future__ import annotations

import json

import pytest
import torch

from .launch_util import cpu_env, deepspeed_cmd, free_port, output, run

TIMEOUT = 150  # a passing launch takes 10-35 s on 2 cores; anything near this is a hang


def launch(script: str, args: list[str], procs: int = 3) -> str:
    cmd = deepspeed_cmd() + ["--num_gpus", str(procs), "--master_port", str(free_port()),
                             f"tests/ds_scripts/{script}"] + args
    proc = run(cmd, TIMEOUT, cpu_env())
    out = output(proc)
    assert proc.returncode == 0, out[-6000:]
    for rank in range(procs):
        assert f"WORKER OK rank {rank}" in out, out[-6000:]
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 (4 layers, untied head) and a LoRA adapter whose merge changes its output."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(root / "model")
    # init_lora_weights=False: B is random, not zero, so the merged weights differ from the base.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(root / "adapter")
    return root


# ---------------------------------------------------------------------------- multi-process


@pytest.mark.launcher
def test_zero3_target_with_trace_check_skipped(tiny_checkpoint):
    """skip_zero3_trace_check + load_target_zero3: 1 drafter idle, 2 targets under ZeRO-3.

    The targets run 3+ forward_taps calls (the WORLD trace check sat at the 2nd) and a whole-model
    forward; taps and logits equal an unsharded load_target bit for bit, LoRA merged into the
    partitioned weights included.
    """
    out = launch("zero3_target.py", ["--model", str(tiny_checkpoint / "model"),
                                     "--adapter", str(tiny_checkpoint / "adapter"), "--forwards", "3"])
    for rank in (1, 2):
        assert f"rank {rank}: 3 ZeRO-3 forwards equal the unsharded model" in out


@pytest.mark.launcher
def test_zero_init_on_partitions_over_the_target_group(tiny_checkpoint):
    """HF from_pretrained under HfDeepSpeedConfig inside zero_init_on(target group): 1 drafter idle.

    Each of the 2 target ranks holds half of every weight (not a third: the group, not WORLD), and
    its half is the checkpoint's, although global rank 0 (where HF writes weights) is a drafter.
    """
    out = launch("hf_zero_init.py", ["--model", str(tiny_checkpoint / "model")])
    for rank in (1, 2):
        assert f"rank {rank}: 47 shards over ranks [1, 2] match the checkpoint" in out


@pytest.mark.launcher
def test_checkpoint_save_load_on_the_drafter_group(tmp_path):
    """barriers_on + tag_validation Ignore: 2 drafters save and load while the target rank waits.

    Reloaded weights, fp32 master partitions and AdamW state equal the saved ones exactly, and the
    steps after the reload repeat the same losses.
    """
    run_dir = tmp_path / "run"
    out = launch("drafter_ckpt.py", ["--drafters", "2", "--run_dir", str(run_dir)])
    for rank in (0, 1):
        assert f"rank {rank}: save/load round trip exact (tag step00000002)" in out
    info = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert info == {"tag": "step00000002", "step": 2}
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step00000002").glob("zero_pp_rank_*"))
    assert len(shards) == 2, shards  # ZeRO-2 over the 2 drafters, not over WORLD's 3 ranks


@pytest.mark.launcher
def test_group_mpu_makes_the_drafter_group_data_parallel():
    """GroupMPU: dp world size 2 of world 3; both drafters end with identical weights equal to
    single-process AdamW on the averaged gradient (and the same gradient norms)."""
    out = launch("drafter_mpu.py", ["--drafters", "2"])
    for rank in (0, 1):
        assert f"rank {rank}: dp world 2, params equal across drafters and to the reference" in out


# ---------------------------------------------------------------------------- single process


def test_group_mpu_reports_the_group():
    from dflash_ds.runtime.deepspeed_patches import GroupMPU

    group = object()
    mpu = GroupMPU(group, [3, 4, 5], 5)
    assert mpu.get_data_parallel_group() is group
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()) == (2, 3)
    assert (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) == (0, 1)
    assert mpu.get_tensor_model_parallel_world_size() == 1
    with pytest.raises(AssertionError):
        GroupMPU(group, [3, 4], 5)


def test_barriers_on_routes_only_groupless_barriers(monkeypatch):
    import deepspeed.comm as dscomm

    from dflash_ds.runtime.deepspeed_patches import barriers_on

    calls = []

    def fake_barrier(group=None, **kwargs):
        calls.append(group)

    monkeypatch.setattr(dscomm, "barrier", fake_barrier)
    with barriers_on("drafters"):
        dscomm.barrier()
        dscomm.barrier(group="other")
        dscomm.barrier(group=None)
    dscomm.barrier()
    assert calls == ["drafters", "other", "drafters", None]
    assert dscomm.barrier is fake_barrier


def test_skip_zero3_trace_check_replaces_only_the_coordinator_binding():
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero import utils as zutils

    from dflash_ds.runtime.deepspeed_patches import skip_zero3_trace_check

    original = ppc.assert_ints_same_as_other_ranks
    try:
        skip_zero3_trace_check()
        skip_zero3_trace_check()
        assert ppc.assert_ints_same_as_other_ranks([1, 2]) is None
        assert ppc.assert_ints_same_as_other_ranks is not zutils.assert_ints_same_as_other_ranks
    finally:
        ppc.assert_ints_same_as_other_ranks = original


ZERO3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


@pytest.mark.parametrize("ds_config, dtype, setting", [
    ({"zero_optimization": {"stage": 2}}, "float32", "target.ds_config"),
    ({}, "float32", "target.ds_config"),
    (ZERO3, "float32", "target.dtype"),
    ({"zero_optimization": {"stage": 3}}, "bfloat16", "target.dtype"),
])
def test_load_target_zero3_rejects_mismatched_settings(ds_config, dtype, setting):
    from dflash_ds.runtime.zero_inference import load_target_zero3

    with pytest.raises(ValueError, match=setting):
        load_target_zero3("unused", ds_config, None, dtype=dtype)


def write_adapter_config(path, **cfg) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_merge_adapter_partitioned_refuses_what_it_cannot_merge(tmp_path):
    from dflash_ds.runtime.zero_inference import merge_adapter_partitioned

    lora_with_saved_modules = write_adapter_config(
        tmp_path / "a", peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    ia3 = write_adapter_config(tmp_path / "b", peft_type="IA3", target_modules=["k_proj"],
                               feedforward_modules=[])
    for adapter, reason in ((lora_with_saved_modules, "modules_to_save"), (ia3, "IA3"),
                            (str(tmp_path / "missing"), "not a PEFT adapter")):
        with pytest.raises(ValueError, match="target.adapter") as err:
            merge_adapter_partitioned(None, adapter)  # refused before the model is touched
        assert reason in str(err.value)
