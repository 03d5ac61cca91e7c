"""The resolve step: batch arithmetic, step counts, the schedule, and memory estimates.

Computed once from the recipe, the world size and the number of prepared rows; printed by
`--dry-run` without touching a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.network.arch_types import StepSizes
from dflash_ds.resolve.ds_config import checkpointed_layers, drafter_ds_config
from dflash_ds.resolve.topology import Layout

if TYPE_CHECKING:
    from dflash_ds.network.shape import DrafterShape


@dataclass(frozen=True)
class Plan:
    layout: Layout
    rows_per_micro: int
    grad_accum: int
    seq_len: int
    num_rows: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    schedule: str = "cosine"
    decay_steps: int = 0
    """wsd: steps of the final linear decay (the stable phase lies between warmup and decay)."""

    @property
    def micro_per_step(self) -> int:
        return self.grad_accum * self.layout.num_drafters

    @property
    def tokens_per_step(self) -> int:
        return self.micro_per_step * self.rows_per_micro * self.seq_len

    def rows_of(self, micro_index: int, seed: int) -> np.ndarray:
        """Row indices of global micro-batch `micro_index`: a fresh permutation every epoch."""
        per_epoch = self.steps_per_epoch * self.micro_per_step
        epoch, i = divmod(micro_index, per_epoch)
        perm = epoch_order(seed, epoch, self.num_rows)
        return perm[i * self.rows_per_micro:(i + 1) * self.rows_per_micro]


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    """The row order of one epoch, computed once, not per micro-batch (a permutation of all the rows
    is too slow to draw at every step: docs/performance.md)."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def resolve(recipe: Recipe, world_size: int, num_rows: int) -> Plan:
    t = recipe.topology
    layout = Layout(world_size, t.drafters_per_node, t.targets_per_node, t.colocated, recipe.target.expert_parallel)
    o = recipe.optim
    micro_per_step = o.grad_accum * layout.num_drafters
    steps_per_epoch = num_rows // (micro_per_step * o.rows_per_micro_batch)
    if steps_per_epoch < 1:
        raise RecipeError(
            f"the prepared data has {num_rows} rows but one optimizer step needs {micro_per_step * o.rows_per_micro_batch} "
            "(optim.rows_per_micro_batch x optim.grad_accum x drafter ranks); use more data or smaller batches")
    total = math.floor(o.epochs * steps_per_epoch) if o.epochs > 0 else o.max_steps
    if o.max_steps is not None:
        total = min(total, o.max_steps) if o.epochs > 0 else o.max_steps
    total = max(int(total), 1)
    warmup = int(round(o.warmup_ratio * total))
    decay = min(max(int(round(o.decay_ratio * total)), 1), total - warmup) if o.schedule == "wsd" else 0
    return Plan(layout, o.rows_per_micro_batch, o.grad_accum, recipe.data.row_length, num_rows, steps_per_epoch,
                total, warmup, o.schedule, decay)


@dataclass
class Cooldown:
    """An early end of the run (runtime/stopping.py): from step `start` on, the learning rate falls
    linearly from its value there to the floor over `steps` steps, and the run ends after them. Set
    at most once, by the trainer, at a step boundary that every drafter rank agreed on."""

    start: int | None = None
    steps: int = 0

    @property
    def end(self) -> int | None:
        return None if self.start is None else self.start + self.steps


