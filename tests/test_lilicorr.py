"""LiLiCorr's package (dflash_ds/architectures/lilicorr/): its recipe sections and their checks, the head's
tensors (the inventory equals the state dict, every parameter a multiple of 8 elements, padded storage
that loads and saves under the engines' names), Model-Optimizer's initialisation, the head's scores, and
an export held against the readers' rules (tests/fixtures/lilicorr_reader_rules.json) with a bit-exact
round trip."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from dflash_ds.architectures import lilicorr
from dflash_ds.config import DrafterConfig
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import drafter_shape

RULES = json.loads((Path(__file__).parent / "fixtures" / "lilicorr_reader_rules.json").read_text())
D, VOCAB, B = 64, 128, 4
TINY = {"candidate_topk": 4, "head_hidden_size": 16, "factor_dim": 16, "num_layers": 2, "num_heads": 4}


@pytest.fixture
def pkg():
    """The lilicorr package (registered by architectures/__init__.py's list)."""
    return lilicorr


def target_config(**kw):
    return Qwen3Config(hidden_size=D, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)


def make_shape(pkg, *, target=None, **fields):
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                            architecture="lilicorr", sections={"lilicorr": pkg.LiLiCorrFields(**{**TINY, **fields})})
    return drafter_shape(target or target_config(), section)


def make_drafter(pkg, seed=0, **fields):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(make_shape(pkg, **fields))
    with torch.no_grad():  # every tensor distinct
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


CONV = {"block_conv_kernel_size": 2, "block_conv_group_size": 16}
FORMS = (("plain", {}), ("conv", CONV), ("full width", {"head_hidden_size": 0, "num_heads": 8}))


@pytest.mark.parametrize("form", [f for f, _ in FORMS])
def test_the_inventory_is_the_state_dict_and_every_parameter_is_aligned(pkg, form):
    fields = dict(FORMS)[form]
    drafter = make_drafter(pkg, **fields)
    shape = drafter.config
    got = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
    assert got == {n: t.shape for n, t in shape.tensors().items()}
    assert ("lilicorr.token_proj.weight" in got) == (form != "full width")
    assert any(".attention_conv." in n for n in got) == (form == "conv")
    assert all(p.numel() % 8 == 0 for p in drafter.parameters())
    # The padded tensors are stored whole: what the state dict holds is what the module computes with.
    head = drafter.lilicorr
    assert torch.equal(drafter.state_dict()["lilicorr.relative_slot_bias"], head.padded("relative_slot_bias"))
    assert got["lilicorr.relative_slot_bias"] == (shape.arch_fields.num_heads, 2 * B - 1) and got["lilicorr.feature_norm.weight"] == (5,)


def test_padded_tensors_load_under_their_names_and_a_wrong_shape_or_a_missing_one_is_named(pkg):
    a, b = make_drafter(pkg, seed=1), make_drafter(pkg, seed=2)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.count_nonzero(b.lilicorr.same_slot_bias_slots[4:]) == 0  # the padding stays zero
    state = a.state_dict()
    state["lilicorr.same_slot_bias"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r"size mismatch for lilicorr\.same_slot_bias"):
        b.load_state_dict(state)
    state.pop("lilicorr.same_slot_bias")
    result = b.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lilicorr.same_slot_bias"] and not result.unexpected_keys


def test_the_head_starts_where_model_optimizers_does(pkg):
    torch.manual_seed(0)
    head = DFlashDrafter(make_shape(pkg, head_hidden_size=128, factor_dim=128)).lilicorr
    for name in ("out_head", "in_head", "anchor_out_head"):
        assert getattr(head, name).weight.std().item() == pytest.approx(0.02, rel=0.05)
    for name in ("pass_hidden_proj", "context_proj", "factor_input_proj", "token_proj"):
        assert getattr(head, name).weight.std().item() == pytest.approx(0.01, rel=0.05)
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 15 and all(torch.count_nonzero(m.bias) == 0 for m in linears)
    bound = math.sqrt(6 / (128 + 3 * 128))  # torch's MultiheadAttention: Xavier-uniform packed q, k, v
    w = head.layers[0].attn.in_proj_weight
    assert w.abs().max().item() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    for t in (head.slot_embedding, head.rank_embedding, head.padded("relative_slot_bias"), head.padded("same_slot_bias"),
              head.layers[0].attn.in_proj_bias, head.feature_norm.padded("bias")):
        assert torch.count_nonzero(t) == 0
    assert torch.equal(head.feature_norm.padded("weight"), torch.ones(5))
    assert all(torch.equal(n.weight, torch.ones(128)) for n in (head.output_norm, head.anchor_norm))


