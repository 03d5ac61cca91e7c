"""Everything that can be checked before any GPU time is spent, and the per-rank run context.

Each check names the recipe setting at fault and the fix. It runs on every rank before the
process group exists, so a bad recipe stops all ranks at once.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_ds.config import Recipe, RecipeError
from dflash_ds.runtime.ds_config import drafter_ds_config, target_ds_config
from dflash_ds.runtime.plan import Plan, drafter_params, memory_estimate, resolve
from dflash_ds.target.model import DTYPES, Geometry, load_config, target_geometry
from dflash_ds.runtime.topology import Layout, TopologyError
from dflash_ds.runtime.transport import PayloadSpec


@dataclass
class Context:
    recipe: Recipe
    device: torch.device
    geometry: Geometry
    drafter_cfg: object
    spec: PayloadSpec
    world_size: int
    plan: Plan | None = None
    memory: dict | None = None
    data: object = None
    rank: int = 0
    groups: object = None
    control: object = None  # runtime.control.RunControl: lock, start point, peers, stop requests
    notes: list[str] = field(default_factory=list)


def check_world(recipe: Recipe, world_size: int) -> Layout:
    t = recipe.topology
    try:
        return Layout(world_size, t.drafters_per_node, t.targets_per_node, t.colocated)
    except TopologyError as exc:
        raise RecipeError(str(exc)) from None


def preflight(recipe: Recipe, world_size: int) -> Context:
    from dflash_ds.model.drafter import DrafterConfig
    from dflash_ds.runtime.engines import pick_device

    layout = check_world(recipe, world_size)
    drafter_ds_config(recipe, layout.num_drafters)
    target_ds_config(recipe, layout.num_targets)
    device = pick_device(recipe)
    if recipe.drafter.init_from and not Path(recipe.drafter.init_from).is_dir():
        raise RecipeError(f"drafter.init_from {recipe.drafter.init_from!r} is not a directory; point it at an exported drafter")
    if recipe.target.adapter and not (Path(recipe.target.adapter) / "adapter_config.json").is_file() \
            and Path(recipe.target.adapter).exists():
        raise RecipeError(f"target.adapter {recipe.target.adapter!r} has no adapter_config.json; point it at a PEFT adapter directory")
    tcfg = load_config(recipe.target.path)
    geo = target_geometry(tcfg)
    d = recipe.drafter
    dcfg = DrafterConfig.from_target(tcfg, num_layers=d.num_layers, block_size=d.block_size, mask_token_id=d.mask_token_id,
                                     target_layer_ids=d.target_layer_ids, intermediate_size=d.intermediate_size,
                                     num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads,
                                     head_dim=d.head_dim)
    if geo.hybrid and recipe.data.pack:
        raise RecipeError(
            "data.pack: true with a hybrid (Gated DeltaNet) target would let recurrent state leak across the "
            "packed documents of a row: the target forward here does not pass per-document boundaries "
            "(cu_seqlens) to the linear-attention layers. Set data.pack: false (one conversation per row)")
    if geo.hybrid and device.type == "cuda" and importlib.util.find_spec("fla") is None:
        print("[dflash] warning: the target has Gated DeltaNet layers but flash-linear-attention is not installed; "
              "the target will run ~1.6x slower (pip install 'dflash-ds[gpu]')", flush=True)
    tap_dtype = DTYPES[recipe.target.dtype] if device.type == "cuda" else torch.float32
    spec = PayloadSpec(recipe.optim.rows_per_micro_batch, recipe.data.max_length, len(dcfg.target_layer_ids),
                       geo.hidden_size, tap_dtype)
    return Context(recipe, device, geo, dcfg, spec, world_size)


def load_data(ctx: Context):
    """Prepare (or read the cache of) the training rows and held-out prompts."""
    from transformers import AutoTokenizer

    from dflash_ds.data.prepare import prepare

    r = ctx.recipe
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if Path(r.target.path).is_dir() and not any((Path(r.target.path) / f).is_file() for f in files):
        # transformers would otherwise build some tokenizer from the config and fail later on the data.
        raise RecipeError(f"target.path {r.target.path!r}: no tokenizer could be loaded (none of {', '.join(files)} "
                          "in that directory); the target directory must hold its tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(r.target.path)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"target.path {r.target.path!r}: no tokenizer could be loaded ({exc}); the target "
                          "directory must hold its tokenizer") from None
    # Packing for hybrid targets is refused in preflight (no varlen wiring), so never claim fla here.
    return prepare(r.data, tok, hybrid_target=ctx.geometry.hybrid, has_fla=False)


def finish(ctx: Context) -> None:
    """Batch arithmetic and memory estimates once the number of rows is known."""
    num_rows = len(ctx.data.rows["input_ids"]) if ctx.data is not None else None
    ctx.plan = resolve(ctx.recipe, ctx.world_size, num_rows if num_rows is not None else _placeholder_rows(ctx))
    c = ctx.drafter_cfg
    dp = drafter_params(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                        c.num_key_value_heads, c.head_dim, len(c.target_layer_ids))
    g = ctx.geometry
    last = max(c.target_layer_ids) + 1
    tp = int(12 * g.hidden_size * g.hidden_size * last + g.vocab_size * g.hidden_size)  # dense estimate
    ctx.memory = memory_estimate(ctx.recipe, ctx.plan, dp, tp, g.hidden_size, g.vocab_size, len(c.target_layer_ids))
    if num_rows is None:
        ctx.notes.append("data not prepared yet: step counts assume one step per epoch "
                         "(run python -m dflash_ds.data prepare RECIPE for exact numbers)")


def _placeholder_rows(ctx: Context) -> int:
    o = ctx.recipe.optim
    lay = check_world(ctx.recipe, ctx.world_size)
    return o.rows_per_micro_batch * o.grad_accum * lay.num_drafters
