"""The static decoder (dflash_ds/data/static_decode.py) against transformers' generate, in float64 where
both are exact: the same greedy answers token for token, with rows refilled as answers end, sliding
windows, sampling's top_p limit, and the refusal of a model whose forward the decoder would not follow."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_ds.data.chat import ChatEncoder
from dflash_ds.data.decoders import HFGenerator, StaticGenerator, hf_generator, load_causal_lm
from dflash_ds.data.static_decode import StaticDecoder, Unsupported

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-target"


def settings(max_new=32, temperature=0.0, top_p=1.0, slots=3):
    return SimpleNamespace(max_new_tokens=max_new, temperature=temperature, top_p=top_p, slots=slots)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY))


@pytest.fixture(scope="module")
def prompts(tok):
    enc = ChatEncoder(tok, False)
    out = []
    for line in (ROOT / "assets" / "tiny_chat.jsonl").read_text().splitlines()[:24]:
        msgs = json.loads(line)["messages"]
        k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        out.append(enc.prompt_ids(msgs[:k]))
    return out


def f64(path=TINY):
    return load_causal_lm(str(path), "cpu", torch.float64)[0]


def test_greedy_equals_generate_token_for_token(tok, prompts):
    """Three rows for 24 prompts: most rows take several prompts one after another (a prefill into a row
    whose last answer ended), and some answers reach the budget unfinished."""
    st = settings(max_new=24)
    want = HFGenerator(str(TINY), tok, st, model=f64(), batch_size=1)(prompts, 0)
    gen = StaticGenerator(str(TINY), tok, st, model=f64())
    gen.decoder.sync_every = 5
    got = gen(prompts, 0)
    assert got == want
    assert any(not fin for _, fin in want) and any(fin for _, fin in want)
    assert len({len(ids) for ids, _ in want}) > 3  # answers of many lengths ended at different steps


def test_every_slot_count_and_sync_gives_the_same_answers(tok, prompts):
    st = settings(max_new=16)
    gen = StaticGenerator(str(TINY), tok, st, model=f64())
    first = gen(prompts[:10], 0)
    for slots, sync in ((1, 1), (4, 7), (64, 3)):
        gen.decoder.max_slots, gen.decoder.sync_every = slots, sync
        assert gen(prompts[:10], 0) == first


def test_sliding_window_layers_equal_generate(tok, prompts):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=tok.vocab_size + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                      use_sliding_window=True, max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    model = Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    st = settings(max_new=12, slots=2)
    short = [p[-20:] for p in prompts[:5]]
    want = HFGenerator(str(TINY), tok, st, model=model, batch_size=1)(short, 0)
    got = StaticGenerator(str(TINY), tok, st, model=model)(short, 0)
    assert got == want


def test_top_p_below_the_top_token_is_greedy_and_sampling_is_seeded(tok, prompts):
    greedy = StaticGenerator(str(TINY), tok, settings(max_new=12), model=f64())(prompts[:6], 0)
    nucleus = StaticGenerator(str(TINY), tok, settings(max_new=12, temperature=1.0, top_p=1e-6), model=f64())
    assert nucleus(prompts[:6], 0) == greedy
    hot = StaticGenerator(str(TINY), tok, settings(max_new=12, temperature=5.0), model=f64())
    a, b = hot(prompts[:6], 3), hot(prompts[:6], 3)
    assert a == b and a != greedy


def test_a_model_whose_forward_differs_is_refused_and_the_backend_falls_back(tok, prompts, monkeypatch, capsys):
    model = f64()
    plain = model.forward

    def doubled(*args, **kwargs):  # e.g. a scale in the model's own forward that the layers do not hold
        out = plain(*args, **kwargs)
        out.logits = out.logits * 2
        return out
    model.forward = doubled
    with pytest.raises(Unsupported, match="differ from the model's forward"):
        StaticDecoder(model, [2], max_new_tokens=4)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(Unsupported, match="softcapping"):
        StaticDecoder(model, [2], max_new_tokens=4)

    import dflash_ds.data.decoders as D

    monkeypatch.setattr(D, "load_causal_lm", lambda *a, **k: (model, "cpu"))
    gen = hf_generator(str(TINY), tok, SimpleNamespace(decoder="static", **vars(settings(max_new=4))))
    assert isinstance(gen, HFGenerator) and "decoding with generate" in capsys.readouterr().err


def test_the_regeneration_bench_compares_both_decoders(tmp_path):
    from dflash_ds.bench.cli import main

    out = tmp_path / "regen.json"
    assert main(["--role", "regenerate", "--target", str(TINY), "--prompts", str(ROOT / "assets" / "tiny_chat.jsonl"),
                 "--limit", "12", "--generate-limit", "6", "--batch-size", "3", "--slots", "4",
                 "--max-new-tokens", "12", "--exact-limit", "6", "--exact-new-tokens", "12", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["result"]
    assert r["static"]["prompts"] == 12 and r["generate"]["prompts"] == 6
    assert r["static"]["generated_tokens"] > 12 and r["static"]["tok_s"] > 0
    assert r["float64_agreement"] == {"answers": 6, "identical": 6, "identical_share": 1.0, "prefix_token_share": 1.0}
    assert main(["--role", "regenerate", "--target", str(TINY), "--prompts", str(tmp_path / "none.jsonl")]) == 2