def test_the_scores_follow_the_definition(pkg):
    """The attention bias by slot distance, the anchor row zeroed when it does not exist, and the
    log-factors logit_scale times cosines (so within +-logit_scale), computed by hand here."""
    from dflash_ds.architectures.lilicorr.head import candidate_features

    head = make_drafter(pkg, seed=3).lilicorr.double()
    k, s, nh = 4, B - 1, 4
    bias = head.attention_bias()
    rel, same = head.padded("relative_slot_bias"), head.padded("same_slot_bias")
    for p in range(k * s):
        for q in range(k * s):
            want = rel[:, p // k - q // k + B - 1] + same * (p // k == q // k)
            assert torch.equal(bias[:, p, q], want)
    assert bias.shape == (nh, k * s, k * s)
    torch.manual_seed(4)
    n = 3
    emb, hidden, context = torch.randn(n, s, k, D).double(), torch.randn(n, s, D).double(), torch.randn(n, D).double()
    lp = torch.randn(n, s, VOCAB).double().log_softmax(-1).topk(k, dim=-1).values
    feats = candidate_features(lp)
    assert torch.equal(feats[..., 0], lp) and torch.equal(feats[..., 1], lp.exp())
    assert torch.equal(feats[0, 0, :, 3], torch.tensor([0, 1 / 3, 2 / 3, 1.0], dtype=torch.float64)) and feats[..., 4].sum() == n * s
    valid = torch.tensor([True, False, True])
    got = head(emb, lp, hidden, context, valid=valid)
    assert got.start.shape == (n, k) and got.pair.shape == (n, s - 1, k, k) and got.start.dtype == torch.float64
    assert got.start.abs().max() <= 8.0 and got.pair.abs().max() <= 8.0
    # An anchor that does not exist scores as a zero context row would, whatever the row holds.
    zeroed = head(emb, lp, hidden, context * torch.tensor([1.0, 0.0, 1.0]).double()[:, None], valid=valid)
    assert torch.equal(got.start, zeroed.start)
    states = head.lattice(emb, lp, hidden)
    alpha = head.anchor_norm(head.context_proj(context) * valid.double()[:, None])
    f = torch.nn.functional.silu(head.factor_input_proj(torch.cat([states, alpha[:, None].expand_as(states),
                                                                    states * alpha[:, None]], -1)))
    out = head.out_head(f).view(n, s, k, -1)
    into = head.in_head(f).view(n, s, k, -1)
    ao = head.anchor_out_head(alpha)
    cos = torch.nn.functional.cosine_similarity
    assert torch.allclose(got.start, 8.0 * cos(ao[:, None], into[:, 0], dim=-1), atol=1e-12)
    want = 8.0 * cos(out[:, 0, :, None], into[:, 1, None, :], dim=-1)
    assert torch.allclose(got.pair[:, 0], want, atol=1e-12)


def rule_shapes(rules: dict, symbols: dict, layers: dict) -> dict[str, tuple[int, ...]]:
    def ev(expr):
        return int(eval(expr, {"__builtins__": {}}, dict(symbols)))  # formulas of the rules file only

    out = {}
    for name, rule in rules.items():
        if "only_if" in rule and not eval(rule["only_if"], {"__builtins__": {}}, dict(symbols)):
            continue
        key = "{l}" if "{l}" in name else "{i}" if "{i}" in name else None
        for index in (range(layers[key]) if key else [None]):
            out[name.replace(key, str(index)) if key else name] = tuple(ev(e) for e in rule["shape"])
    return out


def check_fields(config: dict, rules: dict, width: int) -> None:
    types = {"int": int, "list": list, "float": (int, float)}
    for key, rule in rules.items():
        assert key in config, key
        value = config[key]
        if "equals" in rule:
            assert value == rule["equals"], key
        if "type" in rule:
            assert isinstance(value, types[rule["type"]]) and not isinstance(value, bool), key
        if "power_of_two_max" in rule:
            assert 1 <= value <= rule["power_of_two_max"] and value & (value - 1) == 0, key
        if "min" in rule:
            assert value >= rule["min"], key
        if rule.get("positive"):
            assert value > 0 and math.isfinite(value), key
        if "divides" in rule:
            assert width % value == 0, key


@pytest.mark.parametrize("form", [f for f, _ in FORMS])
def test_the_export_follows_the_readers_rules_and_loads_back_bit_exact(pkg, tmp_path, form):
    fields = dict(FORMS)[form]
    drafter = make_drafter(pkg, seed=5, **fields)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == RULES["architectures"] and config["model_type"] == "qwen3"
    dc = config["dflash_config"]
    width = dc["lilicorr_hidden_size"] or D
    check_fields(dc, RULES["dflash_config"], width)
    conv = [k for k in RULES["conv_keys"]["keys"] if k in dc]
    assert conv == (RULES["conv_keys"]["keys"] if form == "conv" else [])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        stored = {n: f.get_tensor(n) for n in f.keys()}
    symbols = {"H": D, "h": width, "k": dc["lilicorr_candidate_topk"], "B": dc["block_size"], "S": dc["block_size"] - 1,
               "nh": dc["lilicorr_num_heads"], "m": int(width * dc["lilicorr_mlp_ratio"]),
               "F": dc["lilicorr_factor_dim"], "T": dc.get("conv_kernel_size", 0), "G": dc.get("conv_group_size", 1)}
    layers = {"{l}": dc["lilicorr_num_layers"], "{i}": config["num_hidden_layers"]}
    head = {n: s for n, s in got.items() if n.startswith("lilicorr.")}
    assert head == rule_shapes(RULES["tensors"], symbols, layers)
    convs = {n: s for n, s in got.items() if "_conv." in n}
    assert convs == (rule_shapes(RULES["conv_tensors"], symbols, layers) if form == "conv" else {})
    assert not set(RULES["absent_tensors"]) & set(got)
    assert not any(n.startswith(p) for n in got for p in RULES["absent_prefixes"])
    backbone = {n: s for n, s in got.items() if n not in head and n not in convs}
    v1 = DrafterShape.from_hf_config(config).replace(architecture="dflash", arch_fields=None)
    assert backbone == {n: t.shape for n, t in v1.tensors().items()}  # the DFlash backbone, unchanged
    # None of Model-Optimizer's nn.Sequential indices, which neither reader maps onto its named modules.
    assert not [n for n in head for old in RULES["reader_names"]["model_optimizer_indices"] if old in n]
    again = load_drafter(out)
    assert again.config == drafter.config
    mine = drafter.state_dict()
    assert set(stored) == set(mine) and all(torch.equal(stored[n], mine[n]) for n in mine)
    assert all(torch.equal(again.state_dict()[n], mine[n]) for n in mine)
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in card and f"--speculative-num-draft-tokens {B}" in card
    assert f'"num_speculative_tokens": {B - 1}' in card and "llama-server" not in card


def test_the_recipe_sections_keep_model_optimizers_defaults(pkg):
    f, o = pkg.LiLiCorrFields(), pkg.LiLiCorrKeys()
    assert (f.candidate_topk, f.head_hidden_size, f.factor_dim, f.num_layers, f.num_heads) == (8, 1024, 1024, 2, 8)
    assert (f.mlp_ratio, f.score_scale, f.vector_eps, f.conv) == (2.0, 8.0, 1e-4, False)
    assert (o.w_ce, o.w_margin, o.w_pen, o.margin, o.soft_value) == (0.25, 0.0, 0.25, 2.0, True)
    o.check()
    pkg.LiLiCorrKeys(w_ce=0.125, w_margin=0.125).check()  # Model-Optimizer's margin variant
    # The drafter section's own keys (num_layers: the backbone's 2 here) are not read as LiLiCorr's.
    shape = drafter_shape(target_config(), DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                                         architecture="lilicorr"))
    assert shape.arch_fields == pkg.LiLiCorrFields()


