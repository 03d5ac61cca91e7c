"""Mixture-of-experts targets: the geometries, the project's experts forward against transformers' eager
loop (float64), FP8 experts against a per-token reference, packed rows, the drafter derived from the
target, and the pre-launch checks."""

import pytest
import torch

from dflash_ds.target_model import moe
from dflash_ds.target_model.model import decoder_layers, target_geometry
from dflash_ds.target_model.presets import target_config

from .test_packed_target import packed_rows, taps_alone, taps_packed

GEOMETRIES = ["tiny-moe", "tiny-qwen3-moe"]


def tiny_moe(name="tiny-moe", dtype=torch.float64, impl="eager", seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = target_config(name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval().requires_grad_(False)
    # Random routers at init are near zero (every expert equally likely); spread them so routing matters.
    for _, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter"):
            mod.weight.data.normal_(0, 1.0)
    moe.use_experts(model, impl)
    return model


def routed_inputs(experts_module, tokens=37, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    d, e = experts_module.gate_up_proj.shape[2], experts_module.num_experts
    k = experts_module.config.num_experts_per_tok
    hidden = torch.randn(tokens, d, generator=g, dtype=dtype)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=dtype)
    return hidden, index, weights


def eager(module, *args):
    module.config._experts_implementation_internal = "eager"
    try:
        return module(*args)
    finally:
        module.config._experts_implementation_internal = moe.OWN


# ---------------------------------------------------------------------------- the geometries


@pytest.mark.parametrize("name, total, active", [("qwen3.6-35b-a3b", 35, 3), ("qwen3.5-122b-a10b", 122, 10),
                                                 ("qwen3.5-397b-a17b", 397, 17), ("qwen3-30b-a3b", 30.5, 3.3)])
def test_geometries_have_their_published_sizes(name, total, active):
    from transformers import AutoModelForCausalLM

    cfg = target_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    experts, used = moe.experts_linear_params(model)
    # The names round the text tower's count (vision tower and MTP layer are not in it: <= 2% of it).
    assert 0.97 * total < params / 1e9 < 1.0 * total + 0.5, params
    assert 0.8 * active < (params - experts + used) / 1e9 < 1.2 * active
    g = target_geometry(cfg)
    assert g.moe and (g.num_experts, g.experts_per_token) == (cfg.num_experts, cfg.num_experts_per_tok)
    # The planner's rough count (resolve/moe.py) is within 3% of the real one.
    from dflash_ds.resolve.moe import target_params

    assert abs(target_params(g, g.num_layers) / params - 1) < 0.03


def test_35b_a3b_is_qwen3_5_moe_text_config_defaults():
    from transformers import Qwen3_5MoeTextConfig

    ours, default = target_config("qwen3.6-35b-a3b"), Qwen3_5MoeTextConfig()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                "num_experts_per_tok", "layer_types"):
        assert getattr(ours, key) == getattr(default, key), key


def test_dense_targets_have_no_experts():
    assert moe.moe_shape(target_config("tiny")) is None and not target_geometry(target_config("qwen3-8b")).moe
    shape = moe.moe_shape(target_config("tiny-qwen3-moe"))
    assert shape == moe.MoeShape(4, 2, 32, 0, (0, 1, 2, 3, 4, 5))


def test_drafter_of_35b_a3b_is_2048_wide_with_taps_over_40_layers():
    from dflash_ds.config.sections import DrafterConfig
    from dflash_ds.resolve.drafter import drafter_shape

    s = drafter_shape(target_config("qwen3.6-35b-a3b"), DrafterConfig(num_layers=5, mask_token_id=248070))
    assert s.hidden_size == 2048 and s.target_layer_ids == (1, 10, 19, 28, 37)
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.intermediate_size) == (32, 4, 128, 6144)
    assert s.vocab_size == 248320


# ---------------------------------------------------------------------------- the experts forward


@pytest.mark.parametrize("name", GEOMETRIES)
def test_grouped_experts_equal_the_eager_loop_in_float64(name):
    model = tiny_moe(name)
    mod = moe.experts_modules(model)[0][1]
    hidden, index, weights = routed_inputs(mod)
    want = eager(mod, hidden, index, weights)
    got = moe.grouped_experts_forward(mod, hidden, index, weights)
    assert got.dtype == torch.float64 and want.abs().max() > 1e-3
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    mod.chunk_tokens = 5  # 37 tokens in 8 chunks: the same sum
    assert torch.allclose(moe.grouped_experts_forward(mod, hidden, index, weights), want, atol=1e-12, rtol=0)


