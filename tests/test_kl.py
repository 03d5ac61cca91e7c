"""The distillation term: the fused and the checkpointed loss against a float64 dense autograd
reference, flat memory (one chunk of logits, one extra lm_head matmul per chunk), the slot ->
target position map, and the target's final-norm tap."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.model.linear_ce import KLTerm, linear_cross_entropy_kl
from dflash_ds.model.loss import slot_target_states
from dflash_ds.model.objective import LossOptions, chunked_loss
from tests.test_linear_ce import CHUNKS, D, N, V, HeadMatmuls, case
from tests.test_objective import B, Q, ROWS, loss_case


def reference(hidden, weight, target_hidden, labels, weights, normaliser, kl_weight, temperature):
    """Dense float64: every logit materialised, autograd for the gradients, the target constant."""
    logits = hidden.double() @ weight.double().T
    t_logits = (target_hidden.double() @ weight.double().T).detach()
    sup = weights > 0
    ce = F.cross_entropy(logits, torch.where(sup, labels, 0), reduction="none")
    log_q = F.log_softmax(logits / temperature, -1)
    log_p = F.log_softmax(t_logits / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce_sum, kl_sum = (weights.double() * ce).sum(), (weights.double() * kl).sum()
    return (ce_sum + kl_weight * temperature ** 2 * kl_sum) / normaliser, ce_sum, kl_sum


def target_states(dtype, seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_fused_kl_matches_dense_reference(dtype, tol, temperature):
    hidden, weight, labels, weights = case(dtype)
    target = target_states(dtype)
    norm = torch.tensor(float(weights.sum()) * 1.3)
    h_ref = hidden.to(torch.float64, copy=True).requires_grad_()
    loss_ref, ce_ref, kl_ref = reference(h_ref, weight, target, labels, weights, norm.double(), 0.7, temperature)
    (2.0 * loss_ref).backward()
    assert kl_ref > 0.2 * ce_ref  # large enough for a mistake in the term to show
    for num_chunks in (1, 3, 7, N + 2):
        h = hidden.clone().requires_grad_()
        loss, ce_sum, correct, kl_sum = linear_cross_entropy_kl(h, weight, labels, weights, norm, num_chunks,
                                                                KLTerm(0.7, temperature, target))
        (2.0 * loss).backward()
        torch.testing.assert_close(loss.double(), loss_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(ce_sum.double(), ce_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(kl_sum.double(), kl_ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol, atol=tol)
    # The KL gradient is really in there: without the term the input gradient differs.
    h = hidden.clone().requires_grad_()
    linear_cross_entropy_kl(h, weight, labels, weights, norm, 3)[0].backward()
    assert (h.grad.double() - h_ref.grad).abs().max() > 100 * tol
    # Against itself the KL is 0 and the gradient is that of CE alone.
    same = linear_cross_entropy_kl(hidden, weight, labels, weights, norm, 3, KLTerm(0.7, temperature, hidden))
    assert abs(float(same[3])) < 1e-5


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_chunked_loss_with_target_states_matches_reference(fused, temperature):
    hidden, lm_head, labels, weights = loss_case(torch.float64)
    g = torch.Generator().manual_seed(5)
    target = torch.randn(ROWS, Q, hidden.shape[-1], generator=g, dtype=torch.float64)
    norm = weights.sum() * 1.1
    # Reference over the slots chunked_loss supervises: slot 0 of every block is left out by shape.
    keep = (torch.arange(Q) % B) != 0
    sel = lambda t: t[:, keep].reshape(-1, *t.shape[2:])  # noqa: E731
    h_ref = hidden.clone().requires_grad_()
    loss_ref, ce_ref, kl_ref = reference(sel(h_ref), lm_head, sel(target), sel(labels), sel(weights), norm, 0.4,
                                         temperature)
    loss_ref.backward()
    for num_chunks in (1, 3, 100):
        h = hidden.clone().requires_grad_()
        out = chunked_loss(h, lm_head, labels, weights, norm, LossOptions(num_chunks, B, fused=fused),
                           KLTerm(0.4, temperature, target))
        out.loss.backward()
        for got, want in ((out.loss, loss_ref), (out.ce_sum, ce_ref), (out.kl_sum, kl_ref), (h.grad, h_ref.grad)):
            torch.testing.assert_close(got.double(), want.detach().double(), rtol=1e-9, atol=1e-11)


class PeakOutput(TorchDispatchMode):
    """The largest tensor any op creates (in elements): a full-vocabulary logits tensor for all
    rows would show here."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.peak = max(self.peak, t.numel())
        return out


