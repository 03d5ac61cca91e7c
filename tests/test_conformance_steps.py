"""The conformance suite, 20 in-process steps = a pinned record: for every architecture (the registered
ones and the toy of tests/toy_variant.py) a tiny float32 drafter trains 20 steps in this process with
the loss's public entry (`drafter_loss`, with `make_blocks` and `StepSettings.of`, as the trainer calls
them) and a plain torch optimizer, on fixed random target states, in float64 (so that neither the
machine's BLAS nor its thread count moves the record: float32 after 20 steps differed in the fifth
digit between one and two threads); every step's objective,
its named logs (what the trainer writes to metrics.jsonl: loss, accept_proxy, kl and the architecture's
own, `Spec.logs.record`) and its gradient norm equal tests/fixtures/conformance_steps.json.

The record pins the objective's behaviour, not its code: a rewrite of the loss's internals must
reproduce it to float64 summation order (rtol 1e-9). A change of behaviour that is meant regenerates it:

    PYTHONPATH=. python -m tests.test_conformance_steps --update [NAME ...]

(the record of a new architecture is added the same way; the test fails, naming that command, for an
architecture the file does not hold)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash_ds.architectures import VARIANTS
from dflash_ds.config import DrafterConfig, ObjectiveConfig
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, make_blocks
from dflash_ds.objective.drafter_loss import StepSettings, acceptance_proxy, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape

RECORD = Path(__file__).with_name("fixtures") / "conformance_steps.json"
UPDATE = "PYTHONPATH=. python -m tests.test_conformance_steps --update"
STEPS, ROWS, SEQ, D, VOCAB, B, LAYERS = 20, 2, 48, 32, 64, 4, (1, 4)
# The KL term on, so the target's distribution enters every architecture's record.
OBJECTIVE = ObjectiveConfig(num_anchors=6, gamma=None, anchor_last_prompt_token=True, loss_chunks=2, kl_weight=0.3,
                            kl_temperature=1.5)


def micro_batch() -> tuple[MicroBatch, torch.Tensor, torch.Tensor]:
    """Two rows of two conversations each (a prompt, then a response the loss reads), random target
    states, and the target's embedding and lm_head."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (ROWS, SEQ), generator=g)
    doc_ids = (torch.arange(SEQ) >= SEQ // 2).to(torch.int32).expand(ROWS, SEQ).clone()
    doc_ids[1, -5:] = -1  # padding at the end of the second row
    offset = torch.arange(SEQ) % (SEQ // 2)
    loss_mask = ((offset >= 6) & (doc_ids >= 0)).clone()
    taps = torch.randn(ROWS, SEQ, len(LAYERS) * D, generator=g)
    final = torch.randn(ROWS, SEQ, D, generator=g)
    embed, head = torch.randn(VOCAB, D, generator=g), 0.2 * torch.randn(VOCAB, D, generator=g)
    return (MicroBatch(taps.double(), ids, loss_mask, doc_ids, final.double()), embed.double(), head.double())


def settings_of(name: str) -> StepSettings:
    target = Qwen3Config(hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                         rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
    spec = VARIANTS[name].spec
    sections = {name: spec.fields(**spec.small)}  # its own small sizes (Spec.small)
    shape = drafter_shape(target, DrafterConfig(num_layers=2, block_size=B, mask_token_id=VOCAB - 1,
                                                target_layer_ids=list(LAYERS), architecture=name, sections=sections))
    return StepSettings.of(shape, OBJECTIVE, 0, torch.device("cpu"))


def step_record(out, blocks, settings: StepSettings, weight: float) -> dict:
    """The step's named logs as the trainer forms them from drafter_loss's output (DrafterTrainer.log_step),
    and the objective itself."""
    shape = settings.shape
    w = blocks.weights.view(blocks.weights.shape[0], -1, settings.block_size)
    run_sum, counted = acceptance_proxy(out.correct.view_as(w), w, reduce=False, first=shape.first_draft_slot)
    rec = {"objective": float(out.loss.detach()), "loss": float(out.sums["ce"]) / weight,
           "accept_proxy": float(run_sum) / max(float(counted), 1.0), "kl": float(out.sums["kl"]) / weight}
    sums = {n: float(v) for n, v in out.sums.items() if n not in ("ce", "kl")}  # its named logs
    rec.update(shape.spec.logs.record(sums, weight))
    return rec


def train(name: str) -> list[dict]:
    """Every step's record of 20 SGD steps (momentum; no adaptive scaling, so a float-order difference
    stays that size instead of turning a near-zero gradient into a full step)."""
    settings = settings_of(name)
    mb, embed, head = micro_batch()
    torch.manual_seed(0)
    drafter = DFlashDrafter(settings.shape).double()
    model = DraftModel(drafter, embed, head)
    opt = torch.optim.SGD(drafter.parameters(), lr=0.3, momentum=0.9)
    records = []
    for step in range(STEPS):
        blocks = make_blocks(mb, settings, step)
        weight = blocks.weights.sum()
        out = drafter_loss(model, mb, blocks, weight, settings=settings, step=step, total_steps=STEPS)
        opt.zero_grad()
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), float("inf"))
        opt.step()
        records.append({**step_record(out, blocks, settings, float(weight)), "grad_norm": float(norm)})
    return records


def named_logs(name: str) -> set[str]:
    """The names of the sums architecture `name`'s terms add to one micro-batch's loss (its named logs),
    from one loss call at the suite's sizes."""
    settings = settings_of(name)
    mb, embed, head = micro_batch()
    torch.manual_seed(0)
    model = DraftModel(DFlashDrafter(settings.shape).double(), embed, head)
    blocks = make_blocks(mb, settings, 0)
    with torch.no_grad():
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings)
    return set(out.sums) - {"ce", "kl"}


def pinned() -> dict:
    return json.loads(RECORD.read_text())["records"] if RECORD.exists() else {}


def architectures() -> list[str]:
    from tests.test_conformance import ARCHITECTURES

    return ARCHITECTURES


@pytest.mark.parametrize("name", architectures())
def test_twenty_steps_equal_the_pinned_record(name, monkeypatch):
    if name not in VARIANTS:
        from tests.toy_variant import register

        register(monkeypatch)
    records = pinned()
    assert name in records, f"{RECORD.name} holds no record of {name}: run `{UPDATE} {name}`"
    got, want = train(name), records[name]
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), (step, sorted(g), sorted(w))
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-9, abs=1e-12), (name, step, key)
    # The record is of training, not of a frozen drafter: the objective moves.
    assert got[-1]["objective"] < 0.9 * got[0]["objective"]


def update(names: list[str]) -> None:
    from tests.toy_variant import TOY
    from dflash_ds.network.registry import entries

    for registry, key, value in entries(TOY):
        registry[key] = value
    records = pinned()
    for name in names or architectures():
        records[name] = train(name)
        print(f"{name}: objective {records[name][0]['objective']:.5f} -> {records[name][-1]['objective']:.5f}")
    # One line per step, so that a regenerated record reads as a diff of the steps that changed.
    about = json.dumps(f"tests/test_conformance_steps.py; regenerate with `{UPDATE} [NAME ...]`")
    archs = [f"  {json.dumps(name)}: [\n" + ",\n".join(f"   {json.dumps(step)}" for step in steps) + "\n  ]"
             for name, steps in sorted(records.items())]
    RECORD.write_text(f'{{\n "about": {about},\n "records": {{\n' + ",\n".join(archs) + "\n }\n}\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--update":
        sys.exit(f"usage: {UPDATE} [NAME ...]")
    torch.set_num_threads(1)
    update(args[1:])
