"""DSpark (docs/algorithm.md section 9): the backbone with an anchor-first block, a Markov head that
biases every slot's logits by the token before the one it predicts, and a confidence head trained
toward each slot's acceptance probability; the engines walk the Markov chain greedily.

The modules and their math are in parts.py; this module holds its recipe sections (`drafter.dspark:`,
`objective.dspark:`) and says where the modules go, what they hold, how they are trained (inside
the fused loss, on the target's logits the distillation path already computes) and logged, and
how an export names them for llama.cpp, vLLM and SGLang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_ds.architectures.dflash import MODELING as DFLASH_MODELING, DFlashModules, DFlashObjective, DFlashWalk
from dflash_ds.architectures.dspark.parts import (ConfidenceHead, MarkovHead, calibration, confidence_logits,
                                                   confident_prefix, expected_tau, greedy_walk, l1_to_target,
                                                   shift_in)
from dflash_ds.architectures.dspark.report import draw_reliability, reliability
from dflash_ds.architectures.dspark.vocab_pass import l1_pass
from dflash_ds.network.arch_types import (Card, Fields, Keys, LogView, Proposal, RemoteCode, ReportFigure, Serving,
                                         StepSizes)
from dflash_ds.network.contract import Architecture, Spec, StepTerms
from dflash_ds.network.gather import take_rows
from dflash_ds.network.registry import register
from dflash_ds.network.shape import FieldError, Tensor
from dflash_ds.objective.blocks import Blocks, MicroBatch, slot_rows
from dflash_ds.objective.loss_terms import LogitBias, OutputTerm, RowTerm

if TYPE_CHECKING:  # for the annotations only
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.shape import DrafterShape


MODELING = Path(__file__).parent / "modeling_dspark.py"
"""The export's remote code: Qwen3DSparkModel on modeling_dflash.py's backbone, copied beside it."""

HEAD_TYPES = ("vanilla",)  # the only Markov head llama.cpp's converter and vLLM's reader load
# Reliability bins of the confidence head, pooled over the block's slots: 60 sums a step, where
# per-slot bins would be 60 per slot (the report draws one curve).
BINS = 20


@dataclass(frozen=True)
class DSparkFields(Fields):
    """The recipe's `drafter.dspark:` section and DSpark's shape, in dflash_config order; the defaults are
    DeepSpec's published shape."""

    markov_rank: int = 256
    """Rank r of the Markov head, two [vocab, r] tables (DeepSpec: 256; 127M parameters at a 248K
    vocabulary)."""
    markov_head_type: str = "vanilla"
    """The Markov head's form: vanilla, bias = markov_w2 @ markov_w1[prev] (DeepSpec's default and the
    only one llama.cpp and vLLM load; its gated and rnn heads are refused)."""
    enable_confidence_head: bool = True
    """A confidence head predicting each slot's acceptance probability (DeepSpec: on; vLLM's adaptive
    verification and llama.cpp's --spec-draft-p-min read it)."""
    confidence_head_with_markov: bool = True
    """The confidence head also reads the Markov embedding of the slot's predecessor (DeepSpec: true;
    llama.cpp loads only this form)."""

    def check_shape(self, shape: DrafterShape, serving: bool = False) -> None:
        if self.markov_rank < 1:
            raise FieldError("markov_rank", f"= {self.markov_rank} must be >= 1 (DeepSpec publishes 256)")
        if self.markov_head_type not in HEAD_TYPES:
            raise FieldError("markov_head_type", f"= {self.markov_head_type!r} is not served: llama.cpp and vLLM "
                             "load the vanilla Markov head only; set vanilla")
        if shape.output_multiplier != 1.0 or shape.final_logit_softcapping is not None:
            raise FieldError("output_multiplier", "scales or caps the target's logits, and the engines disagree on "
                             "whether DSpark's Markov bias is added before or after that: DSpark is trained for "
                             "targets without a logit transform only (Qwen3, Llama)")

    def config_entries(self, shape: DrafterShape) -> dict:
        # No sample_from_anchor here: vLLM's DFlash speculator, which its DSpark speculator extends,
        # refuses `dflash_config.sample_from_anchor: true` (0.32 and 0.34 alike) before DSpark reads
        # the top-level key; every reader of the layout takes it from the top level.
        return {"block_size": shape.block_size, **dataclasses.asdict(self)}

    def top_level_entries(self, shape: DrafterShape) -> dict:
        # DeepSpec's config class, vLLM's and SGLang's readers and llama.cpp's converter read these
        # at the top level; the converter builds its dflash_config from the top-level ids.
        return {"mask_token_id": shape.mask_token_id, "target_layer_ids": list(shape.target_layer_ids),
                **dataclasses.asdict(self), "sample_from_anchor": True}


