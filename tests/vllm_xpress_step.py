"""vLLM 0.34.0's XPress drafting step, restated from its reader for the tests (imports nothing of dflash_ds):
the export's weights as `Qwen3XPressForCausalLM.load_weights` places them (model_executor/models/
qwen3_xpress.py: `xpress_head.<name>` through `XPressRefinerHead.HYBRID_KEY_MAP`, the raw `mix.L` folded by
`fold_from_raw_` to L * tril + I), and `XPressSpeculator._jacobi_refine` -> `XPressRefinerHead.
jacobi_refine_greedy` (v1/worker/gpu/spec_decode/xpress/speculator.py, qwen3_xpress.py, kernels.py) on
one request batch: the block's draft slots start at the base logits' argmax; each of `xpress_num_passes`
passes rebuilds the latent of every slot from the block as the last pass left it (slot b reads the token
of slot b - 1, slot 0 the anchor id standing for its predecessor), adds `latent @ w2.T` to the base logits
and takes the argmax, among the base logits' top `xpress_topc` candidates of each slot when it is set
(the candidate set fixed for the step; the kernels' `xpress_topc_argmax_to_blk`), else over the
vocabulary (`fused_add_argmax_to_blk`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

# XPressRefinerHead.HYBRID_KEY_MAP: checkpoint sub-name -> the head's parameter.
HYBRID_KEY_MAP = {"w1.weight": "w1.weight", "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight",
                  "in_proj.weight": "in_proj.weight", "mix.L": "__raw_mix_L__",
                  "mlp.gate_proj.weight": "mlp_gate.weight", "mlp.up_proj.weight": "mlp_up.weight",
                  "mlp.down_proj.weight": "mlp_down.weight", "w2.weight": "w2.weight"}
HEAD_PARAMETERS = {"w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix_L", "mlp_gate.weight",
                   "mlp_up.weight", "mlp_down.weight", "w2.weight"}


class ServedHead:
    """The head's parameters as vLLM holds them after loading an export directory, in float64."""

    def __init__(self, export: Path):
        config = json.loads((Path(export) / "config.json").read_text())
        if config.get("sample_from_anchor", False):
            raise ValueError("vLLM's XPressSpeculator refuses sample_from_anchor=True")
        self.block = int(config.get("xpress_block_size") or config["num_speculative_steps"] + 1)
        self.rank = int(config.get("xpress_rank", 256))
        self.passes = int(config.get("xpress_num_passes", 6))
        self.topc = int(config.get("xpress_topc", 512))
        p, raw = {}, None
        for name, t in load_file(str(Path(export) / "model.safetensors")).items():
            if "t2d" in name or "d2t" in name or not name.startswith("xpress_head."):
                continue
            sub = name[len("xpress_head."):]
            if sub == "mix.L":
                raw = t.double()
                continue
            mapped = HYBRID_KEY_MAP.get(sub, sub)
            if "mix_L" in mapped:  # the loader drops it: mix_L is rebuilt from the raw mixer
                continue
            p[mapped] = t.double()
        eye = torch.eye(self.block, dtype=torch.float64)
        # Without a raw mixer the head keeps its constructor's identity (no mixing).
        p["mix_L"] = eye.expand(self.rank, -1, -1).clone() if raw is None else raw * torch.tril(torch.ones_like(eye)) + eye
        missing = HEAD_PARAMETERS - set(p)
        if missing:
            raise ValueError(f"the export leaves the head's {sorted(missing)} unloaded")
        self.p = p

    def latent(self, prev: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """_refine_latent: [N, B] previous ids, [N, B, 2r] hidden cache -> [N, B, r]."""
        p = self.p
        x = torch.cat([hcache, p["w1.weight"][prev]], dim=-1) @ p["in_proj.weight"].T
        x = torch.bmm(p["mix_L"], x.permute(2, 1, 0)).permute(2, 1, 0)  # [r, B, B] @ [r, B, N]
        gate, up = x @ p["mlp_gate.weight"].T, x @ p["mlp_up.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ p["mlp_down.weight"].T

    def draft(self, h_full: torch.Tensor, lm_head: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The draft tokens [N, B - 1] from the head hidden states of every query of N requests [N, B, D]
        (slot 0 the anchor), the target's lm_head [V, D] and the anchors' ids [N]."""
        p, h = self.p, h_full.double()
        n, b, _ = h.shape
        assert b == self.block, f"the served block has {b} slots, the head {self.block}"
        base_full = h @ lm_head.double().T  # compute_draft_logits: the lm_head on every query
        g = h.mean(dim=1, keepdim=True).expand_as(h)
        hcache = torch.cat([h @ p["down_h.weight"].T, g @ p["down_g.weight"].T], dim=-1)
        blk = torch.empty(n, b, dtype=torch.long)
        blk[:, 0] = anchor_ids
        blk[:, 1:] = base_full[:, 1:].argmax(-1)
        v = base_full.shape[-1]
        tok_am1 = anchor_ids.long()  # the speculator's stand-in for the anchor's predecessor
        if self.topc:
            c = min(self.topc, v)
            base_c, cand = base_full[:, 1:].reshape(n * (b - 1), v).topk(c, dim=-1)
            w2c = p["w2.weight"][cand]  # [rows, C, r], gathered once a step
        for _ in range(self.passes):
            prev = torch.cat([tok_am1[:, None], blk[:, :-1]], dim=1)
            lat = self.latent(prev, hcache)[:, 1:].reshape(n * (b - 1), self.rank)
            if self.topc:
                s = base_c + torch.bmm(w2c, lat[:, :, None])[..., 0]
                blk[:, 1:] = cand.gather(1, s.argmax(-1, keepdim=True)).view(n, b - 1)
            else:
                s = base_full[:, 1:].reshape(n * (b - 1), v) + lat @ p["w2.weight"].T
                blk[:, 1:] = s.argmax(-1).view(n, b - 1)
        return blk[:, 1:]
