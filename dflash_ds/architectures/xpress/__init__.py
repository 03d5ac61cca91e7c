"""XPress (arXiv 2608.02438): the DFlash (v1) backbone and a causal low-rank refiner over its block whose
output is a logit bias on the backbone's draft; the engines solve the block with K greedy Jacobi passes
(head.py), vLLM 0.34 with Model Runner V2 (`Qwen3XPressModel`, served by its DFlash method).

This module holds the recipe sections (`drafter.xpress:` with vLLM's config names, `objective.xpress:`
with speculators 0.9's loss weights; each default's source beside it), their checks, where the head goes,
its tensors by vLLM's names, the walk, the logs and the card. The export is read by vLLM's reader as it
is: tests/fixtures/xpress_reader_rules.json.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_ds.architectures.dflash import MODELING as DFLASH_MODELING, DFlashModules, DFlashObjective, DFlashWalk
from dflash_ds.architectures.xpress.head import XPressHead, jacobi_walk, refined_bias
from dflash_ds.architectures.xpress.loss import JacobiTerm, RoundFeatures, log_record
from dflash_ds.network.arch_types import CE_ALWAYS_ON, Card, Fields, Keys, LogView, Proposal, RemoteCode, Serving
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.registry import register
from dflash_ds.network.shape import FieldError, Tensor
from dflash_ds.objective.loss_terms import LogitBias, Rounds

if TYPE_CHECKING:  # for the annotations only
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.objective.blocks import Blocks, MicroBatch

MODELING = Path(__file__).parent / "modeling_xpress.py"
"""The export's remote code: Qwen3XPressModel on modeling_dflash.py's backbone, copied beside it."""
ALIGN = 8  # every parameter a multiple of 8 elements (ZeRO-2's gradient buffer, docs/architecture.md)


@dataclass(frozen=True)
class XPressFields(Fields):
    """The recipe's `drafter.xpress:` section and XPress's shape, by vLLM 0.34's config.json names (all
    top-level keys there, as its reader reads them; `xpress_block_size` is written as drafter.block_size,
    which vLLM requires it to equal)."""

    xpress_rank: int = 256
    """r, the refiner's rank: its embedding, fusion, mixer and MLP live in r dimensions (vLLM's default 256;
    speculators' --xpress-rank 256)."""
    xpress_mlp_hidden: int = 512
    """The refiner's SwiGLU width (vLLM's default 512; speculators writes xpress_mlp_ratio, default 2, so
    r * 2 = 512 at its rank 256)."""
    xpress_num_passes: int = 6
    """K, the Jacobi passes the engines run per draft (vLLM's default 6; speculators' num_jacobi_passes 6).
    Serving only: training runs objective.xpress.consistency_passes rounds."""
    xpress_topc: int = 512
    """C, the base logits' candidates a slot chooses among in every pass (vLLM's default 512; 0: the whole
    vocabulary, the exact Jacobi decode; speculators has none). At most the vocabulary: vLLM refuses more."""
    xpress_compile_head: bool = True
    """vLLM compiles the refiner's bias with torch.compile (vLLM's default true)."""

    def check_shape(self, shape: DrafterShape, serving: bool = False) -> None:
        for name in ("xpress_rank", "xpress_mlp_hidden"):
            value = getattr(self, name)
            if value < ALIGN or value % ALIGN:
                raise FieldError(name, f"= {value} must be a positive multiple of {ALIGN} (vLLM and speculators "
                                 "publish 256 and 512)")
        if self.xpress_num_passes < 1:
            raise FieldError("xpress_num_passes", f"= {self.xpress_num_passes} must be >= 1 (vLLM's default 6)")
        if self.xpress_topc < 0:
            raise FieldError("xpress_topc", f"= {self.xpress_topc} must be >= 0 (vLLM's default 512; 0 scores the "
                             "whole vocabulary)")
        if serving and self.xpress_topc > shape.vocab_size:
            raise FieldError("xpress_topc", f"= {self.xpress_topc} exceeds the vocabulary ({shape.vocab_size}), which "
                             "vLLM refuses; set at most that, or 0 (the whole vocabulary)")
        if shape.output_multiplier != 1.0 or shape.final_logit_softcapping is not None \
                or shape.input_embedding_scale != 1.0:
            raise FieldError("output_multiplier", "scales or caps the target's logits (or input_embedding_scale its "
                             "embedding), and vLLM adds XPress's bias to the lm_head's raw logits: XPress is trained "
                             "for targets without a logit transform only (Qwen3, Llama)")

    def top_level_entries(self, shape: DrafterShape) -> dict:
        # vLLM's Qwen3XPressModel and XPressSpeculator read these at the top level of config.json.
        return {**dataclasses.asdict(self), "xpress_block_size": shape.block_size, "sample_from_anchor": False}


