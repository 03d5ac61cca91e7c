"""The serving export (docs/algorithm.md section 6): names, shapes, dtypes, config.json, bit-exact round trip, atomicity."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

import dflash_ds.export.drafter as export
from dflash_ds.architectures import VARIANTS
from dflash_ds.config import DrafterConfig
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.export.card import TauFacts
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from tests.remote_case import block_case, serving_call, training_call

D, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 4, 2, 16, 96, 128


def tiny_target_config():
    return Qwen3Config(hidden_size=D, intermediate_size=INTER, num_hidden_layers=8, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                       max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_drafter(seed=0, num_layers=2, target_layer_ids=(1, 3, 5)):
    shape = DrafterConfig(num_layers=num_layers, block_size=8, mask_token_id=VOCAB - 1,
                         target_layer_ids=list(target_layer_ids))
    cfg = drafter_shape(tiny_target_config(), shape)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():  # norms start at 1; make every tensor distinct
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


def spec_tensor_names(num_layers):
    """docs/algorithm.md section 6, written out by hand."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        names += [
            f"layers.{i}.self_attn.q_proj.weight",
            f"layers.{i}.self_attn.k_proj.weight",
            f"layers.{i}.self_attn.v_proj.weight",
            f"layers.{i}.self_attn.o_proj.weight",
            f"layers.{i}.self_attn.q_norm.weight",
            f"layers.{i}.self_attn.k_norm.weight",
            f"layers.{i}.mlp.gate_proj.weight",
            f"layers.{i}.mlp.up_proj.weight",
            f"layers.{i}.mlp.down_proj.weight",
            f"layers.{i}.input_layernorm.weight",
            f"layers.{i}.post_attention_layernorm.weight",
        ]
    return sorted(names)


