"""Roles, groups and the deterministic send/receive schedule.

Ranks are numbered node by node (the DeepSpeed launcher's order). On every node the first
`drafters_per_node` local ranks are drafters and the rest are targets, so every hidden-state send
stays inside a node and global rank 0 is a drafter. The latter matters because the drafter engine's
`save_checkpoint` does some work only on global rank 0: it creates the checkpoint directory and
copies DeepSpeed's zero_to_fp32.py recovery script into every checkpoint (and the engine's log lines
come from rank 0). DeepSpeed's own `latest` file plays no part: checkpoints are saved with
`save_latest=False`, and runtime/checkpoint.py writes `latest.json` itself from the lead drafter
once every drafter rank has finished writing.

Micro-batch numbering: step s, accumulation index g, global drafter index j (node-major) own the
global micro-batch m = (s * grad_accum + g) * num_drafters + j. Inside a node the k-th micro-batch
(k = (s * grad_accum + g) * drafters_per_node + local drafter index) is produced by local target
k mod targets_per_node. Every target walks its k in increasing order and every drafter consumes in
increasing order, so FIFO point-to-point channels need no control messages and never deadlock, and a
resumed run knows exactly where it was from the step number alone.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    world_size: int
    drafters_per_node: int
    targets_per_node: int
    colocated: bool = False
    expert_parallel: int = 1  # target ranks per target replica (target.expert_parallel), inside one node

    def __post_init__(self):
        per = self.per_node
        if self.world_size % per != 0:
            raise TopologyError(
                f"world size {self.world_size} is not a multiple of the ranks per node the recipe asks for "
                f"(topology.drafters_per_node {self.drafters_per_node} + topology.targets_per_node "
                f"{self.targets_per_node} = {per}); launch {per} processes per node "
                f"(deepspeed --num_gpus {per}) or change the topology section")
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        n = self.expert_parallel
        if n == 1:
            return
        if n < 1:
            raise TopologyError(f"target.expert_parallel must be >= 1, got {n}")
        if self.colocated:
            raise TopologyError(f"target.expert_parallel {n} spreads one target over {n} target ranks, but "
                                "topology.colocated runs one rank per GPU holding both models: set "
                                "target.expert_parallel=1 or topology.colocated=false")
        if self.targets_per_node % n:
            raise TopologyError(f"target.expert_parallel {n} must divide topology.targets_per_node "
                                f"{self.targets_per_node}: a target's ranks share one node")

    @property
    def per_node(self) -> int:
        return self.drafters_per_node + self.targets_per_node

    @property
    def nodes(self) -> int:
        return self.world_size // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local(self, rank: int) -> int:
        return rank % self.per_node

    def is_drafter(self, rank: int) -> bool:
        return self.colocated or self.local(rank) < self.drafters_per_node

    def is_target(self, rank: int) -> bool:
        return self.colocated or self.local(rank) >= self.drafters_per_node

    def role(self, rank: int) -> str:
        return "both" if self.colocated else ("drafter" if self.is_drafter(rank) else "target")

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if self.is_drafter(r)]

    @property
    def target_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if self.is_target(r)]

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)

    def drafter_index(self, rank: int) -> int:
        """Global drafter index j (node-major), the drafter's data-parallel rank."""
        return self.node_of(rank) * self.drafters_per_node + self.local(rank)

    def drafter_rank(self, node: int, local_drafter: int) -> int:
        return node * self.per_node + local_drafter

    def target_rank(self, node: int, local_target: int) -> int:
        if self.colocated:
            return node * self.per_node + local_target
        return node * self.per_node + self.drafters_per_node + local_target

    # ------------------------------------------------------------------ schedule

    def micro_index(self, step: int, accum: int, grad_accum: int, drafter_rank: int) -> int:
        """Global micro-batch id m, which also fixes the rows it holds."""
        return (step * grad_accum + accum) * self.num_drafters + self.drafter_index(drafter_rank)

    def source_of(self, step: int, accum: int, grad_accum: int, drafter_rank: int) -> int:
        """The target rank that produces drafter_rank's micro-batch (step, accum)."""
        if self.colocated:
            return drafter_rank
        node, ld = self.node_of(drafter_rank), self.local(drafter_rank)
        k = (step * grad_accum + accum) * self.drafters_per_node + ld
        return self.target_rank(node, k % self.targets_per_node)

    def target_work(self, target_rank: int, step: int, grad_accum: int) -> list[tuple[int, int, int]]:
        """(accum, drafter_rank, micro index) that target_rank produces for `step`, in send order."""
        if self.colocated:
            return [(g, target_rank, self.micro_index(step, g, grad_accum, target_rank)) for g in range(grad_accum)]
        node = self.node_of(target_rank)
        lt = self.local(target_rank) - self.drafters_per_node
        out = []
        for g in range(grad_accum):
            for ld in range(self.drafters_per_node):
                k = (step * grad_accum + g) * self.drafters_per_node + ld
                if k % self.targets_per_node == lt:
                    d = self.drafter_rank(node, ld)
                    out.append((g, d, self.micro_index(step, g, grad_accum, d)))
        return out

    def expert_groups(self) -> list[list[int]]:
        """The target ranks holding one target together (target.expert_parallel consecutive local
        target ranks of a node); every target rank is in exactly one. Size 1 without expert parallelism."""
        n, out = self.expert_parallel, []
        for node in range(self.nodes):
            ranks = [self.target_rank(node, lt) for lt in range(self.targets_per_node)]
            out += [ranks[i:i + n] for i in range(0, len(ranks), n)]
        return out

    def expert_group_of(self, rank: int) -> list[int]:
        """The ranks of the target `rank` helps hold (just [rank] without expert parallelism)."""
        return next((g for g in self.expert_groups() if rank in g), [rank])

    def eval_target(self) -> int:
        """The target rank that produces the held-out evaluation payloads for drafter rank 0."""
        return self.target_rank(0, 0)

    def describe(self) -> list[str]:
        lines = []
        for r in range(self.world_size):
            lines.append(f"rank {r}: node {self.node_of(r)} local {self.local(r)} role {self.role(r)}")
        return lines