@pytest.mark.parametrize("fields, message", [
    ({"candidate_topk": 6}, r"candidate_topk = 6 must be a power of two <= 16"),
    ({"candidate_topk": 32}, r"candidate_topk = 32 must be a power of two <= 16"),
    ({"num_heads": 3}, r"num_heads = 3 must divide the head's width 16"),
    ({"head_hidden_size": 12, "num_heads": 4}, r"head_hidden_size = 12 must be a multiple of 8"),
    ({"factor_dim": 0}, r"factor_dim = 0 must be >= 1"),
    ({"mlp_ratio": 0.3}, r"mlp_ratio = 0.3 must be > 0"),
    ({"score_scale": 0.0}, r"score_scale = 0.0 must be finite and > 0"),
    ({"vector_eps": 0.5}, r"vector_eps = 0.5 must be in \(0, 0.5\)"),
    ({"block_conv_kernel_size": 2}, r"block_conv_kernel_size = 2 and block_conv_group_size = 0: set both"),
    ({"block_conv_kernel_size": 5, "block_conv_group_size": 16}, r"block_conv_kernel_size = 5 must not exceed"),
    ({"block_conv_kernel_size": 2, "block_conv_group_size": 24}, r"block_conv_group_size = 24 must divide"),
])
def test_each_mistaken_shape_field_stops_naming_its_key(pkg, fields, message):
    with pytest.raises(ValueError, match=r"^drafter\.lilicorr\." + message):
        make_shape(pkg, **fields)


