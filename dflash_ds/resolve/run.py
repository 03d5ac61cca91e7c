"""The run spec: everything about a run that follows from the recipe and the world size, resolved once.

`resolve_run` runs every check that needs no GPU and no process group, on every rank before the
process group exists, so a bad recipe stops all ranks at once with one message naming the setting
at fault and the fix. What it returns is frozen: nothing fills fields in later. What belongs to a
process rather than to the run (its rank, its process groups, the loaded rows) is held by the
objects that use it (`runtime.target_worker.TargetWorker`, `runtime.trainer.DrafterTrainer`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.network.shape import DrafterShape
from dflash_ds.objective.drafter_loss import StepSettings
from dflash_ds.resolve.drafter import RECIPE_KEYS, check_servable, drafter_shape, recipe_keys
from dflash_ds.resolve.ds_config import drafter_ds_config, target_ds_config
from dflash_ds.resolve.dtypes import payload_dtype, section_dtype
from dflash_ds.resolve.files import check_files
from dflash_ds.resolve.fit import check_fits
from dflash_ds.resolve.moe import check_moe, dense_expert_parallel, target_params
from dflash_ds.resolve.objective import check_objective
from dflash_ds.resolve.payload import PayloadLayout
from dflash_ds.resolve.plan import Plan, memory_parts, resolve
from dflash_ds.resolve.quantization import check_drafter_quantization, check_quantization, check_target_device
from dflash_ds.resolve.topology import Layout, TopologyError
from dflash_ds.safety import say
from dflash_ds.target_model.model import TargetError, TargetShape, load_config, target_geometry


@dataclass(frozen=True)
class RunSpec:
    recipe: Recipe
    device: torch.device  # this rank's device (cuda:LOCAL_RANK or cpu)
    dtype: torch.dtype  # taps on the wire, the frozen embedding / lm_head, the drafter's inputs
    geometry: TargetShape  # the target's
    drafter: DrafterShape  # the one source of the drafter's shape (module, step settings, payload, export)
    payload: PayloadLayout  # one micro-batch on the wire
    plan: Plan  # batch arithmetic, step counts, the schedule
    memory: dict[str, float]  # GiB per rank by role at its peak (resolve.plan.memory_parts)
    rows_known: bool  # False: the plan assumes one step per epoch (data not prepared yet)
    notes: tuple[str, ...] = ()

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def settings(self) -> StepSettings:
        """What every micro-batch's blocks and loss need: the drafter's shape and the objective's knobs."""
        return StepSettings.of(self.drafter, self.recipe.objective, self.recipe.run.seed, self.device)

    def with_rows(self, num_rows: int) -> "RunSpec":
        """The same run once the prepared data's row count is known (exact step counts)."""
        plan, memory = plan_and_memory(self.recipe, self.layout.world_size, self.drafter, self.geometry,
                                       num_rows=num_rows)
        return dataclasses.replace(self, plan=plan, memory=memory, rows_known=True, notes=())


