"""LiLiCorr (Model-Optimizer's candidate reranker over the DFlash lattice): the DFlash backbone, optionally
with DFlash2's block convolution around every sublayer, and a head that reranks the backbone's top-k
candidates of every drafted slot by pair scores between neighbouring slots; the engines walk those
scores greedily, left to right.

The head and its math are in head.py; this module holds the recipe sections (`drafter.lilicorr:`,
`objective.lilicorr:`, with Model-Optimizer's defaults), their checks, where the modules go, what they
hold, how an export names them (`projector_type: lilicorr` and the `lilicorr_*` keys of `dflash_config`,
as vLLM's and SGLang's readers take them: tests/fixtures/lilicorr_reader_rules.json) and the card.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_ds.architectures.dflash import MODELING as DFLASH_MODELING, DFlashModules, DFlashObjective, DFlashWalk
from dflash_ds.architectures.dflash2.parts import BlockConv, conv_activation_bytes
from dflash_ds.architectures.lilicorr.head import ALIGN, Geometry, LiLiCorrHead, NUM_FEATURES
from dflash_ds.architectures.lilicorr.logs import log_record
from dflash_ds.architectures.lilicorr.loss import lattice_inputs, lattice_loss_terms
from dflash_ds.architectures.lilicorr.report import draw_prefixes, prefixes
from dflash_ds.architectures.lilicorr.terms import Weights
from dflash_ds.architectures.lilicorr.walk import chosen, greedy_path, sampled_path, score, text_probabilities
from dflash_ds.network.arch_types import (CE_ALWAYS_ON, Card, Fields, Keys, LogView, Proposal, RemoteCode, ReportFigure,
                                          SampledDraft, Serving, StepSizes, Wrappers)
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.registry import register
from dflash_ds.network.shape import FieldError, Tensor

if TYPE_CHECKING:  # for the annotations only
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape
    from dflash_ds.objective.blocks import Blocks, MicroBatch

MODELING = Path(__file__).parent / "modeling_lilicorr.py"
"""The export's remote code: the head and its walk on modeling_dflash.py's backbone, copied beside it."""
MAX_TOPK = 16
"""vLLM's and SGLang's fused candidate kernels take a power of two up to 16 candidates a slot."""
PROJECTOR = "lilicorr"
"""dflash_config.projector_type: Model-Optimizer's routing key for the head."""
HIGH_PRECISION = ("factor_input_proj", "out_head", "in_head", "feature_mlp")
"""Head modules a quantized export keeps in the drafter's precision: vLLM and SGLang build the first
three unquantized (they fold them into fused weights), SGLang the feature MLP too (five inputs fit no
quantized GEMM), so one export loads in both."""


