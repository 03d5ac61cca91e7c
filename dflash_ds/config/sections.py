"""The recipe's sections: one frozen dataclass per YAML section (and per nested section), each field
documented where it is declared. These docstrings are the reference for every recipe key.

Defaults live here and nowhere else; the whole recipe is config/recipe.py, reading YAML into these
classes is config/load.py, and the checks on their values are config/checks.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """none, or fp8: the target's decoder linear layers run in FP8 on the GPU (H100/H200), faster than
    bf16 (docs/performance.md, "The target in FP8"). From a bf16 checkpoint the weights are quantized once at load
    (per-row scales); an FP8 checkpoint as published (config.json quantization_config: fp8, 128 x 128
    blocks) is used as stored, the numerics it is served with. An FP8 checkpoint with `none` is
    dequantized to target.dtype. Needs a full replica per GPU (not ZeRO-3), target.dtype bfloat16.
    On a mixture-of-experts target the routed experts are quantized too (one scale per expert row)."""
    experts_implementation: str = "dflash_grouped"
    """Mixture-of-experts targets: how the routed experts run. dflash_grouped (tokens sorted by expert,
    one grouped GEMM for gate_up and one for down, chunked; FP8 with target.quantization: fp8),
    or transformers' own grouped_mm, batched_mm, eager (its per-expert loop). Dense targets ignore it."""
    expert_parallel: int = 1
    """Mixture-of-experts targets larger than one GPU: every N consecutive target ranks of a node hold
    one target together, each rank 1/N of every layer's experts (the rest of the model on every rank).
    Each rank still runs its own micro-batches; the experts' tokens are gathered over the N ranks and
    their outputs summed back (docs/performance.md, "Mixture-of-experts targets"). N must divide
    topology.targets_per_node and the expert count. 1 = every target rank holds the whole target."""


FP8_LAYER_RECIPES = ("none", "rowwise", "tensorwise")


@dataclass(frozen=True)
class DrafterFp8Config:
    """drafter.fp8: the drafter's matmuls on FP8 tensor cores (H100/H200), two parts chosen apart. Off by
    default; docs/performance.md ("The drafter in FP8") has the speed and the loss beside bf16."""

    layers: str = "none"
    """none, rowwise or tensorwise: every drafter layer's attention and MLP projections (q/k/v/o,
    gate/up/down) train through torchao's float8 training (pip install 'dflash-ds[fp8]'), the
    bf16 weights and the ZeRO-2 engine's fp32 master weights unchanged. rowwise: one scale per row of
    each operand (e4m3, power-of-two scales); tensorwise: one scale per tensor (e5m2 gradients).
    The fusion layer `fc` (its input is the target's raw hidden states) and DFlash2's block
    convolutions and selector stay in bf16. Needs drafter.compile true."""
    lm_head: bool = False
    """The frozen lm_head of the fused loss (the logits and their input gradient, about half the
    drafter's FLOPs at a 248K vocabulary) in FP8: the weight quantized once in both layouts (per-row
    e4m3 scales), each chunk's rows and logits' gradient quantized per row. Evaluation (tau) and
    the export keep the bf16 lm_head."""


