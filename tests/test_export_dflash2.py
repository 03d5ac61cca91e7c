"""A DFlash2 export: tensor names and shapes against the rules of z-lab's public DFlash2 header fixture
(tests/fixtures/dflash2_header_rules.json, restated as formulas), config.json fields, the refusals of a
config that does not match (the bit-exact round trip, a missing field and AutoModel's loading are the
conformance suite's), the remote code's outputs and proposals equal to the project's drafter, the model
card."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

import dflash_ds.export as export
from dflash_ds.architectures import VARIANTS
from dflash_ds.architectures.dflash2 import DFlash2Fields
from dflash_ds.config import DrafterConfig
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.attention import build_mask
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import drafter_shape
from tests.remote_case import block_case, serving_call, training_call

RULES = json.loads((Path(__file__).parent / "fixtures" / "dflash2_header_rules.json").read_text())
D, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, B = 64, 4, 2, 16, 96, 128, 8


def tiny_target_config():
    return Qwen3Config(hidden_size=D, intermediate_size=INTER, num_hidden_layers=8, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                       max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_drafter(seed=0, num_layers=2):
    section = DrafterConfig(num_layers=num_layers, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                             architecture="dflash2",
                             sections={"dflash2": DFlash2Fields(conv_group_size=16, selector_rank=12, selector_top_k=6)})
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_shape(tiny_target_config(), section))
    with torch.no_grad():  # every tensor distinct (the convolutions and selector included)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


def rule_shapes(symbols: dict, layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape the rules give for one configuration."""
    def ev(expr):
        return int(eval(expr, {"__builtins__": {}}, dict(symbols)))  # formulas of the rules file only

    out = {name: tuple(ev(e) for e in r["shape"]) for name, r in RULES["global"].items()}
    for name, r in RULES["per_layer"].items():
        for i in range(layers):
            out[name.format(i=i)] = tuple(ev(e) for e in r["shape"])
    return out


def test_rules_reproduce_the_public_fixture_shapes():
    # The formulas, evaluated at the fixture's configuration, give the fixture's own shapes.
    ex = RULES["example_config"]
    shapes = rule_shapes(ex, ex["layers"])
    for name, r in RULES["global"].items():
        assert shapes[name] == tuple(r["example"]), name
    for name, r in RULES["per_layer"].items():
        assert shapes[name.format(i=ex["layers"] - 1)] == tuple(r["example"]), name
    assert len(shapes) == len(RULES["global"]) + ex["layers"] * len(RULES["per_layer"])


def test_expected_shapes_follow_the_public_rules_at_the_published_width():
    # DFlash2's published geometry (z-lab's fixture), without its optional logit transforms.
    ex = RULES["example_config"]
    shape = DrafterShape(hidden_size=ex["D"], intermediate_size=ex["I"], num_hidden_layers=ex["layers"],
                         num_attention_heads=ex["H"], num_key_value_heads=ex["KV"], head_dim=ex["HD"],
                         rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None, max_position_embeddings=131072,
                         vocab_size=ex["V"], num_target_layers=52, target_layer_ids=(1, 13, 25, 37, 49),
                         block_size=16, mask_token_id=201818, tie_word_embeddings=False, architecture="dflash2",
                         arch_fields=DFlash2Fields(ex["K"], ex["G"], ex["R"], 16))
    assert export.expected_shapes(shape) == rule_shapes(ex, ex["layers"])


