"""SGLang's own LiLiCorr block proposal on the CPU: run by the SGLang environment's python
(scripts/build_sglang_cpu.sh), not the project's; imports nothing of the project but
tests/sglang_contract.py's loader (which tests/vllm_contract.py's plain-torch helpers back).

    python tests/sglang_lilicorr_walk.py TARGET_DIR EXPORT_DIR INPUTS.pt OUT.pt

The export is built and loaded as tests/sglang_contract.py does; then SGLang's
`speculative.lilicorr_utils.propose_lilicorr_block` (candidates by `lilicorr_topk_lse`'s torch
fallback, the head's `select_with_proposal`, the walk by `kernels/ops/speculative/lilicorr.py`'s
`_selector_walk_torch`: the paths SGLang takes off CUDA) proposes every block of INPUTS:
- `draft_hidden` [n, B, H]: the backbone's states of n blocks (SGLang reads slots 1 .. B - 1 only);
- `anchor` [n, H]: each block's context row (SGLang's published anchor);
- `lm_head`, `embed` [V, H]: the target's;
- `temperature`, `seed`: the sampled proposal's temperature and the seed of its uniforms.

Writes OUT.pt: `greedy` [n, S] (greedy rows, with the anchors), `no_anchor` [n, S] (greedy, no anchor
published: every row invalid), `sampled` [n, S] and `q_rows` [n, S, k] (sampled at `temperature`),
`uniforms` [n, S] (the draws `sampled` used: SGLang draws them with torch.rand, re-drawn here from the
same seed), `candidates` [n, S, k] and `log_probs` [n, S, k], `start` [n, k] and `pair` [n, S - 1, k, k]
(the head's log-factors), and the loader's verdict under `verdict`.
"""

from __future__ import annotations

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sglang_contract import build, load_check, without_scheduler, without_vllm_kernels  # noqa: E402
from tests.vllm_contract import report  # noqa: E402


def propose(target: str, export: str, inputs: dict, result: dict) -> dict:
    from sglang.srt.speculative.lilicorr_utils import lilicorr_candidates, propose_lilicorr_block

    model = build(target, export, result)
    load_check(model, export, result)
    head = model.lilicorr
    hidden, anchor = inputs["draft_hidden"].float(), inputs["anchor"].float()
    lm_weight = inputs["lm_head"].float()
    # What the draft worker hands over: the target's head (a dense weight, its original vocabulary
    # unpadded) and its input embedding module.
    lm_head = types.SimpleNamespace(weight=lm_weight, org_vocab_size=lm_weight.shape[0], quant_method=None)
    embed = torch.nn.Embedding.from_pretrained(inputs["embed"].float())
    n, block, width = hidden.shape
    slots, k = block - 1, int(head.candidate_topk)
    common = dict(head=head, draft_hidden=hidden, lm_head=lm_head, embed_tokens=embed)
    out: dict = {}
    with torch.no_grad():
        out["greedy"] = propose_lilicorr_block(anchor=anchor, **common)[0]
        out["no_anchor"] = propose_lilicorr_block(anchor=None, **common)[0]
        temperature, seed = float(inputs["temperature"]), int(inputs["seed"])
        sampling = types.SimpleNamespace(temperatures=torch.full((n,), temperature),
                                         top_ks=torch.full((n,), 1 << 20, dtype=torch.int32))
        torch.manual_seed(seed)
        sampled, candidates, q_rows = propose_lilicorr_block(anchor=anchor, sampling_info=sampling,
                                                             sampling_enabled=True, **common)
        torch.manual_seed(seed)
        out.update(sampled=sampled, q_rows=q_rows, uniforms=torch.rand(n, slots, dtype=torch.float32))
        log_probs, ids = lilicorr_candidates(hidden_states=hidden[:, 1:].reshape(n * slots, width), lm_head=lm_head,
                                             topk=k)
        assert torch.equal(ids.view(n, slots, k), candidates)
        # The scores as select_with_proposal forms them: one block a row.
        log_probs = log_probs.view(n, slots, k)
        start, pair = head.score(token_embeddings=embed(candidates)[:, None], candidate_log_probs=log_probs[:, None],
                                 pass_hidden=hidden[:, None, 1:], anchor_hidden=anchor[:, None],
                                 anchor_valid=torch.ones(n, 1, dtype=torch.bool))
        start, pair = head.log_factors(start, pair)
        out.update(candidates=candidates, log_probs=log_probs, start=start[:, 0], pair=pair[:, 0])
    return out


def main() -> None:
    target, export, inputs_path, out_path = sys.argv[1:5]
    inputs = torch.load(inputs_path)

    def check(result: dict) -> None:
        without_vllm_kernels()
        without_scheduler()
        out = propose(target, export, inputs, result)
        torch.save({**out, "verdict": dict(result)}, out_path)
        result["written"] = out_path

    report(check)


if __name__ == "__main__":
    main()
