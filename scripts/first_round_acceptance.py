"""First-round against later-round acceptance, with and without objective.anchor_last_prompt_token.

    PYTHONPATH=. python scripts/first_round_acceptance.py RECIPE_NAME FLAG SEED
    (RECIPE_NAME: a key of tests/test_engine.py's EXPORTS; FLAG: 0 or 1)

Trains the recipe's drafter as the engine tier does (tests/test_engine.py: the target's own greedy
responses to 64 bundled prompts, one process) and prints one JSON line over 80 held-out prompts
(assets/tiny_eval.jsonl and 64 prompts of assets/tiny_chat.jsonl the trainer never sees): the drafts
llama-speculative-simple's first round (anchored at the last prompt token) accepts, its later rounds,
and the project's tau from the first generated token. The rounds are the project's prediction, which
the engine tier holds llama.cpp to round for round. Results: docs/performance.md.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tests.test_engine as tier  # noqa: E402 - the tier's trainer and its round prediction
from dflash_ds.config import load_recipe  # noqa: E402
from dflash_ds.eval.cli import read_prompts  # noqa: E402
from dflash_ds.eval.engine_count import accepted  # noqa: E402
from dflash_ds.eval.generate import eos_ids, greedy_continuation, target_taps  # noqa: E402
from dflash_ds.eval.tau import accept_lengths, tau_from_taps  # noqa: E402


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, flag, seed = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(tier.TARGET)
    target = AutoModelForCausalLM.from_pretrained(tier.TARGET, dtype=torch.float32).eval().requires_grad_(False)
    chat = str(tier.ROOT / "assets" / "tiny_chat.jsonl")
    train = [torch.tensor(p) for p in read_prompts(chat, tok, limit=tier.TRAIN_PROMPTS)]
    heldout = read_prompts(str(tier.ROOT / "assets" / "tiny_eval.jsonl"), tok) + read_prompts(chat, tok)[1100:1164]
    tiny = dict(tok=tok, target=target, stop=set(eos_ids(target)),
                sequences=[greedy_continuation(target, p, max_new_tokens=tier.BUDGET) for p in train],
                prompt_lens=[p.numel() for p in train])

    def recipe(path):
        r = load_recipe(path)
        return dataclasses.replace(r, objective=dataclasses.replace(r.objective, anchor_last_prompt_token=flag),
                                   run=dataclasses.replace(r.run, seed=seed))

    tier.load_recipe = recipe
    model = tier.train(tiny, tier.EXPORTS[name])
    first, later, cycles, a = [], [], [], []
    for ids in heldout:
        p = len(ids)
        x = greedy_continuation(target, torch.tensor(ids), max_new_tokens=tier.BUDGET)
        rounds = accepted(tier.project_rounds({"model": model}, tiny, x, p)[0])
        first.append(rounds[0])
        later += rounds[1:]
        taps = target_taps(target, x, model.layer_ids)
        cycles.append(tau_from_taps(model, taps, x, p, end=x.numel()))
        a += accept_lengths(model, taps, x, p, end=x.numel()).tolist()
    print(json.dumps(dict(recipe=name, anchor_last_prompt_token=flag, seed=seed, responses=len(heldout),
                          first_round=sum(first) / len(first), first_round_none=first.count(0),
                          later_rounds=sum(later) / len(later), tau_pooled=sum(map(sum, cycles)) / sum(map(len, cycles)),
                          mean_accepted_after_prompt=sum(a) / len(a),
                          llama_cpp_mean_acc_len=1 + (sum(first) + sum(later)) / (len(first) + len(later)))))


if __name__ == "__main__":
    main()
