"""One suite over every recipe and every drafter architecture (the registered ones and the toy of
tests/toy_variant.py): what each must do whatever it adds.

Every recipe loads in the sections' form (no note), round-trips whole through dump_yaml -> load and
resolves (the tiny ones against their target; the hub ones against the named geometry of their
target). Every architecture's drafter has exactly the tensors its inventory lists, round-trips its
config.json, drafts the same tokens after export -> load (weights bit-exact), and its export loads
through transformers' AutoModel (its remote code: the same tensors and the same states); a config.json
missing one of its architecture's entries is refused naming it (or, for an entry with a fallback, reads
back the same drafter). Each architecture's own test files keep only its own mathematics.

The suite's other members: the online walk equals the offline count of tau
(tests/test_conformance_walk.py) and 20 in-process training steps equal a pinned record
(tests/test_conformance_steps.py), over the same architectures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash_ds.architectures import VARIANTS
from dflash_ds.config import dump_yaml, load_recipe
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape
from dflash_ds.objective.drafter_loss import StepSettings
from dflash_ds.resolve.contract import flat
from dflash_ds.resolve.drafter import check_servable, drafter_shape
from dflash_ds.target_model.presets import target_config as preset
from tests.toy_variant import TOY, register

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "recipes").glob("*.yaml"))
# The geometry in code of each hub target a recipe names (the benches' presets: no download).
GEOMETRY = {"Qwen/Qwen3.6-27B": "qwen3.6-27b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3.6-35B-A3B": "qwen3.6-35b-a3b"}
ARCHITECTURES = sorted(VARIANTS) + [TOY.spec.name]
D, VOCAB, B = 32, 96, 4


def test_the_suite_sees_every_recipe_and_architecture():
    assert len(RECIPES) >= 9 and {"dflash", "dflash2", "dspark", "toy_markov"} <= set(ARCHITECTURES)


@pytest.mark.parametrize("path", RECIPES)
def test_every_recipe_loads_round_trips_whole_and_resolves(path, tmp_path):
    recipe = load_recipe(REPO / path)
    assert recipe.notes == ()  # written in the sections' form: nothing moved, no other architecture's section
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(recipe))
    back = load_recipe(again)
    assert dataclasses.replace(back, source=recipe.source) == recipe and flat(back) == flat(recipe)
    if recipe.target.path in GEOMETRY:
        shape = drafter_shape(preset(GEOMETRY[recipe.target.path]), recipe.drafter)
        check_servable(shape)
    else:
        from dflash_ds.resolve.run import resolve_run

        shape = resolve_run(recipe, world_size=2).drafter
    assert shape.architecture == recipe.drafter.architecture
    # The architecture's own sections are what its shape and its loss read.
    own = recipe.drafter.sections.get(shape.architecture)
    assert own is None or shape.arch_fields == own
    settings = StepSettings.of(shape, recipe.objective, 0, torch.device("cpu"))
    assert settings.keys == (recipe.objective.sections.get(shape.architecture) or
                             (shape.spec.objective_keys() if shape.spec.objective_keys else None))


def small_shape(name: str) -> DrafterShape:
    from dflash_ds.config import DrafterConfig

    target = Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                         rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return drafter_shape(target, DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                               target_layer_ids=[1, 4], architecture=name))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_exports_loads_and_drafts_bit_exact(name, monkeypatch, tmp_path):
    if name == TOY.spec.name:
        register(monkeypatch)
    shape = small_shape(name)
    assert DrafterShape.from_hf_config(shape.to_hf_config()) == shape
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).float()
    with torch.no_grad():  # every tensor away from its initial value, so a tensor lost on the way shows
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    state = drafter.state_dict()
    inventory = shape.tensors()
    assert sorted(state) == sorted(inventory)
    assert all(tuple(state[n].shape) == inventory[n].shape for n in state)
    path = save_drafter(drafter, tmp_path / "export", dtype=torch.float32, card={"steps": 1})
    remote = shape.spec.remote_code  # its own remote code beside the weights, or none
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors", "README.md"} | \
        ({remote.name, *(p.name for p in remote.beside)} if remote else set())
    back = load_drafter(path, dtype=torch.float32)
    assert back.config == shape
    assert all(torch.equal(back.state_dict()[n], t) for n, t in state.items())
    g = torch.Generator().manual_seed(1)
    embed, head = (torch.randn(VOCAB, D, generator=g) for _ in range(2))
    # The states its walk reads: the drafting slots' (every slot's for a walk that reads the anchor's too).
    hidden = DraftModel(drafter, embed, head).drafting_states(torch.randn(6, B, D, generator=g))
    anchors = torch.randint(0, VOCAB, (6,), generator=g)
    context = torch.randn(6, D, generator=g)  # each anchor's context row, for an architecture that reads it
    want = DraftModel(drafter, embed, head).draft(hidden, anchors, context=context)
    assert want.shape == (6, shape.num_drafts)
    assert torch.equal(DraftModel(back, embed, head).draft(hidden, anchors, context=context), want)
    if remote is not None and "AutoConfig" in remote.auto_map:  # transformers' remote code (the toy has its own)
        automodel_loads(path, back)


def automodel_loads(path: Path, ours: DFlashDrafter) -> None:
    """AutoModel with trust_remote_code loads the export at `path` as its architecture's class, with the
    drafter's tensors bit-exact, and its backbone gives the drafter's states for one block after a context
    (the serving call, as the engines run it)."""
    from transformers import AutoModel

    from tests.remote_case import block_case, serving_call

    model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == ours.config.spec.class_name
    got, want = model.state_dict(), ours.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], t) for n, t in want.items())
    case = block_case(D, B, two_docs=False, generator=torch.Generator().manual_seed(2))
    case = case._replace(taps=case.taps[..., :ours.config.num_taps * D])  # its taps (block_case has three)
    with torch.no_grad():
        remote_states, states = serving_call(model, ours, case, B)
    torch.testing.assert_close(remote_states, states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_config_missing_an_entry_of_its_architecture_is_refused_by_name(name, monkeypatch):
    """Every `dflash_config` entry an architecture writes is read back: without it the export is refused
    naming it, unless the entry has a fallback (a block size also at the top level), which reads back
    the same drafter."""
    if name == TOY.spec.name:
        register(monkeypatch)
    shape = small_shape(name)
    config = shape.to_hf_config()
    refused = []
    for key in shape.arch_fields.config_entries(shape):
        broken = dict(config, dflash_config={k: v for k, v in config["dflash_config"].items() if k != key})
        try:
            assert DrafterShape.from_hf_config(broken) == shape, key
        except ValueError as exc:
            assert f"dflash_config.{key}" in str(exc) or key in str(exc), (key, str(exc))
            refused.append(key)
    own = [f.name for f in dataclasses.fields(shape.spec.fields)]
    assert len(refused) >= min(len(own), 1)  # an architecture with fields of its own needs them
