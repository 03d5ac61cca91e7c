"""The seam per drafter architecture (architectures/): a new one is its package plus one name in the list.

tests/toy_variant.py defines one outside the package (a Markov logit bias from the previous token, a
total-variation term against the target inside the fused loss, the Markov walk, its own recipe
sections, export field, tensors, logged and plotted field and remote code). Here it is read from a
recipe, trains a step, logs, exports, loads back (its remote code too) and drafts with no edit to the
package, and its in-loop term matches a float64 dense reference (values and gradients, with and
without the KL term, under a logit transform)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_ds.config import DrafterConfig
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from tests.reference import chunked
from dflash_ds.export.card import model_card
from dflash_ds.network.logit_transform import IDENTITY, LogitTransform
from dflash_ds.network.shape import DrafterShape
from dflash_ds.objective.blocks import MicroBatch, make_blocks
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape
from tests.toy_variant import markov_bias, markov_term, predecessors, register

D, VOCAB, B, S = 32, 96, 4, 40


def target_config():
    return Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                       rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)


def toy_shape(**kw) -> DrafterShape:
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 4],
                            architecture="toy_markov", **kw)
    return drafter_shape(target_config(), section)


def micro_batch(g: torch.Generator) -> MicroBatch:
    ids = torch.randint(0, VOCAB - 1, (1, S), generator=g)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    loss_mask[:, :6] = False
    return MicroBatch(torch.randn(1, S, 2 * D, generator=g, dtype=torch.float64), ids, loss_mask,
                      torch.zeros(1, S, dtype=torch.int32), torch.randn(1, S, D, generator=g, dtype=torch.float64))


def test_a_variant_defined_outside_the_package_trains_exports_loads_and_drafts(monkeypatch, tmp_path):
    toy = register(monkeypatch)
    shape = toy_shape()
    assert shape.variant is toy and shape.arch_fields.toy_rank == 3
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).double()
    g = torch.Generator().manual_seed(1)
    embed, head = (torch.randn(VOCAB, D, generator=g, dtype=torch.float64) for _ in range(2))
    model = DraftModel(drafter, embed, head)
    settings = StepSettings(shape=shape, num_anchors=6, gamma=4.0, loss_chunks=3, mask_kind="dense", seed=0,
                            keys=toy.spec.objective_keys())
    mb = micro_batch(g)
    blocks = make_blocks(mb, settings, 0)
    weight = blocks.weights.sum()
    out = drafter_loss(model, mb, blocks, weight, settings=settings, step=0, total_steps=1)
    assert set(out.sums) == {"ce", "tv_sum"} and float(out.sums["tv_sum"]) > 0  # its one named log
    record = toy.spec.logs.record({"tv_sum": float(out.sums["tv_sum"])}, float(weight))
    assert 0 < record["tv"] < 1
    # One optimizer step moves the head and the backbone.
    opt = torch.optim.SGD(drafter.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    out.loss.backward()
    assert drafter.markov_head.embedding.grad.abs().sum() > 0 and drafter.markov_head.projection.grad.abs().sum() > 0
    opt.step()
    moved = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert {"markov_head.embedding", "markov_head.projection", "fc.weight"} <= moved
    # Export: its class name, its field in dflash_config, its tensors, its own remote code (not DFlash's).
    path = save_drafter(drafter, tmp_path / "export", dtype=torch.float32, card={"steps": 1})
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["ToyMarkovDraftModel"] and config["dflash_config"]["toy_rank"] == 3
    assert config["auto_map"] == {"AutoModel": "toy_modeling.ToyMarkovWalk"} and "| Markov head | rank 3 |" in \
        (path / "README.md").read_text()
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "config.json", "model.safetensors", "toy_modeling.py"]
    back = load_drafter(path, dtype=torch.float64)
    assert back.config == shape
    for n, t in drafter.state_dict().items():
        torch.testing.assert_close(back.state_dict()[n], t.float().double())
    # Drafting: the Markov chain, the same for the loaded drafter, against a step-by-step reference.
    hidden = torch.randn(5, B - 1, D, generator=g, dtype=torch.float64)
    anchors = torch.randint(0, VOCAB, (5,), generator=g)
    loaded = DraftModel(back, embed, head)
    drafts = loaded.draft(hidden, anchors)
    h = back.markov_head
    prev = anchors
    for k in range(B - 1):
        expect = (hidden[:, k] @ head.T + h.embedding[prev] @ h.projection.T).argmax(-1)
        assert torch.equal(drafts[:, k], expect)
        prev = expect
    assert not torch.equal(drafts, (hidden @ head.T).argmax(-1))  # the bias changes the walk
    assert "Toy Markov drafter" in model_card(back.config)
    # The export's remote code, loaded from the export alone, drafts the same tokens.
    spec = importlib.util.spec_from_file_location("toy_modeling_export", path / "toy_modeling.py")
    remote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remote)
    walk = remote.ToyMarkovWalk.from_pretrained(path, dtype=torch.float64)
    assert torch.equal(walk.propose(hidden, anchors, head), drafts)


def test_an_unknown_architecture_names_the_setting_and_the_known_ones():
    with pytest.raises(ValueError, match=r"drafter\.architecture.*dflash, dflash2"):
        toy_shape()


def test_a_variant_field_error_names_its_recipe_key(monkeypatch):
    register(monkeypatch)
    # A section with a key the recipe does not have: a new architecture's own setting.
    section = SimpleNamespace(**dataclasses.asdict(DrafterConfig(
        num_layers=2, block_size=B, mask_token_id=VOCAB - 1, target_layer_ids=[1, 4], architecture="toy_markov")),
        toy_rank=0)
    with pytest.raises(ValueError, match=r"^drafter\.toy_markov\.toy_rank = 0 must be >= 1$"):
        drafter_shape(target_config(), section)


TINY = ["data.num_proc=1", "optim.max_steps=2", "log.progress=false"]


def test_a_variant_defined_outside_the_package_has_recipe_keys_logs_and_panels(monkeypatch, tmp_path):
    """Its sections read from a recipe (overrides included) and checked with dotted names, its field in the
    progress line, the report's loss panel and summary: all declared in tests/toy_variant.py."""
    from dflash_ds.config import RecipeError, dump_yaml, load_recipe
    from dflash_ds.metrics import progress_line
    from dflash_ds.report import _panels, _summary
    from dflash_ds.resolve.run import resolve_run

    toy = register(monkeypatch)
    keys = ["drafter.architecture=toy_markov", "drafter.toy_markov.toy_rank=5", "objective.toy_markov.tv_weight=0.25"]
    recipe = load_recipe("recipes/tiny.yaml", TINY + keys)
    assert recipe.notes == ()
    spec = resolve_run(recipe, world_size=2)
    assert spec.drafter.arch_fields.toy_rank == 5 and spec.settings.keys.tv_weight == 0.25
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(recipe))
    assert dataclasses.replace(load_recipe(again), source=recipe.source) == recipe
    assert "toy_markov:\n    tv_weight: 0.25" in again.read_text()
    for bad, words in (("objective.toy_markov.tv_weight=-1", "objective.toy_markov.tv_weight must be >= 0"),
                       ("drafter.toy_markov.toy_rank=x", "drafter.toy_markov.toy_rank: expected an integer"),
                       ("drafter.toy_markov.rank=2", "unknown recipe key 'drafter.toy_markov.rank'")):
        with pytest.raises(RecipeError) as e:
            load_recipe("recipes/tiny.yaml", TINY + keys + [bad])
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RecipeError, match="drafter.toy_markov.toy_rank = 0 must be >= 1"):
        resolve_run(load_recipe("recipes/tiny.yaml", TINY + keys + ["drafter.toy_markov.toy_rank=0"]), world_size=2)
    rec = {"step": 2, "loss": 1.0, "accept_proxy": 2.0, "tv": 0.125}
    assert "accept 2.00 | tv 0.1250" in progress_line(rec, 4, toy.spec.logs.progress)
    assert "tv" not in progress_line(rec, 4)  # only the architecture's own view names it
    loss_panel = dict(_panels([rec], [], toy.spec.logs))["loss"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    loss_panel(ax)
    assert [line.get_label() for line in ax.get_lines()] == ["loss", "TV term"]
    plt.close(fig)
    assert ("final TV", "0.125") in _summary([rec], [], toy.spec.logs)


def test_the_package_holds_nothing_of_the_toy():
    """The toy architecture needs no edit outside tests/: no file of the package names it."""
    from pathlib import Path

    import dflash_ds

    root = Path(dflash_ds.__file__).parent
    named = [p for p in root.rglob("*.py") if "toy_markov" in p.read_text() or "ToyMarkov" in p.read_text()]
    assert not named and len(list(root.rglob("*.py"))) > 100


def dense_loss(hidden, weight, labels, w, norm, term_inputs, kl, transform):
    """Float64, every logit at once, plain autograd: (CE of the biased logits + kl_weight * T^2 * KL +
    0.5 * TV) summed with the slot weights, over `norm`; kl = (kl_weight, T, the target's states)."""
    prev, emb, proj = term_inputs
    kl_weight, t, target = kl
    x = hidden @ weight.T + markov_bias(prev, emb, proj)
    z = transform.apply(x)
    ce = F.cross_entropy(z, labels, reduction="none")
    tz = transform.apply(target @ weight.T)
    tv = 0.5 * (z.softmax(-1) - tz.softmax(-1)).abs().sum(-1)
    total = (w * ce).sum() + 0.5 * (w * tv).sum()
    if kl_weight > 0:
        klv = F.kl_div(F.log_softmax(z / t, -1), F.log_softmax(tz / t, -1), reduction="none", log_target=True).sum(-1)
        total = total + kl_weight * t * t * (w * klv).sum()
    return total / norm, (w * tv).sum()


@pytest.mark.parametrize("kl_weight, transform", [(0.0, IDENTITY), (0.3, IDENTITY), (0.3, LogitTransform(0.7, 9.0))])
def test_the_in_loop_term_matches_a_float64_dense_reference(kl_weight, transform):
    g = torch.Generator().manual_seed(3)
    n = 23  # not a multiple of the chunk size: the last chunk is padded
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    target = torch.randn(n, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    w = torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) > 0.2)
    prev = torch.randint(0, VOCAB, (n,), generator=g)
    emb = (0.5 * torch.randn(VOCAB, 3, generator=g, dtype=torch.float64)).requires_grad_()
    proj = (0.5 * torch.randn(VOCAB, 3, generator=g, dtype=torch.float64)).requires_grad_()
    kl = (kl_weight, 1.5, target)
    bias, term = markov_term(prev, emb, proj, 0.5)
    out = chunked(hidden, weight, labels, w, 4.0, 4, kl=(kl_weight, 1.5) if kl_weight else None, terms=(term,),
                  target=target, bias=bias, transform=transform)
    loss, sums = out.loss, (out.sums["tv_sum"],)
    ref, tv_ref = dense_loss(hidden, weight, labels, w, 4.0, (prev, emb, proj), kl, transform)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sums[0], tv_ref, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(loss, [hidden, emb, proj])
    want = torch.autograd.grad(ref, [hidden, emb, proj])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert all(float(a.abs().sum()) > 0 for a in got)


