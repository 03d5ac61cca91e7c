"""The collectives of an expert group (target.expert_parallel): target_model/expert_parallel.py's
ExpertComm bound to a torch.distributed process group of the target ranks that hold one target."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class GroupComm:
    """all_gather / reduce_scatter / all_reduce over `group`, rank-major; NCCL's tensor collectives,
    and on gloo (CPU runs, tests) the list forms, with the reduce-scatter as an all-reduce and a slice."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.replicated = False
        self.nccl = dist.get_backend(group) == "nccl"

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.nccl:
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x, group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        n = x.shape[0] // self.size
        if self.nccl:
            out = x.new_empty((n, *x.shape[1:]))
            dist.reduce_scatter_tensor(out, x, group=self.group)
            return out
        dist.all_reduce(x, group=self.group)
        return x[self.rank * n:(self.rank + 1) * n]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    @contextlib.contextmanager
    def same_inputs(self):
        """Within the block every rank of the group runs the same input (ExpertComm.same_inputs)."""
        before, self.replicated = self.replicated, True
        try:
            yield
        finally:
            self.replicated = before
