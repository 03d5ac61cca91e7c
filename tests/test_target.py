"""The frozen target: tap ids are HF hidden_states[k + 1]; truncation, embed/head, adapters, errors."""

import pytest
import torch

from dflash_ds.config import RecipeError, load_recipe
from dflash_ds.resolve.run import resolve_run
from dflash_ds.target_model.model import (TapCapture, TargetError, decoder_layers, embed_and_head, forward_taps, load_config,
                              load_target, target_geometry, truncate_after)


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen35():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
                            max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3_5ForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_qwen35])
def test_tap_k_is_hidden_states_k_plus_1(make):
    model = make()
    n = len(decoder_layers(model))
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    # hidden_states[n] is after the final norm in transformers 5, so the last layer is not compared
    # that way; it is checked against a hook-free forward of the truncated stack below.
    taps = [0, 1, n - 2]
    out = torch.full((2, 11, len(taps) * 32), float("nan"))
    cap = TapCapture(model, taps)
    forward_taps(model, cap, ids, None, out=out)
    for i, k in enumerate(taps):
        assert torch.equal(out[..., i * 32:(i + 1) * 32], hs[k + 1]), k
    # Truncating after the last tap changes no tap.
    cap.remove()
    truncate_after(model, n - 2)
    assert len(decoder_layers(model)) == n - 1
    again = torch.full_like(out, float("nan"))
    forward_taps(model, TapCapture(model, taps), ids, None, out=again)
    assert torch.equal(again, out)


def test_geometry_flags_hybrid_targets():
    assert target_geometry(tiny_qwen35().config).hybrid and not target_geometry(tiny_qwen3().config).hybrid


def test_embed_and_head_read_only_those_tensors(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path)
    embed, head = embed_and_head(str(tmp_path), torch.float32)
    assert torch.equal(embed, model.model.embed_tokens.weight) and torch.equal(head, model.lm_head.weight)


def test_adapter_is_merged_at_load(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen3()
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(tiny_qwen3(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    merged = load_target(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"), dtype="float32")
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, plain, atol=1e-3)
    assert not any(p.requires_grad for p in merged.parameters())


def test_unreachable_target_path_names_the_setting():
    with pytest.raises(TargetError, match=r"^the target '/nonexistent/model/dir' cannot be loaded"):
        load_config("/nonexistent/model/dir")
    # At the boundary the setting is named.
    with pytest.raises(RecipeError, match=r"^target\.path: /nonexistent/model/dir does not exist; point target\.path"):
        resolve_run(load_recipe("recipes/tiny.yaml", ["target.path=/nonexistent/model/dir"]), world_size=2)
    with pytest.raises(TargetError, match="tap layer ids"):
        TapCapture(tiny_qwen3(), [7])