@dataclass(frozen=True)
class DSparkKeys(Keys):
    """The recipe's `objective.dspark:` section: the weights of DSpark's three terms."""

    ce_weight: float = 0.1
    """Weight of the cross-entropy term (DeepSpec's ce_loss_alpha: 0.1). "loss" in the logs stays the
    unweighted sum(w * CE) / sum(w)."""
    l1_weight: float = 0.9
    """Weight of ||q - p||_1 (twice the total variation between the drafter's and the target's
    distributions at the slot; DeepSpec's l1_loss_alpha: 0.9). Target ranks send their final-norm
    states, as for objective.kl_weight > 0."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE toward 1 - TV (DeepSpec's confidence_head_alpha: 1.0)."""

    def check(self) -> None:
        for key, value in dataclasses.asdict(self).items():
            if value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")

    def weights(self, shape: DrafterShape) -> dict[str, float]:
        out = {"ce_weight": float(self.ce_weight), "l1_weight": float(self.l1_weight)}
        if shape.arch_fields.enable_confidence_head:  # without the head its weight trains nothing
            out["confidence_weight"] = float(self.confidence_weight)
        return out

    def trained_parts(self, shape: DrafterShape) -> tuple[tuple[str, tuple[str, ...]], ...]:
        # Only its BCE trains the confidence head: at weight 0 the engines would read an untrained head.
        return (("the confidence head", ("confidence_weight",)),) if shape.arch_fields.enable_confidence_head else ()


def _sum_names(block_size: int, confidence: bool) -> tuple[str, ...]:
    slots = [f"{what}_{k}" for k in range(block_size) for what in ("accept_sum", "accept_count")]
    if not confidence:  # no head: nothing of it to log
        return ("l1_sum", "tau_probabilistic_sum", "tau_probabilistic_blocks", *slots)
    bins = [f"confidence_bin_{what}_{i}" for what in ("weight", "pred", "target") for i in range(BINS)]
    return ("l1_sum", "confidence_sum", "tau_probabilistic_sum", "tau_probabilistic_blocks",
            "confidence_abs_error_sum", "confidence_bias_sum", *slots, *bins)


