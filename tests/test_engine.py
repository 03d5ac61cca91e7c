"""The exports served by an engine nobody here wrote: llama.cpp, as vendored in llama-cpp-python 0.3.36.

Every tiny recipe's drafter (trained here against assets/tiny-target with the recipe's drafter and
objective sections, in process) is exported, converted by llama.cpp's own converter and served by
llama-speculative-simple on the held-out prompts, with the speculative type and `--spec-draft-n-max`
its model card gives (B - 1 drafts a round for DFlash, B for the anchor-first DSpark). Greedy: the
output is the target's alone (llama-completion), and every round's accepted and verified drafts are
what the project's drafter predicts under llama.cpp's loop (dflash_ds.eval.engine_count); the
project's tau cycles are those rounds in its own unit (from the second round on, where both loops
anchor alike). A drafter with a confidence head (DSpark) is served once more with
`--spec-draft-p-min`, whose cut of every draft the project predicts too.
Sampled (T = 1): llama.cpp's mean acceptance length agrees with the project's within the noise.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dflash_ds.config import load_recipe
from dflash_ds.eval.cli import read_prompts
from dflash_ds.eval.engine_count import EngineCount, Round, accepted, engine_rounds
from dflash_ds.eval.generate import eos_ids, greedy_continuation, target_taps
from dflash_ds.eval.sampled import Sampling, ratio_se, sampled_continuation
from dflash_ds.eval.tau import anchor_proposals, tau_from_taps
from dflash_ds.export import save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.objective.blocks import MicroBatch, make_blocks
from dflash_ds.objective.drafter_loss import StepSettings, drafter_loss
from dflash_ds.resolve.drafter import drafter_shape
from tests.eval_world import final_states
from tests.llama_cpp import FLOAT32, FLOAT32_DRAFT, ROOT, build

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]  # a cold build is part of the first test

# One line per export the tier serves: the recipe whose drafter and objective sections it is trained with.
EXPORTS = {
    "dflash": "recipes/tiny.yaml",
    "dflash2": "recipes/tiny-dflash2.yaml",
    "dspark": "recipes/tiny-dspark.yaml",
}
TARGET = ROOT / "assets" / "tiny-target"
TRAIN_PROMPTS, STEPS, ANCHORS, ROWS = 64, 300, 16, 8
BUDGET = 96  # tokens; every greedy held-out response ends well before it, so no budget rule applies
SAMPLES = 3  # sampled responses per held-out prompt
# T = 1: llama.cpp's and the project's mean acceptance lengths are two independent samples of the same
# quantity; they agree when they differ by at most this many standard errors of the difference (a
# false alarm about once in 16,000 runs).
NOISE_SE = 4


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llama_cpp"))


@pytest.fixture(scope="module")
def tiny(llama, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval().requires_grad_(False)
    gguf = llama.convert(TARGET, tmp_path_factory.mktemp("gguf") / "target.gguf")
    train = [torch.tensor(p) for p in read_prompts(str(ROOT / "assets" / "tiny_chat.jsonl"), tok, limit=TRAIN_PROMPTS)]
    heldout = read_prompts(str(ROOT / "assets" / "tiny_eval.jsonl"), tok)
    return dict(tok=tok, target=target, gguf=gguf, heldout=heldout, stop=set(eos_ids(target)),
                sequences=[greedy_continuation(target, p, max_new_tokens=BUDGET) for p in train],
                prompt_lens=[p.numel() for p in train])


def train(tiny, recipe_path: str) -> DraftModel:
    """The recipe's drafter trained on the target's own responses: the objective's functions, one
    process, rows of one conversation each (so fewer anchors per row than the recipe's packed rows)."""
    recipe = load_recipe(ROOT / recipe_path)
    target, seqs = tiny["target"], tiny["sequences"]
    shape = drafter_shape(target.config, recipe.drafter)
    objective = dataclasses.replace(recipe.objective, num_anchors=ANCHORS, loss_chunks=1)
    settings = StepSettings.of(shape, objective, recipe.run.seed, torch.device("cpu"))
    torch.manual_seed(recipe.run.seed)
    model = DraftModel.from_target(DFlashDrafter(shape), target)
    s = max(x.numel() for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    doc_ids = torch.full((len(seqs), s), -1, dtype=torch.int32)
    taps = torch.zeros(len(seqs), s, shape.num_taps * shape.hidden_size)
    # The target's final-norm states, for a loss that reads the target's logits (DSpark's).
    final = torch.zeros(len(seqs), s, shape.hidden_size) if shape.spec.needs_target_logits else None
    for i, (x, p) in enumerate(zip(seqs, tiny["prompt_lens"])):
        ids[i, :x.numel()], loss_mask[i, p:x.numel()], doc_ids[i, :x.numel()] = x, True, 0
        taps[i, :x.numel()] = target_taps(target, x, shape.target_layer_ids)
        if final is not None:
            final[i, :x.numel()] = final_states(target, x)
    opt = torch.optim.AdamW(model.drafter.parameters(), lr=recipe.optim.lr, weight_decay=0.0)
    for step in range(STEPS):
        rows = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(step))[:ROWS]
        mb = MicroBatch(taps[rows], ids[rows], loss_mask[rows], doc_ids[rows], None if final is None else final[rows])
        blocks = make_blocks(mb, settings, step)
        out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings, step=step, total_steps=STEPS)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.drafter.eval().requires_grad_(False)
    return model


