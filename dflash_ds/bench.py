"""Performance harness: measured rates of each role, and the targets:drafters split they imply.

    python -m dflash_ds.bench --role target    [--geometry qwen3.6-27b] [--layers N] [--no-engine]
    python -m dflash_ds.bench --role drafter   [--anchors 512] [--compile-layers] [--cold-cache]
    python -m dflash_ds.bench --role colocated
    python -m dflash_ds.bench --role transport [--transport-backend gloo|nccl]
    python -m dflash_ds.bench --role plan --from target.json drafter.json --gpus-per-node 8

Every compute role runs the real code path on random weights (speed does not depend on them):
the target is the truncated HF model under the DeepSpeed replica engine filling transport
payloads through TapCapture (TargetWorker.fill), the drafter step is DrafterTrainer.train_step
under the ZeRO-2 engine, colocated mode is train.LocalSource feeding that step. Rates are
context tokens per second (rows x seq_len), the unit both sides share, so they can be balanced.
MFU uses the project's FLOP counting rules (target_forward_flops, drafter_step_flops: the same
counts as the published anchor figures) against a bf16 (CPU: fp32) matmul ceiling measured in the
same run. Timing uses CUDA events with a host synchronisation
only at the edges of the timed region.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing: module import time is the next best thing
        return time.time()


PROCESS_START = _process_start()
REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "qwen27b.yaml"
ROLES = ("target", "drafter", "colocated", "transport", "plan")
MASK_METHODS = {
    "flex": "BlockMask.from_kv_blocks from tensor ops (attention._flex_mask), compiled flex_attention",
    "dense": "dense bool [b,1,Q,S+Q] mask (attention._dense_mask), SDPA",
}

# ============================================================================ FLOP counts
# The counting rules behind the project's anchor figures, as plain functions tests check by hand.


def count_linear_params(module: nn.Module) -> int:
    """Weights of every nn.Linear under `module` (the matmuls of a forward)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def target_forward_flops(linear_params: int, full_attention_layers: int, heads: int, head_dim: int, rows: int,
                         seq_len: int) -> dict[str, int]:
    """2 x linear params x tokens + causal attention 2*2*S^2*heads*head_dim/2 per full layer per row."""
    linear = 2 * linear_params * rows * seq_len
    attention = full_attention_layers * rows * 2 * 2 * seq_len * seq_len * heads * head_dim // 2
    return {"linear": linear, "attention": attention, "total": linear + attention}


