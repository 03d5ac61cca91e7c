"""drafter.fp8 on CPU: the recipe keys and their refusals, which drafter linears become torchao float8
layers, and the FP8 lm_head of the fused loss against float64 references.

The lm_head's GEMMs run on FP8 tensor cores on a GPU; on CPU `scaled_matmul` multiplies the
dequantized operands (the same rounding of the inputs), so the quantization, the scales and the
hook into the fused loss are checked here against a float64 emulation; torchao's float8 layers run
on the CPU as they are."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.objective.head_matmuls import GemmHead, SeparateMatmuls
from tests.reference import chunked
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.quantization import fp8_head
from dflash_ds.quantization.fp8_head import Fp8Head
from dflash_ds.resolve import quantization
from dflash_ds.resolve.quantization import Machine
from dflash_ds.resolve.run import resolve_run
from tests.test_dflash2 import D, VOCAB, drafter, micro_batch

TINY = "recipes/tiny.yaml"
FP8 = torch.float8_e4m3fn


def q64(x: torch.Tensor) -> torch.Tensor:
    """float64 row-wise e4m3 round trip: scale = row amax / 448, the reference of every FP8 operand."""
    x = x.double()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x / scale).clamp(-448, 448).to(FP8).double() * scale


def rel(a, b) -> float:
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------ recipe keys and refusals


def test_recipe_keys_default_off_and_parse():
    r = load_recipe(TINY)
    assert r.drafter.fp8.layers == "none" and r.drafter.fp8.lm_head is False
    r = load_recipe(TINY, ["drafter.fp8.layers=rowwise", "drafter.fp8.lm_head=true"])
    assert r.drafter.fp8.layers == "rowwise" and r.drafter.fp8.lm_head is True


@pytest.mark.parametrize("overrides,needle", [
    (["drafter.fp8.layers=rows"], "drafter.fp8.layers must be none, rowwise or tensorwise, got 'rows'"),
    (["drafter.fp8.layers=tensorwise", "drafter.compile=false"], "needs drafter.compile: true"),
])
def test_recipe_combinations_that_cannot_run_are_refused(overrides, needle):
    with pytest.raises(RecipeError) as exc:
        load_recipe(TINY, overrides)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def _fp8(layers="rowwise", lm_head=True):
    return load_recipe(TINY, [f"drafter.fp8.layers={layers}", f"drafter.fp8.lm_head={str(lm_head).lower()}"]).drafter.fp8


H200 = Machine("cuda", (9, 0), "NVIDIA H200", torchao=True)


@pytest.mark.parametrize("fp8,machine,needle", [
    (_fp8(), Machine("cpu", torchao=True), "run.device is cpu, where there is no FP8 matmul"),
    (_fp8("none", True), Machine("cpu"), "drafter.fp8.lm_head=true needs an FP8 GPU"),
    (_fp8(), Machine("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", True), "(NVIDIA A100-SXM4-80GB) has compute capability 8.0"),
    (_fp8("tensorwise", False), Machine("cuda", (9, 0), "NVIDIA H200", torchao=False), "pip install 'dflash-ds[fp8]'"),
])
def test_machines_that_cannot_run_it_are_refused_in_one_line(fp8, machine, needle):
    shape = drafter("dflash").config
    msg = quantization.drafter_refusal(fp8, machine, shape)
    assert needle in msg and "\n" not in msg
    assert "drafter.fp8" in msg


def test_an_fp8_gpu_with_torchao_runs_it_and_off_asks_nothing():
    shape = drafter("dflash").config  # D 64, vocab 300
    assert quantization.drafter_refusal(_fp8(lm_head=False), H200, shape) is None
    # The lm_head GEMMs need the vocabulary in multiples of 16: 300 is not.
    assert "vocabulary to be multiples of 16" in quantization.drafter_refusal(_fp8(), H200, shape)
    off = load_recipe(TINY).drafter.fp8
    assert quantization.drafter_refusal(off, Machine("cpu"), shape) is None
    quantization.check_drafter_quantization(off, torch.device("cuda", 0), shape)  # never queries the GPU when off
    with pytest.raises(RecipeError, match="run.device is cpu"):
        quantization.check_drafter_quantization(_fp8(), torch.device("cpu"), shape)


def test_resolve_run_refuses_fp8_on_cpu_before_launch():
    recipe = load_recipe(TINY, ["run.device=cpu", "drafter.fp8.lm_head=true"])
    with pytest.raises(RecipeError, match="drafter.fp8.lm_head=true needs an FP8 GPU"):
        resolve_run(recipe, 2)


# ------------------------------------------------------------------------------ the layers (torchao)


def test_the_layers_projections_become_float8_and_nothing_else():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from dflash_ds.quantization.fp8_drafter import PROJECTIONS, convert_layers, fp8_layer_names

    for arch in ("dflash", "dflash2"):
        m = drafter(arch).float()
        before = dict(m.named_parameters())
        keys = list(m.state_dict())
        names = convert_layers(m, "rowwise")
        assert names == sorted(f"layers.{i}.{p}" for i in range(len(m.layers)) for p in PROJECTIONS)
        converted = {n for n, mod in m.named_modules() if isinstance(mod, Float8Linear)}
        assert converted == set(names)
        # Left in high precision: the taps' fusion, DFlash2's convolutions and selector.
        others = [n for n, mod in m.named_modules() if type(mod) is nn.Linear]
        assert "fc" in others and (arch == "dflash" or any("conv" in n or "selector" in n for n in others))
        # The same Parameter objects (the engine flattens them) and the export's names.
        assert all(p is before[n] for n, p in m.named_parameters()) and list(m.state_dict()) == keys
        assert fp8_layer_names(m) == []  # converted layers are not plain nn.Linear any more


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_layers_train_close_to_the_high_precision_drafter(recipe):
    pytest.importorskip("torchao")
    from dflash_ds.quantization.fp8_drafter import convert_layers

    ref, m = drafter("dflash").float(), drafter("dflash").float()
    convert_layers(m, recipe)
    mb, bl = micro_batch(ref)
    mb.taps = mb.taps.float()

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, bl.block_ids.shape[1], D, generator=gen)
    probe = torch.randn(x.shape, generator=gen)  # a fixed cotangent: the normed output's mean square has none

    def run(model):
        model.zero_grad()
        out = model(x, model.fuse(mb.taps), bl.block_positions, bl.ctx_positions, mask=bl.mask)
        (out * probe).sum().backward()
        return out.detach(), model.layers[0].mlp.down_proj.weight.grad.clone(), model.fc.weight.grad.clone()

    (o_ref, g_ref, fc_ref), (o, g, fc) = run(ref), run(m)
    # FP8 numerics: percent-level, not bit-level, differences in what the layers compute (so the float8
    # path really ran); the output is mostly the residual input, so it moves less.
    assert 1e-4 < rel(o, o_ref) < 0.02
    assert 1e-2 < rel(g, g_ref) < 0.15 and rel(fc, fc_ref) < 0.15


# ------------------------------------------------------------------------------ the lm_head in FP8


def lm_case(n=40, d=64, v=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    # Rows and columns of different sizes, so a scale taken along the wrong axis shows.
    weight = torch.randn(v, d, generator=g) * torch.rand(v, 1, generator=g) * torch.rand(1, d, generator=g) * 4
    return hidden, weight


def test_the_weight_is_quantized_once_in_both_layouts(monkeypatch):
    hidden, weight = lm_case()
    head = Fp8Head(weight)
    # Logits: one scale per row of W (its amax over D); the gradient: one per column (amax over V).
    torch.testing.assert_close(head.w_rows_scale.double(), weight.double().abs().amax(1)[None] / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(head.w_cols_scale.double(), weight.double().abs().amax(0)[None] / 448, rtol=1e-6, atol=0)
    assert head.w_rows.shape == (512, 64) and head.w_cols.shape == (64, 512)
    assert head.w_rows.dtype == head.w_cols.dtype == FP8 and head.w_cols.is_contiguous()
    torch.testing.assert_close(head.w_rows.double() * head.w_rows_scale.double().T, q64(weight), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(head.w_cols.double() * head.w_cols_scale.double().T, q64(weight.T), rtol=1e-6, atol=1e-9)
    calls = []
    monkeypatch.setattr(fp8_head, "quantize_weight_rows", lambda *a: calls.append(a))
    for _ in range(3):
        head.logits(hidden)
        head.input_grad(torch.randn(40, 512))
    assert calls == []  # the chunks quantize only their own rows


def test_logits_and_input_gradient_against_float64():
    hidden, weight = lm_case()
    head = Fp8Head(weight, fast_accum_grad=True)
    exact = hidden.double() @ weight.double().T
    ref = q64(hidden) @ q64(weight).T  # row-wise activations, the weight's row layout
    out = head.logits(hidden)
    assert out.dtype == hidden.dtype and out.shape == exact.shape
    assert rel(out, ref) < 1e-5
    assert 5e-3 < rel(out, exact) < 0.1  # e4m3's own error: the operands really were quantized
    grad = torch.randn(40, 512, generator=torch.Generator().manual_seed(3)) * torch.rand(40, 1) * 1e-3
    ref_g = q64(grad) @ q64(weight.T).T  # = q(grad) @ (W quantized per column)
    assert rel(head.input_grad(grad), ref_g) < 1e-5
    assert 5e-3 < rel(head.input_grad(grad), grad.double() @ weight.double()) < 0.1


def emulated_loss(h, weight, labels, weights, normaliser):
    """float64: sum(w * CE(q(h) @ q(W).T)) / normaliser, and the gradient the FP8 loss computes for h,
    q(dlogits) @ W quantized per column."""
    logits = q64(h) @ q64(weight).T
    logp = torch.log_softmax(logits, -1)
    w = weights.double()
    lab = torch.where(w > 0, labels, 0)
    loss = -(w * logp.gather(1, lab[:, None])[:, 0]).sum() / normaliser
    g = (logp.exp() - F.one_hot(lab, weight.shape[0]).double()) * (w / normaliser)[:, None]
    return loss, q64(g) @ q64(weight.T).T


@pytest.mark.parametrize("chunks", [1, 3])
def test_fused_loss_through_the_fp8_head_equals_the_emulated_reference(chunks):
    hidden, weight = lm_case(n=45)
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 512, (45,), generator=g)
    weights = torch.rand(45, generator=g)
    weights[::4] = 0
    h = hidden.clone().requires_grad_(True)
    out = chunked(h, weight, labels, weights, 30.0, chunks, top_k=5, head=GemmHead(Fp8Head(weight)))
    loss, ce_sum, correct, top = out.loss, out.sums["ce"], out.correct, out.candidates
    ref_loss, ref_grad = emulated_loss(hidden, weight, labels, weights, 30.0)
    assert rel(loss, ref_loss) < 1e-6 and rel(ce_sum / 30.0, ref_loss) < 1e-6
    loss.backward()
    assert rel(h.grad, ref_grad) < 1e-4
    # The bf16 path's (exact) gradient is measurably elsewhere: the FP8 head was used.
    h2 = hidden.clone().requires_grad_(True)
    chunked(h2, weight, labels, weights, 30.0, chunks).loss.backward()
    assert rel(h.grad, h2.grad) > 1e-3
    ref_logits = q64(hidden) @ q64(weight).T
    assert torch.equal(top, ref_logits.topk(5).indices)
    assert torch.equal(correct, (ref_logits.argmax(-1) == labels) & (weights > 0))


def test_the_head_is_for_a_frozen_weight_only():
    hidden, weight = lm_case()
    labels, weights = torch.zeros(40, dtype=torch.long), torch.ones(40)
    head = GemmHead(Fp8Head(weight))
    with pytest.raises(ValueError, match="frozen weight"):
        chunked(hidden, weight.requires_grad_(True), labels, weights, 1.0, 2, head=head)


class Spy:
    """A head that records its calls and computes the exact products (float64)."""

    def __init__(self, weight):
        self.weight, self.calls = weight, []

    def matmuls(self, rows):
        return SeparateMatmuls(rows, self)

    def logits(self, h):
        self.calls.append("logits")
        return h @ self.weight.T

    def input_grad(self, g):
        self.calls.append("input_grad")
        return g @ self.weight


@pytest.mark.parametrize("architecture,kl", [("dflash", 0.0), ("dflash2", 0.5)])
def test_drafter_loss_reaches_the_draft_models_loss_head(architecture, kl):
    """DraftModel.loss_head is what drafter_loss's fused lm_head matmuls go through, once per chunk each
    (the target's logits of the KL term are not the drafter's: they stay with the weight); with exact
    products the loss, the selector's candidates and the drafter's gradients equal the plain path's."""
    m = drafter(architecture)
    gen = torch.Generator().manual_seed(5)
    embed, head = (torch.randn(VOCAB, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mb, bl = micro_batch(m)
    if kl:
        mb.final_hidden = torch.randn(1, mb.input_ids.shape[1], D, generator=gen, dtype=torch.float64)
    settings = StepSettings(shape=m.config, num_anchors=5, gamma=4.0, loss_chunks=3, mask_kind="dense", seed=0,
                            kl_weight=kl)
    spy = Spy(head)
    w = float(bl.weights.sum())
    plain = drafter_loss(DraftModel(m, embed, head), mb, bl, w, settings=settings)
    plain.loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    out = drafter_loss(DraftModel(m, embed, head, spy), mb, bl, w, settings=settings)
    out.loss.backward()
    assert spy.calls == ["logits", "input_grad"] * 3
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-12, atol=1e-12)
    assert ("kl" in out.sums) == (kl > 0) and out.sums.keys() == plain.sums.keys()
    for name, value in out.sums.items():
        torch.testing.assert_close(value, plain.sums[name], rtol=1e-12, atol=1e-12, msg=name)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-9, atol=1e-12)
