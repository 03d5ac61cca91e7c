"""Loading a target and an exported drafter for evaluation, checked to belong together."""

from __future__ import annotations

import torch

from dflash_ds.network.draft_model import DraftModel
from dflash_ds.target_model.model import load_config, text_config


def load_eval_target(path: str, device: torch.device):
    """The whole causal LM (with its lm_head, unlike target_model.load_target) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        load_config(path)
    except ValueError as e:
        raise ValueError(f"--target: {e}") from None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"--target {path}: cannot load the model or its tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]}); pass a causal LM directory or reachable hub id") from None
    return model.eval().requires_grad_(False).to(device), tokenizer


def load_pair(target_path: str, drafter_path: str):
    """(target, tokenizer, DraftModel) on the GPU when there is one, checked to belong together."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter = _load_drafter(drafter_path, device)  # first: a bad export is named before the target loads
    target, tokenizer = load_eval_target(target_path, device)
    return target, tokenizer, _paired(drafter, target, drafter_path)


def load_drafter_for(target, drafter_path: str) -> DraftModel:
    """A drafter export paired with a target already loaded (several drafters measured against one)."""
    return _paired(_load_drafter(drafter_path, next(target.parameters()).device), target, drafter_path)


def _load_drafter(drafter_path: str, device: torch.device):
    from dflash_ds.export import load_drafter

    try:
        return load_drafter(drafter_path, device=device)
    except ValueError as e:
        raise ValueError(f"--drafter: {e}") from None


def _paired(drafter, target, drafter_path: str) -> DraftModel:
    model = DraftModel.from_target(drafter.to(next(target.parameters()).dtype), target)
    check_pair(model, target, drafter_path)
    return model


def check_pair(model: DraftModel, target, drafter_path: str) -> None:
    cfg, tc, embed = model.config, text_config(target.config), model.embed
    if cfg.hidden_size != tc.hidden_size or cfg.vocab_size != embed.shape[0]:
        raise ValueError(f"--drafter {drafter_path} was built for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                         f"--target has {tc.hidden_size} / {embed.shape[0]}: pass the target the drafter was trained against")
    if max(cfg.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(f"--drafter taps layers {list(cfg.target_layer_ids)} but --target has {tc.num_hidden_layers} "
                         "layers: pass the target the drafter was trained against")