def test_a_target_with_a_logit_transform_and_mistaken_weights_are_refused(pkg):
    with pytest.raises(ValueError, match="raw lm_head logits"):
        make_shape(pkg, target=target_config(final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="all 0: the reranker would never be trained"):
        pkg.LiLiCorrKeys(w_ce=0.0, w_pen=0.0).check()
    with pytest.raises(ValueError, match=r"^w_margin = 0.125 needs margin > 0"):
        pkg.LiLiCorrKeys(w_margin=0.125, margin=0.0).check()
    with pytest.raises(ValueError, match=r"^w_pen must be >= 0"):
        pkg.LiLiCorrKeys(w_pen=-1.0).check()


def test_an_export_routed_elsewhere_is_refused(pkg):
    # A missing key is the conformance suite's (tests/test_conformance.py).
    config = make_shape(pkg).to_hf_config()
    off = dict(config, dflash_config=dict(config["dflash_config"], lilicorr_enabled=False))
    with pytest.raises(ValueError, match="lilicorr_enabled true"):
        DrafterShape.from_hf_config(off)


def test_a_bf16_head_scores_in_fp32(pkg):
    """The cosines are formed in the head's dtype and scaled in fp32, as the engines do (the walk's
    argmax reads fp32 log-factors)."""
    head = make_drafter(pkg, seed=6).lilicorr.bfloat16()
    k, s, n = 4, B - 1, 2
    lp = torch.randn(n, s, VOCAB).log_softmax(-1).topk(k, dim=-1).values
    got = head(torch.randn(n, s, k, D), lp, torch.randn(n, s, D), torch.randn(n, D), valid=torch.ones(n))
    assert got.start.dtype == got.pair.dtype == torch.float32 and torch.isfinite(got.pair).all()


@pytest.mark.parametrize("geometry", ["qwen3.6-27b", "qwen3-8b", "qwen3.6-35b-a3b"])
@pytest.mark.parametrize("fields", [{}, {"block_conv_kernel_size": 2, "block_conv_group_size": 16},
                                    {"head_hidden_size": 0}], ids=["base", "conv", "full width"])
def test_the_head_keeps_zero2_gradients_aligned_at_real_geometries(pkg, geometry, fields):
    """Model-Optimizer's published shape (k 8, width 1024, 2 layers of 8 heads, factors 1024) at block 16 on the
    real targets: every parameter a multiple of 8 elements (tests/test_variant_seam.py's rule)."""
    from dflash_ds.target_model.presets import get_geometry, target_config

    section = DrafterConfig(num_layers=5, block_size=16, mask_token_id=get_geometry(geometry).mask_token_id,
                            architecture="lilicorr", sections={"lilicorr": pkg.LiLiCorrFields(**fields)})
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_shape(target_config(geometry), section))
    assert not [(n, p.numel()) for n, p in drafter.named_parameters() if p.numel() % 8]
    assert {n: tuple(t.shape) for n, t in drafter.state_dict().items()} == \
        {n: t.shape for n, t in drafter.config.tensors().items()}


def test_the_convolution_at_init_leaves_the_backbone_unchanged(pkg):
    """The block convolution starts as the identity and every head draws on its own stream: the backbone of
    a fresh LiLiCorr+conv drafter computes what a fresh LiLiCorr drafter's does, from the same seed."""
    from dflash_ds.network.attention import build_mask

    outs = []
    for fields in ({}, CONV):
        torch.manual_seed(0)
        drafter = DFlashDrafter(make_shape(pkg, **fields)).double()
        g = torch.Generator().manual_seed(1)
        ctx = torch.randn(1, 12, D, generator=g, dtype=torch.float64)
        block = torch.randn(1, 2 * B, D, generator=g, dtype=torch.float64)
        anchors = torch.tensor([[4, 8]])
        positions = (anchors[..., None] + torch.arange(B)).reshape(1, -1)
        mask = build_mask(anchors, torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 12, dtype=torch.int32), B,
                          kind="dense")
        outs.append(drafter(block, ctx, positions, torch.arange(12)[None], mask=mask))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("overrides, named", [
    (["objective.lilicorr.w_ce=0", "objective.lilicorr.w_pen=0"], "objective.lilicorr.w_ce"),
    (["objective.lilicorr.w_margin=0.125", "objective.lilicorr.margin=0"], "objective.lilicorr.w_margin"),
    (["drafter.lilicorr.candidate_topk=6"], "candidate_topk"),
])
def test_the_tiny_recipe_refuses_mistaken_settings_before_launch_naming_them(overrides, named):
    from dflash_ds.config import load_recipe
    from dflash_ds.config.errors import RecipeError
    from dflash_ds.resolve.run import resolve_run

    with pytest.raises(RecipeError) as err:
        resolve_run(load_recipe("recipes/tiny-lilicorr.yaml", overrides), 2)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_the_tiny_recipe_resolves_with_the_target_states_sent_and_the_margin_variant():
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.run import resolve_run, wants_target_logits

    spec = resolve_run(load_recipe("recipes/tiny-lilicorr.yaml", ["objective.lilicorr.w_ce=0.125",
                                                                 "objective.lilicorr.w_margin=0.125"]), 2)
    assert spec.drafter.architecture == "lilicorr" and wants_target_logits(spec.recipe, spec.drafter)
    assert spec.settings.keys.lattice() == lilicorr.terms.Weights(0.125, 0.125, 0.25, 2.0, True)


