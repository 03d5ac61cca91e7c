"""A DSpark export: config.json fields and tensor names and shapes against what llama.cpp's converter,
vLLM's and SGLang's readers take (tests/fixtures/dspark_reader_rules.json), an export that starts a run
and the refusals of one that does not match (the bit-exact round trip, a missing field and AutoModel's
loading are the conformance suite's), the remote code's outputs and proposals equal to the project's drafter, the model card's serving
commands, and the refusals a recipe can meet."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from dflash_ds.architectures import VARIANTS
from dflash_ds.architectures.dspark import DSparkFields
from dflash_ds.config import DrafterConfig
from dflash_ds.export import expected_shapes, load_drafter, save_drafter
from dflash_ds.network.attention import build_mask
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import drafter_shape
from tests.remote_case import block_case, serving_call, training_call

RULES = json.loads((Path(__file__).parent / "fixtures" / "dspark_reader_rules.json").read_text())
D, VOCAB, B, RANK = 64, 128, 7, 12


def tiny_target_config(**kw):
    return Qwen3Config(hidden_size=D, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)


def section(**kw):
    return DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                         architecture="dspark", sections={"dspark": DSparkFields(**{"markov_rank": RANK, **kw})})


def make_drafter(seed=0, **kw):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_shape(tiny_target_config(), section(**kw)))
    with torch.no_grad():  # every tensor distinct, and the heads large enough to change the walk
        for n, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if "head" in n else 0.1))
    return drafter


def rule_shapes(symbols: dict) -> dict[str, tuple[int, ...]]:
    def ev(expr):
        return int(eval(expr, {"__builtins__": {}}, dict(symbols)))  # formulas of the rules file only

    return {name: tuple(ev(e) for e in r["shape"]) for name, r in RULES["tensors"].items()}


def check_fields(config: dict, rules: dict) -> None:
    types = {"int": int, "list": list}
    for key, rule in rules.items():
        assert key in config, key
        if "equals" in rule:
            assert config[key] == rule["equals"], key
        if "type" in rule:
            assert isinstance(config[key], types[rule["type"]]) and not isinstance(config[key], bool), key


def test_export_config_and_tensors_follow_the_readers_rules(tmp_path):
    drafter = make_drafter()
    out = save_drafter(drafter, tmp_path / "export", num_anchors=24)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    heads = {n: s for n, s in got.items() if n.split(".")[0] in ("markov_head", "confidence_head")}
    assert heads == rule_shapes({"D": D, "V": VOCAB, "R": RANK})
    assert not set(RULES["absent_tensors"]) & set(got)
    assert not any(n.startswith("model.") for n in got)
    backbone = {n: s for n, s in got.items() if n not in heads}
    v1 = DrafterShape.from_hf_config(json.loads((out / "config.json").read_text())).replace(architecture="dflash",
                                                                                            arch_fields=None)
    assert backbone == expected_shapes(v1)  # the DFlash backbone, unchanged
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == RULES["architectures"] and config["model_type"] == "qwen3"
    check_fields(config, RULES["top_level"])
    check_fields(config["dflash_config"], RULES["dflash_config"])
    assert (config["markov_rank"], config["block_size"], config["num_anchors"]) == (RANK, B, 24)
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"] == VOCAB - 1
    assert config["auto_map"] == VARIANTS["dspark"].spec.remote_code.auto_map
    card = (out / "README.md").read_text()
    assert "# DSpark drafter" in card and '"method": "dspark"' in card and f'"num_speculative_tokens": {B}' in card
    assert f"--speculative-algorithm DSPARK" in card and f"--speculative-num-draft-tokens {B + 1}" in card
    assert "convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR" in card
    # llama.cpp verifies all B drafts of the anchor-first block (its n_max limit is B for DSpark).
    assert f"-md drafter.gguf --spec-draft-n-max {B}" in card and "`--spec-type draft-dspark`" in card
    assert f"{B} drafted tokens" in card and f"rank {RANK}" in card


def test_a_dspark_export_starts_a_run_and_a_mismatching_field_is_refused(tmp_path):
    # The bit-exact round trip and a missing field are the conformance suite's (tests/test_conformance.py).
    drafter = make_drafter(seed=1)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    # drafter.init_from: the run's shape loads the export (the same fields, compared by check_init_from).
    again = load_drafter(out, shape=drafter_shape(tiny_target_config(), section()))
    assert torch.equal(again.markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, dflash_config=dict(config["dflash_config"],
                                                                                   markov_rank=RANK + 1))))
    with pytest.raises(ValueError, match="markov_head"):
        load_drafter(out)


def test_a_head_free_of_the_markov_feature_and_no_confidence_head_export_their_shapes(tmp_path):
    plain = make_drafter(confidence_head_with_markov=False)
    assert tuple(plain.confidence_head.proj.weight.shape) == (1, D)
    none = make_drafter(enable_confidence_head=False)
    assert not hasattr(none, "confidence_head")
    out = save_drafter(none, tmp_path / "none", dtype=torch.float32)
    assert load_drafter(out).config.arch_fields.enable_confidence_head is False


def test_the_card_serves_only_what_the_engines_load(tmp_path):
    """Without a confidence head the card says nothing of --spec-draft-p-min (no confidence to cut at);
    a confidence head without the Markov embedding is a form llama.cpp does not build, so the card gives
    no llama.cpp commands and the engines' count for it is not predicted."""
    cards = {}
    for name, kw in (("full", {}), ("none", {"enable_confidence_head": False}),
                     ("plain", {"confidence_head_with_markov": False})):
        out = save_drafter(make_drafter(**kw), tmp_path / name, dtype=torch.float32)
        cards[name] = (out / "README.md").read_text()
    assert "--spec-draft-p-min P" in cards["full"] and "llama-server -m target.gguf" in cards["full"]
    assert "spec-draft-p-min" not in cards["none"] and "llama-server -m target.gguf" in cards["none"]
    assert "llama-server" not in cards["plain"] and "llama.cpp does not load this drafter" in cards["plain"]
    assert "vllm serve" in cards["plain"] and "sglang.launch_server" in cards["plain"]
    shape = make_drafter(confidence_head_with_markov=False).config
    assert shape.spec.card(shape).serving.llama_cpp_type is None