def test_export_names_shapes_and_config_follow_the_rules(tmp_path):
    drafter = make_drafter()
    out = save_drafter(drafter, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        dtypes = {f.get_slice(n).get_dtype() for n in f.keys()}
    cfg = drafter.config
    symbols = dict(D=D, H=HEADS, KV=KV_HEADS, HD=HEAD_DIM, I=INTER, T=3, K=cfg.arch_fields.conv_kernel_size,
                   G=cfg.arch_fields.conv_group_size, R=cfg.arch_fields.selector_rank, V=VOCAB)
    assert got == rule_shapes(symbols, 2)
    assert dtypes == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    rules = RULES["config"]
    assert config["architectures"] == rules["architectures"] and config["model_type"] == rules["model_type"]
    assert sorted(config["dflash_config"]) == sorted(rules["dflash_config_keys"])
    assert config["dflash_config"] == {"block_size": B, "conv_group_size": 16, "conv_kernel_size": 2,
                                       "mask_token_id": VOCAB - 1, "selector_rank": 12, "selector_top_k": 6,
                                       "target_layer_ids": [1, 3, 5]}
    present = [k for k in rules["top_level_keys"] if k in config]
    assert {"num_target_layers", "layer_types", "use_sliding_window", "sliding_window",
            "max_window_layers"} <= set(present)
    assert config["auto_map"] == VARIANTS["dflash2"].spec.remote_code.auto_map
    card = (out / "README.md").read_text()
    assert "# DFlash2 drafter" in card and '"num_speculative_tokens": 7' in card
    assert "--speculative-num-draft-tokens 8" in card and "DFlash2DraftModel" in card


def test_a_dflash2_config_mismatching_a_field_is_refused_by_name(tmp_path):
    # The bit-exact round trip and a missing field are the conformance suite's (tests/test_conformance.py).
    drafter = make_drafter(seed=1)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    # The target's logit and embedding scaling are read and written back under the reference's names;
    # identity values are not written (a Qwen export carries none of them).
    assert not {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"} & set(config["dflash_config"])
    scaled = dict(config, dflash_config=dict(config["dflash_config"], final_logit_softcapping=20.0,
                                             output_multiplier=0.5, input_embedding_scale=8.0))
    shape = DrafterShape.from_hf_config(scaled)
    assert (shape.final_logit_softcapping, shape.output_multiplier, shape.input_embedding_scale) == (20.0, 0.5, 8.0)
    assert shape.to_hf_config()["dflash_config"] == scaled["dflash_config"]
    assert DrafterShape.from_hf_config(dict(config, dflash_config=dict(
        config["dflash_config"], final_logit_softcapping=0.0))).final_logit_softcapping is None  # 0: none
    with pytest.raises(ValueError, match="output_multiplier"):
        DrafterShape.from_hf_config(dict(config, dflash_config=dict(config["dflash_config"], output_multiplier=-1.0)))
    # Tensors that do not match the config are refused at load.
    (out / "config.json").write_text(json.dumps(dict(config, dflash_config=dict(config["dflash_config"],
                                                                                   selector_rank=13))))
    with pytest.raises(ValueError, match="candidate_selector"):
        load_drafter(out)


def test_automodel_loads_dflash2_and_equals_the_drafter(tmp_path):
    from transformers import AutoModel

    drafter = make_drafter(seed=3)
    sel = drafter.candidate_selector
    with torch.no_grad():  # pair scores of the size of the unary logits, so that the path changes
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.normal_(0, 1.0)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ours = load_drafter(out, dtype=torch.float32)  # its class and tensors: the conformance suite's

    torch.manual_seed(0)
    case = block_case(D, B, two_docs=False)
    mask = build_mask(case.anchors, case.valid, case.doc_ids, B, kind="dense")
    got, want = training_call(model, ours, case, mask, mask.dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Without its convolutions the output differs: the comparison sees them.
    with torch.no_grad():
        for layer in ours.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        bare = ours(case.embeds, ours.fuse(case.taps), case.block_pos, case.ctx_pos, mask=mask)
    assert not torch.allclose(bare, want, rtol=1e-3, atol=1e-3)
    ours = load_drafter(out, dtype=torch.float32)

    # The serving call: one block after the context, then the selector's proposals.
    lm_head = torch.randn(VOCAB, D)
    hidden_remote, hidden = serving_call(model, ours, case, B)
    torch.testing.assert_close(hidden_remote, hidden, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        anchor = torch.tensor([7])
        want_tokens = DraftModel(ours, torch.zeros(VOCAB, D), lm_head).draft(hidden[:, 1:], anchor)
        got_tokens = model.propose(hidden[:, 1:], anchor, lm_head)
    assert torch.equal(got_tokens, want_tokens)
    assert not torch.equal(want_tokens, (hidden[:, 1:] @ lm_head.T).argmax(-1))  # the selector acts here


@pytest.mark.parametrize("is_causal", [False, None])
def test_automodel_dflash2_with_sliding_layers_equals_the_drafter(tmp_path, is_causal):
    """DFlash2 in its published layout (every layer sliding, is_causal false) and with the engines'
    default causality: the remote code's windows and convolutions give the drafter's output."""
    from transformers import AutoModel

    from dflash_ds.eval.specdec import serving_masks
    from dflash_ds.network.attention import build_layer_masks

    W, S = 10, 24  # a window of 10 over blocks of 8: the context is cut at every anchor
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                             architecture="dflash2", sections={"dflash2": DFlash2Fields(selector_rank=12, selector_top_k=6)},
                             layer_types=("sliding_attention", "sliding_attention"), sliding_window=W,
                             is_causal=is_causal)
    torch.manual_seed(4)
    drafter = DFlashDrafter(drafter_shape(tiny_target_config(), section))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == W
    assert config.get("is_causal") == is_causal
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlash2DraftModel"
    ours = load_drafter(out, dtype=torch.float32)
    case = block_case(D, B, seq=S, two_docs=False, all_valid=True, generator=torch.Generator().manual_seed(0))
    masks = build_layer_masks(case.anchors, case.valid, case.doc_ids, B, attentions=ours.config.layer_attentions())
    training = build_mask(case.anchors, case.valid, case.doc_ids, B)
    got, want = training_call(model, ours, case, masks, training.dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dm = DraftModel(ours, torch.zeros(1), torch.zeros(1))
    got1, want1 = serving_call(model, ours, case, B, serving_masks(dm, S, torch.device("cpu")))
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
    # The windows matter here: the same weights with every layer full and bidirectional differ.
    with torch.no_grad():
        plain = DFlashDrafter(ours.config.replace(layer_types=("full_attention",) * 2, sliding_window=None,
                                                  is_causal=None))
        plain.load_state_dict(ours.state_dict())
        other = plain(case.embeds, plain.fuse(case.taps), case.block_pos, case.ctx_pos, mask=training)
        assert not torch.allclose(other, want, rtol=1e-3, atol=1e-3)
