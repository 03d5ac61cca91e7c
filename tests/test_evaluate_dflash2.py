"""A trained DFlash2 drafter's walk is SGLang's lattice walk on held-out prompts (that the offline tau
follows the walk and equals the online loop is the conformance suite's, tests/test_conformance_walk.py).
The drafter is trained here with the project's drafter_loss (base CE plus the selector term) so that
the selector's path differs from the per-slot argmax."""

import pytest
import torch

from dflash_ds.architectures.dflash import argmax_tokens
from dflash_ds.architectures.dflash2 import DFlash2Keys
from dflash_ds.architectures.dflash2 import DFlash2Fields
from dflash_ds.config import DrafterConfig
from dflash_ds.eval.generate import greedy_continuation, target_taps
from dflash_ds.network.attention import DFlashMask
from tests.eval_world import LAYER_IDS, MASK, NEW, PROMPT_LEN, trained_world


B = 8


@pytest.fixture(scope="module")
def world():
    section = DrafterConfig(num_layers=2, block_size=B, mask_token_id=MASK, target_layer_ids=LAYER_IDS,
                             architecture="dflash2",
                             sections={"dflash2": DFlash2Fields(conv_group_size=16, selector_rank=16, selector_top_k=8)})
    return trained_world(section, DFlash2Keys(selector_inject_gold=True, selector_warmup_ratio=0.0, selector_ramp_ratio=0.0),
                         gamma=4.0)


@pytest.mark.integration  # a tiny target and a drafter trained here (README, "Tests")
def test_trained_selection_equals_sglang_walk_on_held_out_prompts(world):
    """The trained drafter's proposals at every anchor of the two prompts it never saw equal the
    re-implementation of SGLang's lattice walk (tests/test_dflash2.py) on the same states."""
    from .test_dflash2 import sglang_lattice_walk

    w = world
    model = w["model"]
    drafter, p = model.drafter, next(model.drafter.parameters())
    differs = 0
    for prompt in w["prompts"][4:]:
        x = greedy_continuation(w["target"], prompt, max_new_tokens=NEW)
        taps = target_taps(w["target"], x, LAYER_IDS)
        for t in range(PROMPT_LEN, x.numel() - 1, 3):
            block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
            block[0, 0] = x[t]
            mask = DFlashMask(query_len=B, kv_len=t + B, dense=torch.ones(1, 1, B, t + B, dtype=torch.bool))
            with torch.no_grad():
                hidden = drafter(model.embed_tokens(block, p), drafter.fuse(taps[None, :t]),
                                 torch.arange(t, t + B)[None], torch.arange(t)[None], mask=mask)[:, 1:]
                ours = model.draft(hidden, x[t:t + 1])
                theirs = sglang_lattice_walk(drafter.candidate_selector, hidden, model.lm_head, x[t:t + 1])
            assert torch.equal(ours, theirs), t
            differs += int(not torch.equal(ours, argmax_tokens(hidden, model.lm_head)))
    assert differs > 0