def test_drafter_compile_takes_the_whole_head_as_one_graph_equal_to_eager(pkg):
    """`drafter.compile` compiles the layers and LiLiCorr's head (its `compile_units`), a DFlash drafter's
    layers only; the head traces as one graph (fullgraph: no break into eager pieces) whose factors and
    gradients equal the eager head's."""
    from dflash_ds.architectures import dflash  # noqa: F401  (registered)
    from dflash_ds.config import DrafterConfig as Section

    drafter = make_drafter(pkg, seed=7)
    assert drafter.compile_units() == [*drafter.layers, drafter.lilicorr]
    v1 = DFlashDrafter(drafter_shape(target_config(), Section(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                                               target_layer_ids=[1, 3, 5])))
    assert v1.compile_units() == list(v1.layers)
    head, k, s, n = drafter.lilicorr, 4, B - 1, 3
    g = torch.Generator().manual_seed(8)
    lp = torch.randn(n, s, VOCAB, generator=g).log_softmax(-1).topk(k, dim=-1).values
    inputs = (torch.randn(n, s, k, D, generator=g), lp, torch.randn(n, s, D, generator=g), torch.randn(n, D, generator=g))
    valid = torch.tensor([True, False, True])
    torch._dynamo.reset()
    traced = torch.compile(head, dynamic=False, fullgraph=True, backend="eager")
    results = []
    for fn in (head, traced):
        head.zero_grad()
        got = fn(*inputs, valid=valid)
        (got.start.square().sum() + got.pair.sin().sum()).backward()
        results.append((got.start.detach(), got.pair.detach(), [p.grad.clone() for p in head.parameters()]))
    (start, pair, grads), (c_start, c_pair, c_grads) = results
    torch.testing.assert_close(c_start, start)
    torch.testing.assert_close(c_pair, pair)
    assert len(grads) == len(c_grads) and all(torch.isfinite(x).all() for x in grads)
    for a, b in zip(c_grads, grads):
        torch.testing.assert_close(a, b)


def test_bf16_head_gradients_stay_near_float32_for_every_parameter():
    """The head in bf16 (as it trains) against the same head in float32, eager on the CPU: every parameter's
    gradient within 5%. The five-feature norm's weight and bias and the relative slot bias each sum their
    gradient over every candidate or lattice pair of the block; computed in bf16 they came out 4-11% off
    at this shape (the norm's 24% at 256 blocks), so the head computes the norm and gathers the bias in
    float32 (head.py)."""
    from dflash_ds.architectures.lilicorr.head import Geometry

    from .lilicorr_precision import head_errors

    geometry = Geometry(hidden=128, width=256, factor_dim=256, num_layers=2, num_heads=4, mlp_width=512, slots=15,
                        top_k=8, eps=1e-6, logit_scale=8.0, vector_eps=1e-4)
    found = head_errors(geometry, n=128, device="cpu", timer=lambda fn: (0.0, fn()), compiled=False)
    assert found["pair_rms"] > 0.1, found
    assert found["eager_start_rel"] < 0.02 and found["eager_pair_rel"] < 0.02, found  # bf16 rounding, no more
    worst = found["eager_param_grad_worst"]
    assert found["eager_param_grad_max_rel"] < 0.05, (worst, found["eager_param_grad_rel"])
    norm = {p: e for p, e in found["eager_param_grad_rel"].items() if p.startswith("feature_norm")}
    assert len(norm) == 2 and max(norm.values()) < 0.03, norm
