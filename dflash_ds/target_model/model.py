"""The frozen target: loading (+ PEFT merge), truncation after the last tap, and tap capture.

Tap id k is the output of decoder layer k (HF `hidden_states[k + 1]`), the residual stream before
the final norm. The forward runs the base model (no lm_head) and its layer list is cut after the
last tapped layer when nothing needs the rest, which saves 3 of 64 layers on a 27B target.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class TargetError(ValueError):
    pass


def text_config(config):
    """The text-tower config of a (possibly multimodal) checkpoint config."""
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str
    hybrid: bool  # has linear-attention (Gated DeltaNet) layers: packed rows go through target.packed
    num_experts: int = 0  # routed experts per MoE layer (target_model/moe.py); 0 = a dense target
    experts_per_token: int = 0
    expert_width: int = 0  # moe_intermediate_size
    shared_width: int = 0  # the shared expert's intermediate size (0: none)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def is_hybrid(config) -> bool:
    """Qwen3.5/3.6-style targets mixing linear-attention (Gated DeltaNet) and full-attention layers.

    Their recurrent state would leak across documents packed into one row unless per-document
    boundaries reach the linear-attention layers: forward_taps(doc_ids=) routes them through
    target.packed.
    """
    tc = text_config(config)
    layer_types = getattr(tc, "layer_types", None) or []
    return any("linear" in str(t) for t in layer_types) or str(getattr(tc, "model_type", "")).startswith(
        ("qwen3_5", "qwen3_next"))


def target_geometry(config) -> TargetShape:
    from dflash_ds.target_model.moe import moe_shape

    tc = text_config(config)
    moe = moe_shape(tc)
    return TargetShape(
        num_layers=tc.num_hidden_layers,
        hidden_size=tc.hidden_size,
        vocab_size=tc.vocab_size,
        model_type=getattr(tc, "model_type", ""),
        hybrid=is_hybrid(tc),
        num_experts=moe.num_experts if moe else 0,
        experts_per_token=moe.experts_per_token if moe else 0,
        expert_width=moe.expert_width if moe else 0,
        shared_width=moe.shared_width if moe else 0,
    )


def load_config(path: str):
    """AutoConfig of the target at `path`; TargetError (naming the path and the fix) when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise TargetError(
            f"the target {path!r} cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "give a local model directory or a hub id this machine can reach "
            "(HF_HUB_OFFLINE=1 needs the model in the local cache)") from None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = base_model(model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(f"cannot find the decoder layers of {type(model).__name__}; only decoder-only "
                          "causal LMs with model.layers (Qwen, Llama, Mistral families) are supported")
    return layers


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the lm_head (model.model for *ForCausalLM)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model


def truncate_after(model: nn.Module, last_layer: int) -> None:
    """Drop the decoder layers after `last_layer`: the drafter never sees them."""
    layers = decoder_layers(model)
    if last_layer + 1 < len(layers):
        base_model(model).layers = nn.ModuleList(list(layers)[: last_layer + 1])


def load_target(path: str, *, adapter: str | None = None, dtype: str = "bfloat16", device="cpu",
                attn_implementation: str = "sdpa", last_layer: int | None = None, keep_fp8: bool = False) -> nn.Module:
    """The frozen target as an eval-mode causal LM (text tower only).

    A fine-grained FP8 checkpoint (target.fp8) is loaded as stored and its FP8 linears become
    target.fp8.Fp8Linear on `device` with `keep_fp8` (on a GPU), else nn.Linear with the
    dequantized weights (transformers dequantizes them itself when no GPU is present)."""
    from transformers import AutoModelForCausalLM

    from dflash_ds.quantization import fp8

    config = load_config(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                                                       output_loading_info=True)
    if fp8.checkpoint_fp8(config):
        unscaled = [k for k in info.get("missing_keys", ()) if k.endswith("weight_scale_inv")]
        if unscaled:
            raise TargetError(f"the FP8 checkpoint {path!r} has no weight_scale_inv for {unscaled[0]} "
                              f"(and {len(unscaled) - 1} more); its quantization_config.modules_to_not_convert must "
                              "list the layers it stores unquantized")
    if adapter:
        model = merge_adapter(model, adapter)
    model = freeze(model, last_layer).to(device)
    fp8.convert_checkpoint_linears(model, keep_fp8, DTYPES[dtype])
    return model


def freeze(model: nn.Module, last_layer: int | None = None) -> nn.Module:
    """Eval mode, no gradients, and the layers after `last_layer` dropped (when given)."""
    if last_layer is not None:
        truncate_after(model, last_layer)
    model.requires_grad_(False)
    return model.eval()


def merge_adapter(model: nn.Module, adapter: str) -> nn.Module:
    if not (Path(adapter) / "adapter_config.json").is_file() and not os.path.isdir(adapter):
        try:
            from huggingface_hub import hf_hub_download

            hf_hub_download(adapter, "adapter_config.json")
        except Exception:
            raise TargetError(f"the adapter {adapter!r} is not a PEFT adapter directory or reachable hub id; "
                              "give the directory holding adapter_config.json") from None
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


class TapCapture:
    """Forward hooks that copy each tapped layer's output into a slice of a caller-owned buffer.

    The buffer is the transport payload, so the taps land where they are sent from.
    """

    def __init__(self, model: nn.Module, layer_ids, final_norm: bool = False):
        self.layer_ids = list(layer_ids)
        layers = decoder_layers(model)
        bad = [k for k in self.layer_ids if not 0 <= k < len(layers)]
        if bad:
            raise TargetError(f"tap layer ids {bad} are outside the target's {len(layers)} layers")
        self.out: torch.Tensor | None = None
        self.handles = [layers[k].register_forward_hook(self._hook(i)) for i, k in enumerate(self.layer_ids)]
        if final_norm:
            # The extra tap (the KL term's, or an architecture's): the output of the final norm, the
            # state the lm_head reads (the model must then keep all its layers: see truncate_after).
            full = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", len(layers))
            if len(layers) != full:
                raise TargetError(f"the final-norm tap needs the target's final norm after all {full} layers, but "
                                  f"the model was cut after {len(layers)}; keep every layer when it is tapped")
            norm = getattr(base_model(model), "norm", None)
            if not isinstance(norm, nn.Module):
                raise TargetError(f"cannot find the final norm (model.norm) of {type(model).__name__}: this target "
                                  "cannot send its final-norm state")
            self.handles.append(norm.register_forward_hook(self._hook(len(self.layer_ids))))

    def _hook(self, slot: int):
        def hook(module, args, output):
            if self.out is None:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            d = hidden.shape[-1]
            self.out[..., slot * d:(slot + 1) * d].copy_(hidden)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def forward_taps(model: nn.Module, capture: TapCapture, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                 *, out: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run the base model over input_ids and write the tapped states into out [b, S, T*D].

    position_ids restarting per document make transformers mask attention across packed documents.
    With doc_ids ([b, S], -1 = padding) every layer keeps the documents apart (target.packed):
    Gated DeltaNet state and convolution restart per document, and on CUDA the full-attention
    layers run FlashAttention's varlen kernel per document instead of a masked SDPA.
    """
    from dflash_ds.target_model.packed import packed_documents

    capture.out = out
    base = base_model(model)
    try:
        if doc_ids is not None:
            dtype = base.get_input_embeddings().weight.dtype
            with packed_documents(decoder_layers(model), text_config(base.config), doc_ids, dtype):
                base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        else:
            base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        capture.out = None
    return out


def embed_and_head(path: str, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Only the target's input embedding and lm_head weights, read from its safetensors files.

    Drafter ranks need these two matrices (frozen) and nothing else of the target.
    """
    from safetensors import safe_open

    weight_map = checkpoint_files(path)

    def find(suffixes):
        for name in weight_map:
            if any(name.endswith(s) for s in suffixes) and "mtp" not in name and "visual" not in name:
                return name
        return None

    embed_name = find(["embed_tokens.weight"])
    head_name = find(["lm_head.weight"]) or embed_name  # tied embeddings
    if embed_name is None:
        raise TargetError(f"the target {path!r} has no embed_tokens weight in its checkpoint")
    out = []
    for name in (embed_name, head_name):
        with safe_open(str(weight_map[name]), "pt", device="cpu") as f:
            w = f.get_tensor(name)
        scale_name = name + "_scale_inv"  # an FP8 checkpoint that quantized it too: dequantize
        if scale_name in weight_map:
            from dflash_ds.quantization.fp8 import dequantize

            with safe_open(str(weight_map[scale_name]), "pt", device="cpu") as f:
                w = dequantize(w, f.get_tensor(scale_name))
        out.append(w.to(dtype=dtype, device=device))
    return out[0], out[1]


def checkpoint_files(path: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a local model directory or a hub id."""
    root = Path(path)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise TargetError(f"the target {path!r} has no safetensors weights; convert the checkpoint to safetensors")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}
