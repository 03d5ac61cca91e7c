"""Expert parallelism: one mixture-of-experts target held by the N ranks of an expert group.

Every rank of the group keeps the whole model except the routed experts, of which rank r keeps
experts [r E/N, (r+1) E/N) of every layer. Each rank still runs its own rows (its own micro-batches,
as every target rank does, so the send schedule is unchanged), and at every MoE layer:
  1. the router runs on the rank's own tokens (its weights are on every rank);
  2. the tokens' hidden states, expert ids and routing weights are all-gathered over the group;
  3. the rank runs its experts over the gathered (token, expert) pairs routed to them, the others
     dropped (target_model/moe.py: ids past the local experts);
  4. the partial outputs are reduce-scattered in float32, so each rank gets, for its own tokens, the
     sum over all experts, rounded to the model dtype once as an unsplit target does.
The shared expert, attention and Gated DeltaNet layers run on the rank's own tokens as usual. Per rank
this moves 2 (N-1) T D values per MoE layer and computes nothing twice; a group running the SAME
rows on every rank (all-reduce of the partial outputs instead of 2-4) would move 2 (N-1)/N T D but
run attention, Gated DeltaNet and the shared expert N times over.

`ExpertComm.same_inputs()` switches to that second mode where every rank does run the same input:
the held-out generation, whose greedy continuation must come out identical on every rank (an
all-reduce gives every rank the same sum; a reduce-scatter sums each rank's share in its own order).

The collectives come from the caller (`ExpertComm`: runtime/expert_group.py binds them to a process
group), so this module needs no process group of its own. `load_expert_shard` reads only this
rank's experts from the checkpoint: no rank ever holds the whole target, on the host or the device.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from dflash_ds.target_model.model import DTYPES, TargetError, checkpoint_files, load_config
from dflash_ds.target_model.moe import experts_modules, routed_sum


class ExpertComm(Protocol):
    """The collectives of one expert group (rank-major concatenation; sums in the input dtype)."""

    rank: int
    size: int
    replicated: bool

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def same_inputs(self) -> contextlib.AbstractContextManager: ...


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    if num_experts % size:
        raise TargetError(f"{size} expert-parallel ranks cannot share the target's {num_experts} experts per layer "
                          "evenly")
    per = num_experts // size
    return rank * per, (rank + 1) * per


def local_ids(top_k_index: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Global expert ids -> this rank's (0 .. hi-lo-1), the others -> hi-lo (a dropped pair)."""
    mine = (top_k_index >= lo) & (top_k_index < hi)
    return torch.where(mine, top_k_index - lo, hi - lo)


