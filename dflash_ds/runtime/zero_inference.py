"""ZeRO-Inference: a frozen target partitioned over the target group, for targets that do not fit one GPU.

ZeRO-3 with no optimizer (optionally `offload_param`) gathers each layer's weights just before the
layer runs and frees them after, so every target rank holds 1/t of the weights between forwards.
All target ranks must run their forwards in lock-step (the gathers are collectives over the target
group). A target that fits one GPU is faster as a full replica per rank (runtime.engines.load_target_engine).

Loading goes through HF `from_pretrained` under `HfDeepSpeedConfig`, which builds the model inside
`deepspeed.zero.Init` so no rank ever holds the full model on the accelerator; the group-scoped
patches in deepspeed_patches keep every collective inside the target group.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dflash_ds.runtime import deepspeed_patches as patches
from dflash_ds.target_model.model import DTYPES, TargetError, base_model, freeze, load_config


def config_dtype(ds_config: dict) -> torch.dtype:
    """The dtype zero.Init converts parameters to: bf16 / fp16 sections, else float32."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def load_target_zero3(path: str, ds_config: dict, group, *, dtype, attn_implementation: str = "sdpa",
                      adapter: str | None = None, last_layer: int | None = None) -> nn.Module:
    """The frozen target partitioned over `group` under a forward-only ZeRO-3 engine.

    Collective over `group` (every target rank calls it; no other rank does). Returns the engine's
    module: an eval-mode causal LM with requires_grad False, whose forward (or its base model's
    forward, as target.forward_taps runs it) gathers the weights over `group`. `last_layer` drops
    the decoder layers after it, as load_target does.
    """
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ds_config = copy.deepcopy(ds_config)  # HF and DeepSpeed fill in values; the caller's dict stays as given
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage != 3:
        raise ValueError(f"target.ds_config has zero_optimization.stage {stage}; ZeRO-Inference needs stage 3 "
                         "(use ds_configs/target_zero3.json), or load a full replica with a non-ZeRO config")
    if config_dtype(ds_config) != torch_dtype:
        raise ValueError(f"target.dtype is {torch_dtype} but target.ds_config makes ZeRO-3 store "
                         f"{config_dtype(ds_config)} (its bf16/fp16 sections decide); make them agree: "
                         "bf16.enabled true for bfloat16, both false for float32")

    config = load_config(path)
    # zero.Init wraps the constructor of every nn.Module subclass while it is active; a class (or
    # torch._dynamo) imported for the first time inside it fails with "Signature mismatch". A
    # throw-away construction on the meta device imports everything the real one will touch.
    import torch._dynamo  # noqa: F401

    with torch.device("meta"):
        model_class = type(AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation))

    # HF reads the config through a weak reference: it must stay referenced for the whole load.
    # It is dropped afterwards, since while it lives every from_pretrained in this process would
    # go through zero.Init (over WORLD, outside zero_init_on).
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    try:
        with patches.zero_init_on(group):
            model = model_class.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation)
    finally:
        unset_hf_deepspeed_config()
        del hf_ds_config
    if adapter:
        model = merge_adapter_partitioned(model, adapter)
    model = freeze(model, last_layer)

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, mpu=patches.GroupMPU.for_group(group),
                                           dist_init_required=False)
    patches.skip_zero3_trace_check()
    module = engine.module
    module.eval()
    module.requires_grad_(False)
    # The engine's destructor removes the ZeRO-3 gather hooks (a forward would then see empty
    # weights). Today DeepSpeed's hook closures happen to keep it alive; the module holds it
    # explicitly rather than relying on that. A plain attribute, not a registered submodule:
    # state_dict and named_modules stay those of the model.
    object.__setattr__(module, "zero_inference_engine", engine)
    _reset_trace_on_base_forward(module, engine.optimizer.get_param_coordinator())
    return module


def _reset_trace_on_base_forward(module: nn.Module, coordinator) -> None:
    """ZeRO-3 starts a new forward step only in a pre-hook on the engine's root module.

    forward_taps calls the base model (model.model, no lm_head) directly, which would skip that
    hook: the parameter trace would never complete (no prefetching) and grow with every forward.
    So a forward of the base model that is not nested in a root forward starts a step too.
    """
    inner = base_model(module)
    if inner is module:
        return
    in_root = [False]

    def enter_root(mod, args):
        in_root[0] = True

    def leave_root(mod, args, output):
        in_root[0] = False

    def start_step(mod, args):
        if not in_root[0]:
            coordinator.reset_step()

    module.register_forward_pre_hook(enter_root)
    module.register_forward_hook(leave_root, always_call=True)
    inner.register_forward_pre_hook(start_step)


def merge_adapter_partitioned(model: nn.Module, adapter: str) -> nn.Module:
    """Merge a LoRA adapter into ZeRO-3-partitioned weights, one layer at a time.

    A partitioned weight holds only this rank's slice (its .data is empty), so PEFT's
    merge_and_unload cannot touch it directly. Each LoRA layer's base weight is gathered over its
    group, merged (the same arithmetic on every rank), and re-partitioned from group rank 0's copy;
    at most one layer is ever whole. Then the LoRA wrappers are removed without merging again.
    """
    import deepspeed
    from peft import PeftConfig, PeftModel
    from peft.tuners.lora import LoraLayer

    try:
        peft_cfg = PeftConfig.from_pretrained(adapter)
    except Exception as exc:
        raise TargetError(f"target.adapter {adapter!r} is not a PEFT adapter directory or reachable hub id "
                          f"({type(exc).__name__}); point it at the directory holding adapter_config.json") from None
    kind = str(getattr(peft_cfg.peft_type, "value", peft_cfg.peft_type))
    if kind != "LORA" or getattr(peft_cfg, "modules_to_save", None):
        what = f"a {kind} adapter" if kind != "LORA" else f"modules_to_save {peft_cfg.modules_to_save}"
        raise TargetError(
            f"target.adapter {adapter!r} has {what}, which cannot be merged into ZeRO-3-partitioned weights "
            "(only plain LoRA layers can); merge it once offline "
            "(PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(DIR)), then set "
            "target.path to DIR and target.adapter to null")
    peft_model = PeftModel.from_pretrained(model, adapter)
    for layer in peft_model.modules():
        if isinstance(layer, LoraLayer):
            weights = list(layer.get_base_layer().parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(weights, modifier_rank=0):
                layer.merge()
    return peft_model.unload()