class ConfidenceTerm(OutputTerm):
    """confidence * sum(w * BCE(c, 1 - TV)) / normaliser, the confidence head's logits c read from the
    slots' final states (and their predecessors' Markov embeddings) against each slot's 1 - TV from the
    L1 term's per-row values (a constant, as in DeepSpec); and the logs' statistics of 1 - TV and the
    confidence (per slot, per block). Without a confidence head it adds no loss, only those logs."""

    name = "confidence_sum"

    def __init__(self, model: DraftModel, blocks: Blocks, hidden: torch.Tensor, weight: float):
        self.model, self.blocks, self.hidden, self.weight = model, blocks, hidden, weight

    def contribute(self, out, normaliser):
        model, blocks, b = self.model, self.blocks, self.model.config.block_size
        accept = (1.0 - 0.5 * out.rows["l1_sum"].view(-1, b)).clamp(0.0, 1.0)
        w = blocks.weights.view(-1, b).to(accept.dtype)
        head = getattr(model.drafter, "confidence_head", None)
        loss, conf_sum = self.hidden.new_zeros(()), w.new_zeros(())
        cal, bins = (w.new_zeros(()), w.new_zeros(())), w.new_zeros(3 * BINS)
        if head is not None:
            w1 = model.drafter.markov_head.markov_w1.weight
            embedding = take_rows(w1, _predecessors(blocks, b)) if head.with_markov else None
            c = confidence_logits(slot_rows(self.hidden, b, 0), embedding, head.proj.weight, head.proj.bias)
            c = c.to(accept.dtype).view_as(accept)
            conf_sum = (w * F.binary_cross_entropy_with_logits(c, accept, reduction="none")).sum()
            loss = self.weight * conf_sum / normaliser
            stats = calibration(torch.sigmoid(c.detach()), accept, w, BINS)
            cal = (stats.abs_error, stats.bias)
            bins = torch.cat([stats.bin_weight.sum(0), stats.bin_pred.sum(0), stats.bin_target.sum(0)])
        tau_sum, tau_blocks = expected_tau(accept, w)
        on = (w > 0).to(accept.dtype)
        per_slot = torch.stack([(accept * on).sum(0), on.sum(0)], dim=1).flatten()
        if head is None:  # in `_sum_names` order
            sums = (tau_sum, tau_blocks.to(accept.dtype), *per_slot.unbind())
        else:
            sums = (conf_sum, tau_sum, tau_blocks.to(accept.dtype), *(c.to(accept.dtype) for c in cal),
                    *per_slot.unbind(), *bins.to(accept.dtype).unbind())
        names = _sum_names(b, head is not None)[1:]
        return loss, {n: v.detach() for n, v in zip(names, sums, strict=True)}


class DSparkModules(DFlashModules):
    def heads(self, shape: DrafterShape) -> dict:
        f = shape.arch_fields
        out = {"markov_head": MarkovHead(shape.vocab_size, f.markov_rank)}
        if f.enable_confidence_head:
            out["confidence_head"] = ConfidenceHead(shape.hidden_size,
                                                    f.markov_rank if f.confidence_head_with_markov else 0)
        return out

    def tensors(self, shape: DrafterShape) -> dict[str, Tensor]:
        f, d, v, r = shape.arch_fields, shape.hidden_size, shape.vocab_size, shape.arch_fields.markov_rank
        out = {"markov_head.markov_w1.weight": Tensor((v, r), "table"),
               "markov_head.markov_w2.weight": Tensor((v, r), "block")}
        if f.enable_confidence_head:
            out["confidence_head.proj.weight"] = Tensor((1, d + (r if f.confidence_head_with_markov else 0)), "block")
            out["confidence_head.proj.bias"] = Tensor((1,))
        return out

    def extra_flops(self, shape: DrafterShape, draft_tokens: int) -> int:
        # The target's logits of every slot through the frozen lm_head (forward only), for the L1 term.
        return 2 * shape.vocab_size * shape.hidden_size * draft_tokens

    def extra_activation_bytes(self, shape: DrafterShape, step: StepSizes) -> int:
        # Beside each loss chunk's own logits, the L1 term's pass holds two more bf16 [chunk rows, vocab]
        # tensors: the target's logits of the chunk (through the frozen lm_head) and the Markov-biased
        # logits it compares them with. The Markov bias itself is [rows, rank], small next to them.
        return 2 * 2 * step.chunk_rows * shape.vocab_size


class DSparkObjective(DFlashObjective):
    """ce * CE + l1 * ||q - p||_1 + confidence * BCE(c, 1 - TV) on the anchor-first blocks (Spec.label_offset)."""

    def terms(self, model: DraftModel, mb: MicroBatch, blocks: Blocks, hidden: torch.Tensor, *, ctx: torch.Tensor,
              keys: DSparkKeys | None, step: int | None = None, total_steps: int = 0) -> StepTerms:
        k = keys or DSparkKeys()
        # The L1 term runs inside the fused loss's pass over the vocabulary (one Triton kernel on CUDA) on
        # the Markov-biased logits and the target's; the confidence head's term after it, on its per-row values.
        l1 = RowTerm("l1_sum", k.l1_weight, l1_to_target, l1_pass)
        confidence = ConfidenceTerm(model, blocks, hidden, k.confidence_weight)
        # The Markov bias of every slot (teacher-forced predecessor), gathered once for the micro-batch (its
        # gradient one segmented sum); the loss folds embedding @ markov_w2.T into the lm_head matmul.
        head = model.drafter.markov_head
        bias = LogitBias(head.embed(_predecessors(blocks, model.config.block_size), hidden.dtype), head.markov_w2.weight)
        return StepTerms(k.ce_weight, (l1, confidence), bias)