@dataclass(frozen=True)
class DrafterConfig:
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
    """dflash (v1); dflash2: every attention and MLP sublayer wrapped in a grouped dynamic block
    convolution, plus a candidate selector that rescores the unary top-k (docs/algorithm.md section 8);
    dspark: anchor-first blocks, a Markov head and a confidence head (section 9); lilicorr: a candidate
    reranker over the lm_head's top-k on the DFlash backbone (section 10); xpress: a causal low-rank
    refiner over the DFlash block, solved by Jacobi passes, as vLLM 0.34 serves it (section 11). An architecture's
    own keys sit in its own section, `drafter.<architecture>:` (e.g. drafter.dspark.markov_rank), declared
    by its package (dflash_ds/architectures/<architecture>/); their defaults are its published shape."""
    ds_config: str = "ds_configs/drafter_zero2.json"
    """DeepSpeed JSON for the drafter's ZeRO-2 engine (activation checkpointing lives here)."""
    init_from: str | None = None
    """An exported drafter directory to start from instead of random weights. Its config must match
    the drafter this section describes (taps, block size, mask id, layers, widths, attention types):
    a mismatch stops before launch naming both values."""
    compile: bool = True
    """torch.compile the drafter layers on GPU (flex_attention is always compiled on GPU)."""
    fp8: DrafterFp8Config = field(default_factory=DrafterFp8Config)
    """drafter.fp8.layers / drafter.fp8.lm_head (above); off by default."""
    sections: dict[str, Any] = field(default_factory=dict)
    """The architectures' own sections as the recipe sets them, by architecture name (`drafter.dspark:`
    is sections["dspark"], the dataclass its package declares). Not a key: the YAML names each section."""


@dataclass(frozen=True)
class RegenerateConfig:
    enabled: bool = False
    """Train on the responses regenerated by the target (written by python -m dflash_ds.regenerate RECIPE)
    instead of data.path's own."""
    output_dir: str = ""
    """Where regenerated shards go and where training reads them; empty = <data.cache_dir>/regenerated."""
    max_new_tokens: int = 2048
    """Longest response per turn; a turn that reaches it unfinished is dropped with the rest of its
    conversation (unless keep_unfinished)."""
    keep_unfinished: bool = False
    """Keep a turn cut at max_new_tokens as a truncated answer (marked `truncated: true`, trained without
    an end-of-turn token, which the target never produced) and drop only the turns after it. Off by
    default: a long-answer target would otherwise fill the data with answers cut mid-thought; on where
    the budget cuts many turns and dropping them would lose most of the data (the quality lab)."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling when temperature > 0."""
    backend: str = "auto"
    """server (OpenAI-compatible servers at `urls`: vllm serve, SGLang, transformers serve), hf (the
    target's generate in this process: small targets), auto (server when urls are set, else hf)."""
    decoder: str = "static"
    """How the hf backend decodes: static (a static KV cache, continuous batching over `slots` answers
    and, on CUDA, each decode step replayed as a CUDA graph: dflash_ds/data/static_decode.py) or generate
    (transformers' generate, batched with left padding). A model whose layout static does not drive is
    decoded with generate, with a note."""
    slots: int = 1024
    """static: answers decoded side by side (fewer where half the GPU's free memory cannot hold their KV
    cache)."""
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
    """Hub dataset id, or a local .json/.jsonl/.parquet/.arrow file or directory. A directory's files are
    split as `datasets` names them: a file whose name holds a split's word (train.jsonl, test.jsonl,
    test_cases.jsonl, eval-0.parquet) is in that split, and every other data file (shard0.jsonl) is in
    train, never dropped; the files of the splits not read are named in a note."""
    split: str = "train"
    """The split read, as in `datasets`: a hub dataset's split, or a local directory's (data.path); several
    joined by '+' (train+test) read them all."""
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
    """Loss decay over block slots; null = 7 for B=16, 5 for B=10, 4 for B=8 (dspark, whose B slots all
    draft: the value of B + 1, 4 for B=7 as DeepSpec's loss_decay_gamma)."""
    anchor_last_prompt_token: bool = True
    """Also anchor blocks at the last token before each assistant turn (the generation prompt's end),
    whose block drafts the turn's first tokens: the round llama-speculative-simple runs first (it
    prefills the prompt without that token) and a multi-turn request starts each turn with. false =
    anchors on supervised tokens only, the paper's (docs/performance.md: what the default buys)."""
    loss_chunks: int = 16
    """lm_head + cross-entropy computed in this many chunks of slots (only one chunk's logits exist at a
    time; the input gradient is computed in the forward pass, objective/loss.py)."""
    kl_weight: float = 0.0
    """Weight of a distillation term KL(target || drafter) added to the hard-label CE at every slot
    (0 = plain CE, the paper's recipe). Target ranks then also send their final-norm hidden state
    and run all their layers; drafter ranks compute the target's logits chunk by chunk."""
    kl_temperature: float = 1.0
    """Softens both distributions in the KL term (the term is scaled by T^2)."""
    sections: dict[str, Any] = field(default_factory=dict)
    """The architectures' own loss settings as the recipe sets them, by architecture name
    (`objective.dspark:` is sections["dspark"]). Not a key: the YAML names each section."""


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
    max_seconds: float | None = None
    """A time box for the training loop (from its first step; topology.colocated): once what has run,
    with the cooldown after it (cooldown_ratio), would no longer fit, the cooldown starts, so that the
    run ends annealed inside the box instead of cut at a high learning rate. null = no box."""
    cooldown_ratio: float = 0.1
    """A run that ends early (the held-out plateau, eval.plateau_evals, or max_seconds) first decays the
    learning rate linearly from its value there to min_lr_ratio x lr over this fraction of the steps
    run so far (the decay phase of a warmup-stable-decay schedule, started where the run ends)."""
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
    """Thread blocks (SMs) NCCL may use for payload transfers (0: NCCL's choice); a
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
    from step 0 over an existing run directory, the previous run's checkpoints moved aside into
    checkpoints/previous-<time>/. (true = auto, false = restart.)"""
    universal: bool = False
    """Load a universal checkpoint (after ds_to_universal) to change the number of drafter ranks."""


