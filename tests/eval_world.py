"""The small world the architecture evaluation tests share: a float64 tiny Qwen3 target, six prompts
and the target's greedy continuations of the first four, a drafter of a given recipe section trained
on them with the project's drafter_loss, and the sampled-loop check with coupled draws."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ds.eval.generate import greedy_continuation, target_taps
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, default_gamma, make_blocks
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape

VOCAB, MASK, LAYER_IDS, PROMPT_LEN, NEW = 128, 127, [1, 3], 6, 40


def final_states(target, x: torch.Tensor) -> torch.Tensor:
    """The target's final-norm states [S, D] of one sequence (what target ranks send for a loss that
    reads the target's logits)."""
    with torch.no_grad():
        return target.model(input_ids=x[None]).last_hidden_state[0]


def trained_world(section, keys, gamma: float | None, steps: int = 120, *, hidden: int = 64, new: int = NEW) -> dict:
    """target, prompts, sequences and the DraftModel of `section` (a config.DrafterConfig) trained
    `steps` AdamW steps on the four sequences' response tokens under `keys`, the architecture's
    `objective.<name>:` section (gamma None: the architecture's default loss decay); the target `hidden` wide, its responses `new` tokens long (the world's "new")."""
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                      num_attention_heads=hidden // 16, num_key_value_heads=max(hidden // 32, 1), head_dim=16,
                      vocab_size=VOCAB, max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg).double().eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120, (PROMPT_LEN,), generator=gen) for _ in range(6)]
    sequences = [greedy_continuation(target, p, max_new_tokens=new) for p in prompts[:4]]
    shape = drafter_shape(target.config, section)
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).double()
    model = DraftModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    x = torch.stack(sequences)
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    final = torch.stack([final_states(target, s) for s in sequences]) if shape.spec.needs_target_logits else None
    mb = MicroBatch(torch.stack([target_taps(target, s, LAYER_IDS) for s in sequences]), x, loss_mask,
                    torch.zeros_like(x, dtype=torch.int32), final)
    gamma = default_gamma(shape.num_drafts + 1) if gamma is None else gamma
    settings = StepSettings(shape=shape, num_anchors=24, gamma=gamma, loss_chunks=2, mask_kind="dense", seed=0,
                            keys=keys)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        blocks = make_blocks(mb, settings, step)
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings, step=step, total_steps=steps)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    drafter.eval().requires_grad_(False)
    return dict(target=target, prompts=prompts, sequences=sequences, model=model, new=new)


def sampled_cycles_agree(world: dict, monkeypatch) -> list[int]:
    """With the coupled verifier of tests/test_sampled.py (the engines' rule, one draw per position)
    the offline sampled walk and the online sampled loop give the same text and cycles on the first
    four prompts; returns the drafts accepted per cycle."""
    import copy

    from dflash_ds.eval import specdec_sampled
    from dflash_ds.eval.batched import ResponseKey, response_generator
    from dflash_ds.eval.benchmark_table import COIN_SEED, BenchOptions, Responder
    from tests.test_sampled import LOGIT_SCALE, SAMPLING, couple_sampled_drafts

    target = copy.deepcopy(world["target"])
    target.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    accepted = []
    for seed, prompt in enumerate(world["prompts"][:4]):
        # The responder's coins of this response: the first draws of its own coin stream.
        key = ResponseKey()
        coins = torch.rand(prompt.numel() + world["new"], generator=response_generator(seed + COIN_SEED, key),
                           dtype=torch.float64)
        responder = Responder(target, world["model"], SAMPLING, BenchOptions(world["new"], seed=seed))
        response = responder.respond(prompt.tolist(), key)
        with monkeypatch.context() as patch:
            generator = response_generator(seed, key)
            couple_sampled_drafts(patch, target, world["model"], prompt, coins, generator)
            ids, counts = specdec_sampled.speculative_sample(target, world["model"], prompt, SAMPLING,
                                                             generator=generator, max_new_tokens=world["new"])
        assert ids.tolist() == response and counts == responder.result.report.cycles[0]
        accepted += [c - 1 for c in counts]
    return accepted


def online_equals_offline(world: dict, sequences: list | None = None):
    """The exact offline tau's report over the six prompts, after checking that the online reference
    loop emits the same text and the same cycles for each; `sequences`, when a list, receives each
    prompt + response."""
    from dflash_ds.eval.generate import offline_tau
    from dflash_ds.eval.specdec import speculative_generate

    sequences = [] if sequences is None else sequences
    report = offline_tau(world["target"], world["model"], world["prompts"], max_new_tokens=world["new"],
                         sequences=sequences)
    for prompt, x, cycles in zip(world["prompts"], sequences, report.cycles):
        ids, counts = speculative_generate(world["target"], world["model"], prompt, max_new_tokens=world["new"])
        assert ids.tolist() == x[prompt.numel():].tolist()
        assert counts == cycles
    return report
