"""The recipe's value checks: one function per section, run in recipe order by `validate`.

Only checks that need no files or GPUs live here; the checks that read files (the target config, the
DeepSpeed JSONs, drafter.init_from, the data) are resolve.run.resolve_run's and guard/launch.py's.
A check that relates two sections sits with the section whose setting the message tells the user to
change. An architecture's own sections check themselves (`check_sections`). Every failure is one
RecipeError line naming the setting and the fix."""

from __future__ import annotations

from urllib.parse import urlparse

from dflash_ds.config.architectures import KINDS
from dflash_ds.config.errors import RecipeError
from dflash_ds.config.recipe import Recipe
from dflash_ds.config.sections import BENCHMARK_SETS, FP8_LAYER_RECIPES, RegenerateConfig

def need(cond: bool, msg: str) -> None:
    """Stop with `msg` unless `cond` holds."""
    if not cond:
        raise RecipeError(msg)


def validate(r: Recipe) -> None:
    """Checks that need no files or GPUs; the checks that read files (the target config, the DeepSpeed
    JSONs, drafter.init_from, the data) are resolve.run.resolve_run's and guard/launch.py's."""
    check_target(r)  # first: a recipe without a target is the most common mistake, and names it first
    check_run(r)
    # The drafter section is checked where it becomes a shape (resolve/drafter.py, network/shape.py and
    # the architecture's own fields): its rules hold for an export too, so they live with the shape.
    # drafter.fp8 is no part of the shape (it is how the drafter trains), so its values are checked here.
    check_drafter_fp8(r)
    check_data(r)
    check_objective(r)
    check_sections(r)
    check_optim(r)
    check_topology(r)
    check_checkpoint(r)
    check_eval(r)
    check_log(r)


def check_target(r: Recipe) -> None:
    t = r.target
    need(bool(t.path), "target.path is empty; set it to a hub id or a local model directory")
    need(t.dtype in ("bfloat16", "float32"), f"target.dtype must be bfloat16 or float32, got {t.dtype!r}")
    need(t.quantization in ("none", "fp8"), f"target.quantization must be none or fp8, got {t.quantization!r}")


def check_run(r: Recipe) -> None:
    need(r.run.device in ("auto", "cuda", "cpu"), f"run.device must be auto, cuda or cpu, got {r.run.device!r}")
    need(r.run.stop_grace_s > 0, "run.stop_grace_s must be > 0 (seconds to finish a step and checkpoint after a stop signal)")


def check_drafter_fp8(r: Recipe) -> None:
    """drafter.fp8: a known layer recipe, on compiled layers (whether the machine can run it, its GPU and
    torchao, is resolve/quantization.py's, before launch)."""
    f = r.drafter.fp8
    need(f.layers in FP8_LAYER_RECIPES, f"drafter.fp8.layers must be none, rowwise or tensorwise, got {f.layers!r}")
    need(f.layers == "none" or r.drafter.compile,
         f"drafter.fp8.layers={f.layers} needs drafter.compile: true (torchao's float8 casts are separate kernels "
         "unless compiled into the layers); set drafter.compile=true or drafter.fp8.layers=none")


def check_data(r: Recipe) -> None:
    data = r.data
    need(bool(data.path), "data.path is empty; set it to a hub dataset id or a local json/jsonl/parquet file")
    need(data.max_length >= 2 * r.drafter.block_size, f"data.max_length ({data.max_length}) must be at least 2 x drafter.block_size")
    need(data.row_length >= data.max_length,
         f"data.row_length ({data.row_length}) is shorter than data.max_length ({data.max_length}), the longest "
         "conversation a row must hold; raise data.row_length or lower data.max_length")
    need(0 <= data.max_drop_fraction <= 1, f"data.max_drop_fraction must be in [0, 1], got {data.max_drop_fraction}")
    need(data.truncation in ("truncate", "drop"), f"data.truncation must be truncate or drop, got {data.truncation!r}")
    need(data.num_proc >= 0, f"data.num_proc must be >= 0 (0 = every core), got {data.num_proc}")
    check_regenerate(data.regenerate)


