"""The DFlash drafter (docs/algorithm.md sections 1-2): tap ids, config from real transformers configs, export dict,
validation, parameter names, init, a float64 per-block reference forward, and checkpointing."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

from dflash_ds.config import DrafterConfig
from dflash_ds.network.attention import build_mask
from dflash_ds.network.drafter import DFlashDrafter, RMSNorm, rope_cos_sin
from dflash_ds.network.shape import DrafterShape
from dflash_ds.network.taps import build_target_layer_ids
from dflash_ds.resolve.drafter import drafter_shape
from tests.reference import chunked

D, VOCAB = 64, 300


def qwen3_target(**kw):
    args = dict(hidden_size=D, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    args.update(kw)
    return Qwen3Config(**args)


def tiny_drafter(num_layers=2, block_size=4, seed=0, dtype=torch.float64, **kw):
    shape = DrafterConfig(num_layers=num_layers, block_size=block_size, mask_token_id=VOCAB - 1,
                         target_layer_ids=[1, 4, 6], **kw)
    cfg = drafter_shape(qwen3_target(), shape)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).to(dtype)
    with torch.no_grad():  # norms start at exactly 1: perturb so that a wrong norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


# ---------------------------------------------------------------------------------- tap ids

def test_build_target_layer_ids():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 1) == [32]
    assert build_target_layer_ids(37, 1) == [18]
    # Python's round (half to even), as the engines compute it: 3.5 -> 4 but 8.5 -> 8.
    assert build_target_layer_ids(14, 5) == [1, 4, 6, 8, 11]


# ---------------------------------------------------------------------------------- config

def test_from_qwen3_config():
    cfg = drafter_shape(qwen3_target(), DrafterConfig(num_layers=5, block_size=16, mask_token_id=VOCAB - 1))
    # 8 layers, 5 taps -> ids round(1 + i*4/4) = 1..5
    assert cfg.target_layer_ids == (1, 2, 3, 4, 5)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) \
        == (D, 96, 4, 2, 16)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert (cfg.vocab_size, cfg.num_target_layers, cfg.max_position_embeddings) == (VOCAB, 8, 512)
    assert cfg.num_hidden_layers == 5 and cfg.block_size == 16 and cfg.tie_word_embeddings is False


def test_from_qwen3_5_text_and_multimodal_config():
    text = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=VOCAB,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    a = drafter_shape(text, DrafterConfig(num_layers=2, block_size=16, mask_token_id=VOCAB - 1))
    b = drafter_shape(Qwen3_5Config(text_config=text.to_dict()),
                                  DrafterConfig(num_layers=2, block_size=16, mask_token_id=VOCAB - 1))
    assert a == b
    # Unlisted size: the target's own head geometry; theta from rope_parameters, full rotary.
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.intermediate_size) == (4, 2, 32, 128)
    assert a.rope_theta == 1e7 and a.rope_scaling is None
    assert a.target_layer_ids == (1, 5) and a.num_target_layers == 8


def test_from_qwen3_6_27b_geometry():
    # The real Qwen3.5/3.6-27B text geometry (config only; no weights are built).
    text = Qwen3_5TextConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    cfg = drafter_shape(Qwen3_5Config(text_config=text.to_dict()),
                                    DrafterConfig(num_layers=5, block_size=16, mask_token_id=248070))
    geometry = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    assert geometry == (32, 8, 128, 17408)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61) and cfg.rope_theta == 1e7 and cfg.vocab_size == 248320
    per_layer = 5120 * 128 * (32 + 8 + 8 + 32) + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128
    total = 5 * per_layer + 5 * 5120 * 5120 + 2 * 5120
    assert abs(total / 1e9 - 1.73) < 0.01  # docs/algorithm.md section 1: ~1.73B trainable parameters
    over = drafter_shape(text, DrafterConfig(num_layers=5, block_size=16, mask_token_id=248070,
                                                        num_attention_heads=40, num_key_value_heads=4, head_dim=64,
                                                        intermediate_size=1000))
    geometry = (over.num_attention_heads, over.num_key_value_heads, over.head_dim, over.intermediate_size)
    assert geometry == (40, 4, 64, 1000)


def test_moe_config_drafter_mlp_defaults_to_three_widths():
    from transformers import Qwen3_5MoeTextConfig
    moe = Qwen3_5MoeTextConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, vocab_size=VOCAB)
    assert not hasattr(moe, "intermediate_size")  # no dense MLP to copy
    assert drafter_shape(moe, DrafterConfig(num_layers=2, block_size=16, mask_token_id=1)).intermediate_size == 192
    assert drafter_shape(moe, DrafterConfig(num_layers=2, block_size=16, mask_token_id=1,
                                                       intermediate_size=256)).intermediate_size == 256


def test_shape_from_the_recipe_section():
    section = DrafterConfig(num_layers=3, target_layer_ids=(1, 5), block_size=8, mask_token_id=9, head_dim=8,
                             num_attention_heads=6, num_key_value_heads=3, intermediate_size=40)
    cfg = drafter_shape(qwen3_target(), section)
    assert (cfg.num_hidden_layers, cfg.target_layer_ids, cfg.block_size, cfg.mask_token_id) == (3, (1, 5), 8, 9)
    assert (cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (40, 6, 3, 8)
    assert cfg.layer_types == ("full_attention",) * 3


def test_every_consumer_reads_the_one_shape():
    """Step settings, payload and export config are derived from the shape, not from the recipe."""
    import torch

    from dflash_ds.config import ObjectiveConfig, Recipe
    from dflash_ds.objective.drafter_loss import StepSettings
    from dflash_ds.resolve.run import payload_layout

    shape = drafter_shape(qwen3_target(), DrafterConfig(num_layers=2, block_size=8, mask_token_id=9,
                                                                    target_layer_ids=(1, 2, 3)))
    settings = StepSettings.of(shape, ObjectiveConfig(), 0, torch.device("cpu"))
    assert (settings.block_size, settings.mask_token_id, settings.shape) == (8, 9, shape)
    payload = payload_layout(Recipe(), shape, torch.float32)
    assert (payload.num_taps, payload.hidden) == (3, shape.hidden_size)
    assert DrafterShape.from_hf_config(shape.to_hf_config()) == shape
    assert shape.mismatches(shape) == []
    other = shape.replace(block_size=16, layer_types=())
    assert other.mismatches(shape) == [("block_size", 16, 8)]


def test_unknown_layer_types_are_refused():
    shape = drafter_shape(qwen3_target(), DrafterConfig(num_layers=2, block_size=8, mask_token_id=9))
    with pytest.raises(ValueError, match="each entry must be one of"):
        shape.replace(layer_types=("full_attention", "chunked_attention"))
    with pytest.raises(ValueError, match="sliding_window is not set"):
        shape.replace(layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(ValueError, match="2 drafter layers"):
        shape.replace(layer_types=("full_attention",))


def test_from_llama_config():
    tgt = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16384, rope_theta=5e5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = drafter_shape(tgt, DrafterConfig(num_layers=1, block_size=8, mask_token_id=0))
    assert cfg.head_dim == 8 and cfg.num_attention_heads == 8 and cfg.num_key_value_heads == 2
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None and cfg.target_layer_ids == (3,)


def test_hf_config_exact_and_round_trip():
    cfg = drafter_shape(qwen3_target(), DrafterConfig(num_layers=2, block_size=16, mask_token_id=7,
                                                                 target_layer_ids=[1, 4, 6]))
    hf = cfg.to_hf_config()
    expected = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 4, 6]},
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "rope_scaling": None, "max_position_embeddings": 512, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "attention_bias": False, "layer_types": ["full_attention", "full_attention"], "use_sliding_window": False,
        "sliding_window": None,
    }
    for key, value in expected.items():
        assert hf[key] == value, key
    assert DrafterShape.from_hf_config(hf) == cfg
    # What an engine does with it: transformers reads it back as the same qwen3 geometry.
    q = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    geometry = (q.hidden_size, q.head_dim, q.num_attention_heads, q.num_key_value_heads, q.num_hidden_layers)
    assert geometry == (64, 16, 4, 2, 2)
    assert q.rope_parameters["rope_theta"] == 1e6 and q.rope_parameters["rope_type"] == "default"
    # A config re-saved by transformers 5 keeps theta only in rope_parameters.
    resaved = dict(hf, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del resaved["rope_theta"]
    assert DrafterShape.from_hf_config(resaved) == cfg


@pytest.mark.parametrize("kwargs, setting", [
    (dict(mask_token_id=VOCAB), "drafter.mask_token_id"),
    (dict(mask_token_id=-1), "drafter.mask_token_id"),
    (dict(target_layer_ids=[1, 8]), "drafter.target_layer_ids"),
    (dict(target_layer_ids=[-1, 3]), "drafter.target_layer_ids"),
    (dict(target_layer_ids=[]), "drafter.target_layer_ids"),
    (dict(block_size=1), "drafter.block_size"),
    (dict(num_layers=0), "drafter.num_layers"),
    (dict(num_attention_heads=3), "drafter.num_attention_heads"),
])
def test_config_errors_name_the_setting(kwargs, setting):
    args = dict(num_layers=2, block_size=16, mask_token_id=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        drafter_shape(qwen3_target(), DrafterConfig(**args))


def test_rope_scaling_other_than_default_is_refused():
    cfg = drafter_shape(qwen3_target(), DrafterConfig(num_layers=1, block_size=4, mask_token_id=5))
    hf = cfg.to_hf_config()
    with pytest.raises(ValueError, match="rope_scaling"):
        DrafterShape.from_hf_config(dict(hf, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    ok = DrafterShape.from_hf_config(dict(hf, rope_scaling={"rope_type": "default"}))
    assert ok.rope_scaling is None


# ---------------------------------------------------------------------------------- module

def test_state_dict_names_shapes_and_init():
    cfg = tiny_drafter().config
    torch.manual_seed(3)
    m1 = DFlashDrafter(cfg)
    torch.manual_seed(3)
    m2 = DFlashDrafter(cfg)
    torch.manual_seed(4)
    m3 = DFlashDrafter(cfg)
    sd = m1.state_dict()
    h, hk, hd, inter = 4, 2, 16, 96
    expected = {"fc.weight": (D, 3 * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(2):
        expected.update({
            f"layers.{i}.self_attn.q_proj.weight": (h * hd, D), f"layers.{i}.self_attn.k_proj.weight": (hk * hd, D),
            f"layers.{i}.self_attn.v_proj.weight": (hk * hd, D), f"layers.{i}.self_attn.o_proj.weight": (D, h * hd),
            f"layers.{i}.self_attn.q_norm.weight": (hd,), f"layers.{i}.self_attn.k_norm.weight": (hd,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, D), f"layers.{i}.mlp.up_proj.weight": (inter, D),
            f"layers.{i}.mlp.down_proj.weight": (D, inter), f"layers.{i}.input_layernorm.weight": (D,),
            f"layers.{i}.post_attention_layernorm.weight": (D,),
        })
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert not list(m1.buffers())
    for name, p in sd.items():
        assert torch.equal(p, m2.state_dict()[name])
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert not torch.equal(p, m3.state_dict()[name])
            assert abs(p.mean().item()) < 0.01 and abs(p.std().item() - 0.02) < 0.004, name


def test_rmsnorm_and_rope_match_transformers_qwen3():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16) * 3
    ours, theirs = RMSNorm(16, 1e-6), Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        w = torch.randn(16)
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    assert torch.equal(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x))

    positions = torch.tensor([[0, 1, 7, 300, 3071], [5, 5, 6, 9000, 2]])
    cfg = Qwen3Config(head_dim=16, num_attention_heads=2, hidden_size=32, rope_theta=1e7)
    cos_ref, sin_ref = Qwen3RotaryEmbedding(cfg)(x.float(), positions)
    cos, sin = rope_cos_sin(positions, 16, 1e7, torch.float32)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-6)
    q = torch.randn(2, 3, 5, 16)
    from dflash_ds.network.drafter import _apply_rope
    q_ref, _ = apply_rotary_pos_emb(q, q, cos_ref, sin_ref)
    torch.testing.assert_close(_apply_rope(q, cos, sin), q_ref, rtol=0, atol=1e-5)


# ------------------------------------------------------------- float64 per-block reference

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    # x [L, heads, d]; rotate pairs (i, i + d/2) by pos * theta^(-2i/d)
    d = x.shape[-1]
    freq = theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.double()[:, None, None] * freq
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def reference_forward(model, block_embeds, ctx, block_pos, ctx_pos, anchors, valid, doc_ids):
    """Each block on its own: keys = the context it may see (listed from the definition) + its block."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    B, h, hk, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, n = anchors.shape
    out = torch.zeros(b, n * B, cfg.hidden_size, dtype=torch.float64)
    for r in range(b):
        for blk in range(n):
            a = int(anchors[r, blk])
            sl = slice(blk * B, (blk + 1) * B)
            seen = [j for j in range(ctx.shape[1]) if valid[r, blk] and j < a and doc_ids[r, j] == doc_ids[r, a]]
            c, x = ctx[r, seen].double(), block_embeds[r, sl].double()
            pos_q, pos_k = block_pos[r, sl], torch.cat([ctx_pos[r, seen], block_pos[r, sl]])
            for i in range(cfg.num_hidden_layers):
                def p(name, i=i):
                    return sd[f"layers.{i}.{name}.weight"]
                xn = _rms(x, p("input_layernorm"))
                q = _rms((xn @ p("self_attn.q_proj").T).view(B, h, d), p("self_attn.q_norm"))
                q = _rope(q, pos_q, cfg.rope_theta)
                kin = torch.cat([c, xn])
                k = _rms((kin @ p("self_attn.k_proj").T).view(-1, hk, d), p("self_attn.k_norm"))
                k = _rope(k, pos_k, cfg.rope_theta)
                v = (kin @ p("self_attn.v_proj").T).view(-1, hk, d)
                heads = []
                for head in range(h):
                    g = head // (h // hk)
                    att = torch.softmax(q[:, head] @ k[:, g].T / math.sqrt(d), dim=-1)
                    heads.append(att @ v[:, g])
                x = x + torch.cat(heads, dim=-1) @ p("self_attn.o_proj").T
                xn = _rms(x, p("post_attention_layernorm"))
                x = x + (F.silu(xn @ p("mlp.gate_proj").T) * (xn @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
            out[r, sl] = _rms(x, sd["norm.weight"])
    return out


def packed_batch(model, seed=0):
    """Two rows, packed documents and padding, overlapping and invalid blocks."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    S, B = 30, cfg.block_size
    doc_ids = torch.tensor([[0] * 12 + [1] * 14 + [-1] * 4, [0] * 30], dtype=torch.int32)
    ctx_pos = torch.stack([torch.cat([torch.arange(12), torch.arange(14), torch.zeros(4, dtype=torch.long)]),
                           torch.arange(30)])
    anchors = torch.tensor([[2, 9, 15, 16, 0], [0, 5, 20, 27, 0]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, True, True, False]])
    block_pos = (torch.gather(ctx_pos, 1, anchors)[..., None] + torch.arange(B)).view(2, -1)
    taps = torch.randn(2, S, cfg.num_taps * cfg.hidden_size, generator=g, dtype=torch.float64)
    block_embeds = torch.randn(2, anchors.shape[1] * B, cfg.hidden_size, generator=g, dtype=torch.float64)
    return dict(taps=taps, block_embeds=block_embeds, block_pos=block_pos, ctx_pos=ctx_pos, anchors=anchors,
                valid=valid, doc_ids=doc_ids)


def test_forward_matches_float64_per_block_reference():
    model = tiny_drafter(num_layers=2, block_size=4)
    x = packed_batch(model)
    mask = build_mask(x["anchors"], x["valid"], x["doc_ids"], 4, kind="dense")
    with torch.no_grad():
        ctx = model.fuse(x["taps"])
        torch.testing.assert_close(ctx, _rms(x["taps"] @ model.fc.weight.T, model.hidden_norm.weight))
        out = model(x["block_embeds"], ctx, x["block_pos"], x["ctx_pos"], mask=mask)
    ref = reference_forward(model, x["block_embeds"], ctx, x["block_pos"], x["ctx_pos"], x["anchors"], x["valid"],
                            x["doc_ids"])
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_bf16_forward_close_to_float64():
    model = tiny_drafter(num_layers=2, block_size=4)
    x = packed_batch(model)
    mask = build_mask(x["anchors"], x["valid"], x["doc_ids"], 4, kind="dense")
    with torch.no_grad():
        ref = model(x["block_embeds"], model.fuse(x["taps"]), x["block_pos"], x["ctx_pos"], mask=mask)
        m16 = model.to(torch.bfloat16)
        out = m16(x["block_embeds"].bfloat16(), m16.fuse(x["taps"].bfloat16()), x["block_pos"], x["ctx_pos"], mask=mask)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 0.1 * ref.abs().max()


# ---------------------------------------------------------------------------- checkpointing

def _loss_and_grads(model, x, lm_head):
    model.zero_grad(set_to_none=True)
    mask = build_mask(x["anchors"], x["valid"], x["doc_ids"], model.config.block_size, kind="dense")
    hidden = model(x["block_embeds"], model.fuse(x["taps"]), x["block_pos"], x["ctx_pos"], mask=mask)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, hidden.shape[:2], generator=g)
    weights = torch.rand(hidden.shape[:2], generator=g, dtype=torch.float64)
    out = chunked(hidden.flatten(0, 1), lm_head, labels.flatten(), weights.flatten(), weights.sum(), 3)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _counting(fn, calls):
    def wrapped(function, *args):
        calls.append(len(args))
        return fn(function, *args)
    return wrapped


@pytest.mark.parametrize("runtime", ["torch", "deepspeed"])
def test_checkpointing_gives_the_same_gradients(runtime):
    if runtime == "torch":
        def ckpt(function, *args):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    else:
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint as ckpt
    model = tiny_drafter(num_layers=3, block_size=4)
    x = packed_batch(model)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.1
    loss_ref, grads_ref = _loss_and_grads(model, x, lm_head)
    for name, g in grads_ref.items():
        assert g.abs().max() > 0, f"{name} gets no gradient"
    for layers in (3, 1):
        calls = []
        model.checkpoint_fn, model.checkpoint_layers = _counting(ckpt, calls), layers
        loss, grads = _loss_and_grads(model, x, lm_head)
        assert len(calls) == layers  # the wrapper really ran, once per wrapped layer
        torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12, msg=name)
    model.checkpoint_fn = None