def sharded_experts_forward(module: nn.Module, comm: ExpertComm, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output for this rank's tokens, from every rank's share of the experts."""
    lo, hi = module.expert_range
    if comm.replicated:
        part = routed_sum(module, hidden_states, local_ids(top_k_index, lo, hi), top_k_weights, out_dtype=torch.float32)
        return comm.all_reduce(part).to(hidden_states.dtype)
    hidden = comm.all_gather(hidden_states)
    index = comm.all_gather(top_k_index)
    weights = comm.all_gather(top_k_weights)
    part = routed_sum(module, hidden, local_ids(index, lo, hi), weights, out_dtype=torch.float32)
    return comm.reduce_scatter(part).to(hidden_states.dtype)


def shard_experts(model: nn.Module, comm: ExpertComm) -> list[str]:
    """Keep only this rank's experts of every experts module (in place) and route their forward
    through the group. Works on a materialized model (tests) and on one whose parameters are still
    on the meta device (load_expert_shard, before reading the checkpoint)."""
    names = []
    for name, mod in experts_modules(model):
        lo, hi = expert_range(int(mod.num_experts), comm.rank, comm.size)
        for which in ("gate_up_proj", "down_proj"):
            w = getattr(mod, which)
            setattr(mod, which, nn.Parameter(w.data[lo:hi].clone(), requires_grad=False))
        mod.num_experts, mod.expert_range, mod.drops = hi - lo, (lo, hi), True
        # An instance attribute shadows the class's (experts-interface) forward; hooks still run.
        mod.forward = functools.partial(sharded_experts_forward, mod, comm)
        names.append(name)
    model.expert_comm = comm  # for the callers that switch it to same_inputs()
    return names


# ---------------------------------------------------------------------------- loading one rank's share


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no initialisation)
    and their buffers as usual: the rotary tables, which no checkpoint stores, come out right."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def model_key(name: str) -> str:
    # Multimodal checkpoints keep the text tower under model.language_model (transformers' own rename).
    return name.replace("model.language_model.", "model.", 1)


class _ShardWriter:
    """Fills the meta parameters of a model from checkpoint tensors, this rank's experts only."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.params = dict(model.named_parameters())
        self.experts = {name: mod for name, mod in experts_modules(model)}
        self.filled: dict[str, torch.Tensor] = {}

    def _target(self, name: str) -> torch.Tensor:
        if name not in self.filled:
            meta = self.params[name]
            self.filled[name] = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return self.filled[name]

    def wants(self, key: str) -> bool:
        m = _PER_EXPERT.match(key)
        if m:
            mod = self.experts.get(m.group(1))
            return mod is not None and mod.expert_range[0] <= int(m.group(2)) < mod.expert_range[1]
        return key in self.params

    def put(self, key: str, tensor: torch.Tensor) -> None:
        m = _PER_EXPERT.match(key)
        if m:
            prefix, j, proj = m.group(1), int(m.group(2)), m.group(3)
            mod = self.experts[prefix]
            j -= mod.expert_range[0]
            if proj == "down_proj":
                self._target(f"{prefix}.down_proj")[j].copy_(tensor)
            else:
                inter = tensor.shape[0]
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                self._target(f"{prefix}.gate_up_proj")[j, rows].copy_(tensor)
            return
        owner = key.rsplit(".", 1)[0]
        if owner in self.experts and tensor.shape[0] != self.params[key].shape[0]:
            lo, hi = self.experts[owner].expert_range  # fused [E, ...] experts tensor: this rank's rows
            tensor = tensor[lo:hi]
        target = self._target(key)
        if tensor.shape != target.shape:
            raise TargetError(f"the checkpoint's tensor {key} has shape {tuple(tensor.shape)}, the model "
                              f"expects {tuple(target.shape)}")
        target.copy_(tensor)

    def install(self, model: nn.Module) -> None:
        missing = [n for n in self.params if n not in self.filled]
        if missing and getattr(model.config, "tie_word_embeddings", False):
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise TargetError(f"the checkpoint has no weights for {missing[0]} (and {len(missing) - 1} "
                              "more); is it the model its config.json describes?")
        for name, tensor in self.filled.items():
            parent, _, attr = name.rpartition(".")
            mod = model.get_submodule(parent) if parent else model
            mod._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        if "lm_head.weight" not in self.filled and hasattr(model, "lm_head"):
            model.lm_head.weight = model.get_input_embeddings().weight


def load_expert_shard(path: str, comm: ExpertComm, *, dtype: str = "bfloat16", device="cpu",
                      attn_implementation: str = "sdpa") -> nn.Module:
    """This rank's share of the target at `path`: every weight but the routed experts, and experts
    [r E/N, (r+1) E/N) of each layer, read straight from the safetensors files onto `device` and
    routed through the group (`shard_experts`). Eval mode, no gradients. Checkpoints store the
    experts one by one (`...experts.<j>.gate_proj.weight`) or fused (`...experts.gate_up_proj`)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    shard_experts(model, comm)
    writer = _ShardWriter(model, torch.device(device))
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(path).items():
        if writer.wants(model_key(name)):
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt", device="cpu") as f:
            for name in names:
                writer.put(model_key(name), f.get_tensor(name))
    writer.install(model)
    model.requires_grad_(False)
    return model.to(device).eval()