def resolve_device(name: str, setting: str) -> torch.device:
    """auto / cuda / cpu -> this rank's device (cuda:LOCAL_RANK); errors name `setting`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{setting} is cuda but no GPU is visible; set {setting} to cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if name != "cpu":
        raise ValueError(f"{setting} must be auto, cuda or cpu, got {name!r}")
    return torch.device("cpu")


def planned_device(recipe: Recipe, drafter_json: dict, planning: bool) -> tuple[torch.device, tuple[str, ...]]:
    """`resolve_device` of run.device, except for a plan (--dry-run) on a machine without a GPU: that one
    is drawn for the GPUs the recipe asks for (run.device cuda, or auto with a drafter JSON that trains
    in bf16 or fp16, which CPU refuses), with a note, and what only a GPU can say is left unchecked."""
    name = recipe.run.device
    if not planning or torch.cuda.is_available() or name not in ("auto", "cuda"):
        return resolve_device(name, "run.device"), ()
    if name == "auto" and section_dtype(drafter_json, "drafter.ds_config", recipe.drafter.ds_config) == torch.float32:
        return torch.device("cpu"), ()
    return torch.device("cuda", 0), (f"no GPU is visible here: the plan is drawn for GPUs (run.device {name}); "
                                     "the GPU's FP8 support and the GPU-only packages are not checked, its memory only against 1 TiB",)


def check_world(recipe: Recipe, world_size: int) -> Layout:
    t = recipe.topology
    try:
        return Layout(world_size, t.drafters_per_node, t.targets_per_node, t.colocated, recipe.target.expert_parallel)
    except TopologyError as exc:
        raise RecipeError(dense_expert_parallel(recipe) or str(exc)) from None


def resolve_run(recipe: Recipe, world_size: int, num_rows: int | None = None, *, planning: bool = False) -> RunSpec:
    """Every pre-launch check, then the resolved spec. Without `num_rows` (the data is prepared
    after the process group starts) the plan assumes one step per epoch: `RunSpec.with_rows` then
    gives the exact one. `planning` (--dry-run): the plan of a GPU recipe is drawn on a machine
    without a GPU too (`planned_device`), and a hub target out of reach is planned with its built-in
    geometry (target_model.presets), each with a note."""
    layout = check_world(recipe, world_size)
    drafter_json = drafter_ds_config(recipe, layout.num_drafters)
    target_kind, target_json = target_ds_config(recipe, layout.num_targets)
    device, notes = planned_device(recipe, drafter_json, planning)
    no_gpu_here = bool(notes)  # a plan drawn for GPUs on a machine without one
    # Decided once: the drafter's compute dtype; a target of another dtype casts its taps into it
    # as they are written into the payload (the sender), so the drafter side never converts.
    dtype = payload_dtype(recipe, target_kind, target_json, drafter_json, device=device)
    check_files(recipe)
    if recipe.target.adapter and not (Path(recipe.target.adapter) / "adapter_config.json").is_file() \
            and Path(recipe.target.adapter).exists():
        raise RecipeError(f"target.adapter {recipe.target.adapter!r} has no adapter_config.json; point it at a PEFT adapter directory")
    try:
        tcfg = load_config(recipe.target.path)
    except TargetError as exc:
        from dflash_ds.target_model.presets import published_config  # transformers: only when needed

        tcfg = published_config(recipe.target.path) if planning else None
        if tcfg is None:
            raise RecipeError(f"target.path: {exc}") from None
        notes += (f"the target's config ({recipe.target.path}) cannot be read here (no hub, not in the HF cache): "
                  "planned with its published geometry (dflash_ds/target_model/presets.py)",)
    check_quantization(recipe.target, device.type, target_kind, tcfg)
    check_target_device(recipe.target, device)
    check_moe(recipe, tcfg, target_kind, layout)
    geo = target_geometry(tcfg)
    try:
        dcfg = drafter_shape(tcfg, recipe.drafter)
        check_servable(dcfg)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    if recipe.drafter.init_from:
        check_init_from(recipe.drafter.init_from, dcfg)
    check_drafter_quantization(recipe.drafter.fp8, device, dcfg)
    gpu_here = device.type == "cuda" and not no_gpu_here
    if geo.hybrid and recipe.data.pack and gpu_here and importlib.util.find_spec("fla") is None:
        raise RecipeError(
            "data.pack: true with a hybrid (Gated DeltaNet) target on GPU needs flash-linear-attention's varlen "
            "kernel to keep the packed documents of a row apart (without it the exact per-document fallback is "
            "far too slow); pip install 'dflash-ds[gpu]' (flash-linear-attention), or set data.pack=false")
    if geo.hybrid and gpu_here and importlib.util.find_spec("fla") is None:
        say("warning: the target has Gated DeltaNet layers but flash-linear-attention is not installed; "
            "the target will run ~1.6x slower (pip install 'dflash-ds[gpu]')")
    check_objective(StepSettings.of(dcfg, recipe.objective, recipe.run.seed, device))
    payload = payload_layout(recipe, dcfg, dtype)
    rows = num_rows
    if rows is None:
        o = recipe.optim
        rows = o.rows_per_micro_batch * o.grad_accum * layout.num_drafters
        notes += ("data not prepared yet: step counts assume one step per epoch "
                  "(run python -m dflash_ds.data prepare RECIPE for exact numbers)",)
    plan, parts = plan_and_parts(recipe, world_size, dcfg, geo, num_rows=rows)
    check_fits(parts, layout, device, dcfg, zero3_target=target_kind == "zero3")
    return RunSpec(recipe, device, dtype, geo, dcfg, payload, plan, gib(parts), num_rows is not None, notes)


def payload_layout(recipe: Recipe, shape: DrafterShape, dtype: torch.dtype) -> PayloadLayout:
    """One micro-batch on the wire: the shape's taps at its width (the target's hidden size), in
    `dtype`. With the KL term on, targets also send their final-norm states (one more tap)."""
    return PayloadLayout(recipe.optim.rows_per_micro_batch, recipe.data.row_length, shape.num_taps, shape.hidden_size,
                       dtype, final_norm=wants_target_logits(recipe, shape))


def wants_target_logits(recipe: Recipe, shape: DrafterShape) -> bool:
    """Targets send their final-norm states too: the KL term or the architecture's loss needs them."""
    return recipe.objective.kl_weight > 0 or shape.spec.needs_target_logits