def test_kl_adds_one_lm_head_matmul_per_chunk_and_memory_stays_flat():
    hidden, weight, labels, weights = case(torch.float32)
    target = target_states(torch.float32)
    assert max(N * D, V * D) < N * V  # so the peak check below can tell one chunk of logits from all of them
    for num_chunks, (chunks, rows) in CHUNKS.items():
        h = hidden.clone().requires_grad_()
        with HeadMatmuls(weight) as counter, PeakOutput() as peak:
            loss = linear_cross_entropy_kl(h, weight, labels, weights, 2.0, num_chunks, KLTerm(0.5, 2.0, target))[0]
            forward = counter.count
            loss.backward()
        # Forward: drafter logits, target logits and the input gradient of every chunk; backward: none.
        assert (forward, counter.count) == (3 * chunks, 3 * chunks), num_chunks
        assert counter.rows == {rows}, (num_chunks, counter.rows)
        assert peak.peak <= max(rows * V, N * D, V * D), (num_chunks, peak.peak)
        if chunks > 1:
            assert peak.peak < N * V  # never every row's logits at once


def test_slot_target_states_map_slot_k_to_position_a_plus_k_minus_1():
    s, d = 10, 3
    final = torch.arange(2 * s * d, dtype=torch.float32).view(2, s, d)
    anchors = torch.tensor([[2, 7], [0, 4]])
    got = slot_target_states(final, anchors, 4).view(2, 2, 4, d)
    # Block at anchor 2: slots 0..3 -> positions 1, 2, 3, 4; anchor 7 -> 6, 7, 8, 9; anchor 0 -> 0 (clamped), 0, 1, 2.
    want_pos = [[[1, 2, 3, 4], [6, 7, 8, 9]], [[0, 0, 1, 2], [3, 4, 5, 6]]]
    for r in range(2):
        for n in range(2):
            for k in range(4):
                assert torch.equal(got[r, n, k], final[r, want_pos[r][n][k]]), (r, n, k)
    # Positions past the row are clamped (those slots have weight 0).
    assert torch.equal(slot_target_states(final, torch.tensor([[8]]).expand(2, 1), 4)[0, -1], final[0, -1])


def test_target_final_norm_tap_equals_transformers_last_hidden_state():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_ds.resolve.payload import PayloadLayout, final_hidden, layer_taps
    from dflash_ds.target_model.model import TapCapture, TargetError, forward_taps, truncate_after

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=V, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).double().eval().requires_grad_(False)
    ids = torch.randint(0, V, (2, 12))
    layout = PayloadLayout(2, 12, 2, 32, torch.float64, final_norm=True)
    buf = layout.empty("cpu")
    capture = TapCapture(model, [0, 2], final_norm=True)
    forward_taps(model, capture, ids, None, buf[..., :layout.tap_cols])
    ref = model(ids, output_hidden_states=True)
    hs = ref.hidden_states
    torch.testing.assert_close(layer_taps(buf, layout), torch.cat([hs[1], hs[3]], -1))
    # The final-norm state is what the lm_head reads: its logits are the target's.
    torch.testing.assert_close(final_hidden(buf, layout), hs[-1])
    torch.testing.assert_close(final_hidden(buf, layout) @ model.lm_head.weight.T, ref.logits)
    assert final_hidden(buf, PayloadLayout(2, 12, 2, 32, torch.float64)) is None
    # A target cut after its last tap has no final norm worth sending: refused, not silently wrong.
    capture.remove()
    truncate_after(model, 2)
    with pytest.raises(TargetError, match="kl_weight"):
        TapCapture(model, [0, 2], final_norm=True)
