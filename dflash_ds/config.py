"""Typed recipe: frozen dataclasses mirroring the YAML sections.

Unknown keys are errors naming their dotted path; `key.sub=value` overrides go through the same
validation; nothing mutates a recipe afterwards (spec.run.check_recipe resolves it into a RunSpec)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class RecipeError(ValueError):
    """A mistake in the recipe or its overrides; the message names the setting and the fix."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "dflash"
    """Run name, used for the output directory and wandb."""
    output_dir: str = "runs/dflash"
    """Checkpoints, exports, metrics.jsonl and the resolved recipe go here."""
    seed: int = 0
    """Seeds anchor sampling, data order and drafter initialisation."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cuda" or "cpu"."""
    stop_grace_s: float = 300.0
    """After SIGTERM/SIGINT/SIGHUP: seconds the ranks get to finish the current step and write a
    checkpoint before `bash launch.sh` kills the job (a second signal kills at once)."""


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""
    """Hub id or local directory of the frozen target (AutoModelForCausalLM; text tower only)."""
    adapter: str | None = None
    """Optional PEFT adapter merged into the target at load (drafters for fine-tuned targets)."""
    dtype: str = "bfloat16"
    """Target weights and tapped hidden states dtype: bfloat16 or float32."""
    ds_config: str = "ds_configs/target_replica.json"
    """DeepSpeed JSON for the target engine (full replica, or ZeRO-3 'ZeRO-Inference')."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation for the target."""
    quantization: str = "none"
    """none, or fp8: the target's decoder linear layers run in FP8 on the GPU (H100/H200), ~1.4-1.5x the
    bf16 target rate at the 27B geometry. From a bf16 checkpoint the weights are quantized once at load
    (per-row scales); an FP8 checkpoint as published (config.json quantization_config: fp8, 128 x 128
    blocks) is used as stored, the numerics it is served with. An FP8 checkpoint with `none` is
    dequantized to target.dtype. Needs a full replica per GPU (not ZeRO-3), target.dtype bfloat16."""


@dataclass(frozen=True)
class DrafterSection:
    num_layers: int = 5
    """Drafter decoder layers (5 for dense targets in the paper)."""
    target_layer_ids: tuple[int, ...] | None = None
    """Tapped target layers; null = build_target_layer_ids(L, num_layers)."""
    block_size: int = 16
    """Tokens per draft block (anchor + block_size-1 masks)."""
    mask_token_id: int = -1
    """Reserved MASK id < target vocab (Qwen3.5/3.6: 248070, Qwen3: 151669)."""
    intermediate_size: int | None = None
    """MLP width; null = the target's."""
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    layer_types: tuple[str, ...] | None = None
    """Each layer's attention, full_attention or sliding_attention, one per layer; null = all full.
    Exported as config.json's layer_types (docs/algorithm.md section 3)."""
    sliding_window: int | None = None
    """Window W of the sliding layers: a block query at position p sees context tokens at p - W + 1 .. p
    (W counts the query itself, as SGLang and vLLM apply it); needed iff a layer slides, >= block_size."""
    is_causal: bool | None = None
    """Block slot k sees only slots <= k of its own block. null = the engines' default for a config
    without it: sliding layers causal, full layers bidirectional; true/false = every layer (exported)."""
    architecture: str = "dflash"
    """dflash (v1) or dflash2: every attention and MLP sublayer wrapped in a grouped dynamic block
    convolution, plus a candidate selector that rescores the unary top-k (docs/algorithm.md section 8).
    The four fields below apply to dflash2 only; their defaults are the published DFlash2 shape."""
    conv_kernel_size: int = 2
    """dflash2: taps of the block convolution (slot k reads slots k .. k-taps+1 of its own block)."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic coefficient; must divide the hidden size."""
    selector_rank: int = 256
    """dflash2: rank of the selector's pair scores (two [vocab, rank] codebooks: 127M parameters at a
    248K vocabulary)."""
    selector_top_k: int = 16
    """dflash2: unary candidates the selector rescores per slot."""
    ds_config: str = "ds_configs/drafter_zero2.json"
    """DeepSpeed JSON for the drafter's ZeRO-2 engine (activation checkpointing lives here)."""
    init_from: str | None = None
    """An exported drafter directory to start from instead of random weights. Its config must match
    the drafter this section describes (taps, block size, mask id, layers, widths, attention types):
    a mismatch stops before launch naming both values."""
    compile: bool = True
    """torch.compile the drafter layers on GPU (flex_attention is always compiled on GPU)."""


