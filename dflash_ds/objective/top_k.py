"""Top-k over a large vocabulary in two cheap passes instead of one radix select.

`torch.topk` over a row of 248,320 logits runs a multi-pass radix select, many times the cost of
reading those logits once (docs/performance.md, "Figures behind the code"), and DFlash2 needs the
top 16 of every drafted slot's logits at every step (the selector's candidates). The logits are
already in memory, so the selection is done in two stages:

1. the maximum of every group of `group` consecutive logits (one read of the row, a plain
   reduction), then the top k of those group maxima;
2. the top k of the k * group logits of the groups so chosen.

Why this is exact: the k largest values lie in at most k groups, and each such group's maximum is
at least the k-th largest value; any other group's maximum is below it (or equal to it, a tie), so
the k groups with the largest maxima hold the k largest values. With ties at the k-th value the
values returned are still the k largest; which of the tied ids is returned may differ from
`torch.topk`, which leaves that unspecified as well.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch

from dflash_ds.compile import compile_once

GROUP = 128


def _group_max(x: torch.Tensor, group: int) -> torch.Tensor:
    n, v = x.shape
    return x.view(n, v // group, group).amax(-1)


def group_maxima(x: torch.Tensor, group: int) -> torch.Tensor:
    """`[n, V]` -> `[n, V / group]`, the maximum of every group of `group` consecutive entries.
    Compiled on CUDA: the eager reduction over 128-wide groups reads bf16 logits far below the
    memory's rate, the generated kernel near it (docs/performance.md)."""
    if x.device.type != "cuda":
        return _group_max(x, group)
    return compile_once(_group_max, dynamic=False, fullgraph=True)(x, group)


def block_top_k(x: torch.Tensor, k: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of every row of `x` `[n, V]`, sorted best first,
    as `torch.topk(x, k, dim=-1, sorted=True)`. Falls back to `torch.topk` when V is not a
    multiple of `group` or the groups would not make the selection smaller (V <= 4 * k * group)."""
    n, v = x.shape
    if k < 1 or v % group or v <= 4 * k * group:
        return torch.topk(x, k, dim=-1, sorted=True)
    groups = x.view(n, v // group, group)
    best_groups = group_maxima(x, group).topk(k, dim=-1, sorted=False).indices  # [n, k]
    pool = groups.gather(1, best_groups.unsqueeze(-1).expand(n, k, group)).view(n, k * group)
    values, at = pool.topk(k, dim=-1, sorted=True)
    ids = best_groups.gather(1, at // group) * group + at % group
    return values, ids