def test_no_llama_cpp_cut_is_predicted_for_a_drafter_llama_cpp_does_not_load():
    from dflash_ds.eval.cli import llama_cpp_loads

    plain = DraftModel(make_drafter(confidence_head_with_markov=False), torch.zeros(VOCAB, D), torch.randn(VOCAB, D))
    assert not llama_cpp_loads(plain) and llama_cpp_loads(DraftModel(make_drafter(), torch.zeros(VOCAB, D), torch.randn(VOCAB, D)))
    hidden, anchors = torch.randn(3, B, D), torch.tensor([1, 2, 3])
    assert plain.propose(hidden, anchors).served.tolist() == [B] * 3  # drafting itself is unchanged
    with pytest.raises(ValueError, match="llama.cpp does not load"):
        plain.propose(hidden, anchors, 0.5)


def test_automodel_loads_dspark_and_equals_the_drafter(tmp_path):
    from transformers import AutoModel

    drafter = make_drafter(seed=3)
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ours = load_drafter(out, dtype=torch.float32)  # its class and tensors: the conformance suite's
    case = block_case(D, B, two_docs=False)
    mask = build_mask(case.anchors, case.valid, case.doc_ids, B, kind="dense")
    got, want = training_call(model, ours, case, mask, mask.dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The serving call: one anchor-first block after the context, then the chain and its confidences.
    lm_head = torch.randn(VOCAB, D)
    hidden_remote, hidden = serving_call(model, ours, case, B)
    torch.testing.assert_close(hidden_remote, hidden, rtol=1e-5, atol=1e-5)
    anchor = torch.tensor([7])
    with torch.no_grad():
        dm = DraftModel(ours, torch.zeros(VOCAB, D), lm_head)
        want_tokens = dm.draft(dm.drafting_states(hidden), anchor)
        got_tokens, got_conf = model.propose(hidden, anchor, lm_head)
        prev = torch.cat([anchor, want_tokens[0, :-1]])[None]
        want_conf = torch.sigmoid(ours.confidence_head(hidden, ours.markov_head.embed(prev)))
    assert want_tokens.shape == (1, B) and torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_conf, want_conf)
    assert not torch.equal(want_tokens, (hidden @ lm_head.T).argmax(-1))  # the Markov bias acts here


def test_recipe_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"^drafter\.dspark\.markov_head_type = 'gated' is not served.*set vanilla$"):
        drafter_shape(tiny_target_config(), section(markov_head_type="gated"))
    with pytest.raises(ValueError, match=r"^drafter\.dspark\.markov_rank = 0 must be >= 1"):
        drafter_shape(tiny_target_config(), section(markov_rank=0))
    with pytest.raises(ValueError, match=r"^target\.path scales or caps the target's logits"):
        drafter_shape(tiny_target_config(final_logit_softcapping=30.0), section())