def check_regenerate(g: RegenerateConfig) -> None:
    """data.regenerate: a backend that can run, server URLs that are URLs, sane sampling and retries."""
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
    need(g.decoder in ("static", "generate"), f"data.regenerate.decoder must be static or generate, got {g.decoder!r}")
    need(g.slots >= 1, f"data.regenerate.slots must be >= 1, got {g.slots}")
    need(g.max_new_tokens >= 1, "data.regenerate.max_new_tokens must be >= 1")
    need(g.temperature >= 0, "data.regenerate.temperature must be >= 0 (0 = greedy)")
    need(0 < g.top_p <= 1, "data.regenerate.top_p must be in (0, 1]")
    need(g.concurrency >= 1, f"data.regenerate.concurrency must be >= 1, got {g.concurrency}")
    need(g.timeout_s > 0, f"data.regenerate.timeout_s must be > 0, got {g.timeout_s}")
    need(g.max_retries >= 0, f"data.regenerate.max_retries must be >= 0, got {g.max_retries}")
    need(g.backoff_s >= 0, f"data.regenerate.backoff_s must be >= 0, got {g.backoff_s}")
    need(0 <= g.max_failed_fraction <= 1,
         f"data.regenerate.max_failed_fraction must be in [0, 1], got {g.max_failed_fraction}")


def check_objective(r: Recipe) -> None:
    o = r.objective
    need(o.num_anchors >= 1, "objective.num_anchors must be >= 1")
    need(o.num_anchors <= r.data.row_length,
         f"objective.num_anchors ({o.num_anchors}) exceeds data.row_length ({r.data.row_length}); lower it "
         "(null = 512 per 3,072 row tokens)")
    need(o.gamma is None or o.gamma > 0, f"objective.gamma must be > 0 (or null for the default), got {o.gamma}")
    need(o.loss_chunks >= 1, "objective.loss_chunks must be >= 1")
    need(o.kl_weight >= 0, f"objective.kl_weight must be >= 0, got {o.kl_weight}")
    need(o.kl_temperature > 0, f"objective.kl_temperature must be > 0, got {o.kl_temperature}")


def check_sections(r: Recipe) -> None:
    """The architectures' own sections, each by its `check()` (the values that need nothing else; the
    drafter's that need the target are its shape's, resolve/drafter.py), named by their dotted key."""
    for kind in KINDS:
        for name, section in getattr(r, kind).sections.items():
            try:
                getattr(section, "check", lambda: None)()
            except ValueError as exc:
                raise RecipeError(f"{kind}.{name}.{exc}") from None