@dataclass(frozen=True)
class RegenerateConfig:
    enabled: bool = False
    """Train on the responses regenerated by the target (written by python -m dflash_ds.regenerate RECIPE)
    instead of data.path's own."""
    output_dir: str = ""
    """Where regenerated shards go and where training reads them; empty = <data.cache_dir>/regenerated."""
    max_new_tokens: int = 2048
    """Longest response per turn; a turn that reaches it unfinished is dropped with the rest of its
    conversation."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling when temperature > 0."""
    backend: str = "auto"
    """server (OpenAI-compatible servers at `urls`: vllm serve, SGLang, transformers serve), hf (the
    target's generate in this process: small targets), auto (server when urls are set, else hf)."""
    urls: tuple[str, ...] = ()
    """Base URLs of the servers, e.g. [http://10.0.0.5:8000]; requests are spread over them round-robin
    and a failed request is retried on the next one."""
    served_model: str | None = None
    """The `model` field of each request; null = target.path (what `vllm serve PATH` serves under)."""
    concurrency: int = 64
    """Conversations in flight per regeneration process (each runs its turns one after another)."""
    timeout_s: float = 600.0
    """Per-request timeout in seconds (a long response at a slow server must fit)."""
    max_retries: int = 8
    """Retries of a failed request (connection refused or reset, timeout, HTTP 408/429/5xx)."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled after each one (capped at 60 s)."""
    max_failed_fraction: float = 0.01
    """Samples whose requests failed after all retries are left out and counted; above this fraction of
    the samples so far the run stops (finished shards are kept; a rerun resumes)."""


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    """Hub dataset id, or a local .json/.jsonl/.parquet/.arrow file or directory."""
    split: str = "train"
    max_samples: int | None = None
    max_length: int = 3072
    """Longest conversation in tokens (the paper's 3,072); longer ones are cut or dropped (data.truncation).
    Position ids restart in every conversation, so the target never sees a position beyond this."""
    row_length: int | None = None
    """Row length S: every row holds exactly this many tokens (static shapes), whole conversations packed
    into it, never split. null = data.max_length. A row several conversations long (e.g. 12,288 = one
    row per micro-batch) wastes almost nothing on long answers; the attention kernels keep the
    conversations of a row apart, so the row length only sets the packing granularity. With
    data.pack false every row holds one conversation and is data.max_length long (this is unused)."""
    pack: bool = True
    """Pack several conversations per row (refused for hybrid targets without flash-linear-attention)."""
    truncation: str = "truncate"
    """Conversations longer than max_length: "truncate" or "drop"."""
    thinking: bool = False
    """Chat template enable_thinking; must match how the target will be served."""
    max_drop_fraction: float = 0.05
    """Samples preparation may drop (unreadable records, unknown roles, conversations too long with
    truncation drop, nothing supervised...); above this fraction the run stops before launch naming
    each reason with its count (the audit, report.txt, is kept: raising the setting reuses it)."""
    cache_dir: str = ".cache/dflash_data"
    seed: int = 0
    eval_path: str | None = None
    """Held-out prompts for acceptance length; null = the last num_eval samples of the dataset."""
    eval_split: str = "train"
    num_eval: int = 16
    num_proc: int = 0
    """Processes for tokenising; 0 = every core (os.cpu_count()), fewer for small datasets."""
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def __post_init__(self):
        if self.row_length is None or not self.pack:  # resolved once: every reader sees the row length in use
            object.__setattr__(self, "row_length", self.max_length)


ANCHORS_PER_TOKEN = 512 / 3072
"""The paper's anchor density: 512 anchors per 3,072-token row."""


def default_anchors(row_length: int) -> int:
    """objective.num_anchors when null: the paper's density at this row length."""
    return max(1, round(row_length * ANCHORS_PER_TOKEN))