def lr_factor(step: int, plan: Plan, min_ratio: float, cooldown: Cooldown | None = None) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based): linear warmup, then either cosine
    decay to min_ratio at the last step, or (wsd) 1.0 until the last decay_steps steps, which fall
    linearly so that the last step runs at exactly min_ratio; after a `cooldown` starts, linearly from
    the factor at its start to min_ratio at its last step."""
    if cooldown is not None and cooldown.start is not None and step >= cooldown.start:
        base = lr_factor(cooldown.start, plan, min_ratio)
        progress = min((step - cooldown.start + 1) / max(cooldown.steps, 1), 1.0)
        return base - (base - min_ratio) * progress
    if step < plan.warmup_steps:
        return (step + 1) / plan.warmup_steps
    if plan.schedule == "wsd":
        start = plan.total_steps - plan.decay_steps
        if step < start:
            return 1.0
        progress = min((step - start + 1) / max(plan.decay_steps, 1), 1.0)
        return 1.0 - (1.0 - min_ratio) * progress
    span = max(plan.total_steps - plan.warmup_steps, 1)
    progress = min((step - plan.warmup_steps) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def receive_depth(grad_accum: int) -> int:
    """Payload receives a split drafter keeps posted: two whole steps. A step starts only once all of
    its payloads are in (its loss is normalised by the whole step's weight), so the next step's
    receives must already be posted while it runs. With one step and one payload, the target's sends
    of the next step waited for the drafter's step to end, each holding NCCL's thread blocks beside
    the target's GEMMs meanwhile (docs/performance.md, "Two GPUs")."""
    return 2 * grad_accum


BF16 = 2
FP32 = 4


def memory_parts(recipe: Recipe, plan: Plan, drafter: DrafterShape, t_params: int, *, hidden: int, vocab: int,
                 taps: int) -> dict[str, dict[str, float]]:
    """Bytes per rank by role and by what holds them at the role's peak, so that a plan that cannot fit
    names the part, and the settings, at fault. The drafter's parts are what lives during its backward,
    its peak: the measured peaks of docs/performance.md ("What the memory plan counts") hold them within
    10% (tests/test_memory_plan.py)."""
    return {"drafter": drafter_parts(recipe, plan, drafter, taps=taps),
            "target": target_parts(recipe, plan, t_params, hidden=hidden, vocab=vocab, taps=taps)}


def payload_bytes(recipe: Recipe, plan: Plan, hidden: int, taps: int) -> int:
    """One micro-batch on the wire: every row's taps in bf16 and its six int columns' worth."""
    return plan.rows_per_micro * recipe.data.row_length * (taps * hidden + 6) * BF16


def step_sizes(recipe: Recipe, plan: Plan, shape: DrafterShape) -> StepSizes:
    """The sizes of one micro-batch's drafter step (arch_types.StepSizes)."""
    return StepSizes(rows=plan.rows_per_micro, row_length=recipe.data.row_length,
                     blocks=plan.rows_per_micro * recipe.objective.num_anchors, block_size=shape.block_size,
                     drafts=shape.num_drafts, loss_chunks=recipe.objective.loss_chunks)


def drafter_parts(recipe: Recipe, plan: Plan, shape: DrafterShape, *, taps: int) -> dict[str, float]:
    """A drafter rank's bytes at its peak, the backward of a micro-batch: every layer's activations are
    held (or, under activation checkpointing, their inputs) with one loss chunk's logits beside them.
    The ZeRO-2 step comes after the activations are freed: its fp32 copy of the gradient partition
    (4 bytes a parameter over the ranks) is smaller than what they held, so it never sets the peak."""
    cfg = drafter_ds_config(recipe, plan.layout.num_drafters)
    step = step_sizes(recipe, plan, shape)
    d, v, p = shape.hidden_size, shape.vocab_size, shape.num_parameters
    return {"weights": trained_bytes(cfg, p, plan.layout.num_drafters),
            # The target's embedding and lm_head, frozen, each [vocab, D] in bf16.
            "embedding": 2 * v * d * BF16,
            "payload": receive_depth(plan.grad_accum) * payload_bytes(recipe, plan, d, taps),
            "activations": backbone_activations(shape, step, checkpointed_layers(cfg, shape.num_hidden_layers)),
            "architecture": shape.extra_activation_bytes(step),
            # One loss chunk's logits in bf16 and their fp32 softmax (the fused loss's gradient pass).
            "logits": step.chunk_rows * v * (BF16 + FP32)}


def trained_bytes(cfg: dict, params: int, ranks: int) -> float:
    """What the drafter's trained parameters hold on one rank under the drafter JSON's ZeRO stage: bf16
    weights on every rank; from stage 1 the fp32 master weights and Adam's two fp32 moments split over
    the ranks; from stage 2 the bf16 gradients too (each rank keeps its partition), plus the reduction
    buckets: `reduce_bucket_size` bf16 elements, twice with `overlap_comm` (DeepSpeed double-buffers them)."""
    zero = cfg.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    states = params * 3 * FP32 / (ranks if stage >= 1 else 1)
    grads = params * BF16 / (ranks if stage >= 2 else 1)
    buckets = (2 if zero.get("overlap_comm") else 1) * int(zero.get("reduce_bucket_size", 5e8)) * BF16 \
        if stage >= 2 else 0
    return params * BF16 + grads + states + buckets


def backbone_activations(shape: DrafterShape, step: StepSizes, checkpointed: int) -> float:
    """The backbone's activations a micro-batch holds for its backward (bf16 unless said):

    - a layer run plainly keeps, per block query, what its backward reads: the layer input and the
      normed input (D each), q before and after its norm and rotary and the attention's output (3 x
      the query width), the block's k and v before and after their norm and rotary (4 x the kv width),
      the residual after attention and the normed MLP input (2 D), the gate, the up and the gated
      product (3 x the intermediate size); per context token its k, rotary k and v (3 x the kv width);
    - a checkpointed layer keeps only its input (D a query), recomputed in the backward;
    - once a micro-batch: the block embeddings (D a query), the fused context and its norm (2 D a
      context token) and the states' gradient the fused loss writes in its forward (fp32, D a loss row).
    """
    d, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    q = shape.num_attention_heads * shape.head_dim
    per_query = 4 * d + 3 * q + 4 * kv + 3 * shape.intermediate_size
    plain = shape.num_hidden_layers - checkpointed
    context = step.rows * step.row_length
    layers = plain * (step.queries * per_query + context * 3 * kv) * BF16 + checkpointed * step.queries * d * BF16
    once = (step.queries * d + context * 2 * d) * BF16 + step.draft_rows * d * FP32
    return layers + once


def target_parts(recipe: Recipe, plan: Plan, t_params: int, *, hidden: int, vocab: int, taps: int) -> dict[str, float]:
    """A target rank's rough bytes: its weights (bf16; FP8 projections take 1 byte a weight, the
    embedding stays bf16), the payloads in flight and the activations of its forward."""
    weights = t_params + vocab * hidden if recipe.target.quantization == "fp8" else t_params * 2
    r, s = plan.rows_per_micro, recipe.data.row_length
    return {"weights": weights, "payload": (recipe.topology.max_in_flight + 1) * payload_bytes(recipe, plan, hidden, taps),
            "activations": r * s * hidden * 2 * 16}


def memory_estimate(recipe: Recipe, plan: Plan, drafter: DrafterShape, t_params: int, *, hidden: int, vocab: int,
                    taps: int) -> dict[str, float]:
    """GiB per rank by role (the sum of `memory_parts`)."""
    parts = memory_parts(recipe, plan, drafter, t_params, hidden=hidden, vocab=vocab, taps=taps)
    return {role: sum(p.values()) / 1024 ** 3 for role, p in parts.items()}


def describe(plan: Plan, memory: dict[str, float] | None = None) -> str:
    lay = plan.layout
    lines = [f"world {lay.world_size} = {lay.nodes} node(s) x {lay.per_node} ranks "
             f"({'colocated' if lay.colocated else f'{lay.drafters_per_node} drafters + {lay.targets_per_node} targets'} per node)"]
    lines += ["  " + l for l in lay.describe()]
    lines.append(f"drafter group {lay.drafter_ranks}; target group {lay.target_ranks}")
    if lay.expert_parallel > 1:
        lines.append("targets held by expert-parallel groups (each rank 1/"
                     f"{lay.expert_parallel} of the experts): {lay.expert_groups()}")
    lines.append(f"rows {plan.num_rows} of {plan.seq_len} tokens; micro-batch {plan.rows_per_micro} rows; "
                 f"grad_accum {plan.grad_accum}; tokens per step {plan.tokens_per_step:,}")
    sched = f"wsd, decay {plan.decay_steps}" if plan.schedule == "wsd" else "cosine"
    lines.append(f"steps per epoch {plan.steps_per_epoch}; total steps {plan.total_steps}; warmup {plan.warmup_steps}; "
                 f"lr schedule {sched}")
    lines.append("send schedule of step 0 (target -> drafter: micro-batch):")
    for tr in lay.target_ranks:
        work = lay.target_work(tr, 0, plan.grad_accum)
        lines.append(f"  target {tr}: " + ", ".join(f"->{d}:m{m}" for _, d, m in work))
    if memory:
        lines.append("memory estimate per rank: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in memory.items()))
    return "\n".join(lines)
