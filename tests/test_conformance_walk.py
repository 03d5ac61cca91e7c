"""The conformance suite, online walk = offline: for every architecture (the registered ones and the
toy of tests/toy_variant.py), the walk the serving engines run online (one block drafted at a time from
the committed prefix, verified by the target: eval/specdec.py, eval/specdec_sampled.py) emits the same
text and the same accepted lengths, cycle by cycle, as the offline count of tau over the same anchors
(eval/tau.py, and the in-training tau of the held-out payloads, runtime/trainer.py); and the offline
count follows the architecture's own walk, anchor by anchor.

The target is a tiny random-weight Qwen3 (float64, so no argmax tie separates differently shaped
passes); each drafter starts from random weights and is trained a few dozen steps here with the
project's drafter_loss, so that cycles accept several drafts and each architecture's own walk (its
selector's path, its Markov chain) is exercised beyond a(t) = 0."""

from __future__ import annotations

import pytest
import torch

from dflash_ds.config import DrafterConfig
from dflash_ds.eval.generate import target_taps
from dflash_ds.resolve.payload import PayloadLayout, write_meta
from dflash_ds.runtime.trainer import tau_of_payloads
from tests.eval_world import LAYER_IDS, MASK, PROMPT_LEN, online_equals_offline, sampled_cycles_agree, trained_world
from tests.test_conformance import ARCHITECTURES
from tests.toy_variant import TOY, register

B, STEPS, HIDDEN, NEW = 8, 40, 32, 24
_worlds: dict[str, dict] = {}


def walk_world(name: str) -> dict:
    """The trained world of architecture `name`, built once per session (the toy registered by the caller)."""
    if name not in _worlds:
        from dflash_ds.architectures import VARIANTS

        spec = VARIANTS[name].spec
        sections = {name: spec.fields(**spec.small)}  # its own small sizes
        section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=MASK, target_layer_ids=LAYER_IDS,
                                architecture=name, sections=sections)
        # The architecture's default loss settings and loss decay (gamma None), as a recipe without
        # its objective section runs it.
        _worlds[name] = trained_world(section, spec.objective_keys() if spec.objective_keys else None, None, STEPS,
                                      hidden=HIDDEN, new=NEW)
    return _worlds[name]


def in_training_tau(world: dict, sequences: list[torch.Tensor]):
    """The trainer's tau of the sequences packed as one held-out payload row (one document each, the
    responses marked in the loss mask), as the target ranks send them."""
    target, model = world["target"], world["model"]
    taps = torch.cat([target_taps(target, x, LAYER_IDS) for x in sequences])
    layout = PayloadLayout(rows=1, seq_len=taps.shape[0], num_taps=len(LAYER_IDS), hidden=HIDDEN, dtype=torch.float64)
    payload = layout.empty(torch.device("cpu"))
    payload[0, :, :taps.shape[1]] = taps
    ids = torch.cat(sequences)
    doc_ids = torch.cat([torch.full((x.numel(),), d) for d, x in enumerate(sequences)])
    loss_mask = torch.cat([torch.arange(x.numel()) >= PROMPT_LEN for x in sequences])
    write_meta(payload, layout, ids[None], loss_mask[None], doc_ids=doc_ids[None])
    return tau_of_payloads(model, [payload], layout, torch.float64)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_walks_online_as_tau_counts_offline(name, monkeypatch):
    if name == TOY.spec.name:
        register(monkeypatch)
    world = walk_world(name)
    sequences = []
    report = online_equals_offline(world, sequences)  # online loop == eval/tau.py, text and cycles
    assert report.block_size == world["model"].max_emitted
    assert all(sum(c) == x.numel() - PROMPT_LEN - 1 for c, x in zip(report.cycles, sequences))
    assert in_training_tau(world, sequences).cycles == report.cycles
    accepted = [c - 1 for cycles in report.cycles for c in cycles]
    assert max(accepted) >= 3 and min(accepted) == 0  # multi-token acceptance and rejections both occur
    assert len(set(accepted)) >= 4  # a mix of acceptance lengths, not all-or-nothing


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_walks_sampled_online_as_offline_with_coupled_draws(name, monkeypatch):
    """Under sampling too, with the coupled verifier of tests/test_sampled.py (the engines' rule, one
    draw per position), both paths give the same text and cycles."""
    if name == TOY.spec.name:
        register(monkeypatch)
    accepted = sampled_cycles_agree(walk_world(name), monkeypatch)
    # Drafts are accepted (the two paths agree past a(t) = 0 on the architecture's own walk) and rejected.
    assert max(accepted) >= 1 and min(accepted) == 0


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architectures_offline_acceptance_follows_its_walk(name, monkeypatch):
    """a(t) of the batched offline pass (eval/tau.py `accept_lengths`) equals drafting each anchor alone
    with the architecture's walk (eval/specdec.py `draft_block`: its selector's path, its Markov chain
    from slot 0, its reranked lattice), counted against the text; and for an architecture whose walk is
    not the per-slot argmax, that walk differs from the argmax at some anchor of the trained drafter."""
    from dflash_ds.architectures.dflash import argmax_tokens
    from dflash_ds.eval.specdec import block_states, draft_block
    from dflash_ds.eval.tau import accept_lengths

    if name == TOY.spec.name:
        register(monkeypatch)
    world = walk_world(name)
    model, differs = world["model"], 0
    for x in world["sequences"]:
        taps = target_taps(world["target"], x, LAYER_IDS)
        end, expected = x.numel(), []
        for t in range(PROMPT_LEN, end):
            drafts = draft_block(model, taps[:t], int(x[t]))
            n = 0
            while n < model.num_drafts and t + n + 1 < end and int(drafts[n]) == int(x[t + n + 1]):
                n += 1
            expected.append(max(0, min(n, end - t - 2)))
            states, _ = block_states(model, taps[:t], int(x[t]))
            # The drafting slots' argmax (the last num_drafts of the states: a walk may read the anchor's too).
            differs += int(not torch.equal(argmax_tokens(states[0, -model.num_drafts:], model.lm_head), drafts))
        assert accept_lengths(model, taps, x, PROMPT_LEN, end=end, batch_anchors=7).tolist() == expected
    assert (differs == 0) if name == "dflash" else (differs > 0), differs