def check_init_from(path: str, shape: DrafterShape) -> None:
    """`drafter.init_from` must be an export of the drafter this recipe describes: the same taps,
    block size, mask id, layers, widths, attention types and the architecture's own fields
    (resolve.drafter.recipe_keys). A mismatch
    would train silently and export a config that disagrees with how the drafter was trained."""
    from dflash_ds.export import read_export_config

    try:
        exported = DrafterShape.from_hf_config(read_export_config(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise RecipeError(f"drafter.init_from: {exc}") from None
    keys = recipe_keys(shape)
    if exported.architecture != shape.architecture:  # its backbone only, the heads fresh (load_backbone)
        why = shape.backbone_from(exported)
        if why is not None:
            raise RecipeError(f"drafter.init_from {path!r} {why} (drafter.architecture, drafter.{shape.architecture}:); "
                              "point it at an export of that kind or drop drafter.init_from")
        keys = {k: v for k, v in RECIPE_KEYS.items() if k != "architecture"}
    diff = exported.mismatches(shape, keys)
    if diff:
        name, theirs, ours = diff[0]
        more = f" (and {len(diff) - 1} more: {', '.join(d[0] for d in diff[1:])})" if len(diff) > 1 else ""
        raise RecipeError(f"drafter.init_from {path!r} has {name}={_plain(theirs)} but the recipe gives "
                          f"{name}={_plain(ours)} (set by {keys[name]}){more}; make the recipe match the export "
                          "or drop drafter.init_from")


def _plain(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def gib(parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """GiB per rank by role from `memory_parts`' bytes."""
    return {role: sum(p.values()) / 1024 ** 3 for role, p in parts.items()}


def plan_and_memory(recipe: Recipe, world_size: int, c: DrafterShape, g: TargetShape,
                    *, num_rows: int) -> tuple[Plan, dict[str, float]]:
    """The plan for `num_rows` prepared rows and the rough memory per rank (GiB by role) it implies."""
    plan, parts = plan_and_parts(recipe, world_size, c, g, num_rows=num_rows)
    return plan, gib(parts)


def plan_and_parts(recipe: Recipe, world_size: int, c: DrafterShape, g: TargetShape,
                   *, num_rows: int) -> tuple[Plan, dict[str, dict[str, float]]]:
    """The plan for `num_rows` prepared rows and the rough bytes per rank by role and part."""
    plan = resolve(recipe, world_size, num_rows)
    # The target's logits at the drafter (the KL term, or the architecture's) keep every target layer
    # and send one more tap (the final-norm state).
    kl = wants_target_logits(recipe, c)
    last = g.num_layers if kl else max(c.target_layer_ids) + 1
    tp = target_params(g, last, recipe.target.expert_parallel)
    return plan, memory_parts(recipe, plan, c, tp, hidden=g.hidden_size, vocab=g.vocab_size, taps=c.num_taps + int(kl))