@pytest.fixture(scope="module", params=sorted(EXPORTS))
def served(request, llama, tiny, tmp_path_factory):
    model = train(tiny, EXPORTS[request.param])
    out = tmp_path_factory.mktemp(request.param)
    save_drafter(model.drafter, out / "export", dtype=torch.float32)
    gguf = llama.convert(out / "export", out / "drafter.gguf", target_dir=TARGET)
    return dict(name=request.param, model=model, gguf=gguf)


def speculative(llama, tiny, served, text: str, options: list[str]) -> tuple[str, list[Round], float]:
    """(generated text, every round's accepted and verified drafts as logged, llama.cpp's mean acc
    len) of one llama.cpp run, served as the model card says (speculative type, --spec-draft-n-max)."""
    model = served["model"]
    serve = model.config.spec.card(model.config).serving
    r = llama.run([llama.program("llama-speculative-simple"), "-m", str(tiny["gguf"]), "-md", str(served["gguf"]),
                   "-p", text, "-n", str(BUDGET), "--spec-draft-n-max", str(serve.llama_cpp_draft_max), "-c", "1024",
                   "-lv", "5", *FLOAT32, *FLOAT32_DRAFT, *options], complete="#mean acc len")
    assert f"adding speculative implementation '{serve.llama_cpp_type}'" in r.stderr
    assert "exceeds the trained block size" not in r.stderr, "llama.cpp cut --spec-draft-n-max to the block"
    rounds = [Round(int(a), int(n)) for a, n in re.findall(r"accepted (\d+)/(\d+) draft tokens", r.stderr)]
    mean = float(re.search(r"#mean acc len = ([\d.]+)", r.stderr).group(1))
    printed = r.stdout.strip("\n")
    assert printed.startswith(text.strip("\n")), "llama-speculative-simple printed another prompt"
    return printed[len(text.strip("\n")):].strip("\n"), rounds, mean


def target_alone(llama, tiny, text: str) -> str:
    r = llama.run([llama.program("llama-completion"), "-m", str(tiny["gguf"]), "-p", text, "-n", str(BUDGET),
                   "--temp", "0", "-no-cnv", "--no-display-prompt", "-c", "1024", *FLOAT32],
                  complete="graphs reused")
    return r.stdout.strip("\n").removesuffix(" [end of text]").strip("\n")


def project_rounds(served, tiny, x: torch.Tensor, p: int, p_min: float = 0.0):
    """(llama-speculative-simple's rounds under --spec-draft-p-min p_min, the project's tau cycles
    from its second round's anchor, the proposals at every anchor from the last prompt token) of one
    response, from the project's drafter. After a first round (at the last prompt token) that
    accepted a drafts, both loops anchor at p + a: with a = 0 these are the response's tau cycles."""
    model = served["model"]
    taps = target_taps(tiny["target"], x, model.layer_ids)
    proposals = anchor_proposals(model, taps, x, p - 1, end=x.numel(), p_min=p_min)
    rounds = engine_rounds(proposals.tokens, x, p - 1, x.numel(), budget_end=p + BUDGET, stop=tiny["stop"],
                           served=proposals.served)
    return rounds, tau_from_taps(model, taps, x, p + rounds[0].accepted, end=x.numel()), proposals


def in_project_unit(rounds: list[int], start: int, end: int) -> list[int]:
    """llama.cpp's rounds anchored at `start` onwards as the project's cycles: each emits a + 1 tokens,
    a confirmed end token counted as the target's."""
    cycles, t = [], start
    for a in rounds:
        cycles.append(min(a + 1, end - t - 1))
        t += a + 1
    return cycles


def test_prompts_tokenize_alike(llama, tiny):
    for ids in tiny["heldout"]:
        assert llama.tokenize(tiny["gguf"], tiny["tok"].decode(ids)) == ids