# The benchmark sets eval.benchmarks may name (dflash_ds.eval.benchmarks says where each comes from).
BENCHMARK_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench", "heldout")


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 0
    """Exact offline tau on the held-out prompts every K steps (0 = only before and after)."""
    plateau_evals: int = 0
    """Stop at the held-out plateau (topology.colocated; needs every_steps): when the mean held-out
    tau of the last two evaluations has not risen by more than plateau_delta above its best for this
    many evaluations in a row, the run cools down (optim.cooldown_ratio) and ends there, with its
    final checkpoint and export. 0 = train the planned steps."""
    plateau_delta: float = 0.02
    """The rise in held-out tau that counts as progress for plateau_evals."""
    train_probe: int = 0
    """Also measure the exact tau on the first N conversations of the training rows at every
    evaluation (topology.colocated), cut to max_new_tokens as the held-out answers are: the training
    rows' acceptance beside the held-out tau (the memorisation gap). 0 = off."""
    max_new_tokens: int = 256
    at_start: bool = True
    at_end: bool = True
    benchmarks: tuple[str, ...] = ()
    """Sets evaluated on the export after training (with eval.at_end), one table row per set and
    sampling setting (greedy, and the sampling below when eval.temperature > 0): gsm8k, math500,
    humaneval, mbpp, mt_bench (hub datasets, or files in eval.bench_dir) and heldout (the held-out
    prompts). The table goes to <run.output_dir>/benchmarks.json, the report and the model card."""
    bench_dir: str | None = None
    """Directory of local benchmark files (<name>.jsonl or .parquet) used instead of the hub."""
    bench_limit: int = 32
    """Prompts (conversations) per benchmark set."""
    temperature: float = 1.0
    """Sampling of the benchmark rows as the engines serve it (0: greedy rows only)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filter."""
    samples: int = 1
    """Sampled responses per prompt (each its own stream, seeded by run.seed, the prompt and the sample)."""
    bench_batch: int = 32
    """Benchmark responses the target generates at once (one forward per new token for the batch).
    Changes no response, only speed and memory: lower it when a large target runs out of memory."""


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
    """Profile steps profile_start .. profile_start + profile_steps - 1 on every rank (0: none): traces and
    summaries under <run.output_dir>/profile (runtime/profiling.py)."""
    profile_steps: int = 3
    wandb: WandbConfig = field(default_factory=WandbConfig)