def check_optim(r: Recipe) -> None:
    o = r.optim
    need(o.lr > 0, "optim.lr must be > 0")
    # AdamW moves each weight by about lr per step: above 1 nothing trains (the gradients overflow and
    # every step is skipped), most likely a mistyped exponent.
    need(o.lr <= 1, f"optim.lr = {o.lr:g} is above 1: AdamW would move every weight by about that much per step and "
                    "nothing would train; set a rate such as 6e-4")
    need(0 <= o.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
    need(o.schedule in ("cosine", "wsd"), f"optim.schedule must be cosine or wsd, got {o.schedule!r}")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    need(0 < o.decay_ratio <= 1, f"optim.decay_ratio must be in (0, 1], got {o.decay_ratio}")
    need(o.schedule != "wsd" or o.warmup_ratio + o.decay_ratio <= 1,
         f"optim.warmup_ratio ({o.warmup_ratio}) + optim.decay_ratio ({o.decay_ratio}) exceed 1; "
         "lower one of them so the wsd phases fit in the run")
    need(o.epochs > 0 or o.max_steps, "set optim.epochs > 0 or optim.max_steps")
    need(o.max_steps is None or o.max_steps >= 1, "optim.max_steps must be >= 1 or null")
    need(o.rows_per_micro_batch >= 1, "optim.rows_per_micro_batch must be >= 1")
    need(o.grad_accum >= 1, "optim.grad_accum must be >= 1")
    need(o.max_seconds is None or o.max_seconds > 0, f"optim.max_seconds must be > 0 or null, got {o.max_seconds}")
    need(0 <= o.cooldown_ratio < 1, f"optim.cooldown_ratio must be in [0, 1), got {o.cooldown_ratio}")


def check_topology(r: Recipe) -> None:
    t = r.topology
    if t.colocated:
        need(t.targets_per_node == 0 and t.drafters_per_node >= 1,
             "topology.colocated: true puts both models on every rank; set topology.targets_per_node: 0 and drafters_per_node to the ranks per node")
    else:
        need(t.targets_per_node >= 1 and t.drafters_per_node >= 1,
             "topology needs targets_per_node >= 1 and drafters_per_node >= 1 (or colocated: true)")
    need(t.max_in_flight >= 1, "topology.max_in_flight must be >= 1")
    need(0 <= t.payload_ctas <= 64,
         f"topology.payload_ctas must be in [0, 64] (NCCL's limit; 0 = its default), got {t.payload_ctas}")
    need(t.peer_timeout_s > 0, "topology.peer_timeout_s must be > 0")
    need(t.peer_report_s > 0, "topology.peer_report_s must be > 0")


def check_checkpoint(r: Recipe) -> None:
    c = r.checkpoint
    need(c.every_steps >= 1, "checkpoint.every_steps must be >= 1")
    need(c.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    need(c.resume in ("auto", "fallback", "restart"), f"checkpoint.resume must be auto, fallback or restart, got {c.resume!r}")


def check_eval(r: Recipe) -> None:
    e = r.eval
    bad = [b for b in e.benchmarks if b not in BENCHMARK_SETS]
    need(not bad, f"eval.benchmarks: unknown set(s) {bad}; known: {', '.join(BENCHMARK_SETS)}")
    need(e.temperature >= 0, f"eval.temperature must be >= 0 (0 = greedy only), got {e.temperature}")
    need(0 < e.top_p <= 1, f"eval.top_p must be in (0, 1], got {e.top_p}")
    need(e.top_k >= 0, f"eval.top_k must be >= 0 (0 = off), got {e.top_k}")
    need(e.samples >= 1 and e.bench_limit >= 1, "eval.samples and eval.bench_limit must be >= 1")
    need(e.bench_batch >= 1, f"eval.bench_batch must be >= 1 (responses generated at once), got {e.bench_batch}")
    need(e.plateau_evals >= 0, f"eval.plateau_evals must be >= 0 (0 = off), got {e.plateau_evals}")
    need(e.plateau_delta >= 0, f"eval.plateau_delta must be >= 0, got {e.plateau_delta}")
    need(e.train_probe >= 0, f"eval.train_probe must be >= 0 (0 = off), got {e.train_probe}")
    need(not e.plateau_evals or e.every_steps >= 1,
         "eval.plateau_evals reads the periodic held-out evaluations: set eval.every_steps too")
    # An early end is decided by the drafter ranks; a split topology's target ranks run the planned
    # schedule and would wait on drafters that are gone.
    for key, on in (("eval.plateau_evals", e.plateau_evals), ("eval.train_probe", e.train_probe),
                    ("optim.max_seconds", r.optim.max_seconds)):
        need(not on or r.topology.colocated,
             f"{key} needs topology.colocated: true (target ranks of a split topology run the planned steps); "
             "leave it unset there")


def check_log(r: Recipe) -> None:
    g = r.log
    need(g.every_steps >= 1, "log.every_steps must be >= 1")
    need(g.profile_start >= 0, "log.profile_start must be >= 0 (a step number; 0 turns profiling off)")
    need(g.profile_steps >= 1, "log.profile_steps must be >= 1")
    need(g.wandb.mode in ("online", "offline", "disabled"), "log.wandb.mode must be online, offline or disabled")