def test_teacher_forced_predecessors():
    labels = torch.tensor([[7, 1, 2, 3, 8, 4, 5, 6]])
    assert predecessors(labels, 4).tolist() == [[7, 7, 1, 2, 8, 8, 4, 5]]


@pytest.mark.parametrize("geometry", ["qwen3.6-27b", "qwen3-8b", "qwen3.6-35b-a3b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("recipe", ["recipes/qwen27b.yaml", "recipes/qwen27b-dflash2.yaml", "recipes/qwen27b-dspark.yaml",
                                    "recipes/qwen27b-lilicorr.yaml"])
def test_every_architectures_parameters_keep_zero2_gradients_aligned(recipe, geometry):
    """ZeRO-2 lays the gradients back to back in arrival order: a parameter whose size is no multiple of 8
    elements shifts every later bf16 gradient off 16 bytes (DSpark's one-element confidence bias did: the
    gradient copies ran 3.5x slower, docs/performance.md "What DSpark costs"). Every architecture, at every
    real target geometry, keeps its parameters to multiples of 8 (an odd-sized one is stored padded, as
    architectures/dspark/parts.py `Projection`)."""
    from dflash_ds.config import load_recipe
    from dflash_ds.target_model.presets import get_geometry, target_config

    drafter_cfg = dataclasses.replace(load_recipe(recipe).drafter, mask_token_id=get_geometry(geometry).mask_token_id,
                                      target_layer_ids=None)
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_shape(target_config(geometry), drafter_cfg))
    odd = [(n, p.numel()) for n, p in drafter.named_parameters() if p.numel() % 8]
    assert not odd


