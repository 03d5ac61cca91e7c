"""vLLM's own config and model code against one export: run by the vLLM environment's python
(scripts/build_vllm_cpu.sh), not the project's, and imports nothing of the project.

    python tests/vllm_contract.py TARGET_DIR EXPORT_DIR METHOD NUM_SPECULATIVE_TOKENS

Prints one JSON object on its last stdout line:
- `runner_refuses`: what vLLM's V1 model runner check refuses in this configuration (the only runner
  on a CPU build; the check is recorded, not raised, so that the rest of the config still validates);
- `architecture`, `model_class`: the export's architecture and the class vLLM's registry resolves it to;
- `missing`: the model's parameters `load_weights` left unwritten (every parameter starts as NaN;
  the embedding and lm_head vLLM takes from the target when the export has none are listed apart, in
  `shared_with_target`, and the mask embedding it reads only from an optional mask_embedding.pt, which
  the model marks unused without one, in `unused`);
- `unexpected`: the export's tensors whose values ended up in no parameter (every tensor of a test
  export is distinct, so its values identify it, also when vLLM stacks it into a fused parameter);
- `error`: the exception that stopped the check, if one did.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(target: str, export: str, method: str, k: int, result: dict):
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    def record(self):
        result["runner_refuses"] = self._get_v1_model_runner_unsupported_features()

    VllmConfig._validate_v1_model_runner = record
    args = EngineArgs(model=target, dtype="float32", max_model_len=1024, enforce_eager=True,
                      speculative_config={"method": method, "model": export, "num_speculative_tokens": k})
    return args.create_engine_config()


def located(tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> bool:
    """Whether the tensor's rows are a run of some parameter's rows (as loaded, or stacked into a
    fused parameter along dim 0)."""
    t = tensor.float().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
    for p in params.values():
        q = p.detach().float().reshape(p.shape[0] if p.dim() else 1, -1)
        if q.shape[1] != t.shape[1] or q.shape[0] < t.shape[0]:
            continue
        for o in range(q.shape[0] - t.shape[0] + 1):
            if torch.equal(q[o:o + t.shape[0]], t):
                return True
    return False


def load_check(config, export: str, result: dict) -> torch.nn.Module:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    draft = config.speculative_config.draft_model_config
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    with set_current_vllm_config(config):
        initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=config, model_config=draft)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -1)
    tensors = load_file(os.path.join(export, "model.safetensors"))
    with set_current_vllm_config(config):
        model.load_weights(iter(tensors.items()))

    def unwritten(p):
        return bool(torch.isnan(p).any()) if p.is_floating_point() else bool((p == -1).any())

    shipped = " ".join(tensors)
    shared = [n for n in params if n.split(".")[-2] in ("embed_tokens", "lm_head") and n.split(".")[-2] not in shipped]
    separate_mask = getattr(model.model, "has_separate_mask_embedding", True)
    unused = [n for n in params if n.endswith("mask_embedding") and not separate_mask]
    result["shared_with_target"], result["unused"] = sorted(shared), sorted(unused)
    written = {n: p for n, p in params.items() if n not in shared and n not in unused}
    result["missing"] = sorted(n for n, p in written.items() if unwritten(p))
    result["unexpected"] = sorted(n for n, t in tensors.items() if not located(t, written))
    result["num_tensors"] = len(tensors)
    result["num_parameters"] = len(written)
    return model


def report(check) -> None:
    """`check(result)`, then `result` printed as one JSON line: the test's verdict to read, an exception
    included as its `error` (the test names it)."""
    result: dict = {}
    try:
        check(result)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print(json.dumps(result))


def main() -> None:
    target, export, method, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def check(result: dict) -> None:
        loaded(target, export, method, k, result)

    report(check)


def loaded(target: str, export: str, method: str, k: int, result: dict) -> tuple:
    """(the engine config, the model vLLM built for the export and loaded), the verdict in `result`."""
    from vllm.model_executor.models.registry import ModelRegistry

    config = engine_config(target, export, method, k, result)
    draft = config.speculative_config.draft_model_config
    cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, model_config=draft)
    result.update(architecture=arch, model_class=cls.__name__)
    return config, load_check(config, export, result)


if __name__ == "__main__":
    main()