@dataclass(frozen=True)
class LiLiCorrFields(Fields):
    """The recipe's `drafter.lilicorr:` section and LiLiCorr's shape; the defaults are Model-Optimizer's
    published recipe (modelopt_recipes/general/speculative_decoding/lilicorr.yaml). Written to
    `dflash_config` as `lilicorr_<name>` (the convolution's as DFlash2's `conv_kernel_size` and
    `conv_group_size`, when on)."""

    candidate_topk: int = 8
    """k, the backbone's candidates a slot the head reranks (Model-Optimizer: 8). A power of two up to
    16: vLLM's and SGLang's fused kernels refuse others."""
    head_hidden_size: int = 1024
    """h, the head's width (Model-Optimizer's lilicorr_hidden_size: 1024); 0 = the drafter's width, and the
    head then has no `token_proj` (the readers build it only when the widths differ). Named apart from
    the drafter's own hidden_size, a field of every drafter shape; exported as `lilicorr_hidden_size`."""
    factor_dim: int = 1024
    """Width of the out / in / anchor factor vectors whose cosines are the scores (Model-Optimizer: 1024)."""
    num_layers: int = 2
    """Bidirectional layers over the k x S lattice of a block (Model-Optimizer: 2)."""
    num_heads: int = 8
    """Attention heads of those layers (Model-Optimizer: 8); divides the head's width."""
    mlp_ratio: float = 2.0
    """Their MLP's width over the head's (Model-Optimizer: 2.0; ungated SiLU MLP)."""
    score_scale: float = 8.0
    """lambda: the log-factors are lambda times the cosines, a fixed constant (Model-Optimizer's logit_scale:
    8.0). It changes the walk's scores without changing a shape, so every reader requires it in the
    export, as `lilicorr_logit_scale` (named apart from the target configs' own logit_scale here)."""
    vector_eps: float = 1e-4
    """Floor of the factor vectors' norm before normalising (Model-Optimizer: 1e-4)."""
    block_conv_kernel_size: int = 0
    """Taps of DFlash2's block convolution around every backbone sublayer; 0 = none (Model-Optimizer: no
    convolution unless set; DFlash2 publishes 2). Named apart from DFlash2's own key so that an older
    recipe's flat `drafter.conv_kernel_size` keeps meaning DFlash2's; exported as `conv_kernel_size`."""
    block_conv_group_size: int = 0
    """Channels sharing one convolution coefficient; set with block_conv_kernel_size or not at all
    (DFlash2 publishes 16); exported as `conv_group_size`."""

    @property
    def conv(self) -> bool:
        return self.block_conv_kernel_size > 0

    @classmethod
    def from_recipe(cls, section: Any, name: str) -> LiLiCorrFields:
        # Only its own section: a drafter section's attributes of the same names (num_layers, the
        # backbone's) are not LiLiCorr's.
        own = getattr(section, "sections", {}).get(name)
        return own if own is not None else cls()

    def check_shape(self, shape: DrafterShape, serving: bool = False) -> None:
        f, width = self, self.head_hidden_size or shape.hidden_size
        k = f.candidate_topk
        if not (1 <= k <= MAX_TOPK and k & (k - 1) == 0):
            raise FieldError("candidate_topk", f"= {k} must be a power of two <= {MAX_TOPK} (vLLM's and SGLang's fused "
                             "candidate kernels); Model-Optimizer publishes 8")
        if k > shape.vocab_size:
            raise FieldError("candidate_topk", f"= {k} exceeds the vocabulary ({shape.vocab_size})")
        for name in ("head_hidden_size", "block_conv_kernel_size", "block_conv_group_size"):
            if getattr(f, name) < 0:
                raise FieldError(name, f"= {getattr(f, name)} must be >= 0")
        for name in ("factor_dim", "num_layers", "num_heads"):
            if getattr(f, name) < 1:
                raise FieldError(name, f"= {getattr(f, name)} must be >= 1 (Model-Optimizer publishes 1024, 2, 8)")
        if width % f.num_heads:
            raise FieldError("num_heads", f"= {f.num_heads} must divide the head's width {width}")
        # Every parameter a multiple of 8 elements (ZeRO-2 alignment, docs/architecture.md): the head's
        # biases are [width], [factor_dim] and [width * mlp_ratio] long.
        if width % ALIGN or f.factor_dim % ALIGN:
            raise FieldError("head_hidden_size" if width % ALIGN else "factor_dim",
                             f"= {width if width % ALIGN else f.factor_dim} must be a multiple of {ALIGN}")
        if not (math.isfinite(f.mlp_ratio) and f.mlp_ratio > 0) or int(width * f.mlp_ratio) % ALIGN or \
                int(width * f.mlp_ratio) < 1:
            raise FieldError("mlp_ratio", f"= {f.mlp_ratio} must be > 0 and make width * mlp_ratio "
                             f"({int(width * max(f.mlp_ratio, 0))}) a positive multiple of {ALIGN}")
        if not (math.isfinite(f.score_scale) and f.score_scale > 0):
            raise FieldError("score_scale", f"= {f.score_scale} must be finite and > 0 (Model-Optimizer: 8.0)")
        if not 0 < f.vector_eps < 0.5:
            raise FieldError("vector_eps", f"= {f.vector_eps} must be in (0, 0.5) (Model-Optimizer: 1e-4)")
        if (f.block_conv_kernel_size > 0) != (f.block_conv_group_size > 0):
            raise FieldError("block_conv_kernel_size", f"= {f.block_conv_kernel_size} and block_conv_group_size = "
                             f"{f.block_conv_group_size}: set both (DFlash2 publishes 2 and 16) or neither")
        if f.conv and f.block_conv_kernel_size > shape.block_size:
            raise FieldError("block_conv_kernel_size", f"= {f.block_conv_kernel_size} must not exceed the block size "
                             f"{shape.block_size}: the convolution runs inside one block")
        if f.conv and shape.hidden_size % f.block_conv_group_size:
            raise FieldError("block_conv_group_size", f"= {f.block_conv_group_size} must divide the hidden size "
                             f"{shape.hidden_size}")
        if shape.output_multiplier != 1.0 or shape.final_logit_softcapping is not None \
                or shape.input_embedding_scale != 1.0:
            raise FieldError("output_multiplier", "scales or caps the target's logits (or input_embedding_scale its "
                             "embedding), and the engines take LiLiCorr's candidate log-probs from the raw lm_head "
                             "logits and its candidates' raw embedding rows: LiLiCorr is trained for targets "
                             "without a logit transform only (Qwen3, Llama)")

    def config_entries(self, shape: DrafterShape) -> dict:
        # No reader takes any of these from elsewhere or defaults one: the logit scale and vector_eps change
        # the scores without changing a shape. The convolution's keys only with the convolution.
        f = self
        out = {"block_size": shape.block_size, "projector_type": PROJECTOR, "lilicorr_enabled": True}
        out.update({CONFIG_KEYS[n]: v for n, v in dataclasses.asdict(f).items()
                    if f.conv or not n.startswith("block_conv_")})
        return out

    @classmethod
    def from_config(cls, dflash_config: dict, *, class_name: str) -> LiLiCorrFields:
        if dflash_config.get("projector_type", PROJECTOR) != PROJECTOR or not dflash_config.get("lilicorr_enabled", True):
            raise ValueError(f"a {class_name} config.json needs dflash_config.projector_type {PROJECTOR!r} and "
                             "lilicorr_enabled true")
        conv = {"block_conv_kernel_size", "block_conv_group_size"}
        missing = [CONFIG_KEYS[n] for n in CONFIG_KEYS if n not in conv and CONFIG_KEYS[n] not in dflash_config]
        if missing:
            raise ValueError(f"a {class_name} config.json needs dflash_config.{', '.join(missing)}")
        values = {n: dflash_config.get(key, 0) for n, key in CONFIG_KEYS.items()}
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(**{n: {"int": int, "float": float}[hints[n]](v) for n, v in values.items()})


