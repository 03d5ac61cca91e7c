"""Expert parallelism in one process: each rank's share read from the checkpoint (per-expert and fused
layouts), the id mapping, and the sharded forward of a one-rank group equal to the whole target.
The multi-rank forward over gloo is tests/test_expert_parallel_launcher.py."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dflash_ds.target_model import expert_parallel as ep
from dflash_ds.target_model import moe
from dflash_ds.target_model.model import TargetError, forward_taps, TapCapture

from .test_moe import tiny_moe


class OneRank:
    """The collectives of a group of one: nothing to exchange."""

    rank, size, replicated = 0, 1, False

    def all_gather(self, x):
        return x

    reduce_scatter = all_reduce = all_gather

    def same_inputs(self):
        return contextlib.nullcontext()


def save_fused(model, path):
    """A checkpoint storing each layer's experts as the fused [E, ...] tensors (the other layout)."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen3-moe"])
def test_each_rank_reads_its_own_experts_and_every_other_weight(tmp_path, layout, name):
    full = tiny_moe(name, dtype=torch.float32, impl=moe.OWN)
    if layout == "per_expert":
        full.save_pretrained(tmp_path)  # transformers writes experts.<j>.gate_proj.weight ...
    else:
        save_fused(full, tmp_path)
    want = dict(full.named_parameters())
    for rank in range(2):
        comm = SimpleNamespace(rank=rank, size=2, replicated=False)
        shard = ep.load_expert_shard(str(tmp_path), comm, dtype="float32")
        got = dict(shard.named_parameters())
        assert got.keys() == want.keys()
        for key, value in got.items():
            ref = want[key]
            if ".experts." in key:
                ref = ref[2 * rank:2 * rank + 2]
            assert torch.equal(value, ref), key
        mods = moe.experts_modules(shard)
        assert mods and all(m.num_experts == 2 and m.expert_range == (2 * rank, 2 * rank + 2) for _, m in mods)
        # The rotary tables, which no checkpoint stores, are the model's own.
        for (k, b), (_, b0) in zip(shard.named_buffers(), full.named_buffers()):
            assert torch.equal(b, b0), k


def test_a_checkpoint_missing_weights_is_named(tmp_path):
    from safetensors.torch import save_file

    full = tiny_moe(dtype=torch.float32)
    full.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in full.state_dict().items() if "layers.1.mlp.gate" not in k},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(TargetError, match="no weights for model.layers.1.mlp.gate.weight"):
        ep.load_expert_shard(str(tmp_path), OneRank(), dtype="float32")


def test_local_ids_map_this_ranks_experts_and_drop_the_rest():
    index = torch.tensor([[0, 5], [3, 4], [7, 2]])
    assert ep.local_ids(index, 2, 4).tolist() == [[2, 2], [1, 2], [2, 0]]
    assert ep.expert_range(8, 3, 4) == (6, 8)
    with pytest.raises(TargetError, match="3 expert-parallel ranks cannot share the target's 8 experts"):
        ep.expert_range(8, 0, 3)


def test_one_rank_group_gives_the_whole_targets_taps(tmp_path):
    full = tiny_moe(dtype=torch.float32, impl="eager")
    full.save_pretrained(tmp_path)
    shard = ep.load_expert_shard(str(tmp_path), OneRank(), dtype="float32")
    moe.use_experts(shard, moe.OWN)
    ids = torch.randint(0, 1024, (2, 19), generator=torch.Generator().manual_seed(5))
    taps = [0, 1, 2, 3]
    outs = []
    for model in (full, shard):
        out = torch.empty(2, 19, 4 * 64)
        cap = TapCapture(model, taps)
        forward_taps(model, cap, ids, None, out=out)
        cap.remove()
        outs.append(out)
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.launcher
def test_two_ranks_of_two_experts_give_the_unsplit_targets_taps(tmp_path):
    """tests/ds_scripts/expert_parallel.py through the real launcher: 1 idle drafter, 2 target ranks
    holding 2 of the 4 experts each; taps of each rank's own packed rows and a greedy continuation
    with both ranks on the same prompt equal the unsplit model's."""
    from .test_deepspeed_patches import launch

    tiny_moe(dtype=torch.float32).save_pretrained(tmp_path)
    out = launch("expert_parallel.py", ["--model", str(tmp_path), "--forwards", "2"])
    for rank in (1, 2):
        assert f"rank {rank}: 2 expert-parallel forwards and the greedy continuation equal the unsplit model" in out
