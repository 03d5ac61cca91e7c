"""Every workaround for DeepSpeed paths that assume one process group spans the whole world.

The target group and the drafter group run different programs, so a WORLD collective issued by
only one of them waits forever. Each patch here is narrow, and has a multi-process test in
tests/test_deepspeed_patches.py that hangs (times out) or fails without it (deepspeed 0.19.8,
transformers 5.17):

| patch                  | what it removes                                                        |
|------------------------|------------------------------------------------------------------------|
| GroupMPU               | deepspeed.initialize cloning WORLD as its data-parallel group (a WORLD |
|                        | new_group) and every ZeRO reduction over it; the WORLD batch check     |
| skip_zero3_trace_check | ZeRO-3's parameter-trace check (WORLD broadcasts) at the 2nd forward   |
| barriers_on            | the WORLD barrier in save_checkpoint (load_checkpoint has none today;  |
|                        | it is routed too)                                                      |
| zero_init_on           | zero.Init's per-parameter WORLD broadcast inside HF from_pretrained,   |
|                        | and HF's ZeRO-3 loader writing weights on global rank 0 only (silently |
|                        | unloaded weights when rank 0 is a drafter)                             |

Checkpoint tag validation (a WORLD all-reduce in save_checkpoint) is switched off in the JSON
instead: resolve/ds_config.py's drafter_ds_config writes `"checkpoint": {"tag_validation": "Ignore"}`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys


def disable_cpu_shm_build() -> None:
    """Stop the CPU comm backend from JIT-compiling its shared-memory op at every engine start.

    The op takes ~25 s of g++ per process, fails without a compiler, and ignores process groups.
    `import deepspeed.comm.torch as m` would bind the torch package itself, hence sys.modules.
    """
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


class GroupMPU:
    """The `mpu` DeepSpeed asks for: data parallelism over one group, no model parallelism.

    deepspeed.initialize has no process-group argument; through this object dp_world_size,
    gradient all-reduce and train_batch_size follow the rank's own group.
    """

    def __init__(self, group, ranks: list[int], rank: int):
        assert rank in ranks, f"rank {rank} is not in the group's ranks {list(ranks)}"
        self.group = group
        self.ranks = list(ranks)
        self.rank = rank

    @classmethod
    def for_group(cls, group) -> "GroupMPU":
        """The mpu of the calling rank's `group` (ranks read from the group itself)."""
        import torch.distributed as dist

        return cls(group, dist.get_process_group_ranks(group), dist.get_rank())

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return self.ranks.index(self.rank)

    def get_data_parallel_world_size(self):
        return len(self.ranks)

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    # Newer DeepSpeed code paths ask for these names.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


def skip_zero3_trace_check() -> None:
    """ZeRO-3's second forward compares its parameter trace with an all-reduce over WORLD.

    On a target-only group the drafters never join it; the frozen target's trace cannot diverge
    between target ranks (same model, same code), so the check is dropped. Only the coordinator's
    binding is replaced: the same helper elsewhere (ZeRO-3 gradient buckets, `safe_mode`
    all-gathers) keeps checking, and is not used by a forward-only target. Idempotent.
    """
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    ppc.assert_ints_same_as_other_ranks = _no_trace_check


def _no_trace_check(ints) -> None:
    return None


@contextlib.contextmanager
def barriers_on(group):
    """Route deepspeed.comm.barrier to `group` (checkpoint save/load barrier on WORLD otherwise).

    Only group-less calls are redirected; a barrier that names its group is left alone.
    """
    import deepspeed.comm as dscomm

    original = dscomm.barrier

    def barrier(*args, **kwargs):
        if not args and kwargs.get("group") is None:
            kwargs["group"] = group
        return original(*args, **kwargs)

    dscomm.barrier = barrier
    try:
        yield
    finally:
        dscomm.barrier = original


@contextlib.contextmanager
def zero_init_on(group):
    """Make HF from_pretrained under HfDeepSpeedConfig build and load the model on `group` only.

    Two WORLD assumptions in that path, both fixed only while the context is open:
    - transformers calls `deepspeed.zero.Init(config_dict_or_path=...)` through the module
      attribute, which is swapped for a subclass that partitions over `group` (zero.Init
      broadcasts every new parameter over its group). It also passes an mpu for the group:
      zero.Init builds a DeepSpeedConfig from the JSON, whose batch check
      (train_batch_size = micro x accum x world) would otherwise count WORLD.
    - transformers' ZeRO-3 state-dict loader writes the gathered weights on global rank 0 only and
      broadcasts from the group's first rank. Drafter ranks come first, so global rank 0 is not a
      target: without the fix the target keeps uninitialised memory, silently. During that loader,
      a group-less torch.distributed.get_rank() answers the rank within `group`.
    """
    import deepspeed
    import transformers.modeling_utils as hf_modeling

    original_init = deepspeed.zero.Init
    original_load = hf_modeling._load_state_dict_into_zero3_model
    mpu = GroupMPU.for_group(group)

    class GroupInit(original_init):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("data_parallel_group", group)
            kwargs.setdefault("mpu", mpu)
            super().__init__(*args, **kwargs)

    def load_on_group(*args, **kwargs):
        with _group_rank_as_rank(group):
            return original_load(*args, **kwargs)

    deepspeed.zero.Init = GroupInit
    hf_modeling._load_state_dict_into_zero3_model = load_on_group
    try:
        yield
    finally:
        deepspeed.zero.Init = original_init
        hf_modeling._load_state_dict_into_zero3_model = original_load


@contextlib.contextmanager
def _group_rank_as_rank(group):
    import torch.distributed as dist

    original = dist.get_rank
    group_rank = original(group)

    def get_rank(group=None):
        return group_rank if group is None else original(group)

    dist.get_rank = get_rank
    try:
        yield
    finally:
        dist.get_rank = original
