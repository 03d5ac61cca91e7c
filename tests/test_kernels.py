"""The fused target kernels compute exactly transformers' math (they only change kernel fusion),
and swapping them in is GPU-only and undone after each test here."""

import pytest
import torch
import transformers.models.qwen3.modeling_qwen3 as q3
import transformers.models.qwen3_5.modeling_qwen3_5 as q35
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as q35m
import transformers.models.qwen3_moe.modeling_qwen3_moe as q3m

from dflash_ds.target_model import kernels

# Everything fuse_target_elementwise / use_fla_short_conv may replace.
PATCHABLE = [(q35.Qwen3_5RMSNorm, "forward"), (q35.Qwen3_5RMSNormGated, "forward"), (q35.Qwen3_5MLP, "forward"),
             (q3.Qwen3RMSNorm, "forward"), (q3.Qwen3MLP, "forward"), (q35, "causal_conv1d_fn"),
             (q35m.Qwen3_5MoeRMSNorm, "forward"), (q35m.Qwen3_5MoeRMSNormGated, "forward"),
             (q35m.Qwen3_5MoeMLP, "forward"), (q3m.Qwen3MoeRMSNorm, "forward"), (q3m.Qwen3MoeMLP, "forward"),
             (q35m, "causal_conv1d_fn")]


def _current(obj, name):
    return obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)


@pytest.fixture
def transformers_restored(monkeypatch):
    """Records transformers' originals, asserts no earlier test left a swap in place, and puts
    them back after the test (monkeypatch restores what it set)."""
    originals = {}
    for obj, name in PATCHABLE:
        value = _current(obj, name)
        assert getattr(value, "__module__", "") != kernels.__name__, f"{obj.__name__}.{name} is still patched"
        monkeypatch.setattr(obj, name, value)
        originals[obj, name] = value
    return originals


def test_compiled_norm_and_mlp_functions_equal_transformers_modules(transformers_restored):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g).to(torch.bfloat16)
    gate = torch.randn(2, 7, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(32, generator=g)
    zc = q35.Qwen3_5RMSNorm(32)
    zc.weight.data = w.clone()
    assert torch.equal(kernels._rms_zero_centered(x, zc.weight, zc.eps), zc(x))
    gated = q35.Qwen3_5RMSNormGated(32)
    gated.weight.data = w.to(torch.bfloat16)
    assert torch.equal(kernels._rms_gated(x, gate, gated.weight, gated.variance_epsilon), gated(x, gate))
    plain = q3.Qwen3RMSNorm(32)
    plain.weight.data = w.to(torch.bfloat16)
    assert torch.equal(kernels._rms_plain(x, plain.weight, plain.variance_epsilon), plain(x))
    # The MoE classes' norms are the dense ones' math.
    for cls, fn in ((q35m.Qwen3_5MoeRMSNorm, kernels._rms_zero_centered), (q3m.Qwen3MoeRMSNorm, kernels._rms_plain)):
        norm = cls(32)
        norm.weight.data = (w if fn is kernels._rms_zero_centered else w.to(torch.bfloat16)).clone()
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        assert torch.equal(fn(x, norm.weight, eps), norm(x)), cls.__name__
    moe_gated = q35m.Qwen3_5MoeRMSNormGated(32)
    moe_gated.weight.data = w.to(torch.bfloat16)
    assert torch.equal(kernels._rms_gated(x, gate, moe_gated.weight, moe_gated.variance_epsilon), moe_gated(x, gate))
    assert torch.equal(kernels._swiglu(x, gate), torch.nn.functional.silu(x) * gate)


def test_kernel_swaps_patch_only_on_gpu_and_keep_the_numbers(transformers_restored):
    patched = kernels.fuse_target_elementwise()
    swapped = {key for key, value in transformers_restored.items() if _current(*key) is not value}
    if not torch.cuda.is_available():
        # CPU runs use transformers' code unchanged.
        assert patched == [] and swapped == set()
        assert kernels.use_fla_short_conv() is False and q35.causal_conv1d_fn is transformers_restored[q35, "causal_conv1d_fn"]
        assert q35m.causal_conv1d_fn is transformers_restored[q35m, "causal_conv1d_fn"]
        return
    assert sorted(patched) == ["qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe"]
    assert swapped == {key for key in PATCHABLE if key[1] == "forward"}
    # The swapped forwards give transformers' numbers (compiled: only the rounding order may move).
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.randn(2, 64, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    for cls, args in ((q35.Qwen3_5RMSNorm, (x,)), (q3.Qwen3RMSNorm, (x,)), (q35.Qwen3_5RMSNormGated, (x, gate))):
        module = cls(128).to("cuda", torch.bfloat16)
        torch.nn.init.normal_(module.weight, 0.0, 0.5, generator=g)
        original = transformers_restored[cls, "forward"](module, *args)
        assert torch.allclose(module(*args).float(), original.float(), rtol=2e-2, atol=2e-2), cls.__name__
    fla = kernels.use_fla_short_conv()
    has_fla = kernels.fla_short_conv_available()
    assert fla is has_fla
    assert (q35.causal_conv1d_fn is not transformers_restored[q35, "causal_conv1d_fn"]) is has_fla
    assert (q35m.causal_conv1d_fn is not transformers_restored[q35m, "causal_conv1d_fn"]) is has_fla
