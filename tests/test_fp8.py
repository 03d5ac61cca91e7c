"""target.quantization: fp8 on CPU: the formats against float64, which layers become FP8 and which do
not, the refusals, and an FP8 checkpoint as published (config detection, loading as stored, its
dequantization). FP8 matmuls need a GPU; on CPU `scaled_matmul` computes the same product from the
dequantized operands, so the wiring runs here and the GPU tier checks the tensor-core path."""

import json
import types

import pytest
import torch
from torch import nn

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.resolve.quantization import refusal
from dflash_ds.resolve.run import resolve_run
from dflash_ds.quantization import fp8
from dflash_ds.target_model.model import TapCapture, TargetError, decoder_layers, forward_taps, load_target

TINY = "recipes/tiny.yaml"
E4M3_STEP = 2.0 ** -3  # spacing of e4m3 mantissas: rounding moves a normal value by at most half of it


def wide_config(layers: int = 4, hidden: int = 128):
    """The hybrid layout at widths that are multiples of 128 (so most projections quantize), except
    k/v (64 wide) and the Gated DeltaNet gates in_proj_a / in_proj_b (4 wide)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"][:layers],
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})


def random_target(seed: int = 0, dtype=torch.float32, hidden: int = 128):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(wide_config(hidden=hidden), dtype=dtype, attn_implementation="sdpa")
    return model.requires_grad_(False).eval()


def taps_of(model, ids, layers=(0, 1, 2, 3), doc_ids=None):
    cap = TapCapture(model, list(layers))
    d = model.config.hidden_size
    out = torch.empty(ids.shape[0], ids.shape[1], len(layers) * d, device=ids.device,
                      dtype=model.model.embed_tokens.weight.dtype)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids) if doc_ids is None else None
    if doc_ids is not None:
        from dflash_ds.objective.blocks import position_ids_from_doc_ids

        positions = position_ids_from_doc_ids(doc_ids)
    forward_taps(model, cap, ids, positions, out=out, doc_ids=doc_ids)
    cap.remove()
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------- formats


@pytest.mark.parametrize("kind", ["rows", "groups", "blocks"])
def test_quantization_matches_a_float64_reference(kind):
    torch.manual_seed(1)
    x = torch.randn(256, 384, dtype=torch.float64) * torch.logspace(-2, 1, 384, dtype=torch.float64)
    q, s = {"rows": fp8.quantize_rows, "groups": fp8.quantize_groups, "blocks": fp8.quantize_blocks}[kind](x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    if kind == "rows":
        want = x.abs().amax(1, keepdim=True) / 448
        scale = s
    elif kind == "groups":
        want = x.abs().reshape(256, 3, 128).amax(-1) / 448
        scale = s.t()  # stored transposed for the GEMM
        assert s.is_contiguous() and s.shape == (3, 256)
    else:
        want = x.abs().reshape(2, 128, 3, 128).amax((1, 3)) / 448
        scale = s
    torch.testing.assert_close(scale.double(), want, rtol=1e-6, atol=0)
    back = fp8.dequantize(q, scale).double()
    # Each value lands within half an e4m3 step of itself (relative), the scaled amax exactly on 448.
    big = x.abs() > 1e-2 * x.abs().max()
    assert ((back - x).abs()[big] / x.abs()[big]).max() <= E4M3_STEP / 2 + 1e-6
    assert float(q.float().abs().max()) == 448.0


@pytest.mark.parametrize("blocks", [False, True])
def test_scaled_matmul_is_the_product_of_the_dequantized_operands(blocks):
    torch.manual_seed(2)
    x, w = torch.randn(64, 256), torch.randn(384, 256) * 0.02
    xq, xs = fp8.quantize_groups(x) if blocks else fp8.quantize_rows(x)
    wq, ws = fp8.quantize_blocks(w) if blocks else fp8.quantize_rows(w)
    ws = ws if blocks else ws.reshape(1, -1)
    out = fp8.scaled_matmul(xq, xs, wq, ws, blocks=blocks, out_dtype=torch.float32)
    x64 = xq.double() * (xs.t().double().repeat_interleave(128, 1) if blocks else xs.double())
    w64 = fp8.dequantize(wq, ws if blocks else ws.t()).double()
    torch.testing.assert_close(out.double(), x64 @ w64.t(), rtol=1e-5, atol=1e-6)
    # ... and that product is the float one to FP8 accuracy (a few percent), not more and not exact.
    assert 0.005 < rel(out, x @ w.t()) < 0.06


def test_fp8_linear_pads_odd_token_counts_and_keeps_the_leading_shape():
    torch.manual_seed(3)
    w = torch.randn(256, 128)
    q, scale = fp8.quantize_rows(w)
    lin = fp8.Fp8Linear(q, scale, torch.randn(256), False, out_dtype=torch.float32)
    x = torch.randn(2, 7, 128)
    y = lin(x)
    assert y.shape == (2, 7, 256)
    assert rel(y, x @ w.t() + lin.bias) < 0.06


# ---------------------------------------------------------------------------- the model


def test_quantize_model_converts_the_decoder_projections_only():
    model = random_target()
    embed, head = model.model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    gdn = {k: v.clone() for k, v in decoder_layers(model)[0].linear_attn.named_parameters() if "proj" not in k}
    report = fp8.quantize_model(model, fp8.ROWS)
    layers = decoder_layers(model)
    for i in range(3):
        la = layers[i].linear_attn
        assert all(isinstance(getattr(la, n), fp8.Fp8Linear) for n in ("in_proj_qkv", "in_proj_z", "out_proj"))
        assert type(la.in_proj_a) is nn.Linear and type(la.in_proj_b) is nn.Linear  # 4 wide: kept
    attn = layers[3].self_attn
    assert isinstance(attn.q_proj, fp8.Fp8Linear) and isinstance(attn.o_proj, fp8.Fp8Linear)
    assert type(attn.k_proj) is nn.Linear and type(attn.v_proj) is nn.Linear  # 64 wide: kept
    for layer in layers:  # gate and up became one GEMM; the fused forward is the instance's
        mlp = layer.mlp
        assert isinstance(mlp.gate_up_proj, fp8.Fp8Linear) and mlp.gate_up_proj.out_features == 512
        assert not hasattr(mlp, "gate_proj") and mlp.forward.func is fp8.fused_mlp_forward
    assert len(report.fp8) == 3 * 3 + 2 + 4 * 3 and len(report.fused_mlps) == 4
    assert sorted(report.kept) == sorted([f"layers.{i}.linear_attn.in_proj_{g}" for i in range(3) for g in "ab"]
                                         + ["layers.3.self_attn.k_proj", "layers.3.self_attn.v_proj"])
    # Untouched: embedding, lm_head, the Gated DeltaNet's conv / decay / norm parameters, the kernels.
    assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.model.embed_tokens.weight, embed)
    for k, v in decoder_layers(model)[0].linear_attn.named_parameters():
        if "proj" not in k:
            assert torch.equal(v, gdn[k]), k
    assert "forward" not in vars(layers[0].linear_attn) and "forward" not in vars(attn)  # kernels unchanged


@pytest.mark.parametrize("scheme", [fp8.ROWS, fp8.BLOCKS])
def test_quantized_taps_stay_close_to_the_float_target(scheme):
    ref_model, model = random_target(hidden=512), random_target(hidden=512)  # 512: the block GEMM's widths
    fp8.quantize_model(model, scheme)
    ids = torch.randint(0, 512, (2, 96))
    want, got = taps_of(ref_model, ids), taps_of(model, ids)
    d = 512
    for t in range(4):
        e = rel(got[..., t * d:(t + 1) * d], want[..., t * d:(t + 1) * d])
        # Quantized (not exact), and to FP8 accuracy: a few e4m3 GEMMs in a chain (~4% each) whose
        # error the random weights then carry on; a wrong scale or SwiGLU order gives order 1.
        assert 0.002 < e < 0.2, (t, e)
    # Packed rows go through the per-document Gated DeltaNet forward, which calls the same projections.
    doc_ids = torch.cat([torch.zeros(2, 40, dtype=torch.int32), torch.ones(2, 56, dtype=torch.int32)], 1)
    assert rel(taps_of(model, ids, doc_ids=doc_ids), taps_of(ref_model, ids, doc_ids=doc_ids)) < 0.2


def test_compile_for_sets_the_training_shape_on_every_fp8_module():
    model = random_target()
    fp8.quantize_model(model)
    assert fp8.compile_for(model, 3072) == 3 * 3 + 2 + 4 * 2  # gate+up fused: 2 modules per MLP
    lin = decoder_layers(model)[0].linear_attn.in_proj_qkv
    assert lin.tokens == 3072 and not lin.compiled_for(torch.zeros(3072, 128))  # CPU: never compiled


# ---------------------------------------------------------------------------- FP8 checkpoints


def write_fp8_checkpoint(model, path, not_converted=True):
    """`model` saved as a fine-grained FP8 checkpoint is published: e4m3 weights + weight_scale_inv
    per 128 x 128 block for the decoder projections whose widths allow it, the rest as they are."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    out, skip = {}, []
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2 and ".layers." in k and v.shape[0] % 128 == 0 and v.shape[1] % 128 == 0:
            out[k], out[k + "_scale_inv"] = fp8.quantize_blocks(v)
        else:
            out[k] = v
            if k.endswith(".weight") and v.ndim == 2:
                skip.append(k[: -len(".weight")])
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128],
                                  "modules_to_not_convert": skip if not_converted else ["lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
def fp8_checkpoint(tmp_path):
    model = random_target(seed=4, dtype=torch.bfloat16, hidden=512)
    stored = write_fp8_checkpoint(model, tmp_path)
    return tmp_path, stored


def test_checkpoint_config_detection():
    assert not fp8.checkpoint_fp8(types.SimpleNamespace())
    ok = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert fp8.checkpoint_fp8(types.SimpleNamespace(quantization_config=ok))
    # multimodal configs may carry it on the text tower
    assert fp8.checkpoint_fp8(types.SimpleNamespace(text_config=types.SimpleNamespace(quantization_config=ok)))
    with pytest.raises(fp8.QuantizationError, match="quantized with 'gptq'"):
        fp8.checkpoint_fp8(types.SimpleNamespace(quantization_config={"quant_method": "gptq"}))
    with pytest.raises(fp8.QuantizationError, match=r"weight_block_size \[64, 64\]"):
        fp8.checkpoint_fp8(types.SimpleNamespace(quantization_config={**ok, "weight_block_size": [64, 64]}))
    with pytest.raises(fp8.QuantizationError, match="activation_scheme 'static'"):
        fp8.checkpoint_fp8(types.SimpleNamespace(quantization_config={**ok, "activation_scheme": "static"}))


def test_fp8_checkpoint_dequantizes_as_transformers_does(fp8_checkpoint):
    path, stored = fp8_checkpoint
    # No GPU here: transformers dequantizes the FP8 layers itself; that is our float reference.
    model = load_target(str(path), dtype="bfloat16")
    layer = decoder_layers(model)[1].mlp.up_proj
    assert type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16
    k = "model.layers.1.mlp.up_proj.weight"
    ours = fp8.dequantize(stored[k], stored[k + "_scale_inv"]).to(torch.bfloat16)
    torch.testing.assert_close(layer.weight, ours, rtol=0, atol=0)


def test_fp8_checkpoint_loads_as_stored(fp8_checkpoint, monkeypatch):
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    path, stored = fp8_checkpoint
    reference = load_target(str(path), dtype="bfloat16")  # dequantized (CPU)
    # What a GPU rank does: transformers keeps the stored e4m3 weights (its GPU check is skipped here).
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    model = load_target(str(path), dtype="bfloat16", keep_fp8=True)
    layers = decoder_layers(model)
    qkv = layers[0].linear_attn.in_proj_qkv
    assert isinstance(qkv, fp8.Fp8Linear) and qkv.blocks
    k = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert torch.equal(qkv.weight.view(torch.uint8), stored[k].view(torch.uint8))  # the stored bytes, as is
    assert torch.equal(qkv.weight_scale, stored[k + "_scale_inv"])
    assert isinstance(layers[2].mlp.gate_up_proj, fp8.Fp8Linear) and layers[2].mlp.gate_up_proj.blocks
    assert type(layers[0].linear_attn.in_proj_b) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(layers[0].linear_attn.out_proj) is nn.Linear  # 128 in: not a block-GEMM width, dequantized
    ids = torch.randint(0, 512, (1, 64))
    e = rel(taps_of(model, ids).float(), taps_of(reference, ids).float())
    assert 0.002 < e < 0.1  # only the activations' quantization separates them

    # Without keep_fp8 (target.quantization: none) the same layers are dequantized to nn.Linear.
    plain = load_target(str(path), dtype="bfloat16", keep_fp8=False)
    up = decoder_layers(plain)[1].mlp.up_proj
    assert type(up) is nn.Linear
    torch.testing.assert_close(up.weight, decoder_layers(reference)[1].mlp.up_proj.weight, rtol=0, atol=0)


def test_fp8_checkpoint_that_does_not_list_its_unquantized_layers_is_refused(tmp_path, monkeypatch):
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    # transformers would make FP8 layers of in_proj_a/b, k/v too, with no stored scale: garbage weights.
    write_fp8_checkpoint(random_target(seed=5, dtype=torch.bfloat16, hidden=512), tmp_path, not_converted=False)
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    with pytest.raises(TargetError, match="no weight_scale_inv for .*modules_to_not_convert"):
        load_target(str(tmp_path), dtype="bfloat16", keep_fp8=True)


# ---------------------------------------------------------------------------- refusals before launch


def section(**kw):
    base = dict(quantization="fp8", dtype="bfloat16", adapter=None)
    return types.SimpleNamespace(**{**base, **kw})


def test_refusals_name_the_setting():
    assert refusal(section(), "cuda", "replica", False) is None
    assert refusal(section(quantization="none"), "cpu", "zero3", False) is None
    assert "run.device is cpu" in refusal(section(), "cpu", "replica", False)
    assert "ZeRO-3" in refusal(section(), "cuda", "zero3", False)
    assert "an FP8 checkpoint" in refusal(section(quantization="none"), "cuda", "zero3", True)
    assert "target.dtype=bfloat16" in refusal(section(dtype="float32"), "cuda", "replica", False)
    assert "target.adapter" in refusal(section(adapter="a"), "cuda", "replica", True)
    assert refusal(section(adapter="a"), "cuda", "replica", False) is None  # merged in bf16, then quantized
    for msg in (refusal(section(), "cpu", "replica", False), refusal(section(), "cuda", "zero3", False)):
        assert "\n" not in msg and "target." in msg


def test_a_gpu_without_fp8_tensor_cores_is_refused_before_launch(monkeypatch):
    """The rank's GPU is checked with the other refusals, before anything loads (a plan drawn without a
    GPU has no capability to check)."""
    from dflash_ds.resolve import quantization

    a100 = quantization.Machine("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", True)
    monkeypatch.setattr(quantization, "machine", lambda device: a100)
    with pytest.raises(RecipeError, match=r"^target.quantization: fp8 needs FP8 tensor cores .*\(NVIDIA A100-SXM4-80GB\) "
                                          r"has compute capability 8.0: set target.quantization=none$"):
        quantization.check_target_device(section(), torch.device("cuda", 0))
    quantization.check_target_device(section(quantization="none"), torch.device("cuda", 0))  # bf16: any GPU
    monkeypatch.setattr(quantization, "machine", lambda device: quantization.Machine("cuda", (9, 0), "NVIDIA H200"))
    quantization.check_target_device(section(), torch.device("cuda", 0))
    monkeypatch.setattr(quantization, "machine", lambda device: quantization.Machine("cuda"))  # planned, no GPU here
    quantization.check_target_device(section(), torch.device("cuda", 0))


def test_cpu_run_with_fp8_stops_before_launch_in_one_line(tmp_path):
    wide_config().save_pretrained(tmp_path)
    r = load_recipe(TINY, [f"target.path={tmp_path}", "target.quantization=fp8"])
    with pytest.raises(RecipeError, match=r"^target\.quantization: fp8 needs an FP8 GPU.*set target\.quantization=none$"):
        resolve_run(r, world_size=2)
    assert resolve_run(load_recipe(TINY, [f"target.path={tmp_path}"]), world_size=2).recipe.target.quantization == "none"
    with pytest.raises(RecipeError, match="target.quantization must be none or fp8"):
        load_recipe(TINY, ["target.quantization=int8"])


def test_zero3_with_fp8_stops_before_launch(tmp_path, monkeypatch):
    import dflash_ds.resolve.run as run

    wide_config().save_pretrained(tmp_path)
    monkeypatch.setattr(run, "resolve_device", lambda name, setting: torch.device("cuda"))
    monkeypatch.setattr(run, "payload_dtype", lambda *a, **k: torch.bfloat16)
    r = load_recipe(TINY, [f"target.path={tmp_path}", "target.quantization=fp8", "data.pack=false",
                           "target.ds_config=ds_configs/target_zero3_cpu.json"])
    with pytest.raises(RecipeError, match="needs a full target replica per GPU.*target_replica.json"):
        resolve_run(r, world_size=2)


def test_generation_runs_through_the_fp8_layers():
    """The held-out continuations are generated by the loaded (quantized) target: cache, single-token
    steps and all. The first step's logits stay at FP8 accuracy from the float target's."""
    ref_model, model = random_target(seed=7, hidden=512), random_target(seed=7, hidden=512)
    fp8.quantize_model(model)
    ids = torch.randint(0, 512, (1, 12))
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    got, want = model.generate(ids, **kw), ref_model.generate(ids, **kw)
    assert got.sequences.shape == (1, 17) and len(got.scores) == 5
    assert 0.0 < rel(got.scores[0], want.scores[0]) < 0.2


def test_dry_run_memory_counts_fp8_weights_at_one_byte():
    from dflash_ds.resolve.plan import memory_estimate, resolve
    from dflash_ds.resolve.run import resolve_run

    r = load_recipe(TINY)
    q = load_recipe(TINY, ["target.quantization=fp8"])
    plan, shape = resolve(r, 2, 64), resolve_run(r, 2).drafter
    t_params, hidden, vocab = 26_000_000_000, 5120, 248320
    bf16 = memory_estimate(r, plan, shape, t_params, hidden=hidden, vocab=vocab, taps=5)["target"]
    fp8_ = memory_estimate(q, plan, shape, t_params, hidden=hidden, vocab=vocab, taps=5)["target"]
    saved = (t_params - vocab * hidden) / 1024 ** 3
    assert abs((bf16 - fp8_) - saved) < 1e-6 and fp8_ < bf16


def test_fp8_refusals_of_a_mixture_of_experts_target_name_the_setting():
    from dflash_ds.resolve.quantization import check_quantization, experts_refusal
    from dflash_ds.target_model.presets import target_config

    moe = section(experts_implementation="dflash_grouped", expert_parallel=1)
    assert experts_refusal(moe, False) is None
    assert "set target.experts_implementation=dflash_grouped" in experts_refusal(
        section(experts_implementation="grouped_mm", expert_parallel=1), False)
    split = section(quantization="none", experts_implementation="dflash_grouped", expert_parallel=2)
    assert experts_refusal(split, False) is None
    assert "target.path is an FP8 checkpoint" in experts_refusal(split, True)
    # Asked of the experts only when the target has them: the same stored FP8 config, dense and MoE.
    stored = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    dense, sparse = target_config("tiny-qwen3"), target_config("tiny-qwen3-moe")
    dense.quantization_config = sparse.quantization_config = stored
    check_quantization(split, "cuda", "replica", dense)
    with pytest.raises(RecipeError, match="target.expert_parallel 2 loads each rank's experts"):
        check_quantization(split, "cuda", "replica", sparse)