def read_file(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def test_export_layout_matches_spec(tmp_path):
    drafter = make_drafter()
    out = save_drafter(drafter, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                     "modeling_dflash.py"]
    tensors = read_file(out)
    assert sorted(tensors) == spec_tensor_names(2)
    assert not any("embed" in n or "lm_head" in n for n in tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    expected = {"fc.weight": (D, 3 * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(2):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTER, D), p + "mlp.up_proj.weight": (INTER, D),
            p + "mlp.down_proj.weight": (D, INTER), p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
        })
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 8
    assert config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5]}
    assert {k: config[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
        "vocab_size", "tie_word_embeddings", "attention_bias", "layer_types", "use_sliding_window", "sliding_window",
    )} == {
        "hidden_size": D, "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 512, "vocab_size": VOCAB,
        "tie_word_embeddings": False, "attention_bias": False, "layer_types": ["full_attention"] * 2,
        "use_sliding_window": False, "sliding_window": None,
    }
    assert config["torch_dtype"] == "bfloat16"
    # transformers reads it as a plain qwen3 config, as the serving engines do.
    hf = Qwen3Config.from_pretrained(out)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.vocab_size) == (D, 2, HEAD_DIM, VOCAB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    drafter = make_drafter(seed=1)
    save_drafter(drafter, tmp_path / "e", dtype=dtype)
    loaded = load_drafter(tmp_path / "e")
    assert loaded.config == drafter.config
    src, back = drafter.state_dict(), loaded.state_dict()
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert back[name].dtype == dtype
        assert torch.equal(back[name], t.to(dtype)), name
    # The loaded module computes what the saved one does (same dtype): same tensors, same code.
    ref = drafter.to(dtype)
    taps = torch.randn(1, 5, 3 * D, dtype=dtype)
    assert torch.equal(loaded.fuse(taps), ref.fuse(taps))
    # dtype= converts on load.
    as32 = load_drafter(tmp_path / "e", dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in as32.parameters())


def test_save_replaces_export_atomically(tmp_path, monkeypatch):
    out = tmp_path / "export"
    first = make_drafter(seed=2)
    save_drafter(first, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    second = make_drafter(seed=3)

    def failing_save(tensors, filename, metadata=None):
        save_file(dict(list(tensors.items())[:3]), filename, metadata=metadata)  # a partial file, then a crash
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(second, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp directories left

    # A crash at the final rename also keeps the previous export.
    monkeypatch.setattr(export, "save_file", save_file)
    real_rename = export.os.rename

    def failing_rename(src, dst):
        if str(src).startswith(str(tmp_path / ".export.tmp-")):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(export.os, "rename", failing_rename)
    with pytest.raises(OSError, match="rename failed"):
        save_drafter(second, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    # Without the fault, the new export replaces the old one.
    monkeypatch.setattr(export.os, "rename", real_rename)
    save_drafter(second, out)
    loaded = load_drafter(out)
    assert all(torch.equal(loaded.state_dict()[n], t.to(torch.bfloat16)) for n, t in second.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_save_refuses_to_replace_other_directories(tmp_path):
    other = tmp_path / "model"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a DFlash drafter export"):
        save_drafter(make_drafter(), other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_load_rejects_non_dflash_directories(tmp_path):
    good = tmp_path / "good"
    save_drafter(make_drafter(), good)
    config = json.loads((good / "config.json").read_text())

    with pytest.raises(ValueError, match="config.json is missing.*--drafter"):
        load_drafter(tmp_path)

    target = tmp_path / "target"  # what a user passing the target model by mistake would hit
    target.mkdir()
    tiny_target_config().save_pretrained(target)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="architectures.*not a DFlash drafter export|not a DFlash drafter export.*architectures"):
        load_drafter(target)

    no_dflash = tmp_path / "no_dflash"
    no_dflash.mkdir()
    (no_dflash / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dflash_config"}))
    (no_dflash / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="lacks dflash_config.*pass the directory written by dflash_ds export"):
        load_drafter(no_dflash)

    bad_tensors = tmp_path / "bad_tensors"
    bad_tensors.mkdir()
    (bad_tensors / "config.json").write_text(json.dumps(config))
    tensors = read_file(good)
    tensors["lm_head.weight"] = torch.zeros(VOCAB, D)
    del tensors["norm.weight"]
    tensors["fc.weight"] = torch.zeros(D, 2 * D)
    save_file(tensors, str(bad_tensors / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_drafter(bad_tensors)
    msg = str(err.value)
    assert "missing tensors norm.weight" in msg and "unexpected tensors lm_head.weight" in msg
    assert "fc.weight (64, 128) (expected (64, 192))" in msg


def test_automodel_loads_the_export_and_computes_the_drafter(tmp_path):
    """AutoModel with trust_remote_code gives the project's drafter outputs (float32, dense mask)."""
    from transformers import AutoConfig, AutoModel

    from dflash_ds.network.attention import DFlashMask, build_mask
    from dflash_ds.network.drafter import DFlashDrafter

    out = save_drafter(make_drafter(seed=3), tmp_path / "export")
    source = (out / "modeling_dflash.py").read_text()
    assert "dflash_ds" not in source.replace("dflash-ds", "")  # self-contained
    assert json.loads((out / "config.json").read_text())["auto_map"] == VARIANTS["dflash"].spec.remote_code.auto_map
    # Serving engines (no trust_remote_code) still get the plain qwen3 config.
    plain = AutoConfig.from_pretrained(out)
    assert type(plain) is Qwen3Config and plain.hidden_size == D
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlashDraftModel" and model.config.model_type == "qwen3"
    assert model.config.block_size == 8 and model.config.target_layer_ids == [1, 3, 5]
    ours = load_drafter(out, dtype=torch.float32)
    got_state = model.state_dict()
    assert sorted(got_state) == sorted(ours.state_dict())
    assert all(torch.equal(got_state[n], t) for n, t in ours.state_dict().items())

    # Two rows, two documents in the second, three blocks each (one invalid): the training mask.
    torch.manual_seed(0)
    b, B, N = 2, 8, 3
    case = block_case(D, B)
    mask = build_mask(case.anchors, case.valid, case.doc_ids, B, kind="dense")
    got, want = training_call(model, ours, case, mask, mask.dense)
    assert got.shape == want.shape == (b, N * B, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()  # not a trivially small output

    # The serving call: one block after the whole context, no mask (everything visible).
    got1, want1 = serving_call(model, ours, case, B)
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)


def test_export_card_and_permissions(tmp_path):
    old = os.umask(0o077)
    try:
        out = save_drafter(make_drafter(), tmp_path / "export",
                           card={"target": "Qwen/Qwen3-8B", "data": "chat.jsonl", "steps": 120})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        n: 0o644 for n in ("README.md", "config.json", "model.safetensors", "modeling_dflash.py")}
    card = (out / "README.md").read_text()
    assert "Qwen/Qwen3-8B" in card and "chat.jsonl" in card and "| optimizer steps | 120 |" in card
    assert "--speculative-num-draft-tokens 8" in card and '"num_speculative_tokens": 7' in card
    assert "--target-model-dir TARGET_DIR" in card and "-md drafter.gguf --spec-draft-n-max 7" in card
    assert "`--spec-type draft-dflash`" in card
    assert "not measured" in card
    export.write_card(out, target="Qwen/Qwen3-8B", steps=120, tau=TauFacts(3.25, "eval.jsonl",
                      [0.9, 0.5, None, None, None, None, None]))
    card = (out / "README.md").read_text()
    assert "3.250 (exact offline" in card and "1:0.90 2:0.50 3:-" in card
    assert stat.S_IMODE((out / "README.md").stat().st_mode) == 0o644
