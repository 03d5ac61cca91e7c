"""The fused target kernels compute exactly transformers' math (they only change kernel fusion)."""

import torch

from dflash_ds.target import kernels


def test_compiled_norm_and_mlp_functions_equal_transformers_modules():
    import transformers.models.qwen3.modeling_qwen3 as q3
    import transformers.models.qwen3_5.modeling_qwen3_5 as q35

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
    assert torch.equal(kernels._swiglu(x, gate), torch.nn.functional.silu(x) * gate)


def test_kernel_swaps_are_gpu_only():
    # On a CPU machine nothing is patched, so CPU runs use transformers' code unchanged.
    assert kernels.fuse_target_elementwise() == [] or torch.cuda.is_available()
    assert kernels.use_fla_short_conv() is False or torch.cuda.is_available()
