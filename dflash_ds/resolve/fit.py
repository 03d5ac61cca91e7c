"""Whether the plan fits where it runs: the memory estimate per rank (resolve.plan.memory_parts)
against the device's memory, before any rank starts.

A drafter of 10^11 parameters used to pass every check and end, after the launcher had started every
rank, in an allocation traceback. On a GPU each rank holds its own device, so each role's estimate is
compared with the GPU's memory; on CPU the ranks of a node share the host's memory, so their sum is
compared with it. The drafter's estimate is held within 10% of its measured peaks (docs/performance.md,
"What the memory plan counts"); those are the allocator's peaks, and the caching allocator reserves more
than it hands out, so only a plan whose estimate exceeds the whole memory is refused: that one cannot run.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dflash_ds.config import RecipeError
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import setting_of
from dflash_ds.resolve.topology import Layout

GIB = 1024 ** 3
# A plan drawn for GPUs on a machine without one (--dry-run) is held to this: no GPU made has as much.
ANY_GPU = 1024 * GIB

# The settings behind each part of the estimate, and what shrinks it.
PART_SETTINGS = {
    ("drafter", "embedding"): "the target's vocabulary x hidden size (target.path)",
    ("drafter", "payload"): "data.row_length x optim.rows_per_micro_batch x the taps (received 2 x optim.grad_accum deep)",
    ("drafter", "activations"): "optim.rows_per_micro_batch x objective.num_anchors x drafter.block_size x drafter.num_layers "
                                "x the layer's widths (drafter.intermediate_size; fewer with the drafter.ds_config's "
                                "activation_checkpointing)",
    ("drafter", "architecture"): "the architecture's own modules (its drafter.<architecture>: section) x "
                                 "optim.rows_per_micro_batch x objective.num_anchors x drafter.block_size",
    ("drafter", "logits"): "optim.rows_per_micro_batch x objective.num_anchors x drafter.block_size x the vocabulary "
                           "/ objective.loss_chunks",
    ("target", "weights"): "the target's weights (target.path; target.quantization=fp8 or a ZeRO-3 target.ds_config "
                           "holds less)",
    ("target", "payload"): "topology.max_in_flight x data.row_length x optim.rows_per_micro_batch",
    ("target", "activations"): "data.row_length x optim.rows_per_micro_batch",
}


def host_memory() -> int | None:
    """This host's physical memory in bytes, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory a rank on `device` has (a plan drawn for GPUs on a machine
    without one: more than any GPU has); None when the system does not say."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ANY_GPU, f"any GPU's memory (none has {ANY_GPU // GIB:,} GiB)"
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the GPU's {props.total_memory / GIB:.1f} GiB ({props.name})"
    total = host_memory()
    return (total, f"this host's {total / GIB:.1f} GiB of memory") if total else None


def largest_drafter_field(shape: DrafterShape) -> str:
    """The drafter setting whose halving removes the most parameters: the one to lower."""
    base, best, name = shape.num_parameters, 0, "drafter.num_layers"
    fields = {f.name for f in dataclasses.fields(shape.arch_fields)}
    for field, value in shape.flat().items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 2 or not setting_of(field).startswith("drafter."):
            continue
        try:
            if field in fields:
                smaller = shape.replace(arch_fields=dataclasses.replace(shape.arch_fields, **{field: value // 2}))
            else:
                smaller = shape.replace(**{field: value // 2})
            saved = base - smaller.num_parameters
        except (ValueError, TypeError):  # a value the shape refuses (e.g. heads that no longer divide)
            continue
        if saved > best:
            best, name = saved, f"{setting_of(field)} {value:,}"
    return name


def per_rank(parts: dict[str, dict[str, float]], layout: Layout, device: torch.device,
             zero3_target: bool) -> dict[str, dict[str, float]]:
    """The parts (keyed "role part") each compared unit holds: a rank on a GPU (a colocated rank both
    roles), or on CPU the node's ranks together."""
    roles = {"drafter": parts["drafter"], "target": {} if zero3_target else parts["target"]}
    held = {role: {f"{role} {k}": v for k, v in p.items()} for role, p in roles.items()}
    if layout.colocated:
        held = {"colocated": {**held["drafter"], **held["target"]}}
    if device.type == "cuda":
        return {f"a {role} rank": p for role, p in held.items() if p}
    counts = {"drafter": layout.drafters_per_node, "target": layout.targets_per_node, "colocated": layout.per_node}
    node: dict[str, float] = {}
    for role, p in held.items():
        for k, v in p.items():
            node[k] = node.get(k, 0.0) + v * counts[role]
    return {f"the {layout.per_node} ranks of a node": node}


def check_fits(parts: dict[str, dict[str, float]], layout: Layout, device: torch.device, shape: DrafterShape, *,
               zero3_target: bool = False) -> None:
    """RecipeError naming the part and its settings when a rank's estimate exceeds its memory. A
    ZeRO-3 target is left out: its weights are partitioned, or offloaded, by its config."""
    memory = device_memory(device)
    if memory is None:
        return
    limit, what = memory
    for unit, held in per_rank(parts, layout, device, zero3_target).items():
        total = sum(held.values())
        if total <= limit:
            continue
        part = max(held, key=held.get)
        role, name = part.split(" ", 1)
        if (role, name) == ("drafter", "weights"):
            cause = f"the drafter's {shape.num_parameters:,} parameters (the largest share: {largest_drafter_field(shape)})"
        else:
            cause = PART_SETTINGS[(role, name)]
        raise RecipeError(f"the memory plan needs {total / GIB:,.1f} GiB for {unit}, more than {what}; "
                          f"{held[part] / GIB:,.1f} GiB of it is the {part}, set by {cause}: lower it "
                          "(--dry-run prints the plan)")