def test_greedy_is_lossless_and_every_round_is_predicted(llama, tiny, served):
    """With no confidence cut, then (a drafter with a confidence head) with a --spec-draft-p-min that
    cuts many drafts."""
    tok = tiny["tok"]
    count, tau_cycles, first_accepted, responses, confidences = EngineCount(), [], [], [], []
    for ids in tiny["heldout"]:
        text, p = tok.decode(ids), len(ids)
        x = greedy_response(tiny, served, ids)
        generated, rounds, mean = speculative(llama, tiny, served, text, ["--temp", "0"])
        assert generated == tok.decode(x[p:-1]).strip("\n") == target_alone(llama, tiny, text)
        predicted, cycles, proposals = project_rounds(served, tiny, x, p)
        assert rounds == predicted, f"{served['name']}: llama.cpp ran {rounds}, the project predicts {predicted}"
        assert mean == pytest.approx(1 + sum(accepted(rounds)) / len(rounds), abs=0.005)
        assert in_project_unit(accepted(rounds)[1:], p + rounds[0].accepted, x.numel()) == cycles
        count.rounds.append(accepted(rounds))
        tau_cycles.append(cycles)
        first_accepted.append(rounds[0].accepted)
        responses.append((ids, x))
        confidences.append(proposals.confidence)
    assert sum(len(c) for c in tau_cycles) >= 2 * len(tiny["heldout"])  # the unit check saw many cycles
    assert max(max(r) for r in count.rounds) >= 4  # the drafter accepts several tokens: the test can fail
    later = [a for r in count.rounds for a in r[1:]]
    tau = sum(map(sum, tau_cycles)) / sum(map(len, tau_cycles))
    print(f"\n{served['name']}: llama.cpp mean acc len {count.mean_accept_length:.3f}; project tau_pooled "
          f"from the second round's anchor {tau:.3f}; first round accepted "
          f"{sum(first_accepted) / len(first_accepted):.3f} drafts (none on {first_accepted.count(0)}/"
          f"{len(first_accepted)}), later rounds {sum(later) / len(later):.3f}")
    if confidences[0] is not None:
        confidence_cut_is_predicted(llama, tiny, served, responses, cut_threshold(torch.cat(confidences)))


def greedy_response(tiny, served, ids: list[int]) -> torch.Tensor:
    """Prompt + the target's greedy response, which ends (EOS) well inside the budget."""
    x = greedy_continuation(tiny["target"], torch.tensor(ids), max_new_tokens=BUDGET)
    assert int(x[-1]) in tiny["stop"] and x.numel() - len(ids) <= BUDGET - 2 * served["model"].block_size
    return x


def cut_threshold(confidences: torch.Tensor) -> float:
    """A --spec-draft-p-min between the 10th and the 30th percentile of the drafter's confidences
    (every slot at every anchor: many drafts cut short, few to nothing), in the widest gap between
    two of them: the engine's float32 confidences differ from the project's by far less than half
    that gap, so no slot falls on the other side of the threshold."""
    values = confidences.flatten().double().sort().values
    band = values[len(values) // 10: 3 * len(values) // 10 + 1]
    gaps = band[1:] - band[:-1]
    i = int(gaps.argmax())
    assert gaps[i] > 1e-4, "no confidence gap wide enough to put a threshold in"
    return float((band[i] + band[i + 1]) / 2)


def confidence_cut_is_predicted(llama, tiny, served, responses, p_min: float) -> None:
    """Served with --spec-draft-p-min p_min: the output is still the target's, and every verified
    round's accepted and verified drafts are predicted; a draft cut to nothing is a plain decoding
    step (`accepted 0/0`), which llama.cpp's mean counts once it has verified a draft."""
    tok, full = tiny["tok"], served["model"].num_drafts
    cut = verified = plain = 0
    for ids, x in responses:
        text, p = tok.decode(ids), len(ids)
        generated, rounds, mean = speculative(llama, tiny, served, text,
                                              ["--temp", "0", "--spec-draft-p-min", f"{p_min:.9f}"])
        assert generated == tok.decode(x[p:-1]).strip("\n")
        predicted = project_rounds(served, tiny, x, p, p_min)[0]
        drafted = [r for r in rounds if r.drafted > 0]
        assert drafted == predicted, f"p_min {p_min}: llama.cpp ran {rounds}, the project predicts {predicted}"
        counted = rounds[next(i for i, r in enumerate(rounds) if r.drafted > 0):]
        assert mean == pytest.approx(1 + sum(accepted(counted)) / len(counted), abs=0.005)
        cut += sum(r.drafted < full for r in drafted)
        verified += len(drafted)
        plain += len(rounds) - len(drafted)
    print(f"{served['name']} --spec-draft-p-min {p_min:.4f}: {cut} of {verified} verified drafts cut short, "
          f"{plain} cut to nothing")
    assert 0 < cut < verified  # the threshold cuts drafts, not every one: the test can fail


def test_sampled_acceptance_agrees_within_noise(llama, tiny, served):
    tok, target, stop = tiny["tok"], tiny["target"], tiny["stop"]
    sampling = ["--temp", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    engine, project = [], []
    gen = torch.Generator().manual_seed(0)
    for ids in tiny["heldout"]:
        p = len(ids)
        for seed in range(SAMPLES):
            run = speculative(llama, tiny, served, tok.decode(ids), [*sampling, "--seed", str(seed)])
            engine.append(accepted(run[1]))
            x = sampled_continuation(target, torch.tensor(ids), Sampling(temperature=1.0), gen, max_new_tokens=BUDGET)
            project.append(accepted(project_rounds(served, tiny, x, p)[0]))
    (a, se_a), (b, se_b) = (ratio_se([len(r) + sum(r) for r in rs], [len(r) for r in rs]) for rs in (engine, project))
    print(f"\n{served['name']} T=1: llama.cpp mean acc len {a:.3f} +- {se_a:.3f}, project {b:.3f} +- {se_b:.3f}")
    assert abs(a - b) <= NOISE_SE * (se_a ** 2 + se_b ** 2) ** 0.5
    assert b > 1.2  # sampled drafts are still accepted
