"""Every workaround for DeepSpeed paths that assume one process group spans the whole world.

The target group and the drafter group run different programs, so a WORLD collective issued by
only one of them waits forever. Each patch here is narrow, undoable, and has a test in
tests/test_deepspeed_patches.py that hangs (times out) without it.
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
        self.group = group
        self.ranks = list(ranks)
        self.rank = rank

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
    between target ranks (same model, same code), so the check is dropped.
    """
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    ppc.assert_ints_same_as_other_ranks = lambda ints: None


@contextlib.contextmanager
def barriers_on(group):
    """Route deepspeed.comm.barrier to `group` (checkpoint save/load barrier on WORLD otherwise)."""
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
    """Make HF from_pretrained's deepspeed.zero.Init partition over `group`, not WORLD."""
    import deepspeed

    original = deepspeed.zero.Init

    class GroupInit(original):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("data_parallel_group", group)
            super().__init__(*args, **kwargs)

    deepspeed.zero.Init = GroupInit
    try:
        yield
    finally:
        deepspeed.zero.Init = original
