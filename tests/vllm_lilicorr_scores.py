"""vLLM's own LiLiCorr candidates and scores on the CPU: run by the vLLM environment's python
(scripts/build_vllm_cpu.sh), not the project's; imports nothing of the project but
tests/vllm_contract.py.

    python tests/vllm_lilicorr_scores.py TARGET_DIR EXPORT_DIR INPUTS.pt OUT.pt

The export is built and loaded by vLLM's LiLiCorrForCausalLM as tests/vllm_contract.py does, the
target's lm_head written into the model's (the speculator shares the target's), and the model's own
`compute_candidates` (top-k through its LogitsProcessor, full-vocabulary log-probs) and head
(`model.lilicorr`, the log-factors Model Runner V2's selector walk reads) run on INPUTS:
`pass_hidden` [n, S, H] (the drafting slots' states), `anchor` [n, H] and `anchor_valid` [n] (the
context rows), `lm_head` and `embed` [V, H] (the target's). vLLM's walk over the factors is a Triton
kernel (`spec_decode/dflash2/speculator.py`) with no torch path: it is not run here.

Writes OUT.pt: `candidates` and `log_probs` [n, S, k], `factors` [n, S, k, k] (row 0 of slot 0 the
start factors, as vLLM stacks them), and the loader's verdict under `verdict`.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.vllm_contract import loaded, report  # noqa: E402


def main() -> None:
    target, export, inputs_path, out_path = sys.argv[1:5]
    inputs = torch.load(inputs_path)

    def check(result: dict) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        hidden = inputs["pass_hidden"].float()
        n, slots, width = hidden.shape
        config, model = loaded(target, export, "dflash", slots, result)
        with torch.no_grad(), set_current_vllm_config(config):
            model.lm_head.weight.copy_(inputs["lm_head"])
            # What vLLM's loader does next (on a CPU it fixes each linear layer's gemm).
            process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
            ids, log_probs = model.compute_candidates(hidden.reshape(n * slots, width))
            k = ids.shape[-1]
            ids, log_probs = ids.view(n, slots, k), log_probs.view(n, slots, k)
            embeddings = torch.nn.functional.embedding(ids, inputs["embed"].float())
            factors = model.model.lilicorr(embeddings, log_probs, hidden, inputs["anchor"].float(),
                                           inputs["anchor_valid"])
        torch.save(dict(candidates=ids, log_probs=log_probs, factors=factors, verdict=dict(result)), out_path)
        result["written"] = out_path

    report(check)


if __name__ == "__main__":
    main()