class DSparkWalk(DFlashWalk):
    def propose(self, model: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, p_min: float = 0.0, *,
                context: torch.Tensor | None = None) -> Proposal:
        # llama.cpp's confidence of slot k is the head's sigmoid on the slot's state and the Markov
        # embedding of the chain's token before it, computed in the same graph as the chain; its
        # loop stops the draft at the first slot below the threshold (common/speculative.cpp).
        walk = _chain(model, hidden, anchors)
        head = getattr(model.drafter, "confidence_head", None)
        full = torch.full(walk.tokens.shape[:1], walk.tokens.shape[1], dtype=torch.long)
        if head is None:
            if p_min > 0:
                raise ValueError(f"p_min = {p_min}: this DSpark drafter has no confidence head, and llama.cpp "
                                 "refuses --spec-draft-p-min > 0 for it; use 0")
            return Proposal(walk.tokens, full)
        if p_min > 0 and not head.with_markov:
            raise ValueError(f"p_min = {p_min}: llama.cpp does not load a DSpark drafter whose confidence head "
                             "does not read the Markov embedding, so it has no cut to predict; use 0")
        with torch.no_grad():
            c = head(hidden, model.drafter.markov_head.embed(walk.predecessors))
        return Proposal(walk.tokens, confident_prefix(c, p_min).long().cpu(), torch.sigmoid(c))


def log_record(sums: dict[str, float], weight: float) -> dict[str, float | list[float]]:
    # Weighted over the slots like "loss" (sum(w * term) / sum(w)); tau_probabilistic per block
    # (DeepSpec's 1 + sum_k prod_{j <= k} (1 - TV_j)); acceptance per drafting slot unweighted.
    # The reliability bins as shares of the step's weight, so that records add up (the report
    # pools the last few). Without a confidence head no confidence field is written.
    rec = {"l1": sums["l1_sum"] / weight}
    if "confidence_sum" in sums:
        rec["confidence_loss"] = sums["confidence_sum"] / weight
    rec["tau_probabilistic"] = sums["tau_probabilistic_sum"] / max(sums["tau_probabilistic_blocks"], 1e-9)
    if "confidence_sum" in sums:
        rec["confidence_mae"] = sums["confidence_abs_error_sum"] / weight
        rec["confidence_bias"] = sums["confidence_bias_sum"] / weight
    k = 0
    while f"accept_sum_{k}" in sums:
        if sums[f"accept_count_{k}"] > 0:
            rec[f"accept_rate_pos_{k + 1}"] = sums[f"accept_sum_{k}"] / sums[f"accept_count_{k}"]
        k += 1
    if "confidence_sum" not in sums:
        return rec
    bin_weight, bin_pred, bin_target = ([sums[f"confidence_bin_{what}_{i}"] for i in range(BINS)]
                                        for what in ("weight", "pred", "target"))
    if sum(bin_weight) > 0:  # a step with weight
        rec["confidence_ece"] = sum(abs(p - t) for p, t in zip(bin_pred, bin_target)) / sum(bin_weight)
        for name, values in (("weight", bin_weight), ("pred", bin_pred), ("target", bin_target)):
            rec[f"confidence_bin_{name}"] = [v / weight for v in values]
    return rec


def report_figures(steps: list[dict]) -> list[ReportFigure]:
    pooled = reliability(steps)
    if pooled is None:
        return []
    return [ReportFigure("confidence_reliability", lambda ax: draw_reliability(ax, pooled), (pooled.row(),))]