@dataclass(frozen=True)
class ObjectiveConfig:
    num_anchors: int | None = None
    """Blocks per row; rows with fewer valid anchors are padded. null = the paper's density, 512 per 3,072
    row tokens (ANCHORS_PER_TOKEN x data.row_length: 512 at 3,072, 2,048 at 12,288)."""
    gamma: float | None = None
    """Loss decay over block slots; null = 7 for B=16, 5 for B=10, 4 for B=8."""
    loss_chunks: int = 16
    """lm_head + cross-entropy computed in this many checkpointed chunks."""
    fused_loss: bool = True
    """lm_head + CE with the input gradient computed in the forward pass (2 lm_head matmuls per chunk
    instead of 3, no fp32 logits round trips); false = the checkpointed autograd path."""
    kl_weight: float = 0.0
    """Weight of a distillation term KL(target || drafter) added to the hard-label CE at every slot
    (0 = plain CE, the paper's recipe). Target ranks then also send their final-norm hidden state
    and run all their layers; drafter ranks compute the target's logits chunk by chunk."""
    kl_temperature: float = 1.0
    """Softens both distributions in the KL term (the term is scaled by T^2)."""
    selector_alpha: float = 1.0
    """dflash2: weight of the selector loss (a k-way cross-entropy over the unary top-k, teacher-forced
    predecessor, the same slot weights) added to the base loss. Peers: 1.0 in SpecForge, speculators
    and NeMo Automodel. 0 leaves the selector untrained (its successor codebook stays zero)."""
    selector_inject_gold: bool = False
    """dflash2: a gold token outside the unary top-k replaces the weakest candidate (speculators'
    default: true); false = such slots add no selector loss, strict top-k (SpecForge's default,
    which it reports gives the best serving acceptance)."""
    selector_warmup_ratio: float = 0.0005
    """dflash2: fraction of the optimizer steps with selector weight 0 (SpecForge: 0.0005; speculators
    and Automodel: 0)."""
    selector_ramp_ratio: float = 0.0005
    """dflash2: fraction of the steps after the warm-up over which the weight rises linearly to
    selector_alpha (SpecForge: 0.0005; speculators and Automodel: 0)."""
    selector_detach: bool = False
    """dflash2: the selector loss trains the selector's own parameters only, not the drafter's states
    (SpecForge's dflash2_selector_stop_gradient, default false; speculators and Automodel: false)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    """Linear warmup from lr/warmup_steps to lr over this fraction of the steps."""
    schedule: str = "cosine"
    """After warmup: "cosine" (decay to min_lr_ratio x lr at the last step) or "wsd"
    (warmup-stable-decay: hold lr, then decay linearly to min_lr_ratio x lr over the last
    decay_ratio of the steps; a run can be extended from a stable-phase checkpoint)."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of lr (both schedules)."""
    decay_ratio: float = 0.2
    """wsd only: fraction of all steps spent in the final linear decay."""
    grad_clip: float = 1.0
    epochs: float = 6.0
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs when smaller)."""
    rows_per_micro_batch: int = 1
    grad_accum: int = 1
    """Micro-batches per drafter rank per optimizer step."""


@dataclass(frozen=True)
class TopologyConfig:
    drafters_per_node: int = 1
    targets_per_node: int = 1
    colocated: bool = False
    """One rank holds both models and passes hidden states in memory (single GPU)."""
    max_in_flight: int = 4
    """Payload sends a target may have outstanding (bounded run-ahead)."""
    payload_ctas: int = 1
    """Thread blocks (SMs) NCCL may use for payload transfers (0: NCCL's choice, 16 on an H200); a
    posted transfer holds them until its peer arrives, slowing the GEMMs beside it (docs/performance.md)."""
    peer_timeout_s: float = 1200.0
    """A rank waiting this long on a peer (a payload, a send, a collective) names the peer and ends
    the job; a dead peer ends it at once. Must exceed the longest legitimate pause of a peer: a
    checkpoint write (minutes for a 27B-width drafter), the first step's compilation, the target's
    held-out generation before the first step."""
    peer_report_s: float = 120.0
    """While a wait on a peer lasts longer than this, a line every this many seconds says who waits
    on whom."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1000
    keep_last: int = 2
    resume: str = "auto"
    """auto: continue from latest.json's checkpoint, stop if it is missing or damaged; fallback: the
    same, but fall back to the newest complete earlier checkpoint with a warning; restart: start
    from step 0 over an existing run directory. (true = auto, false = restart.)"""
    universal: bool = False
    """Load a universal checkpoint (after ds_to_universal) to change the number of drafter ranks."""


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 0
    """Exact offline tau on the held-out prompts every K steps (0 = only before and after)."""
    max_new_tokens: int = 256
    at_start: bool = True
    at_end: bool = True


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    project: str = "dflash-ds"
    mode: str = "online"
    """online or offline (offline needs no network); the API key only from WANDB_API_KEY."""
    offline_fallback: bool = False
    """When wandb's service does not answer before launch (a few seconds): log offline instead of
    stopping (false: stop with one line naming the choices)."""


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = 10
    progress: bool = True
    profile_start: int = 0
    """Profile steps profile_start .. + profile_steps - 1 on every rank (0: none); runtime/profiling.py."""
    profile_steps: int = 3
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterSection = field(default_factory=DrafterSection)
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

    def __post_init__(self):
        if self.objective.num_anchors is None:  # follows the row length at the paper's density
            objective = dataclasses.replace(self.objective, num_anchors=default_anchors(self.data.row_length))
            object.__setattr__(self, "objective", objective)


# ----------------------------------------------------------------------------- building


def _coerce(value, tp, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            return tp()
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping of settings, got {value!r}")
        return _build(tp, value, path)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}: expected a list, got {value!r}")
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
            return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecipeError(f"{path}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RecipeError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise RecipeError(f"{path}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise RecipeError(f"{path}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RecipeError(f"{path}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise RecipeError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls, raw: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            known = ", ".join(sorted(n for n in names if n != "source"))
            raise RecipeError(f"unknown recipe key '{path}'; known keys here: {known}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def build_recipe(raw: dict) -> Recipe:
    """A Recipe from a mapping of sections (types checked, unknown keys refused; not validated)."""
    return _build(Recipe, raw)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override '{item}' is not of the form key.sub=value")
        key, text = item.split("=", 1)
        # YAML parses the value so that numbers, booleans, null and [lists] work as in the file.
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"override '{item}': the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                              "quote it, e.g. key='[a, b]'") from None
        out.append((key.strip(), value))
    return out


def _yaml_error(path: str, exc: "yaml.YAMLError") -> str:
    """One line for a recipe that is not valid YAML: file, line and column (1-based) and the problem."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: the recipe is not valid YAML ({problem}); fix that line (indentation, a missing ':' or quote)"


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `key.sub=value` overrides, validate and return it."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {str(path)!r} not found; pass a path such as recipes/tiny.yaml")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_error(str(path), exc)) from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: the recipe must be a mapping of sections (run, target, drafter, ...)")
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(raw, key, value)
    recipe = _build(Recipe, raw)
    recipe = dataclasses.replace(recipe, source=str(p))
    # Recipes written when resume was a boolean keep working.
    legacy = {"true": "auto", "false": "restart"}.get(recipe.checkpoint.resume.lower())
    if legacy:
        recipe = dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, resume=legacy))
    validate(recipe)
    return recipe


def validate(r: Recipe) -> None:
    """Checks that need no files or GPUs; the checks that read files (the target config, the DeepSpeed
    JSONs, drafter.init_from, the data) are spec.run.check_recipe's and runtime/prelaunch.py's."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise RecipeError(msg)

    need(bool(r.target.path), "target.path is empty; set it to a hub id or a local model directory")
    need(r.target.dtype in ("bfloat16", "float32"), f"target.dtype must be bfloat16 or float32, got {r.target.dtype!r}")
    need(r.target.quantization in ("none", "fp8"), f"target.quantization must be none or fp8, got {r.target.quantization!r}")
    need(r.run.device in ("auto", "cuda", "cpu"), f"run.device must be auto, cuda or cpu, got {r.run.device!r}")
    need(r.drafter.block_size >= 2, f"drafter.block_size must be >= 2 (an anchor plus at least one mask), got {r.drafter.block_size}")
    _validate_attention(r.drafter, need)
    need(r.drafter.mask_token_id >= 0, "drafter.mask_token_id is not set; use the target's reserved MASK id (Qwen3.5/3.6: 248070, Qwen3: 151669)")
    need(bool(r.data.path), "data.path is empty; set it to a hub dataset id or a local json/jsonl/parquet file")
    need(r.data.max_length >= 2 * r.drafter.block_size, f"data.max_length ({r.data.max_length}) must be at least 2 x drafter.block_size")
    need(r.data.row_length >= r.data.max_length,
         f"data.row_length ({r.data.row_length}) is shorter than data.max_length ({r.data.max_length}), the longest "
         "conversation a row must hold; raise data.row_length or lower data.max_length")
    need(0 <= r.data.max_drop_fraction <= 1, f"data.max_drop_fraction must be in [0, 1], got {r.data.max_drop_fraction}")
    need(r.data.truncation in ("truncate", "drop"), f"data.truncation must be truncate or drop, got {r.data.truncation!r}")
    _validate_regenerate(r.data.regenerate, need)
    for name in ("drafter.num_layers", "objective.num_anchors", "objective.loss_chunks", "optim.rows_per_micro_batch",
                 "optim.grad_accum", "topology.max_in_flight", "checkpoint.every_steps", "checkpoint.keep_last",
                 "log.every_steps", "log.profile_steps"):
        need(functools.reduce(getattr, name.split("."), r) >= 1, f"{name} must be >= 1")
    need(0 <= r.topology.payload_ctas <= 64,
         f"topology.payload_ctas must be in [0, 64] (NCCL's limit; 0 = its default), got {r.topology.payload_ctas}")
    need(r.data.num_proc >= 0, f"data.num_proc must be >= 0 (0 = every core), got {r.data.num_proc}")
    need(r.objective.num_anchors <= r.data.row_length,
         f"objective.num_anchors ({r.objective.num_anchors}) exceeds data.row_length ({r.data.row_length}); lower it "
         "(null = 512 per 3,072 row tokens)")
    need(r.objective.kl_weight >= 0, f"objective.kl_weight must be >= 0, got {r.objective.kl_weight}")
    need(r.objective.kl_temperature > 0, f"objective.kl_temperature must be > 0, got {r.objective.kl_temperature}")
    need(r.drafter.architecture in ("dflash", "dflash2"),
         f"drafter.architecture must be dflash or dflash2, got {r.drafter.architecture!r}")
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        need(getattr(r.drafter, name) >= 1, f"drafter.{name} must be >= 1 (DFlash2 publishes 2, 16, 256, 16)")
    need(r.drafter.conv_kernel_size <= r.drafter.block_size,
         f"drafter.conv_kernel_size ({r.drafter.conv_kernel_size}) must not exceed drafter.block_size "
         f"({r.drafter.block_size}): the convolution runs inside one block")
    need(r.objective.selector_alpha >= 0, f"objective.selector_alpha must be >= 0, got {r.objective.selector_alpha}")
    for name in ("selector_warmup_ratio", "selector_ramp_ratio"):
        need(0 <= getattr(r.objective, name) <= 1, f"objective.{name} must be in [0, 1], got {getattr(r.objective, name)}")
    need(0 <= r.optim.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
    need(r.optim.schedule in ("cosine", "wsd"), f"optim.schedule must be cosine or wsd, got {r.optim.schedule!r}")
    need(0 <= r.optim.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {r.optim.min_lr_ratio}")
    need(0 < r.optim.decay_ratio <= 1, f"optim.decay_ratio must be in (0, 1], got {r.optim.decay_ratio}")
    need(r.optim.schedule != "wsd" or r.optim.warmup_ratio + r.optim.decay_ratio <= 1,
         f"optim.warmup_ratio ({r.optim.warmup_ratio}) + optim.decay_ratio ({r.optim.decay_ratio}) exceed 1; "
         "lower one of them so the wsd phases fit in the run")
    need(r.optim.epochs > 0 or r.optim.max_steps, "set optim.epochs > 0 or optim.max_steps")
    need(r.optim.max_steps is None or r.optim.max_steps >= 1, "optim.max_steps must be >= 1 or null")
    t = r.topology
    if t.colocated:
        need(t.targets_per_node == 0 and t.drafters_per_node >= 1,
             "topology.colocated: true puts both models on every rank; set topology.targets_per_node: 0 and drafters_per_node to the ranks per node")
    else:
        need(t.targets_per_node >= 1 and t.drafters_per_node >= 1,
             "topology needs targets_per_node >= 1 and drafters_per_node >= 1 (or colocated: true)")
    need(r.checkpoint.resume in ("auto", "fallback", "restart"),
         f"checkpoint.resume must be auto, fallback or restart, got {r.checkpoint.resume!r}")
    need(r.run.stop_grace_s > 0, "run.stop_grace_s must be > 0 (seconds to finish a step and checkpoint after a stop signal)")
    for name in ("optim.lr", "topology.peer_timeout_s", "topology.peer_report_s"):
        need(functools.reduce(getattr, name.split("."), r) > 0, f"{name} must be > 0")
    need(r.log.profile_start >= 0, "log.profile_start must be >= 0 (a step number; 0 turns profiling off)")
    need(r.log.wandb.mode in ("online", "offline", "disabled"), "log.wandb.mode must be online, offline or disabled")


def _validate_attention(d: DrafterSection, need) -> None:
    kinds = ("full_attention", "sliding_attention")
    types = d.layer_types or ()
    need(d.layer_types is None or len(types) == d.num_layers,
         f"drafter.layer_types lists {len(types)} layers but drafter.num_layers is {d.num_layers}; give one type per layer")
    need(all(t in kinds for t in types), f"drafter.layer_types: each entry must be full_attention or sliding_attention, "
         f"got {[t for t in types if t not in kinds]}")
    sliding = "sliding_attention" in types
    need(not sliding or d.sliding_window is not None,
         "drafter.layer_types has sliding_attention layers but drafter.sliding_window is not set; set it (e.g. 2048)")
    need(sliding or d.sliding_window is None, f"drafter.sliding_window={d.sliding_window} but no layer in "
         "drafter.layer_types is sliding_attention; list the sliding layers or set drafter.sliding_window=null")
    need(d.sliding_window is None or d.sliding_window >= d.block_size,
         f"drafter.sliding_window ({d.sliding_window}) must be >= drafter.block_size ({d.block_size}): "
         "the window must cover the whole block")


def _validate_regenerate(g: RegenerateConfig, need) -> None:
    from urllib.parse import urlparse

    need(g.backend in ("auto", "server", "hf"),
         f"data.regenerate.backend must be server, hf or auto, got {g.backend!r} (the in-process vllm backend was "
         "replaced by server: run `vllm serve TARGET` and set data.regenerate.urls)")
    need(g.backend != "server" or bool(g.urls),
         "data.regenerate.backend is server but data.regenerate.urls is empty; set it to the servers' base URLs, "
         "e.g. data.regenerate.urls=[http://127.0.0.1:8000]")
    for k, url in enumerate(g.urls):
        u = urlparse(url)
        need(u.scheme in ("http", "https") and bool(u.netloc) and not u.query,
             f"data.regenerate.urls[{k}]: {url!r} is not a server URL; use http://HOST:PORT (optionally ending in /v1)")
    need(g.max_new_tokens >= 1, "data.regenerate.max_new_tokens must be >= 1")
    need(g.temperature >= 0, "data.regenerate.temperature must be >= 0 (0 = greedy)")
    need(0 < g.top_p <= 1, "data.regenerate.top_p must be in (0, 1]")
    need(g.concurrency >= 1, f"data.regenerate.concurrency must be >= 1, got {g.concurrency}")
    need(g.timeout_s > 0, f"data.regenerate.timeout_s must be > 0, got {g.timeout_s}")
    need(g.max_retries >= 0, f"data.regenerate.max_retries must be >= 0, got {g.max_retries}")
    need(g.backoff_s >= 0, f"data.regenerate.backoff_s must be >= 0, got {g.backoff_s}")
    need(0 <= g.max_failed_fraction <= 1,
         f"data.regenerate.max_failed_fraction must be in [0, 1], got {g.max_failed_fraction}")


def ranks_per_node(r: Recipe) -> int:
    return r.topology.drafters_per_node + r.topology.targets_per_node


def dump_yaml(r: Recipe) -> str:
    d = dataclasses.asdict(r)
    d.pop("source", None)
    # Tuples are written as lists so the dump loads back through load_recipe.
    return yaml.safe_dump(json.loads(json.dumps(d)), sort_keys=False)