@dataclass(frozen=True)
class XPressKeys(Keys):
    """The recipe's `objective.xpress:` section: speculators 0.9's XPress terms beside the backbone's loss."""

    consistency_weight: float = 0.3
    """Weight of the Jacobi consistency term, the mean of the rounds' losses (speculators' 0.3)."""
    consistency_passes: int = 3
    """J, the free-running rounds that term averages: round j reads round j - 1's argmax (speculators' 3)."""
    base_anchor_weight: float = 0.6
    """Weight of the backbone's own logits' loss, the base anchor (speculators' 0.6)."""

    def check(self) -> None:
        for key in ("consistency_weight", "base_anchor_weight"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)} (speculators: 0.3 and 0.6)")
        if self.consistency_passes < 0:
            raise ValueError(f"consistency_passes must be >= 0, got {self.consistency_passes} (speculators: 3)")

    def weights(self, shape: DrafterShape) -> dict[str, float]:
        return {CE_ALWAYS_ON: 1.0, "consistency_weight": float(self.consistency_weight if self.consistency_passes else 0),
                "base_anchor_weight": float(self.base_anchor_weight)}

    def rounds(self, features) -> Rounds:
        j = self.consistency_passes
        return Rounds(j, self.consistency_weight / j if j else 0.0, self.base_anchor_weight, features)


class XPressModules(DFlashModules):
    def heads(self, shape: DrafterShape) -> dict:
        f = shape.arch_fields
        return {"xpress_head": XPressHead(shape.vocab_size, shape.hidden_size, block_size=shape.block_size,
                                          rank=f.xpress_rank, mlp_hidden=f.xpress_mlp_hidden)}

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        f, d, v, b = shape.arch_fields, shape.hidden_size, shape.vocab_size, shape.block_size
        r, m = f.xpress_rank, f.xpress_mlp_hidden
        head = {"w1.weight": Tensor((v, r), "table"), "down_h.weight": Tensor((r, d), "block"),
                "down_g.weight": Tensor((r, d), "block"), "in_proj.weight": Tensor((r, 3 * r), "block"),
                "mix.L": Tensor((r, b, b)), "mlp_gate.weight": Tensor((m, r), "block"),
                "mlp_up.weight": Tensor((m, r), "block"), "mlp_down.weight": Tensor((r, m), "block"),
                "w2.weight": Tensor((v, r), "block")}
        return {f"xpress_head.{n}": t for n, t in head.items()}

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        # Beyond the teacher-forced pass (its tensors'): each consistency round's latent forward and
        # backward and its rank-r bias, and the base logits' rank-r correction, per drafting row.
        f = shape.arch_fields
        r, m = f.xpress_rank, f.xpress_mlp_hidden
        rounds = 3  # speculators' default; the FLOP count is an estimate, not a setting
        latent = 3 * r * r + 3 * r * m
        return int(6 * draft_tokens * (rounds * (latent + shape.vocab_size * r) + shape.vocab_size * r))

    def backbone_from(self, shape: DrafterShape, exported: DrafterShape) -> str | None:
        # speculators trains the refiner on a DFlash backbone: a v1 export starts it, the head fresh.
        if exported.architecture != "dflash":
            return f"is a {exported.architecture} export; an XPress backbone starts from a dflash export"
        return None


