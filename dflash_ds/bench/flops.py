"""FLOP, parameter and attention-pair counts: the rules behind the project's anchor figures.

The first four are plain functions tests check by hand; the last two apply them to a bench run.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_ds.network.attention import FULL, LayerAttention

from .setup import Setup, setup_rows


def count_linear_params(module: nn.Module) -> int:
    """Weights of every nn.Linear (or FP8 linear) under `module` (the matmuls of a forward)."""
    from dflash_ds.quantization.fp8 import Fp8Linear

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, Fp8Linear)))


def target_forward_flops(linear_params: int, full_attention_layers: int, heads: int, head_dim: int, *, rows: int,
                         seq_len: int) -> dict[str, int]:
    """2 x linear params x tokens + causal attention 2*2*S^2*heads*head_dim/2 per full layer per row."""
    linear = 2 * linear_params * rows * seq_len
    attention = full_attention_layers * rows * 2 * 2 * seq_len * seq_len * heads * head_dim // 2
    return {"linear": linear, "attention": attention, "total": linear + attention}


def visible_pairs(anchors: torch.Tensor, valid: torch.Tensor, doc_ids: torch.Tensor, block_size: int,
                  *, attention: LayerAttention = FULL) -> int:
    """(query, key) pairs the DFlash mask allows under one layer attention, counted from the mask's definition.

    Per block: for each slot k, the context keys strictly before the anchor in its document (and,
    with a window W, at positions >= anchor + k - W + 1) + its own block's keys (all B, or k + 1 in a
    causal layer); invalid (padding) blocks see their own block only.
    """
    anchors, valid, doc_ids = anchors.cpu().long(), valid.cpu().bool(), doc_ids.cpu().long()
    s = doc_ids.shape[1]
    doc_at = torch.gather(doc_ids, 1, anchors.clamp(0, s - 1))
    j = torch.arange(s)
    ctx = (j.view(1, 1, s) < anchors.unsqueeze(-1)) & (doc_ids.unsqueeze(1) == doc_at.unsqueeze(-1))
    ctx = ctx & valid.unsqueeze(-1)
    slots = torch.arange(block_size)
    if attention.window is None:
        ctx_keys = int(ctx.sum()) * block_size
    else:  # keys at or after the window start: all visible keys minus those below it (a prefix sum)
        below = torch.zeros(*ctx.shape[:2], s + 1, dtype=torch.long)
        below[..., 1:] = ctx.long().cumsum(-1)
        lo = (anchors.unsqueeze(-1) + slots - attention.window + 1).clamp(0, s)  # [b, N, B]
        ctx_keys = int((below[..., s:] - torch.gather(below, 2, lo)).sum())
    own = int((slots + 1).sum()) if attention.causal else block_size * block_size
    return ctx_keys + anchors.numel() * own


def drafter_step_flops(cfg, ctx_tokens: int, block_tokens: int, pairs: int) -> dict[str, int]:
    """One micro-batch's forward + backward FLOPs of the drafter (the anchor figures' rule), from the
    shape's tensor inventory (`DrafterShape.tensors`).

    6 x params x tokens for every matmul weight (forward, input and weight gradient): the backbone's
    q, o and MLP over the block tokens, k and v over the context and block tokens; 4 x the fc weight x
    context tokens (no input gradient: the taps are data); attention 4 x pairs x heads x head_dim x 3
    (forward + backward) per layer (`pairs`: the mean over the layers when they attend differently);
    4 x vocab x D x drafting tokens for the frozen lm_head (forward + input gradient: the fused loss
    runs on the drafting slots only, B - 1 of a block's B, all B anchor-first). An architecture's
    own weights (`Modules.tensors`, over their `use` tokens) and matmuls on the drafting slots
    (`extra_flops`) are counted under its name;
    elementwise tensors and gathered tables are not matmuls and are not counted.
    """
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    tokens = {"block": block_tokens, "context+block": ctx_tokens + block_tokens}
    backbone = cfg.backbone_tensors()

    def matmuls(tensors) -> int:
        return sum(6 * t.numel * tokens[t.use] for t in tensors.values() if t.use in tokens)

    fuse = sum(4 * t.numel * ctx_tokens for t in backbone.values() if t.use == "context")
    attention = cfg.num_hidden_layers * 3 * 4 * pairs * h * hd
    drafts = block_tokens // cfg.block_size * cfg.num_drafts
    lm_head = 4 * cfg.vocab_size * d * drafts
    out = {"dense": matmuls(backbone), "fuse": fuse, "attention": attention, "lm_head": lm_head}
    own = {n: t for n, t in cfg.tensors().items() if n not in backbone}
    extra = matmuls(own) + cfg.extra_flops(drafts)
    if own or extra:
        out[cfg.architecture] = extra
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------- counts of a bench run


def active_linear_params(layers: nn.Module) -> dict[str, int]:
    """The matmul weights one token goes through: every linear layer, and of a mixture-of-experts
    target its routers and experts_per_token / num_experts of the routed experts (MFU on the active
    parameters); `experts_total` is what the layers hold."""
    from dflash_ds.target_model.moe import experts_linear_params

    experts, used = experts_linear_params(layers)
    routers = sum(m.weight.numel() for m in layers.modules() if type(m).__name__.endswith("TopKRouter"))
    dense = count_linear_params(layers)
    return {"active": dense + used + routers, "dense": dense, "experts_active": used, "experts_total": experts,
            "routers": routers}


def target_flops_per_micro(setup: Setup, model) -> dict[str, int]:
    from dflash_ds.target_model.model import decoder_layers

    layers = decoder_layers(model)
    tc = setup.target_config
    types = getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers
    full = sum(1 for t in types[:len(layers)] if t == "full_attention")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    params = active_linear_params(layers)
    out = target_forward_flops(params["active"], full, tc.num_attention_heads, head_dim,
                               rows=setup.payload.rows, seq_len=setup.payload.seq_len)
    out["layers_run"] = len(layers)
    out["full_attention_layers_run"] = full
    out["linear_params_run"] = params["active"]
    if params["experts_total"]:
        out["params_run"] = params
    return out


def drafter_flops_of_steps(setup: Setup, steps: range) -> dict:
    """FLOPs of the given steps, with the attention pairs counted from each micro-batch's anchors.

    Anchors depend only on (seed, micro-batch id) and the loss mask / documents, which every
    synthetic row shares, so they are recomputed here exactly as make_blocks draws them. With
    --lengths the rows differ: the pairs are counted on the first rows only, so MFU is approximate.
    """
    from dflash_ds.objective.blocks import anchor_generator, sample_anchors

    a, r, plan = setup.args, setup.recipe, setup.plan
    rows = setup_rows(setup, setup.payload.rows)
    loss_mask = torch.from_numpy(rows["loss_mask"]).bool()
    doc_ids = torch.from_numpy(rows["doc_ids"])
    ctx_tokens = setup.payload.rows * a.seq_len
    block_tokens = setup.payload.rows * r.objective.num_anchors * r.drafter.block_size
    total, pairs, valid_blocks, n = None, 0, 0, 0
    for step in steps:
        for g in range(plan.grad_accum):
            m = plan.layout.micro_index(step, g, plan.grad_accum, 0)
            anchors, valid = sample_anchors(loss_mask, doc_ids, r.objective.num_anchors, anchor_generator(r.run.seed, m),
                                            prompt_end=r.objective.anchor_last_prompt_token)
            layers = setup.drafter_config.layer_attentions()
            counts = {att: visible_pairs(anchors, valid, doc_ids, r.drafter.block_size,
                                         attention=att) for att in set(layers)}
            p = sum(counts[att] for att in layers) / len(layers)  # mean over the layers
            f = drafter_step_flops(setup.drafter_config, ctx_tokens, block_tokens, p)
            total = f if total is None else {k: total[k] + f[k] for k in f}
            pairs += p
            valid_blocks += int(valid.sum())
            n += 1
    steps_n = max(len(steps), 1)
    per_step = {k: v / steps_n for k, v in total.items()}
    return {"per_step": per_step, "visible_pairs_per_micro": pairs / n, "valid_blocks_per_micro": valid_blocks / n,
            "ctx_tokens_per_micro": ctx_tokens, "block_tokens_per_micro": block_tokens}
