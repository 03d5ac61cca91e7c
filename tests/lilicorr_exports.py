"""LiLiCorr exports for the engines' loader checks (tests/test_engine_vllm.py, tests/test_engine_sglang.py):
the tiny recipe's drafter with every tensor distinct (so that its values identify where an engine put
it), plain and with DFlash2's block convolution, and a copy with one tensor removed and one added that
the gates must name."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dflash_ds.config import load_recipe
from dflash_ds.eval.cli import read_prompts
from dflash_ds.eval.generate import greedy_continuation, target_taps
from dflash_ds.eval.specdec import block_states
from dflash_ds.export import save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from tests.llama_cpp import ROOT

TARGET = ROOT / "assets" / "tiny-target"
RECIPE = ROOT / "recipes" / "tiny-lilicorr.yaml"
# The recipe's head (width 16, so with token_proj); with the convolution DFlash2 publishes (2 taps, groups
# of 16 channels), which the tiny width 128 takes; and as wide as the drafter (no token_proj: the readers
# build none either).
FORMS = {"plain": (), "conv": ("drafter.lilicorr.block_conv_kernel_size=2", "drafter.lilicorr.block_conv_group_size=16"),
         "full": ("drafter.lilicorr.head_hidden_size=0",)}
# Tensors of each form's export: the convolution adds 2 tensors to each of 2 wrapped sublayers of the 2
# layers; the full-width head has no token_proj weight and bias.
TENSORS = {"plain": 71, "conv": 79, "full": 69}
# Both loaders pass over these two without a word (a backbone tensor is not covered by their checks,
# and an HF rotary cache is dropped by name), so only the gate's own accounting can name them.
DROPPED = "layers.1.self_attn.o_proj.weight"
JUNK = "layers.0.self_attn.rotary_emb.inv_freq"


def distinct_export(path: Path, recipe: Path = RECIPE, overrides: tuple[str, ...] = ()) -> Path:
    """The recipe's drafter (with `overrides`), every tensor moved off its start by noise, as a float32 export."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_shape(AutoConfig.from_pretrained(TARGET), load_recipe(recipe, overrides).drafter))
    with torch.no_grad():
        for w in drafter.parameters():
            w.add_(torch.randn_like(w) * 0.1)
    save_drafter(drafter, path, dtype=torch.float32)
    return path


def tampered(export: Path, path: Path, *, drop: str = DROPPED, junk: str | None = JUNK) -> Path:
    """A copy of `export` without the tensor `drop` and, unless `junk` is None, with a tensor of that
    name whose values are no parameter's."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, path)
    tensors = load_file(str(export / "model.safetensors"))
    tensors.pop(drop)
    if junk is not None:
        tensors[junk] = torch.arange(16, dtype=torch.float32) + 1000.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def held_out_blocks(model: DraftModel, target, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the drafted states [n, B - 1, D], the context rows [n, D]) of the blocks anchored at the last n
    positions of the first held-out conversation (its prompt and the target's greedy response)."""
    from transformers import AutoTokenizer

    prompt = read_prompts(str(ROOT / "assets" / "tiny_eval.jsonl"), AutoTokenizer.from_pretrained(TARGET), limit=1)[0]
    x = greedy_continuation(target, torch.tensor(prompt), max_new_tokens=32)
    taps = target_taps(target, x, model.layer_ids)
    assert x.numel() > n
    blocks = [block_states(model, taps[:t], int(x[t])) for t in range(x.numel() - n, x.numel())]
    return torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])
