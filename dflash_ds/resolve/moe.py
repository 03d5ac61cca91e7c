"""Pre-launch checks for mixture-of-experts targets: the experts implementation, expert parallelism
against the topology, and the engines an MoE target cannot run under (what FP8 asks of the experts:
resolve/quantization.py). Each failure is one line naming the setting and the fix."""

from __future__ import annotations

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.resolve.topology import Layout
from dflash_ds.target_model.model import TargetShape
from dflash_ds.target_model.moe import IMPLEMENTATIONS, OWN, moe_shape


def dense_problem(n: int) -> str:
    return (f"target.expert_parallel is {n} but target.path is a dense model (no routed experts): set "
            "target.expert_parallel=1 (a dense target too large for one GPU runs under ZeRO-3: "
            "ds_configs/target_zero3.json)")


def dense_expert_parallel(recipe: Recipe) -> str | None:
    """The line for target.expert_parallel > 1 on a dense target, checked before the topology: the
    topology's own complaint about it (e.g. the targets per node it must divide) would send the user
    to fix a setting that then fails on the real problem. None when the target's config cannot be
    read (that is reported in its turn)."""
    from dflash_ds.target_model.model import TargetError, load_config

    if recipe.target.expert_parallel == 1:
        return None
    try:
        config = load_config(recipe.target.path)
    except TargetError:
        return None
    return dense_problem(recipe.target.expert_parallel) if moe_shape(config) is None else None


def check_moe(recipe: Recipe, target_config, target_kind: str, layout: Layout) -> None:
    t = recipe.target
    if t.experts_implementation not in IMPLEMENTATIONS:
        raise RecipeError(f"target.experts_implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                          f"got {t.experts_implementation!r}")
    shape = moe_shape(target_config)
    n = t.expert_parallel
    if shape is None:
        if n != 1:
            raise RecipeError(dense_problem(n))
        return
    if target_kind == "zero3":
        raise RecipeError(
            "target.ds_config is a ZeRO-3 JSON but the target is a mixture of experts: ZeRO-3 would gather "
            f"all {shape.num_experts} experts of every layer for each forward, where a token uses "
            f"{shape.experts_per_token}; use ds_configs/target_replica.json, with target.expert_parallel=N for a "
            "target larger than one GPU")
    if n > 1:
        check_expert_parallel(recipe, shape.num_experts, layout)


def check_expert_parallel(recipe: Recipe, num_experts: int, layout: Layout) -> None:
    t, n = recipe.target, recipe.target.expert_parallel
    if num_experts % n:
        raise RecipeError(f"target.expert_parallel {n} must divide the target's {num_experts} experts per layer")
    if t.experts_implementation != OWN:
        raise RecipeError(f"target.expert_parallel {n} runs each rank's share of the experts through {OWN}; "
                          f"set target.experts_implementation={OWN} (it is {t.experts_implementation})")
    # The experts' tokens are gathered over a target's ranks at every MoE layer, so its ranks run their
    # forwards in lock-step: each must produce as many micro-batches per step as the others.
    tpn = layout.targets_per_node
    if (layout.drafters_per_node * recipe.optim.grad_accum) % tpn:
        raise RecipeError(f"target.expert_parallel {n} runs a target's ranks in lock-step, so every target rank "
                          "must produce the same number of micro-batches per step: make topology.drafters_per_node "
                          f"x optim.grad_accum ({layout.drafters_per_node} x {recipe.optim.grad_accum}) a multiple "
                          f"of topology.targets_per_node ({tpn})")
    if recipe.eval.at_end and recipe.eval.benchmarks:
        raise RecipeError(f"eval.benchmarks runs the whole target in one process after training, but it is split over "
                          f"target.expert_parallel {n} GPUs: set eval.benchmarks=[] and run python -m dflash_ds.eval "
                          "on the export where the target fits (or with a smaller target)")
    if t.adapter:
        raise RecipeError(f"target.adapter cannot be merged into a target split over target.expert_parallel {n} "
                          "ranks: merge it first (PEFT merge_and_unload, save_pretrained) and point target.path at "
                          "the merged model")


def target_params(g: TargetShape, layers: int, expert_parallel: int = 1) -> int:
    """Rough parameter count one target rank holds for `layers` decoder layers plus the embedding:
    12 D^2 per dense layer; an MoE layer ~8 D^2 of attention or Gated DeltaNet projections, its
    router and shared expert, and 1/expert_parallel of its routed experts (3 D I each)."""
    d = g.hidden_size
    if not g.moe:
        return int(12 * d * d * layers + g.vocab_size * d)
    experts = g.num_experts * 3 * d * g.expert_width // expert_parallel
    per_layer = 8 * d * d + g.num_experts * d + 3 * d * g.shared_width + experts
    return int(per_layer * layers + g.vocab_size * d)