def card(shape: DrafterShape) -> Card:
    f = shape.arch_fields
    conf = ("with the Markov embedding" if f.confidence_head_with_markov else "without the Markov embedding") \
        if f.enable_confidence_head else "none"
    rows = (f"| Markov head | {f.markov_head_type}, rank {f.markov_rank} |",
            f"| confidence head | {conf} |",
            "| block layout | anchor-first (`sample_from_anchor`): all block slots draft |")
    # Every slot drafts: vLLM and llama.cpp verify B drafts a round, SGLang counts the anchor too.
    # llama.cpp builds the confidence head with the Markov embedding only: without it, it does not load.
    llama_cpp = not f.enable_confidence_head or f.confidence_head_with_markov
    b = shape.block_size
    serving = Serving("DSPARK", b + 1, "dspark", b, "draft-dspark" if llama_cpp else None, b,
                      vllm_v2_only="DSpark drafting")
    note = ["The engines select DSpark from `architectures: [\"Qwen3DSparkModel\"]` and read the Markov and",
            "confidence fields at the top level of config.json. All B slots of the block draft, so vLLM's"]
    convert = ["", "```", "python convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR", "```", ""]
    if not llama_cpp:
        note += ["`num_speculative_tokens` is B. llama.cpp does not load this drafter: its confidence head",
                 "does not read the Markov embedding (`confidence_head_with_markov: false`), the only form",
                 "llama.cpp builds.", ""]
    elif f.enable_confidence_head:
        note += ["`num_speculative_tokens` and llama.cpp's `--spec-draft-n-max` are B. llama.cpp converts it",
                 "against the target and runs it as `draft-dspark`; `--spec-draft-p-min P` (default 0: no cut)",
                 "verifies only the slots before the first whose confidence is below P, and a draft cut to",
                 "nothing is a plain decoding step:", *convert]
    else:  # no confidence head: llama.cpp has no confidence to cut a draft at
        note += ["`num_speculative_tokens` and llama.cpp's `--spec-draft-n-max` are B. llama.cpp converts it",
                 "against the target and runs it as `draft-dspark`, verifying every drafted slot (the drafter",
                 "has no confidence head):", *convert]
    return Card(rows, serving, tuple(note))


def _predecessors(blocks, block_size: int) -> torch.Tensor:
    """Teacher forcing: each slot's Markov predecessor (the anchor for slot 0, then the gold tokens),
    in the loss's row order."""
    labels = blocks.labels.view(blocks.labels.shape[0], -1, block_size)
    return slot_rows(shift_in(blocks.block_ids.view_as(labels)[..., 0], labels).flatten(1), block_size, 0)


def _chain(model, hidden: torch.Tensor, anchors: torch.Tensor):
    """The greedy Markov walk of the drafting slots' states `[n, B, D]`: every slot's lm_head logits,
    slot 0 conditioned on the anchor, slot k on the token chosen at slot k - 1 (llama.cpp's in-graph
    chain, vLLM's greedy drafting)."""
    base = hidden @ model.lm_head.to(device=hidden.device, dtype=hidden.dtype).T
    return greedy_walk(model.drafter.markov_head, base, anchors.to(hidden.device))


SPEC = Spec(
    name="dspark", class_name="Qwen3DSparkModel", title="DSpark", card=card, fields=DSparkFields,
    objective_keys=DSparkKeys, label_offset=1, needs_target_logits=True,
    remote_code=RemoteCode(MODELING, MODELING.name, {"AutoConfig": "modeling_dspark.DSparkConfig",
                                                      "AutoModel": "modeling_dspark.Qwen3DSparkModel"},
                           beside=(DFLASH_MODELING,)),
    logs=LogView(
        log_record,
        progress=("l1 {l1:.4f}", "tau_p {tau_probabilistic:.2f}", "confidence MAE {confidence_mae:.3f}"),
        series=(("loss", "l1", "L1 term"), ("loss", "confidence_loss", "confidence BCE"),
                ("accept_proxy", "tau_probabilistic", "probabilistic tau")),
        summary=(("final probabilistic tau", "{tau_probabilistic:.2f}"),
                 ("final confidence calibration", "MAE {confidence_mae:.3f}, bias {confidence_bias:+.3f}")),
        figures=report_figures),
    small={"markov_rank": 16})
DSPARK = register(Architecture(SPEC, DSparkModules(), DSparkObjective(), DSparkWalk()))