def visible_pairs(anchors: torch.Tensor, valid: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> int:
    """(query, key) pairs the DFlash mask allows, counted from the mask's definition.

    Per block: B queries x (context keys strictly before the anchor in its document + the B keys
    of its own block); invalid (padding) blocks see their own block only.
    """
    anchors, valid, doc_ids = anchors.cpu().long(), valid.cpu().bool(), doc_ids.cpu().long()
    s = doc_ids.shape[1]
    doc_at = torch.gather(doc_ids, 1, anchors.clamp(0, s - 1))
    j = torch.arange(s)
    ctx = (j.view(1, 1, s) < anchors.unsqueeze(-1)) & (doc_ids.unsqueeze(1) == doc_at.unsqueeze(-1))
    ctx_keys = (ctx.sum(-1) * valid).sum()
    blocks = anchors.numel()
    return int(block_size * ctx_keys + blocks * block_size * block_size)


def drafter_step_flops(cfg, ctx_tokens: int, block_tokens: int, pairs: int) -> dict[str, int]:
    """One micro-batch's forward + backward FLOPs of the drafter (the anchor figures' rule).

    6 x (q, o, MLP params x block tokens + k, v params x (context + block tokens)) per layer,
    4 x fc params x context tokens (no input gradient: the taps are data), attention
    4 x pairs x heads x head_dim x 3 (forward + backward) per layer, and 4 x vocab x D x block
    tokens for the frozen lm_head (forward + input gradient).
    """
    d, h, hk, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layers = cfg.num_hidden_layers
    q_o_mlp = 2 * d * h * hd + 3 * d * cfg.intermediate_size
    k_v = 2 * d * hk * hd
    dense = 6 * layers * (q_o_mlp * block_tokens + k_v * (ctx_tokens + block_tokens))
    fuse = 4 * (cfg.num_taps * d * d) * ctx_tokens
    attention = layers * 3 * 4 * pairs * h * hd
    lm_head = 4 * cfg.vocab_size * d * block_tokens
    return {"dense": dense, "fuse": fuse, "attention": attention, "lm_head": lm_head,
            "total": dense + fuse + attention + lm_head}


# ============================================================================ split planner


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    target_tok_s: float  # targets x per-GPU target rate: what the target side can produce
    drafter_tok_s: float  # drafters x per-GPU drafter rate: what the drafter side can consume

    @property
    def tok_s(self) -> float:
        return min(self.target_tok_s, self.drafter_tok_s)

    @property
    def bound(self) -> str:
        if math.isclose(self.target_tok_s, self.drafter_tok_s):
            return "balanced"
        return "target" if self.target_tok_s < self.drafter_tok_s else "drafter"


def plan_splits(target_rate: float, drafter_rate: float, gpus_per_node: int) -> list[Split]:
    """Every integer split t + d = N (t, d >= 1) with its expected tok/s (transport assumed free)."""
    if gpus_per_node < 2:
        raise ValueError(f"--gpus-per-node must be >= 2 (one target and one drafter rank), got {gpus_per_node}")
    if not (target_rate > 0 and drafter_rate > 0):
        raise ValueError(f"rates must be > 0 tok/s (--target-rate {target_rate}, --drafter-rate {drafter_rate})")
    return [Split(t, gpus_per_node - t, t * target_rate, (gpus_per_node - t) * drafter_rate)
            for t in range(1, gpus_per_node)]


def best_split(splits: list[Split]) -> Split:
    """The split of highest tok/s; ties go to more drafter ranks (ZeRO-2 shards over more ranks)."""
    return max(splits, key=lambda s: (s.tok_s, s.drafters))


def fractional_split(target_rate: float, drafter_rate: float, gpus_per_node: int) -> tuple[float, float]:
    """The real-valued optimum: t* = N*d/(t+d) target GPUs, giving N*t*d/(t+d) tok/s."""
    t = gpus_per_node * drafter_rate / (target_rate + drafter_rate)
    return t, t * target_rate


# ============================================================================ measurement


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Wall time between consecutive marks: CUDA events on GPU, so the timed region never syncs.

    Events are recorded in stream order, so an interval also covers any time the GPU waited on
    the host: it is the step's wall time as the stream sees it.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class MemoryTrace:
    """Peak allocated GPU memory of each step (host-side allocator stats: no sync needed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: list[int] = []

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> None:
        if self.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated(self.device))

    def summary(self) -> dict:
        gib = 1024 ** 3
        out = {"host_max_rss_gib": _max_rss() / gib}
        if self.peaks:
            out.update(first_step_peak_gib=self.peaks[0] / gib, last_step_peak_gib=self.peaks[-1] / gib,
                       max_step_peak_gib=max(self.peaks) / gib,
                       growth_gib=(self.peaks[-1] - self.peaks[0]) / gib,
                       step_peaks_gib=[p / gib for p in self.peaks],
                       reserved_gib=torch.cuda.memory_reserved(self.device) / gib)
        return out


def _max_rss() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    except Exception:
        return 0


def matmul_ceiling(device: torch.device) -> dict:
    """Achieved matmul TFLOP/s: bf16 8192^3 on GPU (CUDA events), fp32 512^3 on CPU."""
    if device.type == "cuda":
        n, dtype, warm, iters = 8192, torch.bfloat16, 10, 50
    else:
        n, dtype, warm, iters = 512, torch.float32, 2, 10
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warm):
        torch.mm(a, b, out=out)
    synchronize(device)
    clock = StepClock(device)
    clock.mark()
    for _ in range(iters):
        torch.mm(a, b, out=out)
    clock.mark()
    seconds = clock.intervals()[0]
    del a, b, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tflops": 2 * n ** 3 * iters / seconds / 1e12, "size": n, "dtype": str(dtype).replace("torch.", ""),
            "iters": iters}


def dynamo_counters() -> dict:
    """Compile bookkeeping: graphs compiled, graph breaks, recompilations (cumulative)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
            "frames_ok": int(counters["frames"].get("ok", 0))}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_entries(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return 0 if path else None
    return sum(len(files) for _, _, files in os.walk(path))


def environment(device: torch.device, cache_at_start: dict) -> dict:
    env = {"device": str(device), "device_name": platform.processor() or platform.machine(),
           "hostname": socket.gethostname(), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": _version("transformers"), "deepspeed": _version("deepspeed"),
           "triton": _version("triton"), "flash_linear_attention": _version("flash-linear-attention"),
           "fla_core": _version("fla-core"), "fla_importable": importlib.util.find_spec("fla") is not None,
           "causal_conv1d_importable": importlib.util.find_spec("causal_conv1d") is not None,
           "compile_cache": cache_at_start}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 1024 ** 3
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def compile_cache_state(cold: bool) -> dict:
    """Point inductor/triton at fresh directories for --cold-cache; report what the caches hold."""
    if cold:
        root = tempfile.mkdtemp(prefix="dflash_bench_cold_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is None:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            inductor = default_cache_dir()
        except Exception:
            inductor = None
    triton = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    return {"cold": cold, "inductor_dir": inductor, "inductor_entries_at_start": _cache_entries(inductor),
            "triton_dir": triton, "triton_entries_at_start": _cache_entries(triton)}


def step_stats(times: list[float]) -> dict:
    return {"mean": sum(times) / len(times), "median": statistics.median(times), "min": min(times),
            "max": max(times), "all": times}


# ============================================================================ setup


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    recipe: object  # config.Recipe
    target_config: object  # transformers text config
    drafter_config: object  # drafter.DrafterConfig
    geometry_name: str
    plan: object = None  # plan.Plan for a 1-rank colocated layout
    spec: object = None  # transport.PayloadSpec

    @property
    def tap_ids(self) -> list[int]:
        return list(self.drafter_config.target_layer_ids)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no GPU is visible; use --device cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if name != "cpu":
        raise ValueError(f"--device must be auto, cuda or cpu, got {name!r}")
    return torch.device("cpu")


def _resize_layers(config, layers: int):
    """A copy of a loaded target config with `layers` decoder layers (layer pattern repeated)."""
    d = config.to_dict()
    types = d.get("layer_types")
    d["num_hidden_layers"] = layers
    if types:
        d["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return type(config)(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})


def resolve_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    """Target config, drafter config and the bench recipe from --geometry / --recipe and the flags.

    The recipe supplies everything that is not geometry (DeepSpeed JSONs, loss chunks, optimiser,
    activation checkpointing) exactly as a training run would read it. Batch shape, topology and
    output directory are overridden for a single-rank colocated layout, the one every role fits.
    """
    from .config import load_recipe
    from .drafter import DrafterConfig
    from .geometry import get_geometry, target_config
    from .plan import resolve
    from .target import load_config, text_config
    from .transport import PayloadSpec

    cuda = device.type == "cuda"
    recipe_path = Path(args.recipe) if args.recipe else DEFAULT_RECIPE
    total_steps = args.warmup + args.steps
    cfgs = REPO / "ds_configs"
    # The target and transport roles draw no anchors; keep the recipe valid at short --seq-len.
    anchors = args.anchors if args.role in ("drafter", "colocated") else min(args.anchors, args.seq_len)
    # Nothing is written to the run directory (no metrics, no checkpoints); it only has to be valid.
    over = [f"run.output_dir={Path(tempfile.gettempdir()) / 'dflash_bench'}", f"run.seed={args.seed}",
            f"run.device={device.type}", "log.wandb.enabled=false", "log.progress=false",
            f"data.max_length={args.seq_len}", f"objective.num_anchors={anchors}",
            f"drafter.block_size={args.block_size}", f"optim.rows_per_micro_batch={args.rows}",
            f"optim.grad_accum={args.grad_accum}", "optim.epochs=1", f"optim.max_steps={total_steps}",
            "topology.colocated=true", "topology.drafters_per_node=1", "topology.targets_per_node=0",
            "checkpoint.resume=false", f"target.dtype={'bfloat16' if cuda else 'float32'}"]
    if not cuda:
        # The GPU JSONs enable bf16, which the CPU engine cannot run.
        over += [f"drafter.ds_config={cfgs / 'drafter_zero2_cpu.json'}",
                 f"target.ds_config={cfgs / 'target_replica_cpu.json'}"]
    elif not args.recipe:
        over += [f"drafter.ds_config={cfgs / 'drafter_zero2.json'}", f"target.ds_config={cfgs / 'target_replica.json'}"]
    local_target = None
    if args.recipe:
        path = load_recipe(recipe_path).target.path
        local_target = path if Path(path).is_dir() else None
    if local_target:
        tcfg = text_config(load_config(local_target))
        if args.layers:
            tcfg = _resize_layers(tcfg, args.layers)
            over.append("drafter.target_layer_ids=null")
        geometry_name = f"recipe:{local_target}"
    else:
        geo = get_geometry(args.geometry)
        tcfg = target_config(args.geometry, args.layers)
        geometry_name = geo.name
        over += [f"drafter.num_layers={geo.drafter_layers}", f"drafter.mask_token_id={geo.mask_token_id}",
                 "drafter.target_layer_ids=null", "drafter.intermediate_size=null",
                 "drafter.num_attention_heads=null", "drafter.num_key_value_heads=null", "drafter.head_dim=null"]
    recipe = load_recipe(recipe_path, over + list(args.set or []))
    d = recipe.drafter
    dcfg = DrafterConfig.from_target(tcfg, num_layers=d.num_layers, block_size=d.block_size,
                                     mask_token_id=d.mask_token_id, target_layer_ids=d.target_layer_ids,
                                     intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
                                     num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim)
    o = recipe.optim
    plan = resolve(recipe, 1, total_steps * o.grad_accum * o.rows_per_micro_batch)
    tap_dtype = torch.bfloat16 if cuda and recipe.target.dtype == "bfloat16" else torch.float32
    spec = PayloadSpec(o.rows_per_micro_batch, recipe.data.max_length, dcfg.num_taps, dcfg.hidden_size, tap_dtype)
    return Setup(args, device, recipe, tcfg, dcfg, geometry_name, plan, spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(device: torch.device):
    """A world of one rank (the engines need a process group); returns its group."""
    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cpu":
        # Read when deepspeed first picks its accelerator, so set before it is imported.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        from .runtime import init_distributed

        init_distributed(device)
    return dist.new_group([0])


def synthetic_rows(num_rows: int, seq_len: int, vocab: int, prompt_tokens: int, seed: int) -> dict[str, np.ndarray]:
    """One document per row: random ids, loss mask off on the prompt prefix and on after it."""
    if not 0 <= prompt_tokens < seq_len - 1:
        raise ValueError(f"--prompt-tokens must be in [0, seq_len - 1), got {prompt_tokens} for --seq-len {seq_len}")
    rng = np.random.default_rng(seed)
    loss_mask = np.ones((num_rows, seq_len), dtype=np.int32)
    loss_mask[:, :prompt_tokens] = 0
    return {"input_ids": rng.integers(0, vocab, size=(num_rows, seq_len), dtype=np.int64),
            "loss_mask": loss_mask,
            "doc_ids": np.zeros((num_rows, seq_len), dtype=np.int32)}


def prompt_tokens(args) -> int:
    return args.prompt_tokens if args.prompt_tokens is not None else args.seq_len // 8


# ---------------------------------------------------------------------------- target side


def build_target_model(setup: Setup, use_engine: bool, group):
    """Random-weight target built on the device, truncated after the last tap, under its engine."""
    from transformers import AutoModelForCausalLM

    from .runtime import build_target_engine
    from .target import DTYPES, truncate_after

    dtype = DTYPES[setup.recipe.target.dtype]
    torch.manual_seed(setup.args.seed)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(setup.target_config, dtype=dtype,
                                                 attn_implementation=setup.recipe.target.attn_implementation)
    truncate_after(model, max(setup.tap_ids))
    model.requires_grad_(False)
    model.eval()
    kind = "none"
    if use_engine:
        model, kind = build_target_engine(setup.recipe, model, setup.plan, group)
    return model, kind


def target_flops_per_micro(setup: Setup, model) -> dict[str, int]:
    from .target import decoder_layers

    layers = decoder_layers(model)
    tc = setup.target_config
    types = getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers
    full = sum(1 for t in types[:len(layers)] if t == "full_attention")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    out = target_forward_flops(count_linear_params(layers), full, tc.num_attention_heads, head_dim,
                               setup.spec.rows, setup.spec.seq_len)
    out["layers_run"] = len(layers)
    out["full_attention_layers_run"] = full
    out["linear_params_run"] = count_linear_params(layers)
    return out


def target_worker(setup: Setup, model):
    from .workers import TargetWorker

    a = setup.args
    rows = synthetic_rows(setup.plan.num_rows, a.seq_len, setup.drafter_config.vocab_size, prompt_tokens(a), a.seed)
    return TargetWorker(model, setup.tap_ids, rows, setup.plan, setup.spec, setup.recipe.run.seed, setup.device)


# ---------------------------------------------------------------------------- drafter side


class SyntheticSource:
    """Payload source of the drafter role: a few pre-filled payloads, reused in turn."""

    def __init__(self, payloads: list[torch.Tensor]):
        self.payloads = payloads
        self.i = 0
        self.wait_seconds = 0.0

    def get(self) -> torch.Tensor:
        p = self.payloads[self.i % len(self.payloads)]
        self.i += 1
        return p

    def release(self, buf) -> None:
        pass

    def close(self) -> None:
        pass


def synthetic_payloads(setup: Setup, count: int = 2) -> list[torch.Tensor]:
    from .transport import taps_view, write_meta

    a, spec = setup.args, setup.spec
    rows = synthetic_rows(count * spec.rows, a.seq_len, setup.drafter_config.vocab_size, prompt_tokens(a), a.seed)
    g = torch.Generator(device=setup.device).manual_seed(a.seed)
    out = []
    for k in range(count):
        buf = spec.empty(setup.device)
        taps_view(buf, spec).normal_(generator=g)
        sl = slice(k * spec.rows, (k + 1) * spec.rows)
        write_meta(buf, spec, *(torch.from_numpy(rows[f][sl]) for f in ("input_ids", "loss_mask", "doc_ids")))
        out.append(buf)
    return out


def build_drafter_side(setup: Setup, group):
    """Drafter under the real ZeRO-2 engine, plus random frozen embedding and lm_head [V, D]."""
    from .drafter import DFlashDrafter
    from .runtime import build_drafter_engine
    from .target import DTYPES

    torch.manual_seed(setup.args.seed)
    drafter = DFlashDrafter(setup.drafter_config).to(setup.device)
    engine, ds_cfg = build_drafter_engine(setup.recipe, drafter, setup.plan, group, 0, setup.device)
    if setup.args.compile_layers:
        for layer in drafter.layers:
            layer.compile(dynamic=False)
    c = setup.drafter_config
    dtype = DTYPES[setup.recipe.target.dtype]
    g = torch.Generator(device=setup.device).manual_seed(setup.args.seed + 1)
    embed = torch.empty(c.vocab_size, c.hidden_size, device=setup.device, dtype=dtype).normal_(0, 0.02, generator=g)
    head = torch.empty(c.vocab_size, c.hidden_size, device=setup.device, dtype=dtype).normal_(0, 0.02, generator=g)
    return drafter, engine, ds_cfg, embed, head


def bench_context(setup: Setup, group):
    """The run context train.LocalSource reads (colocated role)."""
    from .preflight import Context
    from .runtime import Groups
    from .target import target_geometry

    return Context(setup.recipe, setup.device, target_geometry(setup.target_config), setup.drafter_config,
                   setup.spec, 1, plan=setup.plan, rank=0, groups=Groups(group, group))


class DrafterStep:
    """One optimizer step of a drafter rank: the work of train.DrafterTrainer.train_step, op for op.

    Payloads -> unpack -> make_blocks -> step-wide weight all-reduce -> per micro-batch
    drafter_loss, engine.backward, engine.step -> acceptance proxy bookkeeping. Only the logging
    that train_step's caller does at log steps is left out.
    """

    def __init__(self, setup: Setup, engine, drafter, embed, head, source, group):
        from .step import StepSettings
        from .target import DTYPES

        self.setup, self.engine, self.drafter, self.embed, self.head = setup, engine, drafter, embed, head
        self.source, self.group = source, group
        self.settings = StepSettings.from_recipe(setup.recipe, setup.device)
        self.dtype = DTYPES[setup.recipe.target.dtype] if setup.device.type == "cuda" else torch.float32

    def __call__(self, step: int):
        import torch.distributed as dist

        from .workers import train_step

        st = train_step(self.engine, self.drafter, self.embed, self.head, self.source, self.settings, self.setup.plan,
                        dist.get_rank(), self.group, self.setup.spec, self.dtype, step)
        return st.ce_sum, st.weight, st.accept, st.anchors


def micro_batch_of(setup: Setup, payload: torch.Tensor):
    from .target import DTYPES
    from .workers import unpack

    dtype = DTYPES[setup.recipe.target.dtype] if setup.device.type == "cuda" else torch.float32
    return unpack(payload, setup.spec, dtype)


def time_mask(setup: Setup, payload: torch.Tensor, repeats: int = 5) -> dict:
    """Mask construction time: the process's first build (cold), the median warm build, make_blocks.

    Runs before the first training step, so the first build here is the process's first.
    """
    from .attention import build_mask
    from .objective import sample_anchors
    from .step import StepSettings, anchor_generator, make_blocks

    s = StepSettings.from_recipe(setup.recipe, setup.device)
    mb = micro_batch_of(setup, payload)
    anchors, valid = sample_anchors(mb.loss_mask.cpu(), mb.doc_ids.cpu(), s.num_anchors, anchor_generator(s.seed, 0))
    anchors, valid = anchors.to(setup.device), valid.to(setup.device)
    times = []
    for _ in range(repeats + 1):
        synchronize(setup.device)
        t0 = time.perf_counter()
        build_mask(anchors, valid, mb.doc_ids, s.block_size, kind=s.mask_kind)
        synchronize(setup.device)
        times.append(time.perf_counter() - t0)
    synchronize(setup.device)
    t0 = time.perf_counter()
    make_blocks(mb, s, 0)
    synchronize(setup.device)
    return {"kind": s.mask_kind, "method": MASK_METHODS[s.mask_kind], "first_build_s": times[0],
            "build_s": statistics.median(times[1:]), "make_blocks_s": time.perf_counter() - t0}


def drafter_flops_of_steps(setup: Setup, steps: range) -> dict:
    """FLOPs of the given steps, with the attention pairs counted from each micro-batch's anchors.

    Anchors depend only on (seed, micro-batch id) and the loss mask / documents, which every
    synthetic row shares, so they are recomputed here exactly as make_blocks draws them.
    """
    from .objective import sample_anchors
    from .step import anchor_generator

    a, r, plan = setup.args, setup.recipe, setup.plan
    rows = synthetic_rows(setup.spec.rows, a.seq_len, setup.drafter_config.vocab_size, prompt_tokens(a), a.seed)
    loss_mask = torch.from_numpy(rows["loss_mask"]).bool()
    doc_ids = torch.from_numpy(rows["doc_ids"])
    ctx_tokens = setup.spec.rows * a.seq_len
    block_tokens = setup.spec.rows * r.objective.num_anchors * r.drafter.block_size
    total, pairs, valid_blocks, n = None, 0, 0, 0
    for step in steps:
        for g in range(plan.grad_accum):
            m = plan.layout.micro_index(step, g, plan.grad_accum, 0)
            anchors, valid = sample_anchors(loss_mask, doc_ids, r.objective.num_anchors,
                                            anchor_generator(r.run.seed, m))
            p = visible_pairs(anchors, valid, doc_ids, r.drafter.block_size)
            f = drafter_step_flops(setup.drafter_config, ctx_tokens, block_tokens, p)
            total = f if total is None else {k: total[k] + f[k] for k in f}
            pairs += p
            valid_blocks += int(valid.sum())
            n += 1
    steps_n = max(len(steps), 1)
    per_step = {k: v / steps_n for k, v in total.items()}
    return {"per_step": per_step, "visible_pairs_per_micro": pairs / n, "valid_blocks_per_micro": valid_blocks / n,
            "ctx_tokens_per_micro": ctx_tokens, "block_tokens_per_micro": block_tokens}


# ---------------------------------------------------------------------------- the timed loop


def profile_steps(step_fn, first: int, count: int, path: str) -> None:
    """Kernel-level time table of `count` extra steps (torch.profiler), top 40 by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for s in range(first, first + count):
            step_fn(s)
        synchronize(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))


def drive(step_fn, device: torch.device, warmup: int, steps: int, t_build: float, profile: str | None = None) -> dict:
    """First step (alone, synchronised), the rest of the warmup, then `steps` timed steps."""
    out = {}
    c0 = dynamo_counters()
    synchronize(device)
    t0 = time.perf_counter()
    step_fn(0)
    synchronize(device)
    now = time.perf_counter()
    out["first_step_s"] = now - t0
    out["first_step_since_build_s"] = now - t_build
    out["first_step_since_process_start_s"] = time.time() - PROCESS_START
    c1 = dynamo_counters()
    for s in range(1, warmup):
        step_fn(s)
    synchronize(device)
    c2 = dynamo_counters()
    clock, mem = StepClock(device), MemoryTrace(device)
    clock.mark()
    for s in range(warmup, warmup + steps):
        mem.begin()
        step_fn(s)
        clock.mark()
        mem.end()
    times = clock.intervals()
    c3 = dynamo_counters()
    out["step_s"] = step_stats(times)
    out["timed_s"] = sum(times)
    out["memory"] = mem.summary()
    out["compile"] = {"first_step": _delta(c1, c0), "warmup": _delta(c2, c1), "timed": _delta(c3, c2),
                      "total": c3}
    out["first_step_overhead_s"] = out["first_step_s"] - out["step_s"]["median"]
    if profile:
        profile_steps(step_fn, warmup + steps, 2, profile)
    return out


def _rates(result: dict, tokens_per_step: int, flops_per_step: float, ceiling: dict) -> None:
    step = result["timed_s"] / len(result["step_s"]["all"])
    result["tokens_per_step"] = tokens_per_step
    result["tok_s"] = tokens_per_step / step
    result["flops_per_step"] = flops_per_step
    result["tflops"] = flops_per_step / step / 1e12
    result["mfu"] = result["tflops"] / ceiling["tflops"]


# ============================================================================ roles


def run_target(setup: Setup, ceiling: dict) -> dict:
    group = init_single_process(setup.device)
    a = setup.args
    t_build = time.perf_counter()
    model, kind = build_target_model(setup, not a.no_engine, group)
    worker = target_worker(setup, model)
    buf = setup.spec.empty(setup.device)
    synchronize(setup.device)
    build_s = time.perf_counter() - t_build
    plan = setup.plan

    def step(s: int) -> None:
        for g in range(plan.grad_accum):
            worker.fill(buf, plan.layout.micro_index(s, g, plan.grad_accum, 0))

    result = drive(step, setup.device, a.warmup, a.steps, t_build, a.profile)
    flops = target_flops_per_micro(setup, model)
    result.update(build_s=build_s, engine=kind, taps=setup.tap_ids, flops_per_micro=flops,
                  payload_bytes=setup.spec.nbytes)
    _rates(result, plan.grad_accum * setup.spec.rows * a.seq_len, plan.grad_accum * flops["total"], ceiling)
    return result


def run_drafter(setup: Setup, ceiling: dict, colocated: bool = False) -> dict:
    group = init_single_process(setup.device)
    a = setup.args
    t_build = time.perf_counter()
    drafter, engine, ds_cfg, embed, head = build_drafter_side(setup, group)
    extra = {}
    if colocated:
        from .train import LocalSource

        model, kind = build_target_model(setup, not a.no_engine, group)
        source = LocalSource(target_worker(setup, model), bench_context(setup, group), 0)
        extra.update(engine_target=kind, target_flops_per_micro=target_flops_per_micro(setup, model))
        probe = synthetic_payloads(setup, 1)[0]
    else:
        payloads = synthetic_payloads(setup)
        source = SyntheticSource(payloads)
        probe = payloads[0]
    step_fn = DrafterStep(setup, engine, drafter, embed, head, source, group)
    synchronize(setup.device)
    build_s = time.perf_counter() - t_build
    mask = time_mask(setup, probe)
    del probe
    result = drive(step_fn, setup.device, a.warmup, a.steps, t_build, a.profile)
    counted = drafter_flops_of_steps(setup, range(a.warmup, a.warmup + a.steps))
    flops = counted["per_step"]["total"]
    if colocated:
        flops += setup.plan.grad_accum * extra["target_flops_per_micro"]["total"]
    result.update(build_s=build_s, mask=mask, drafter_flops=counted, taps=setup.tap_ids,
                  drafter_params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                  checkpointed_layers=drafter.checkpoint_layers if drafter.checkpoint_fn is not None else 0,
                  compiled_layers=bool(a.compile_layers), zero_stage=ds_cfg.get("zero_optimization", {}).get("stage"),
                  loss_chunks=setup.recipe.objective.loss_chunks, **extra)
    _rates(result, setup.plan.grad_accum * setup.spec.rows * a.seq_len, flops, ceiling)
    return result


def _transport_worker(rank: int, port: int, spec, args: dict, queue) -> None:
    import torch.distributed as dist

    from .transport import Receiver, Sender, write_meta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = args["backend"] == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(args["backend"], rank=rank, world_size=2)
    total = args["warmup"] + args["steps"]
    try:
        if rank == 1:  # target: sends the same buffers over and over (the fill is not what is measured)
            tx = Sender(spec, device, args["in_flight"])
            zeros = torch.zeros(spec.rows, spec.seq_len, dtype=torch.long)
            for buf in tx.free:
                write_meta(buf, spec, zeros, zeros, zeros)
            for _ in range(total):
                tx.send(tx.buffer(), dst=0)
            tx.flush()
            queue.put({"rank": 1, "send_wait_s": tx.wait_seconds})
        else:
            rx = Receiver(spec, device, args["depth"], [1] * total)
            for _ in range(args["warmup"]):
                rx.release(rx.get())
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(args["steps"]):
                buf = rx.get()
                synchronize(device)  # NCCL's wait only orders streams; the bytes must have landed
                rx.release(buf)
            seconds = time.perf_counter() - t0
            rx.close()
            queue.put({"rank": 0, "seconds": seconds, "recv_wait_s": rx.wait_seconds})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_transport(setup: Setup, ceiling: dict) -> dict:
    import torch.multiprocessing as mp

    from .transport import PayloadSpec

    a = setup.args
    spec = PayloadSpec(setup.spec.rows, setup.spec.seq_len, setup.spec.num_taps, setup.spec.hidden, torch.bfloat16)
    if a.transport_backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError("--transport-backend nccl needs 2 visible GPUs; use gloo (the host path) on this machine")
    if a.warmup < 1 or a.steps < 1:
        raise ValueError("--warmup and --steps must be >= 1 for the transport role")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    wargs = {"backend": a.transport_backend, "warmup": a.warmup, "steps": a.steps, "in_flight": a.in_flight,
             "depth": a.recv_depth}
    procs = [ctx.Process(target=_transport_worker, args=(r, port, spec, wargs, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(2):
            rep = queue.get(timeout=a.transport_timeout)
            reports[rep["rank"]] = rep
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"transport worker exited with {bad}")
    seconds = reports[0]["seconds"]
    per_s = a.steps / seconds
    return {"backend": a.transport_backend, "payload_shape": list(spec.shape), "payload_bytes": spec.nbytes,
            "payloads": a.steps, "seconds": seconds, "payloads_per_s": per_s, "gb_s": per_s * spec.nbytes / 1e9,
            "tok_s": per_s * spec.rows * spec.seq_len, "in_flight": a.in_flight, "recv_depth": a.recv_depth,
            "send_wait_s": reports[1]["send_wait_s"], "recv_wait_s": reports[0]["recv_wait_s"]}


def _rate_from(path: str) -> tuple[str, float, dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--from {path}: cannot read a bench JSON ({exc})") from None
    role = data.get("role")
    if role not in ("target", "drafter") or "tok_s" not in data.get("result", {}):
        raise ValueError(f"--from {path}: a --role target or --role drafter bench output is needed, got role {role!r}")
    return role, float(data["result"]["tok_s"]), data


def run_plan(args: argparse.Namespace) -> dict:
    rates = {"target": args.target_rate, "drafter": args.drafter_rate}
    sources, warnings = {}, []
    for path in args.from_files or []:
        role, rate, data = _rate_from(path)
        rates[role] = rate
        run_args = data.get("args") or {}
        sources[role] = {"file": path, "args": run_args, "device_name": data.get("env", {}).get("device_name"),
                         "ceiling_tflops": data.get("ceiling", {}).get("tflops")}
        if run_args.get("layers"):
            warnings.append(f"{path}: measured with --layers {run_args['layers']}, not the full target; its rate "
                            "is not the training rate")
        if run_args.get("device") == "cpu" or data.get("env", {}).get("device") == "cpu":
            warnings.append(f"{path}: measured on CPU")
    missing = [k for k, v in rates.items() if v is None]
    if missing:
        raise ValueError(f"no {' and no '.join(missing)} rate: pass --{missing[0]}-rate TOK_S or --from a bench JSON "
                         f"of --role {missing[0]}")
    n = args.gpus_per_node
    splits = plan_splits(rates["target"], rates["drafter"], n)
    best = best_split(splits)
    t_frac, tok_frac = fractional_split(rates["target"], rates["drafter"], n)
    return {"target_rate": rates["target"], "drafter_rate": rates["drafter"], "gpus_per_node": n,
            "splits": [{"targets": s.targets, "drafters": s.drafters, "target_tok_s": s.target_tok_s,
                        "drafter_tok_s": s.drafter_tok_s, "tok_s": s.tok_s, "bound": s.bound} for s in splits],
            "best": {"targets": best.targets, "drafters": best.drafters, "tok_s": best.tok_s, "bound": best.bound},
            "fractional": {"targets": t_frac, "drafters": n - t_frac, "tok_s": tok_frac},
            "recipe": f"topology.targets_per_node={best.targets} topology.drafters_per_node={best.drafters}",
            "sources": sources, "warnings": warnings}


# ============================================================================ CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_ds.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--geometry", default="qwen3.6-27b", help="named target geometry (dflash_ds.geometry)")
    p.add_argument("--recipe", default=None,
                   help=f"recipe for engine/optimiser settings (default {DEFAULT_RECIPE.relative_to(REPO)}); its "
                        "target geometry is used when target.path is a local directory")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra recipe override (repeatable)")
    p.add_argument("--layers", type=int, default=None, help="override the target's layer count (taps recomputed)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt prefix without loss (default seq_len/8)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before, the first one timed alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write all numbers to this JSON file")
    p.add_argument("--no-engine", action="store_true", help="run the target without DeepSpeed")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each drafter layer")
    p.add_argument("--no-fla-conv", action="store_true", help="target: keep transformers' PyTorch short conv")
    p.add_argument("--profile", default=None, help="write a kernel time table of 2 extra steps to this file")
    p.add_argument("--cold-cache", action="store_true", help="fresh inductor/triton caches (cold compile times)")
    p.add_argument("--transport-backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--in-flight", type=int, default=4, help="transport: sends outstanding (topology.max_in_flight)")
    p.add_argument("--recv-depth", type=int, default=2, help="transport: receives posted ahead")
    p.add_argument("--transport-timeout", type=float, default=600.0)
    p.add_argument("--target-rate", type=float, default=None, help="plan: target tok/s per GPU")
    p.add_argument("--drafter-rate", type=float, default=None, help="plan: drafter tok/s per GPU")
    p.add_argument("--from", dest="from_files", nargs="+", default=None, help="plan: bench JSONs to read rates from")
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args(argv)
    for name in ("seq_len", "rows", "grad_accum", "anchors", "steps", "warmup", "in_flight", "recv_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def summary_lines(report: dict) -> list[str]:
    r = report["result"]
    geo = report.get("geometry", {}).get("name", "")
    lines = [f"role {report['role']} | {geo} | {report['env']['device_name']}"]
    if report["role"] == "plan":
        lines.append(f"rates per GPU: target {r['target_rate']:,.0f} tok/s, drafter {r['drafter_rate']:,.0f} tok/s; "
                     f"{r['gpus_per_node']} GPUs per node")
        lines.append(f"{'targets':>8} {'drafters':>9} {'target tok/s':>13} {'drafter tok/s':>14} {'tok/s':>9}  bound")
        for s in r["splits"]:
            mark = "  <- best" if (s["targets"], s["drafters"]) == (r["best"]["targets"], r["best"]["drafters"]) else ""
            lines.append(f"{s['targets']:>8} {s['drafters']:>9} {s['target_tok_s']:>13,.0f} {s['drafter_tok_s']:>14,.0f} "
                         f"{s['tok_s']:>9,.0f}  {s['bound']}{mark}")
        f = r["fractional"]
        lines.append(f"fractional optimum: {f['targets']:.2f} targets + {f['drafters']:.2f} drafters -> {f['tok_s']:,.0f} tok/s")
        lines.append(f"recipe: {r['recipe']}")
        lines += [f"warning: {w}" for w in r["warnings"]]
        return lines
    c = report.get("ceiling") or {}
    if c:
        lines.append(f"matmul ceiling {c['tflops']:.4g} TFLOP/s ({c['dtype']} {c['size']}^3)")
    keys = [("tok/s", "tok_s"), ("MFU", "mfu"), ("TFLOP/s", "tflops"), ("GB/s", "gb_s"), ("payloads/s", "payloads_per_s"),
            ("build s", "build_s"), ("first step s", "first_step_s"), ("first step since build s", "first_step_since_build_s"),
            ("first step since process start s", "first_step_since_process_start_s")]
    for label, key in keys:
        if key in r:
            lines.append(f"  {label:<34} {_fmt(r[key])}")
    if "step_s" in r:
        st = r["step_s"]
        lines.append(f"  {'step s (mean/median/min/max)':<34} {st['mean']:.4f} / {st['median']:.4f} / {st['min']:.4f} / {st['max']:.4f}")
    mem = r.get("memory", {})
    if "first_step_peak_gib" in mem:
        lines.append(f"  {'peak GiB (first/last timed step)':<34} {mem['first_step_peak_gib']:.2f} / {mem['last_step_peak_gib']:.2f}")
    if "mask" in r:
        m = r["mask"]
        lines.append(f"  {'mask build s (first/warm)':<34} {m['first_build_s']:.4f} / {m['build_s']:.4f} ({m['kind']})")
    comp = r.get("compile", {})
    if comp.get("total", {}).get("unique_graphs"):
        lines.append(f"  {'graphs compiled (first/warmup/timed)':<34} {comp['first_step']['unique_graphs']} / "
                     f"{comp['warmup']['unique_graphs']} / {comp['timed']['unique_graphs']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.no_fla_conv:
            os.environ["DFLASH_FLA_SHORT_CONV"] = "0"
        report = run(args)
    except ValueError as exc:
        print(f"bench error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(report)), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"written {args.out}", flush=True)
    return 0


def run(args: argparse.Namespace) -> dict:
    cache = compile_cache_state(args.cold_cache)
    if args.role == "plan":
        return {"role": "plan", "args": vars(args), "env": environment(torch.device("cpu"), cache),
                "result": run_plan(args)}
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup = resolve_setup(args, device)
    ceiling = matmul_ceiling(device)
    if args.role == "target":
        result = run_target(setup, ceiling)
    elif args.role in ("drafter", "colocated"):
        result = run_drafter(setup, ceiling, colocated=args.role == "colocated")
    else:
        result = run_transport(setup, ceiling)
    c = setup.drafter_config
    return {"role": args.role, "args": vars(args), "env": environment(device, cache), "ceiling": ceiling,
            "geometry": {"name": setup.geometry_name, "target_layers": setup.target_config.num_hidden_layers,
                         "hidden": c.hidden_size, "vocab": c.vocab_size, "taps": list(c.target_layer_ids),
                         "drafter": dataclasses.asdict(c)},
            "recipe": {"source": setup.recipe.source, "drafter_ds_config": setup.recipe.drafter.ds_config,
                       "target_ds_config": setup.recipe.target.ds_config},
            "result": result}


if __name__ == "__main__":
    sys.exit(main())
