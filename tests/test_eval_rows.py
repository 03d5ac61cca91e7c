"""Held-out sequences are packed into evaluation rows like training rows (a row is several
conversations long): the same taps and the same exact tau as one sequence per row, in fewer payloads."""

from pathlib import Path

import pytest
import torch

from dflash_ds.config import load_recipe
from dflash_ds.data.packing import first_fit_rows
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.payload import unpack
from dflash_ds.resolve.run import resolve_run
from dflash_ds.runtime.target_worker import TargetWorker, eval_bounds, eval_payload_count, eval_rows
from dflash_ds.runtime.trainer import tau_of_payloads

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
COLOCATED = ["topology.colocated=true", "topology.targets_per_node=0", "run.device=cpu"]


def test_first_fit_rows_and_bounds():
    assert first_fit_rows([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert eval_bounds([3, 50, 200], 40, 100) == [43, 90, 100]


def spec_for(max_new_tokens: int):
    return resolve_run(load_recipe(TINY, COLOCATED + [f"eval.max_new_tokens={max_new_tokens}"]), 1)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-target", dtype=torch.float32).eval()


def sequences(vocab: int, n: int = 9):
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        prompt = int(torch.randint(5, 120, (1,), generator=g))
        new = int(torch.randint(3, 30, (1,), generator=g))  # at most eval.max_new_tokens (30)
        out.append({"prompt_len": prompt, "ids": torch.randint(6, vocab, (prompt + new,), generator=g).tolist()})
    return out


def payloads(spec, target, seqs):
    worker = TargetWorker(spec, target, {}, 0, eval_sequences=seqs)
    try:
        return [p.clone() for p in worker.eval_payloads(lambda: spec.payload.empty(torch.device("cpu")))]
    finally:
        worker.capture.remove()


def per_sequence(spec, bufs):
    """(ids, taps) of every held-out sequence found in the payloads, in the order they appear."""
    out = []
    for p in bufs:
        mb = unpack(p, spec.payload, torch.float32)
        for j in range(mb.input_ids.shape[0]):
            for d in range(int(mb.doc_ids[j].max()) + 1):
                where = mb.doc_ids[j] == d
                out.append((tuple(mb.input_ids[j][where].tolist()), mb.taps[j][where]))
    return out


def test_packed_evaluation_rows_give_the_taps_and_tau_of_one_sequence_per_row(target):
    packed_spec = spec_for(30)  # every sequence within its prompt + 30 tokens: several per 1,024-token row
    alone_spec = spec_for(100_000)  # bounds of a whole row: one sequence per row, as before
    seqs = sequences(target.config.vocab_size)
    packed, alone = payloads(packed_spec, target, seqs), payloads(alone_spec, target, seqs)
    data = type("Data", (), {"eval_prompts": [s["ids"][:s["prompt_len"]] for s in seqs]})()
    assert len(packed) == eval_payload_count(packed_spec, data) < len(alone) == eval_payload_count(alone_spec, data)
    assert len(alone) == len(seqs) and len(eval_rows(packed_spec, [s["prompt_len"] for s in seqs])) == len(packed)
    a, b = per_sequence(packed_spec, packed), per_sequence(alone_spec, alone)
    assert sorted(x[0] for x in a) == sorted(x[0] for x in b) == sorted(tuple(s["ids"]) for s in seqs)
    taps_alone = {ids: taps for ids, taps in b}
    for ids, taps in a:  # the packed forward keeps each sequence apart: the taps of it alone
        torch.testing.assert_close(taps, taps_alone[ids], rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    model = DraftModel.from_target(DFlashDrafter(packed_spec.drafter), target)
    tau_packed = tau_of_payloads(model, packed, packed_spec.payload, torch.float32)
    tau_alone = tau_of_payloads(model, alone, alone_spec.payload, torch.float32)
    assert len(tau_packed.cycles) == len(seqs) and tau_packed.num_tokens == tau_alone.num_tokens > 0
    assert sorted(map(tuple, tau_packed.cycles)) == sorted(map(tuple, tau_alone.cycles))