def test_register_adds_the_architecture_and_its_sections_and_refuses_a_second_of_one_name(monkeypatch):
    from dflash_ds.architectures import DEFAULT, VARIANTS
    from dflash_ds.config.architectures import SECTIONS, section_type
    from dflash_ds.network.registry import register as decorate
    from tests.toy_variant import TOY, ToyKeys

    for registry in (VARIANTS, SECTIONS):  # the toy's entries are removed again after the test
        monkeypatch.setitem(registry, "toy_markov", None)
    assert decorate(TOY) is TOY
    assert VARIANTS["toy_markov"] is TOY and section_type("objective", "toy_markov") is ToyKeys
    assert section_type("drafter", "dflash") is None and section_type("objective", "dflash") is None  # v1 adds none

    impostor = dataclasses.replace(DEFAULT, spec=dataclasses.replace(DEFAULT.spec, name="dspark"))
    with pytest.raises(ValueError, match="'dspark' is registered twice"):
        decorate(impostor)
    assert VARIANTS["dspark"].spec.title == "DSpark"


def overrides(arch) -> list[str]:
    """The names an architecture defines beyond DFlash's: every method of its modules, objective and walk
    that its classes define over DFlash's parts, and of its recipe sections over `Fields` / `Keys`
    (its spec is data: nothing to override)."""
    from dflash_ds.architectures import DEFAULT
    from dflash_ds.network.arch_types import Fields, Keys

    spec, found = arch.spec, []
    pairs = [(type(getattr(arch, part)), type(getattr(DEFAULT, part))) for part in ("modules", "objective", "walk")]
    pairs += [(spec.fields, Fields)] + ([(spec.objective_keys, Keys)] if spec.objective_keys else [])
    for cls, base in pairs:
        own = {n for c in cls.__mro__ if c is not base and issubclass(c, base) for n in vars(c)}
        found += [f"{cls.__name__}.{n}" for n in sorted(own & set(dir(base))) if callable(getattr(base, n))
                  and not n.startswith("__")]
    return found