def test_dropped_pairs_contribute_nothing():
    model = tiny_moe()
    mod = moe.experts_modules(model)[0][1]
    hidden, index, weights = routed_inputs(mod)
    dropped = torch.rand(index.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    want = eager(mod, hidden, index, weights * ~dropped)
    mod.drops = True
    got = moe.grouped_experts_forward(mod, hidden, torch.where(dropped, mod.num_experts, index), weights)
    assert dropped.any() and torch.allclose(got, want, atol=1e-12, rtol=0)


def test_route_sorts_pairs_by_expert_and_counts_them():
    index = torch.tensor([[2, 0], [1, 2], [4, 0]])  # 4: a dropped pair (3 experts)
    r = moe.route(index, 3, drops=True)
    assert r.offsets.tolist() == [2, 3, 5] and r.kept == 5
    assert index.reshape(-1)[r.order].tolist() == [0, 0, 1, 2, 2]
    assert r.order.tolist() == [1, 5, 2, 0, 3]  # stable: pair order kept inside an expert


@pytest.mark.parametrize("name", GEOMETRIES)
def test_model_with_grouped_experts_equals_eager_model(name):
    ref, ours = tiny_moe(name, impl="eager"), tiny_moe(name, impl=moe.OWN)
    ids = torch.randint(0, 1024, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(input_ids=ids, output_hidden_states=True).hidden_states
        got = ours(input_ids=ids, output_hidden_states=True).hidden_states
    assert ours.config._experts_implementation == moe.OWN
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", GEOMETRIES)
def test_traced_moe_block_equals_the_eager_block_in_float64(name):
    """The function the GPU compiles for a whole sparse MoE block (target_model/moe_block.py), run
    eagerly on its tensors, against transformers' block with its eager experts, on each family; in
    chunks too. A block the function does not compute exactly (CPU tensors here; FP8 or
    expert-parallel experts) keeps its own forward."""
    from dflash_ds.target_model import moe_block

    model = tiny_moe(name, impl="eager")
    layer = decoder_layers(model)[0]
    block = layer.mlp
    x = torch.randn(2, 19, model.config.hidden_size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        want = block(x)
        routed, shared = moe_block.block_tensors(block)
        assert (shared is None) == (name == "tiny-qwen3-moe")

        def traced(r):
            if shared is not None:
                return moe_block.qwen35_block(x, r, shared)
            return moe_block.qwen3_block(x, r, bool(block.gate.norm_topk_prob))

        for chunk in (moe.CHUNK_TOKENS, 7):
            got = traced(routed._replace(chunk=chunk))
            assert got.shape == want.shape and want.abs().max() > 1e-3
            assert torch.allclose(got, want, atol=1e-12, rtol=0), (chunk, (got - want).abs().max())
            # The check can fail: a router choosing one expert fewer per token gives another sum.
            fewer = traced(routed._replace(chunk=chunk, top_k=routed.top_k - 1))
            assert not torch.allclose(fewer, want, atol=1e-6)
    moe.use_experts(model, moe.OWN)
    assert not moe_block.traced_usable(block)  # CPU: the block's own forward
    assert moe_block.fuse_moe_blocks() == []  # and nothing is patched without CUDA


def test_silu_experts_equal_the_module_forward_with_chunks():
    model = tiny_moe()
    mod = moe.experts_modules(model)[0][1]
    hidden, index, weights = routed_inputs(mod)
    want = eager(mod, hidden, index, weights)
    for chunk in (moe.CHUNK_TOKENS, 5):
        got = moe.silu_experts(hidden, index, weights, mod.gate_up_proj, down=mod.down_proj, chunk=chunk)
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
    swapped = moe.silu_experts(hidden, index.flip(1), weights, mod.gate_up_proj, down=mod.down_proj)
    assert not torch.allclose(swapped, want, atol=1e-6)  # the weights follow their own slot


def test_unsupported_expert_layout_is_refused():
    model = tiny_moe()
    mod = moe.experts_modules(model)[0][1]
    mod.is_transposed = True
    with pytest.raises(ValueError, match="laid out otherwise: use transformers' grouped_mm"):
        moe.grouped_experts_forward(mod, *routed_inputs(mod))
    with pytest.raises(ValueError, match="laid out otherwise"):
        moe.use_experts(model, moe.OWN)  # at load, before any forward
    # At the run's load the setting is named (the model code's message names none).
    from types import SimpleNamespace

    from dflash_ds.runtime.engines import quantized_replica
    from dflash_ds.target_model.model import TargetError

    recipe = SimpleNamespace(target=SimpleNamespace(experts_implementation=moe.OWN, quantization="none"))
    with pytest.raises(TargetError, match="^target.experts_implementation: the dflash_grouped experts run"):
        quantized_replica(recipe, model, {}, torch.device("cpu"))


def test_fp8_experts_equal_a_per_token_reference():
    from dflash_ds.quantization.fp8 import dequantize, quantize_rows

    model = tiny_moe(dtype=torch.float32)
    mod = moe.experts_modules(model)[0][1]
    hidden, index, weights = routed_inputs(mod, dtype=torch.float32)
    w1, w2 = mod.gate_up_proj.data.clone(), mod.down_proj.data.clone()
    plain = moe.grouped_experts_forward(mod, hidden, index, weights)
    assert moe.quantize_experts(model) and mod.gate_up_proj_q.dtype == torch.float8_e4m3fn
    got = moe.grouped_experts_forward(mod, hidden, index, weights)

    def fp8(x):  # what an FP8 GEMM input holds: per-row e4m3 values times their scale
        return dequantize(*quantize_rows(x))

    want = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            gate, up = (fp8(hidden[t:t + 1]) @ fp8(w1[e]).t()).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up * weights[t, s]
            want[t] += (fp8(act) @ fp8(w2[e]).t())[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-6  # it did quantize


def test_fp8_grouped_gemms_equal_the_float64_product_of_their_operands(monkeypatch):
    """The references the GPU tier holds torch._scaled_grouped_mm to (tests/fp8_experts.py), on the CPU
    emulation: each GEMM the FP8 experts forward runs against the float64 product of its own e4m3
    operands, on routing with empty experts, groups of 1..129 pairs and experts in nearly every token;
    the whole forward against the float64 sum over the slots of its own down GEMM's operands."""
    from dataclasses import replace

    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    from .fp8_experts import (RARE_SIZES, dequantized_product, gemm_errors, group_sizes, record_fp8_gemms, rel,
                              skewed_routing, unrouted_sum)

    cfg = target_config("tiny-moe")
    cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size = 32, 256, 128
    torch.manual_seed(0)
    mod = Qwen3_5MoeExperts(cfg).to(torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(mod.gate_up_proj, 0, 0.02)
    torch.nn.init.normal_(mod.down_proj, 0, 0.02)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 256, generator=g).bfloat16()
    index, weights = skewed_routing(300, 32, 4, g)
    holder = torch.nn.Module()
    holder.experts = mod
    moe.quantize_experts(holder)
    calls = record_fp8_gemms(monkeypatch)
    got = moe.grouped_experts_forward(mod, hidden, index, weights.bfloat16())
    r = moe.route(index, 32)
    sizes = group_sizes(r.offsets)
    assert len(calls) == 2 and all(torch.equal(c.offsets, r.offsets) for c in calls)
    assert sizes[0] == sizes[-1] == sizes[16] == 0 and sizes[2:2 + len(RARE_SIZES)] == list(RARE_SIZES)
    assert max(sizes) > 240
    for call in calls:
        e = gemm_errors(call)
        # float32 accumulation: the bf16 output rounding is the only error.
        assert e["rel"] <= 1.05 * e["floor"] and 1e-3 < e["floor"] < 3e-3 and e["worst_row"] < 2e-2, e
    ref = unrouted_sum(dequantized_product(calls[1]), r.order, 4)
    assert rel(got, ref) <= 1.6 * rel(ref.bfloat16(), ref)  # two roundings: the pairs' outputs, their sum
    # The check can fail: one group boundary moved by a row gives that row another expert's weights.
    shifted = calls[0].offsets.clone()
    shifted[5] += 1
    c = calls[0]
    bad = replace(c, out=moe.scaled_grouped_mm(c.xq, c.x_scale, c.wq, c.w_scale, offsets=shifted,
                                               out_dtype=torch.bfloat16))
    assert gemm_errors(bad)["worst_row"] > 0.5


# ---------------------------------------------------------------------------- packed rows


@pytest.mark.parametrize("name", GEOMETRIES)
def test_packed_taps_equal_each_document_alone(name):
    # Routing is per token, so packing cannot mix documents in the experts; the Gated DeltaNet layers
    # (tiny-moe) are kept apart by target.packed as for dense hybrids.
    model = tiny_moe(name, dtype=torch.float32, impl=moe.OWN)
    taps = list(range(len(decoder_layers(model))))
    ids, doc_ids = packed_rows([[13, 1, 20, 6], [7, 33]], 48, model.config.vocab_size)
    width = model.config.hidden_size
    got = taps_packed(model, taps, ids, doc_ids, width)
    want = taps_alone(model, taps, ids, doc_ids, width)
    real = (doc_ids >= 0).unsqueeze(-1)
    assert torch.isfinite(got).all()
    assert ((got - want).abs() * real).max().item() < 1e-5


# ---------------------------------------------------------------------------- before launch


@pytest.fixture(scope="module")
def moe_config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    target_config("tiny-moe").save_pretrained(path)
    return path


def resolve(path, world, *overrides):
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.run import resolve_run

    return resolve_run(load_recipe("recipes/tiny.yaml", [f"target.path={path}", *overrides]), world)


def test_expert_parallel_plan_names_the_groups_and_shrinks_the_target(moe_config_dir):
    from dflash_ds.resolve.plan import describe

    one = resolve(moe_config_dir, 3, "topology.targets_per_node=2", "optim.grad_accum=2")
    two = resolve(moe_config_dir, 5, "topology.targets_per_node=4", "optim.grad_accum=4", "target.expert_parallel=2",
                  "eval.benchmarks=[]")
    assert two.layout.expert_groups() == [[1, 2], [3, 4]] and two.layout.expert_group_of(4) == [3, 4]
    assert "expert-parallel groups (each rank 1/2 of the experts): [[1, 2], [3, 4]]" in describe(two.plan, two.memory)
    assert two.memory["target"] < one.memory["target"]


@pytest.mark.parametrize("overrides, world, needle", [
    (["target.ds_config=ds_configs/target_zero3_cpu.json"], 2, "ZeRO-3 would gather all 4 experts"),
    (["target.expert_parallel=2"], 2, "must divide topology.targets_per_node 1"),
    (["target.expert_parallel=3", "topology.targets_per_node=3", "optim.grad_accum=3"], 4,
     "must divide the target's 4 experts"),
    (["target.expert_parallel=2", "topology.targets_per_node=2"], 3,
     r"drafters_per_node\nx optim.grad_accum|x optim.grad_accum \(1 x 1\) a multiple"),
    (["target.expert_parallel=2", "topology.targets_per_node=2", "optim.grad_accum=2", "eval.benchmarks=[]",
      "target.experts_implementation=eager"], 3, "set target.experts_implementation=dflash_grouped"),
    (["target.experts_implementation=fast"], 2, "must be one of dflash_grouped, grouped_mm"),
    (["target.expert_parallel=2", "topology.colocated=true", "topology.targets_per_node=0"], 1,
     "topology.colocated runs one rank per GPU"),
    (["target.expert_parallel=2", "topology.targets_per_node=2", "optim.grad_accum=2"], 3,
     "set eval.benchmarks=\\[\\]"),
])
def test_moe_recipe_errors_stop_before_launch(moe_config_dir, overrides, world, needle):
    from dflash_ds.config import RecipeError

    with pytest.raises(RecipeError, match=needle):
        resolve(moe_config_dir, world, *overrides)


def test_expert_parallel_on_a_dense_target_is_refused(tmp_path):
    from dflash_ds.config import RecipeError

    target_config("tiny-qwen3").save_pretrained(tmp_path)
    with pytest.raises(RecipeError, match="target.path is a dense model"):
        resolve(tmp_path, 3, "topology.targets_per_node=2", "optim.grad_accum=2", "target.expert_parallel=2")


def test_the_35b_a3b_recipe_fits_its_target():
    from dflash_ds.config import load_recipe
    from dflash_ds.resolve.drafter import drafter_shape
    from dflash_ds.resolve.moe import check_moe
    from dflash_ds.resolve.run import check_world

    recipe = load_recipe("recipes/qwen36-35b-a3b.yaml")
    cfg = target_config("qwen3.6-35b-a3b")
    shape = drafter_shape(cfg, recipe.drafter)
    # The recipe's explicit drafter is the one derived from the target.
    assert shape == drafter_shape(cfg, load_recipe("recipes/qwen36-35b-a3b.yaml", [
        "drafter.num_attention_heads=null", "drafter.num_key_value_heads=null", "drafter.head_dim=null",
        "drafter.intermediate_size=null"]).drafter)
    assert shape.hidden_size == 2048 and shape.target_layer_ids == (1, 10, 19, 28, 37)
    check_moe(recipe, cfg, "replica", check_world(recipe, 8))
    two = load_recipe("recipes/qwen36-35b-a3b.yaml", ["target.expert_parallel=2", "topology.targets_per_node=4",
                                                      "topology.drafters_per_node=4"])
    check_moe(two, cfg, "replica", check_world(two, 8))


def test_active_parameters_count_k_of_e_experts_and_the_routers():
    from transformers import AutoModelForCausalLM

    from dflash_ds.bench.flops import active_linear_params, count_linear_params

    cfg = target_config("tiny-moe")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layers = model.model.layers
    n, e, k, d, i = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, \
        cfg.moe_intermediate_size
    p = active_linear_params(layers)
    assert p["experts_total"] == n * e * 3 * d * i and p["experts_active"] == n * k * 3 * d * i
    assert p["routers"] == n * e * d and p["dense"] == count_linear_params(layers)
    assert p["active"] == p["dense"] + p["experts_active"] + p["routers"]
