"""What the distillation term reads (the term itself: tests/test_loss.py): the slot -> target position
map, and the target's final-norm tap."""

import pytest
import torch

from dflash_ds.objective.blocks import slot_target_states

V = 50


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
    forward_taps(model, capture, ids, None, out=buf[..., :layout.tap_cols])
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
    with pytest.raises(TargetError, match="final-norm tap needs the target's final norm"):
        TapCapture(model, [0, 2], final_norm=True)
