"""SGLang's own model code against one export: run by the SGLang environment's python
(scripts/build_sglang_cpu.sh), not the project's; imports nothing of the project but
tests/vllm_contract.py's `located` (plain torch).

    python tests/sglang_contract.py TARGET_DIR EXPORT_DIR

SGLang refuses DFLASH speculative decoding on a CPU when it resolves its server arguments, so the
target's server arguments are published without a speculative algorithm (the model classes read
only the parallel widths from them) and the export's config builds the class its architecture
resolves to, as SGLang's draft worker does, with a gloo process group of 1. On a platform that is
neither CUDA nor SGLang's CPU engine (which needs sgl_kernel, whose wheel needs libcuda) the rotary
layer imports vLLM's `rotary_embedding` at construction; it is replaced by a function that raises,
since nothing here runs a forward pass; and so is the draft worker's module (`without_scheduler`).

Prints one JSON object on its last stdout line:
- `architecture`, `model_class`: the export's architecture and the class SGLang's registry resolves
  it to;
- `missing`: the model's parameters `load_weights` left unwritten (every parameter starts as NaN);
- `unexpected`: the export's tensors whose values ended up in no parameter (SGLang's loader skips
  names it does not know without a word, so this is read from the values: every tensor of a test
  export is distinct);
- `error`: the exception that stopped the check, if one did.
"""

from __future__ import annotations

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.vllm_contract import free_port, located, report  # noqa: E402


def without_vllm_kernels() -> None:
    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("vLLM's rotary kernel is not available here; the loader check runs no forward")

    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    vllm = types.ModuleType("vllm")
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def without_scheduler() -> None:
    """SGLang's LiLiCorr model imports its speculative utilities, which import the draft worker's
    `make_draft_input_v2` and with it the scheduler and the HTTP server's packages (uvicorn,
    setproctitle, ...), none of which the environment installs: the registry then skips the class.
    The worker's module is replaced by one whose only function raises; loading runs no worker."""

    def make_draft_input_v2(*args, **kwargs):
        raise RuntimeError("SGLang's draft worker is not available here; the loader check runs no worker")

    worker = types.ModuleType("sglang.srt.speculative.draft_worker_common")
    worker.make_draft_input_v2 = make_draft_input_v2
    sys.modules.setdefault(worker.__name__, worker)


def build(target: str, export: str, result: dict) -> torch.nn.Module:
    from transformers import AutoConfig

    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=target, device="cpu"), role="scheduler")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(backend="gloo")
    config = AutoConfig.from_pretrained(export)
    cls, arch = ModelRegistry.resolve_model_cls(config.architectures)
    result.update(architecture=arch, model_class=cls.__name__)
    return cls(config)


def load_check(model: torch.nn.Module, export: str, result: dict) -> None:
    from safetensors.torch import load_file

    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -1)
    tensors = load_file(os.path.join(export, "model.safetensors"))
    model.load_weights(iter(tensors.items()))

    def unwritten(p):
        return bool(torch.isnan(p).any()) if p.is_floating_point() else bool((p == -1).any())

    result["missing"] = sorted(n for n, p in params.items() if unwritten(p))
    result["unexpected"] = sorted(n for n, t in tensors.items() if not located(t, params))
    result["num_tensors"] = len(tensors)
    result["num_parameters"] = len(params)


def main() -> None:
    target, export = sys.argv[1], sys.argv[2]

    def check(result: dict) -> None:
        without_vllm_kernels()
        without_scheduler()
        load_check(build(target, export, result), export, result)

    report(check)


if __name__ == "__main__":
    main()
