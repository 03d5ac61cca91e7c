"""XPress's own checks: its export against what vLLM 0.34.0's reader takes (tests/fixtures/
xpress_reader_rules.json), vLLM's drafting step restated from its reader (tests/vllm_xpress_step.py) equal
to the project's proposals and greedy tau on held-out anchors at several top-C and pass counts, the card's
serving line, and the refusals a recipe can meet. The loss against float64 autograd, the bit-exact export,
AutoModel's loading, the pinned steps and online = offline are the conformance suite's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from dflash_ds.architectures.dflash import argmax_tokens
from dflash_ds.architectures.xpress import XPressFields
from dflash_ds.config import DrafterConfig
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import check_servable, drafter_shape
from tests.vllm_xpress_step import ServedHead

RULES = json.loads((Path(__file__).parent / "fixtures" / "xpress_reader_rules.json").read_text())
D, VOCAB, B, RANK, MLP = 64, 128, 6, 16, 24


def section(**kw):
    fields = XPressFields(**{"xpress_rank": RANK, "xpress_mlp_hidden": MLP, "xpress_topc": 32, **kw})
    return DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                         architecture="xpress", sections={"xpress": fields})


def target_config():
    return Qwen3Config(hidden_size=D, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_the_export_is_what_vllm_034_reads(tmp_path):
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_shape(target_config(), section()))
    out = save_drafter(drafter, tmp_path / "export", dtype=torch.bfloat16, card={"steps": 1})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == RULES["architectures"]
    # method dflash rewrites the architecture to DFlash{arch}: both names resolve to the XPress model.
    assert {a: RULES["registry"][a] for a in (config["architectures"][0], "DFlash" + config["architectures"][0])}
    symbols = {"D": D, "V": VOCAB, "R": RANK, "H": MLP, "B": B}
    for key, rule in RULES["top_level"].items():
        assert key in config, key
        value = config[key]
        if "type" in rule:
            assert type(value) is {"int": int, "bool": bool}[rule["type"]], key
        if "equals" in rule:
            assert value == rule["equals"], key
        if "equals_key" in rule:
            assert value == config[rule["equals_key"]], key
        if "range" in rule:
            lo, hi = (symbols.get(x, x) for x in rule["range"])
            assert lo <= value <= hi, key
    assert not set(RULES["not_read"]) & set(config), "a speculators name vLLM does not read"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    for name, rule in RULES["tensors"].items():
        want = tuple(int(eval(e, {"__builtins__": {}}, symbols)) for e in rule["shape"])  # the rules' formulas only
        assert shapes.get(name) == want, name
    assert not names & set(RULES["absent_tensors"])
    assert dtypes == {"BF16"}
    ServedHead(out)  # every head parameter loaded through the reader's name mapping, none missing
    card = (out / "README.md").read_text()
    line = next(x for x in card.splitlines() if x.startswith("vllm serve"))
    cfg = json.loads(line.split("--speculative-config '")[1].split("'")[0])
    assert cfg == {"method": RULES["vllm_method"], "model": "DRAFTER_DIR", "num_speculative_tokens": B - 1}
    assert "sglang.launch_server" not in card


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
@pytest.mark.parametrize("topc, passes", [(16, 3), (0, 6), (3, 1)])
def test_vllms_step_equals_the_projects_proposals_and_tau_on_held_out_anchors(topc, passes, monkeypatch, tmp_path):
    """On the held-out prompts' greedy continuations, at every anchor: vLLM's step restated from its reader
    drafts what the project proposes offline (eval/tau.py, batched) from the same export, so a(t) and tau
    along vLLM's walk are the project's; at some anchor the refiner moves a slot off the base argmax."""
    from dflash_ds.eval.generate import greedy_continuation, target_taps
    from dflash_ds.eval.specdec import block_states
    from dflash_ds.eval.tau import accept_lengths, anchor_drafts, matched_prefix, walk
    from tests.eval_world import LAYER_IDS, PROMPT_LEN
    from tests.test_conformance_walk import walk_world

    world = walk_world("xpress")
    target, trained = world["target"], world["model"]
    drafter = copy.deepcopy(trained.drafter)
    with torch.no_grad():  # a refiner strong enough that each of its inputs moves some slot
        g = torch.Generator().manual_seed(3)
        for name, p in drafter.xpress_head.named_parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if name == "mix.L" else 0.1))
    path = save_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    for where in (config, config["dflash_config"]):
        where.update(xpress_topc=topc, xpress_num_passes=passes)
    (path / "config.json").write_text(json.dumps(config))
    model = DraftModel(load_drafter(path, dtype=torch.float32).double(), trained.embed, trained.lm_head)
    served, moved, total = ServedHead(path), 0, 0
    assert (served.topc, served.passes) == (topc, passes)
    for prompt in world["prompts"][4:]:  # not trained on
        x = greedy_continuation(target, prompt, max_new_tokens=world["new"])
        taps, end = target_taps(target, x, LAYER_IDS), x.numel()
        ours = anchor_drafts(model, taps, x, PROMPT_LEN, end=end)
        theirs = []
        for t in range(PROMPT_LEN, end):
            states, _ = block_states(model, taps[:t], int(x[t]))  # every slot's, slot 0 the anchor's
            theirs.append(served.draft(states, model.lm_head, torch.tensor([int(x[t])]))[0])
            moved += int(not torch.equal(theirs[-1], argmax_tokens(states[0, 1:], model.lm_head)))
        theirs = torch.stack(theirs)
        assert torch.equal(theirs, ours)
        a = matched_prefix(theirs, x, PROMPT_LEN, end)
        assert torch.equal(a, accept_lengths(model, taps, x, PROMPT_LEN, end=end))
        total += sum(walk(a, PROMPT_LEN, end))
    assert moved > 0 and total > 0


def test_recipe_refusals_name_the_setting():
    for fields, key in (({"xpress_rank": 12}, "xpress_rank"), ({"xpress_mlp_hidden": 0}, "xpress_mlp_hidden"),
                        ({"xpress_num_passes": 0}, "xpress_num_passes"), ({"xpress_topc": -1}, "xpress_topc")):
        with pytest.raises(ValueError, match=f"drafter.xpress.{key} "):
            drafter_shape(target_config(), section(**fields))
    shape = drafter_shape(target_config(), section(xpress_topc=VOCAB + 1))  # trains, but vLLM refuses it
    with pytest.raises(ValueError, match="drafter.xpress.xpress_topc .*exceeds the vocabulary"):
        check_servable(shape)


def speculators_checkpoint(drafter: DFlashDrafter) -> tuple[dict, dict]:
    """A speculators 0.9 XPress checkpoint of `drafter` (its config.json and tensors), written the way
    speculators' XPressDraftModel names them (`refiner_head.token_embed`, `mix_l`, `readout`; the verifier's
    tensors it keeps beside them)."""
    theirs = {"w1.weight": "token_embed.weight", "mix.L": "mix_l", "w2.weight": "readout.weight"}
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("xpress_head."):
            sub = name[len("xpress_head."):]
            name = "refiner_head." + theirs.get(sub, sub)
        tensors[name] = t.clone()
    tensors |= {"verifier_norm.weight": torch.ones(D), "embed_tokens.weight": torch.zeros(VOCAB, D)}
    s = drafter.config
    config = {"speculators_model_type": "xpress", "architectures": ["XPressSpeculator"], "block_size": s.block_size,
              "mask_token_id": s.mask_token_id, "aux_hidden_state_layer_ids": list(s.target_layer_ids),
              "draft_vocab_size": VOCAB, "sample_from_anchor": False, "xpress_rank": RANK, "xpress_mlp_ratio": 2,
              "num_jacobi_passes": 4,
              "transformer_layer_config": {"num_hidden_layers": s.num_hidden_layers, "vocab_size": VOCAB,
                                           "num_attention_heads": s.num_attention_heads,
                                           "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim,
                                           "intermediate_size": s.intermediate_size, "hidden_size": D}}
    return config, tensors


def test_a_speculators_checkpoint_becomes_an_export_vllm_loads(tmp_path):
    """Each of speculators' names translates to vLLM's (the values land where they came from), its config's
    XPress keys to vLLM's (xpress_mlp_ratio x rank -> xpress_mlp_hidden, num_jacobi_passes ->
    xpress_num_passes), the verifier's tensors are dropped, and the export drafts what the original drafter
    drafts, through vLLM's step; what vLLM cannot serve is refused by name."""
    from dflash_ds.architectures.xpress import speculators as sp

    torch.manual_seed(0)
    original = DFlashDrafter(drafter_shape(target_config(), section(xpress_mlp_hidden=2 * RANK, xpress_num_passes=4,
                                                                    xpress_topc=512)))
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.3 * torch.randn_like(p))
    config, tensors = speculators_checkpoint(original)
    sp.check_config(config)
    translated = {sp.vllm_name(n): t for n, t in tensors.items() if sp.vllm_name(n) is not None}
    assert {sp.vllm_name(f"refiner_head.{a}") for a in ("token_embed.weight", "mix_l", "readout.weight")} == \
        {"xpress_head.w1.weight", "xpress_head.mix.L", "xpress_head.w2.weight"}
    assert sp.vllm_name("verifier_norm.weight") is None and sp.vllm_name("layers.0.mlp.up_proj.weight") == \
        "layers.0.mlp.up_proj.weight"
    want = original.state_dict()
    assert sorted(translated) == sorted(want) and all(torch.equal(translated[n], want[n]) for n in want)
    section_of = DrafterConfig(**sp.backbone(config), architecture="xpress", sections={"xpress": sp.fields(config)})
    shape = drafter_shape(target_config(), section_of)
    assert shape == original.config
    converted = DFlashDrafter(shape)
    converted.load_state_dict(translated, strict=True)
    out = save_drafter(converted, tmp_path / "export", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    embed, lm_head = (torch.randn(VOCAB, D, generator=g) for _ in range(2))
    states, anchors = torch.randn(5, B, D, generator=g), torch.randint(0, VOCAB, (5,), generator=g)
    ours = DraftModel(original, embed, lm_head).draft(states, anchors)
    assert torch.equal(ServedHead(out).draft(states, lm_head, anchors), ours)
    for bad, match in (({"sample_from_anchor": True}, "sample_from_anchor"), ({"draft_vocab_size": 64}, "draft_vocab_size"),
                       ({"speculators_model_type": "dflash"}, "speculators_model_type")):
        with pytest.raises(ValueError, match=match):
            sp.check_config({**config, **bad})
    with pytest.raises(ValueError, match="refiner_head.gate"):
        sp.vllm_name("refiner_head.gate")