# dflash_config key of each field (the readers' names).
_RENAMED = {"head_hidden_size": "lilicorr_hidden_size", "score_scale": "lilicorr_logit_scale", "block_conv_kernel_size": "conv_kernel_size",
            "block_conv_group_size": "conv_group_size"}
CONFIG_KEYS = {f.name: _RENAMED.get(f.name, f"lilicorr_{f.name}") for f in dataclasses.fields(LiLiCorrFields)}


@dataclass(frozen=True)
class LiLiCorrKeys(Keys):
    """The recipe's `objective.lilicorr:` section: the head's terms, added to the DFlash loss (whose
    cross-entropy keeps weight 1). Defaults: Model-Optimizer's `base` recipe. Its `margin` variant is
    w_ce 0.125, w_margin 0.125, w_pen 0.25, margin 2.0 (the head's total weight 0.5 in both)."""

    w_ce: float = 0.25
    """Weight of the candidate cross-entropy: the gold candidate's log-softmax under the scores leaving
    the gold predecessor (Model-Optimizer base 0.25; margin variant 0.125)."""
    w_margin: float = 0.0
    """Weight of the hinge relu(margin - gap), gap = the gold's score minus the best other's (base 0.0;
    margin variant 0.125)."""
    w_pen: float = 0.25
    """Weight of the penalty E_p[relu(z_target(gold) - z_target(candidate))] under the head's own slot
    distribution p: the target's logits push target-rejected candidates down (0.25 in both variants)."""
    margin: float = 2.0
    """The hinge's margin in log-factor units (Model-Optimizer: 2.0; read only with w_margin > 0)."""
    soft_value: bool = True
    """The candidates' log-probs, a feature of the head, carry its gradient into the backbone (Model-Optimizer:
    always); false detaches them."""

    def check(self) -> None:
        for key in ("w_ce", "w_margin", "w_pen", "margin"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.w_ce == self.w_margin == self.w_pen == 0:
            raise ValueError("w_ce, w_margin and w_pen are all 0: the reranker would never be trained; Model-Optimizer's "
                             "base recipe sets w_ce 0.25, w_pen 0.25")
        if self.w_margin > 0 and self.margin <= 0:
            raise ValueError(f"w_margin = {self.w_margin} needs margin > 0 (Model-Optimizer: 2.0), got {self.margin}")

    def weights(self, shape: DrafterShape) -> dict[str, float]:
        return {CE_ALWAYS_ON: 1.0, "w_ce": float(self.w_ce), "w_margin": float(self.w_margin), "w_pen": float(self.w_pen)}

    def lattice(self) -> Weights:
        """The lattice terms' weights (terms.py), constant over the run as in Model-Optimizer."""
        return Weights(self.w_ce, self.w_margin, self.w_pen, self.margin, self.soft_value)


def geometry(shape: DrafterShape) -> Geometry:
    """The head's sizes for a drafter of `shape`."""
    f = shape.arch_fields
    width = f.head_hidden_size or shape.hidden_size
    return Geometry(hidden=shape.hidden_size, width=width, factor_dim=f.factor_dim, num_layers=f.num_layers,
                    num_heads=f.num_heads, mlp_width=int(width * f.mlp_ratio), slots=shape.block_size - 1,
                    top_k=f.candidate_topk, eps=shape.rms_norm_eps, logit_scale=f.score_scale,
                    vector_eps=f.vector_eps)


class LiLiCorrModules(DFlashModules):
    def wrappers(self, shape: DrafterShape) -> Wrappers | None:
        f = shape.arch_fields
        if not f.conv:
            return None
        conv = (shape.hidden_size, f.block_conv_kernel_size, f.block_conv_group_size, shape.block_size)
        return Wrappers(("attention_conv", BlockConv(*conv)), ("mlp_conv", BlockConv(*conv)))

    def heads(self, shape: DrafterShape) -> dict:
        return {"lilicorr": LiLiCorrHead(geometry(shape))}

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        # The head runs on the k x S lattice of a block, not on its tokens: its matmuls are counted in
        # extra_flops, so its tensors are listed without a per-token use.
        f, g, d = shape.arch_fields, geometry(shape), shape.hidden_size
        h, m, k, s, nh = g.width, g.mlp_width, g.top_k, g.slots, g.num_heads
        out = {}
        if f.conv:
            taps = f.block_conv_kernel_size
            for i in range(shape.num_hidden_layers):
                for conv in ("attention_conv", "mlp_conv"):
                    out[f"layers.{i}.{conv}.base_kernel"] = Tensor((2, taps, d))
                    out[f"layers.{i}.{conv}.kernel_projection.weight"] = Tensor(
                        (2 * taps * d // f.block_conv_group_size, d), "block")
        head = {}
        if h != d:
            head |= {"token_proj.weight": (h, d), "token_proj.bias": (h,)}
        head |= {"pass_hidden_proj.weight": (h, d), "pass_hidden_proj.bias": (h,),
                 "feature_norm.weight": (NUM_FEATURES,), "feature_norm.bias": (NUM_FEATURES,),
                 "feature_mlp.up_proj.weight": (h, NUM_FEATURES), "feature_mlp.up_proj.bias": (h,),
                 "feature_mlp.down_proj.weight": (h, h), "feature_mlp.down_proj.bias": (h,),
                 "slot_embedding": (1, 1, s, 1, h), "rank_embedding": (1, 1, 1, k, h),
                 "relative_slot_bias": (nh, 2 * s + 1), "same_slot_bias": (nh,),
                 "context_proj.weight": (h, d), "context_proj.bias": (h,)}
        for layer in range(g.num_layers):
            head |= {f"layers.{layer}.{name}": t for name, t in {
                "attn_norm.weight": (h,), "attn.in_proj_weight": (3 * h, h), "attn.in_proj_bias": (3 * h,),
                "attn.out_proj.weight": (h, h), "attn.out_proj.bias": (h,), "mlp_norm.weight": (h,),
                "mlp.up_proj.weight": (m, h), "mlp.up_proj.bias": (m,), "mlp.down_proj.weight": (h, m),
                "mlp.down_proj.bias": (h,)}.items()}
        head |= {"output_norm.weight": (h,), "anchor_norm.weight": (h,),
                 "factor_input_proj.weight": (h, 3 * h), "factor_input_proj.bias": (h,)}
        for name in ("out_head", "in_head", "anchor_out_head"):
            head |= {f"{name}.weight": (g.factor_dim, h), f"{name}.bias": (g.factor_dim,)}
        return {**out, **{f"lilicorr.{n}": Tensor(t) for n, t in head.items()}}

    def backbone_from(self, shape: DrafterShape, exported: DrafterShape) -> str | None:
        # Model-Optimizer trains the head on a DFlash backbone: a v1 export's, or with the block
        # convolution a DFlash2 export's (its selector left behind), the head starting fresh.
        f = shape.arch_fields
        want = "dflash2" if f.conv else "dflash"
        if exported.architecture != want:
            return (f"is a {exported.architecture} export; a LiLiCorr backbone starts from a dflash export, or from a "
                    "dflash2 export with block_conv_kernel_size / block_conv_group_size set to its conv_kernel_size / "
                    "conv_group_size")
        if f.conv:
            theirs = (exported.arch_fields.conv_kernel_size, exported.arch_fields.conv_group_size)
            if theirs != (f.block_conv_kernel_size, f.block_conv_group_size):
                return (f"has conv_kernel_size / conv_group_size {theirs[0]} / {theirs[1]} but the drafter's "
                        f"block_conv_kernel_size / block_conv_group_size are {f.block_conv_kernel_size} / "
                        f"{f.block_conv_group_size}")
        return None

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        # Per drafted slot: its k lattice positions through the token projection, the feature MLP, the
        # layers (q, k, v, out and the MLP; the k*S-long attention itself is left out) and the
        # factor projections; its pass-hidden projection once; per block (1 in S slots) the anchor's
        # projections. Forward and backward: 6 FLOPs a multiply-add.
        g, d = geometry(shape), shape.hidden_size
        h, m = g.width, g.mlp_width
        token = h * d if h != d else 0
        position = token + NUM_FEATURES * h + h * h + g.num_layers * (4 * h * h + 2 * h * m) + 3 * h * h + 2 * h * g.factor_dim
        per_slot = g.top_k * position + h * d + (h * d + h * g.factor_dim) / max(g.slots, 1)
        return int(6 * per_slot * draft_tokens)

    def extra_activation_bytes(self, shape: DrafterShape, step: StepSizes) -> int:
        # What the head keeps for its backward over the k x S lattice of every block: the inputs its
        # matmuls, norms and activations read again, counted from its modules in bf16 states a lattice
        # position (h wide unless said): the candidates' target embeddings (token_proj's input, H wide);
        # the feature MLP's hidden and the summed state (2); per lattice layer the residual, the normed
        # input, q, k, v and the attention's output, the residual after it and the normed MLP input (8),
        # and the MLP's up and activated states (2 m); the output norm's input and output (2); the
        # cosines' [states, alpha, states * alpha] input (3), the factor projection's output (1) and the
        # out / in factors before and after their normalisation (4 factor_dim); with the block
        # convolutions, their states as DFlash2's.
        g = geometry(shape)
        positions = step.blocks * g.slots * g.top_k
        per_position = (g.hidden + (2 + 2 + 3 + 1) * g.width + g.num_layers * (8 * g.width + 2 * g.mlp_width)
                        + 4 * g.factor_dim)
        convs = conv_activation_bytes(shape.hidden_size, shape.num_hidden_layers, step.queries) if shape.arch_fields.conv else 0
        return 2 * positions * per_position + convs


class LiLiCorrObjective(DFlashObjective):
    """The DFlash cross-entropy (weight 1) and the head's lattice terms (loss.py): a zero-weight row term
    giving each row's log-normaliser inside the fused loss, then the lattice over every block's top-k."""

    def terms(self, model: DraftModel, mb: MicroBatch, blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor,
              keys: LiLiCorrKeys | None, step: int | None = None, total_steps: int = 0) -> StepTerms:
        inputs = lattice_inputs(blocks, hidden, ctx=ctx, mb=mb)
        return StepTerms(terms=lattice_loss_terms(model, blocks, inputs, (keys or LiLiCorrKeys()).lattice()))


class LiLiCorrWalk(DFlashWalk):
    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None, context_valid: torch.Tensor | None = None) -> Proposal:
        """The engines' greedy walk over the head's log-factors (walk.py). The head reads each anchor's
        context row, `context` [n, D]: hidden_norm(fc(taps)) at the position before the anchor, zero-weighted
        where `context_valid` [n] is false (default: every row exists)."""
        if p_min > 0:
            raise ValueError("llama.cpp's --spec-draft-p-min cut of a LiLiCorr draft is not modelled (no llama.cpp "
                             "release loads LiLiCorr); predict its rounds with p_min 0")
        if context is None:
            raise ValueError("a LiLiCorr draft reads each anchor's context row (hidden_norm(fc(taps)) at the position "
                             "before the anchor); pass context [n, D]")
        if context_valid is None:
            context_valid = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        with torch.no_grad():
            found, factors = score(model, hidden, context.to(hidden.device), context_valid.to(hidden.device))
            tokens = chosen(found, greedy_path(factors))
        return Proposal(tokens, torch.full(tokens.shape[:1], tokens.shape[1], dtype=torch.long))

    def text_probabilities(self, model: DraftModel, hidden: torch.Tensor, following: torch.Tensor, temperature: float,
                           *, context: torch.Tensor | None = None) -> torch.Tensor:
        """The engines draw a LiLiCorr draft from the head's walk at the sampling temperature (walk.py
        `sampled_path`): q along the text from each anchor's context row `context` [n, D]."""
        if context is None:
            raise ValueError("a LiLiCorr draft reads each anchor's context row; pass context [n, D]")
        valid = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        with torch.no_grad():
            found, factors = score(model, hidden, context.to(hidden.device), valid)
            return text_probabilities(found, factors, following, temperature)

    def sampled_draft(self, model: DraftModel, hidden: torch.Tensor, temperature: float, generator: torch.Generator,
                      *, context: torch.Tensor | None = None) -> SampledDraft:
        """The head's walk drawn at `temperature`, one uniform a slot from `generator` (walk.sampled_path)."""
        if context is None:
            raise ValueError("a LiLiCorr draft reads each anchor's context row; pass context [n, D]")
        valid = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        with torch.no_grad():
            found, factors = score(model, hidden, context.to(hidden.device), valid)
            uniforms = torch.rand(found.ids.shape[:2], generator=generator, dtype=torch.float64,
                                  device=generator.device).to(hidden.device)
            path = sampled_path(factors, temperature, uniforms)
            q = path.rows.new_zeros(*found.ids.shape[:2], model.lm_head.shape[0]).scatter(-1, found.ids, path.rows)
        return SampledDraft(chosen(found, path), q, lambda following: text_probabilities(found, factors, following,
                                                                                         temperature))


def report_figures(steps: list[dict]) -> list[ReportFigure]:
    found = prefixes(steps)
    if found is None:
        return []
    return [ReportFigure("lilicorr_prefix", lambda ax: draw_prefixes(ax, found), (found.row(),))]


def card(shape: DrafterShape) -> Card:
    f, g, b = shape.arch_fields, geometry(shape), shape.block_size
    rows = [f"| LiLiCorr head | top {g.top_k} candidates a slot, width {g.width}, {g.num_layers} lattice layers "
            f"x {g.num_heads} heads, factors {g.factor_dim}, logit scale {f.score_scale} |"]
    if f.conv:
        rows.append(f"| block convolution | {f.block_conv_kernel_size} taps, groups of {f.block_conv_group_size} "
                    "channels |")
    serving = Serving("DFLASH", b, "dflash", b - 1, None, b - 1, vllm_v2_only="the LiLiCorr head")
    return Card(tuple(rows), serving, (
        "Both engines serve it with their DFlash method and select the LiLiCorr head from",
        "`architectures: [\"LiLiCorrDraftModel\"]` and the `lilicorr_*` fields of `dflash_config`: SGLang's",
        "`LiLiCorrDraftModel`, vLLM's Model Runner V2 (`spec_decode/lilicorr`). The head reranks the",
        f"backbone's top {g.top_k} of every slot over all {b - 1} drafted slots: a shorter draft count",
        "builds a smaller lattice whose scores differ. llama.cpp's LiLiCorr reader is newer than",
        "the llama.cpp this export was checked with, so no llama.cpp command is given. With",
        "transformers (trust_remote_code), `drafter.propose(hidden, anchor_taps, lm_head, embed_tokens)`",
        "gives the reranked draft of a block's drafting slots (modeling_lilicorr.py).",
        "",
    ))


SPEC = Spec(
    name="lilicorr", class_name="LiLiCorrDraftModel", title="LiLiCorr", card=card, fields=LiLiCorrFields,
    objective_keys=LiLiCorrKeys,
    needs_target_logits=True,  # the penalty reads the target's logits at the candidates
    remote_code=RemoteCode(MODELING, MODELING.name, {"AutoConfig": "modeling_lilicorr.LiLiCorrConfig",
                                                      "AutoModel": "modeling_lilicorr.LiLiCorrDraftModel"},
                           beside=(DFLASH_MODELING,)),
    logs=LogView(
        lambda sums, weight: log_record(sums),
        progress=("lattice CE {lilicorr_ce:.3f}",
                  "prefix sel/top1/oracle {lilicorr_selected_prefix:.2f}/{lilicorr_top1_prefix:.2f}/"
                  "{lilicorr_oracle_prefix:.2f}", "spread {lilicorr_logfactor_spread:.2f}"),
        series=(("loss", "lilicorr_ce", "lattice CE"), ("loss", "lilicorr_penalty", "lattice penalty")),
        summary=(("final reranked / top-1 / oracle prefix", "{lilicorr_selected_prefix:.2f} / "
                  "{lilicorr_top1_prefix:.2f} / {lilicorr_oracle_prefix:.2f}"),
                 ("final log-factor spread", "{lilicorr_logfactor_spread:.3f}")),
        figures=report_figures),
    small={"head_hidden_size": 16, "factor_dim": 16, "num_heads": 4, "candidate_topk": 8})
LILICORR = register(Architecture(SPEC, LiLiCorrModules(), LiLiCorrObjective(), LiLiCorrWalk()))