class XPressObjective(DFlashObjective):
    """The backbone's loss on the teacher-forced refined logits, the consistency rounds and the base anchor
    (loss.py), all inside the one fused loss."""

    def terms(self, model: DraftModel, mb: MicroBatch, blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor,
              keys: XPressKeys | None, step: int | None = None, total_steps: int = 0) -> StepTerms:
        k, b, head = keys or XPressKeys(), model.config.block_size, model.drafter.xpress_head
        full = hidden.reshape(-1, b, hidden.shape[-1])
        cache = head.hidden_cache(full)
        anchors = blocks.block_ids.reshape(-1, b)[:, 0]
        # Teacher forcing: the data's tokens in the block (the labels of slots 1 .. B - 1).
        z = refined_bias(head, cache, anchors, blocks.labels.reshape(-1, b)[:, 1:])
        features = z.reshape(-1, z.shape[-1])
        rounds = RoundFeatures(head, cache, anchors)
        bias = LogitBias(features, head.w2.weight, k.rounds(rounds))
        return StepTerms(terms=(JacobiTerm(rounds, features, blocks.weights),), bias=bias)


class XPressWalk(DFlashWalk):
    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None) -> Proposal:
        """vLLM 0.34's draft (head.jacobi_walk) from every slot's states `hidden` [n, B, D] (the spec's
        `walk_reads_anchor_slot`: the refiner reads the anchor slot too)."""
        if p_min > 0:
            raise ValueError("llama.cpp's --spec-draft-p-min cut of an XPress draft is not modelled (no llama.cpp "
                             "release loads XPress); predict its rounds with p_min 0")
        f = model.config.arch_fields
        with torch.no_grad():
            base = hidden[:, 1:] @ model.lm_head.to(device=hidden.device, dtype=hidden.dtype).T
            tokens = jacobi_walk(model.drafter.xpress_head, base, hidden, anchors.to(hidden.device),
                                 passes=f.xpress_num_passes, topc=f.xpress_topc)
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))


def card(shape: DrafterShape) -> Card:
    f, b = shape.arch_fields, shape.block_size
    topc = f"top {f.xpress_topc} base candidates a slot" if f.xpress_topc else "the whole vocabulary"
    rows = (f"| XPress refiner | rank {f.xpress_rank}, MLP {f.xpress_mlp_hidden}, {f.xpress_num_passes} greedy Jacobi "
            f"passes over {topc} |",)
    serving = Serving(None, b, "dflash", b - 1, None, b - 1, vllm_v2_only="XPress drafting")
    return Card(rows, serving, (
        "vLLM 0.34 and later serve it with its DFlash method: `architectures: [\"Qwen3XPressModel\"]` routes it",
        "to `Qwen3XPressForCausalLM`, whose speculator runs the backbone and then the refiner's Jacobi passes",
        f"(Model Runner V2, GPU). `num_speculative_tokens` must be {b - 1} (`xpress_block_size` - 1); add",
        "`\"xpress_topc\": C` to the speculative config to score C candidates a slot (0: all). SGLang and",
        "llama.cpp do not serve XPress. With transformers (trust_remote_code),",
        "`drafter.propose(hidden, anchor_ids, lm_head)` gives the refined draft of a block (modeling_xpress.py).",
        "",
    ))


SPEC = Spec(
    name="xpress", class_name="Qwen3XPressModel", title="XPress", card=card, fields=XPressFields,
    objective_keys=XPressKeys, walk_reads_anchor_slot=True,
    remote_code=RemoteCode(MODELING, MODELING.name, {"AutoConfig": "modeling_xpress.XPressConfig",
                                                      "AutoModel": "modeling_xpress.Qwen3XPressModel"},
                           beside=(DFLASH_MODELING,)),
    logs=LogView(
        log_record,
        progress=("base CE {xpress_base_ce:.3f}", "pass 0/last {xpress_accept_base:.2f}/{xpress_accept_last:.2f}",
                  "bias {xpress_bias_rms:.3f}"),
        series=(("loss", "xpress_base_ce", "base CE"), ("loss", "xpress_consistency_ce", "consistency CE"),
                ("accept_proxy", "xpress_accept_base", "pass 0 (base)"),
                ("accept_proxy", "xpress_accept_last", "last round")),
        summary=(("final acceptance proxy, pass 0 / last round / teacher-forced",
                  "{xpress_accept_base:.2f} / {xpress_accept_last:.2f} / {xpress_accept_tf:.2f}"),
                 ("final refiner bias RMS", "{xpress_bias_rms:.4f}"))),
    small={"xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 16, "xpress_num_passes": 3})
XPRESS = register(Architecture(SPEC, XPressModules(), XPressObjective(), XPressWalk()))
