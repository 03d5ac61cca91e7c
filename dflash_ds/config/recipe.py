"""The whole recipe: one field per YAML section, in the order they are written and dumped.

Defaults that depend on another section (objective.num_anchors follows data.row_length) are resolved
here, once, when the recipe is built; nothing mutates a recipe afterwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dflash_ds.config.sections import (CheckpointConfig, DataConfig, DrafterConfig, EvalConfig, LogConfig,
                                       ObjectiveConfig, OptimConfig, RunConfig, TargetConfig, TopologyConfig,
                                       default_anchors)


@dataclass(frozen=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str = ""
    """Path of the YAML this recipe came from (set by load_recipe; relative paths resolve against
    the working directory, not this file)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Warnings about how the YAML was read (a moved key, another architecture's section), one line
    each; the launch prints them once (load_recipe sets them; no part of the recipe)."""

    def __post_init__(self):
        if self.objective.num_anchors is None:  # follows the row length at the paper's density
            objective = dataclasses.replace(self.objective, num_anchors=default_anchors(self.data.row_length))
            object.__setattr__(self, "objective", objective)


def ranks_per_node(r: Recipe) -> int:
    """Processes one node runs: its drafter ranks plus its target ranks (0 targets when colocated)."""
    return r.topology.drafters_per_node + r.topology.targets_per_node