def test_a_new_architecture_overrides_at_most_ten_names(monkeypatch):
    """The toy (a head, a row term with a logit bias, a walk, a section each) overrides 6; the published
    ones stay near that (LiLiCorr, which also reads its own config keys and samples its drafts, the most)."""
    from dflash_ds.architectures import VARIANTS

    toy = register(monkeypatch)
    assert overrides(toy) == ["ToyModules.heads", "ToyModules.tensors", "ToyObjective.terms", "ToyWalk.propose",
                              "ToyFields.check_shape", "ToyKeys.check"]
    counts = {name: len(overrides(arch)) for name, arch in VARIANTS.items() if name != "toy_markov"}
    # DSpark: its keys also name the part only its confidence term trains (Keys.trained_parts). DFlash2, DSpark
    # and LiLiCorr each tell the memory plan what their modules hold at the peak (Modules.extra_activation_bytes),
    # one name each; XPress does not yet.
    assert counts == {"dflash": 0, "dflash2": 11, "dspark": 12, "lilicorr": 16, "xpress": 10}


def test_the_training_step_of_every_architecture_reads_on_one_screen(monkeypatch):
    """Its objective (the one method a micro-batch's loss asks: its terms, their weights, its logit bias) is
    at most 30 lines; its labels are the spec's `label_offset`'s (objective/blocks.py)."""
    import inspect

    from dflash_ds.architectures import VARIANTS

    register(monkeypatch)
    lines = {name: len(inspect.getsource(type(arch.objective)).splitlines()) for name, arch in VARIANTS.items()}
    assert max(lines.values()) <= 30, lines
