"""Per-layer attention types (docs/algorithm.md section 3, "Sliding windows and causality"): the window
and causal masks against references written from the serving rule, flex vs dense as the kernel reads
them, block sparsity that skips what a window hides, the drafter's per-layer masks, the export fields
through transformers' Qwen3Config, the AutoModel remote code, and the recipe checks."""

import json

import pytest
import torch
from transformers import Qwen3Config

from dflash_ds.config import DrafterConfig, RecipeError, load_recipe
from dflash_ds.network.attention import FLEX_BLOCK, FULL, LayerAttention, build_layer_masks, build_mask
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape, attention_layout
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.resolve.run import resolve_run
from tests.remote_case import block_case, serving_call, training_call
from tests.test_attention import emulate_block_mask, naive_layer_mask, packed_case

S_, F_ = "sliding_attention", "full_attention"


ATTENTIONS = [LayerAttention(4, True), LayerAttention(4, False), LayerAttention(7, True), LayerAttention(11, False),
              LayerAttention(None, True), LayerAttention(500, True)]


@pytest.mark.parametrize("att", ATTENTIONS, ids=str)
def test_dense_window_mask_equals_the_serving_rule(att):
    anchors, valid, doc_ids, B = packed_case()
    dense = build_mask(anchors, valid, doc_ids, B, kind="dense", attention=att)
    assert dense.attention == att
    assert torch.equal(dense.dense, naive_layer_mask(anchors, valid, doc_ids, B, att.window, att.causal))


def test_window_edge_hand_worked():
    """W = 8, B = 4, one document, anchor 20: slot k sees context 13 + k .. 19 (W - 1 - k keys).
    An off-by-one rule (`<=` instead of `<`) gives slot 0 position 12 as well and fails here."""
    B, W = 4, 8
    doc_ids = torch.zeros(1, 30, dtype=torch.int32)
    anchors, valid = torch.tensor([[20]]), torch.tensor([[True]])
    for kind in ("dense", "flex"):
        mask = build_mask(anchors, valid, doc_ids, B, kind=kind, attention=LayerAttention(W, causal=True))
        if kind == "flex":
            element = emulate_block_mask(mask.block_mask, B, 30 + B)[0][0]
        else:
            element = mask.dense[0, 0]
        for k in range(B):
            assert element[k, :30].nonzero().flatten().tolist() == list(range(13 + k, 20)), (kind, k)
            assert element[k, 30:].nonzero().flatten().tolist() == list(range(k + 1)), (kind, k)  # causal block


def test_window_at_least_the_block():
    anchors, valid, doc_ids, B = packed_case()
    with pytest.raises(AssertionError):
        build_mask(anchors, valid, doc_ids, B, attention=LayerAttention(B - 1))
    with pytest.raises(ValueError, match=">= 1"):
        LayerAttention(0)


@pytest.mark.parametrize("att", ATTENTIONS[:4] + [FULL, LayerAttention(None, True)], ids=str)
@pytest.mark.parametrize("S, B", [(37, 4), (300, 16), (700, 16)])
def test_flex_window_mask_equals_dense_and_is_exactly_sparse(att, S, B):
    """Element by element as the kernel reads it (both tile layouts), and the BlockMask lists exactly
    the tiles holding a visible key: a tile hidden by the window is skipped, never computed."""
    if att.window is not None and att.window < B:
        att = LayerAttention(att.window * 4, att.causal)
    if S == 37:
        anchors, valid, doc_ids, B = packed_case(S, B)
    else:
        g = torch.Generator().manual_seed(S)
        n = 24
        doc_ids = torch.zeros(2, S, dtype=torch.int32)
        doc_ids[0, 140:] = 1
        doc_ids[1, S // 2:] = 3
        doc_ids[1, S - 7:] = -1
        anchors = torch.randint(0, S - 8, (2, n), generator=g).sort(-1).values
        anchors[0, :4] = torch.tensor([127, 128, 129, 255])  # window starts at tile edges
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, -1] = False
    Q = anchors.shape[1] * B
    dense = build_mask(anchors, valid, doc_ids, B, kind="dense", attention=att).dense[:, 0]
    flex = build_mask(anchors, valid, doc_ids, B, kind="flex", attention=att)
    for q_side in (False, True):
        element, partial, full = emulate_block_mask(flex.block_mask, Q, S + Q, use_q_side=q_side)
        assert torch.equal(element, dense)
    q_pad, kv_pad = flex.block_mask.seq_lengths
    padded = torch.zeros(dense.shape[0], q_pad, kv_pad, dtype=torch.bool)
    padded[:, :Q, :S + Q] = dense
    tiles = padded.view(dense.shape[0], q_pad // FLEX_BLOCK, FLEX_BLOCK, kv_pad // FLEX_BLOCK, FLEX_BLOCK)
    assert torch.equal(partial | full, tiles.any(4).any(2))


def test_window_skips_context_tiles():
    """At S = 2048 with a 256-token window, each query tile (8 blocks whose anchors span ~220 tokens)
    touches at most 5 context tiles (476 tokens) instead of all the ones before its anchors."""
    S, B, n = 2048, 16, 64
    doc_ids = torch.zeros(1, S, dtype=torch.int32)
    anchors = torch.linspace(300, S - 20, n).long()[None]
    valid = torch.ones(1, n, dtype=torch.bool)
    ctx_tiles = S // FLEX_BLOCK

    def tiles(att):
        bm = build_mask(anchors, valid, doc_ids, B, kind="flex", attention=att).block_mask
        idx, num = bm.kv_indices[0, 0], bm.kv_num_blocks[0, 0]
        fidx, fnum = bm.full_kv_indices[0, 0], bm.full_kv_num_blocks[0, 0]
        per_q = [sum(int(t) < ctx_tiles for t in idx[qb, :num[qb]]) + sum(int(t) < ctx_tiles for t in fidx[qb, :fnum[qb]])
                 for qb in range(idx.shape[0])]
        return per_q

    full, window = tiles(FULL), tiles(LayerAttention(256, True))
    assert max(window) <= 5 < max(full) and sum(window) * 2 < sum(full)


# ------------------------------------------------------------------------------------ the drafter

def tgt_config():
    return Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=512, rope_theta=1e4)


def windowed_drafter(layer_types, window, is_causal=None, block_size=4, seed=0, dtype=torch.float64):
    choices = DrafterConfig(num_layers=len(layer_types), block_size=block_size, mask_token_id=63,
                             target_layer_ids=(1, 4, 6), layer_types=tuple(layer_types), sliding_window=window,
                             is_causal=is_causal)
    cfg = drafter_shape(tgt_config(), choices)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_engine_causality_rule():
    """SGLang's and vLLM's reading of a DFlash config: sliding layers causal and full layers bidirectional
    unless `is_causal` says otherwise for every layer."""
    types = (S_, S_, F_)
    assert attention_layout(types, 2048, None) == (LayerAttention(2048, True), LayerAttention(2048, True), FULL)
    assert attention_layout(types, 2048, False) == (LayerAttention(2048, False),) * 2 + (FULL,)
    assert attention_layout(types, 2048, True) == (LayerAttention(2048, True),) * 2 + (LayerAttention(None, True),)


def test_drafter_refuses_a_mask_built_for_another_attention():
    model = windowed_drafter([S_, F_], window=8)
    anchors, valid, doc_ids, B = packed_case()
    ctx = torch.randn(2, 37, 32, dtype=torch.float64)
    block = torch.randn(2, anchors.shape[1] * B, 32, dtype=torch.float64)
    pos = torch.arange(37).expand(2, -1)
    bpos = (anchors[..., None] + torch.arange(B)).view(2, -1)
    with pytest.raises(ValueError, match="layer 0 attends"):
        model(block, ctx, bpos, pos, mask=build_mask(anchors, valid, doc_ids, B))
    masks = build_layer_masks(anchors, valid, doc_ids, B, attentions=model.config.layer_attentions())
    assert masks[0] is not masks[1] and masks[0].attention == LayerAttention(8, True)
    out = model(block, ctx, bpos, pos, mask=masks)
    assert torch.isfinite(out).all()
    shared = build_layer_masks(anchors, valid, doc_ids, B, attentions=attention_layout((S_, S_, F_, S_), 8, None))
    assert shared[0] is shared[1] is shared[3] and shared[2] is not shared[0]


@pytest.mark.parametrize("is_causal", [None, False])
def test_context_outside_the_window_never_reaches_a_block(is_causal):
    """All layers sliding (W = 6, B = 4): the block at anchor 20 depends on context 15 .. 19 only
    (slot 0 sees a - W + 1 .. a - 1); changing position 14 changes nothing, position 15 does."""
    W, B, a = 6, 4, 20
    model = windowed_drafter([S_, S_], window=W, is_causal=is_causal)
    doc_ids = torch.zeros(1, 32, dtype=torch.int32)
    anchors, valid = torch.tensor([[a]]), torch.tensor([[True]])
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 32, 32, generator=g, dtype=torch.float64)
    block = torch.randn(1, B, 32, generator=g, dtype=torch.float64)
    pos, bpos = torch.arange(32)[None], torch.arange(a, a + B)[None]
    variants = [ctx]
    for j in (a - W, a - W + 1):
        c = ctx.clone()
        c[0, j] += 1.0
        variants.append(c)
    n = len(variants)
    for kind in ("dense", "flex"):
        masks = build_layer_masks(anchors.expand(n, -1), valid.expand(n, -1), doc_ids.expand(n, -1), B,
                                  attentions=model.config.layer_attentions(), kind=kind)
        with torch.no_grad():
            out = model(block.expand(n, -1, -1), torch.cat(variants), bpos.expand(n, -1), pos.expand(n, -1), mask=masks)
        assert torch.equal(out[1], out[0]), kind
        assert not torch.allclose(out[2], out[0]), kind


@pytest.mark.parametrize("layer_types, is_causal", [((S_, S_, F_), None), ((S_, F_, S_), False), ((F_, F_), True)])
def test_batched_training_masks_equal_the_serving_view(layer_types, is_causal):
    """Every anchor drafted on its own with the engines' position rule (eval.specdec.serving_masks, the
    context being the prefix before the anchor) equals the batched training forward with
    build_layer_masks over the whole row (float64)."""
    from dflash_ds.eval.specdec import serving_masks
    from dflash_ds.network.draft_model import DraftModel

    B, S = 4, 30
    model = windowed_drafter(layer_types, window=7 if S_ in layer_types else None, is_causal=is_causal)
    dm = DraftModel(model, torch.zeros(64, 32, dtype=torch.float64), torch.zeros(64, 32, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    ctx = torch.randn(1, S, 32, generator=g, dtype=torch.float64)
    anchors = torch.tensor([[2, 6, 9, 15, 16, 25]])
    n = anchors.shape[1]
    block = torch.randn(1, n * B, 32, generator=g, dtype=torch.float64)
    pos = torch.arange(S)[None]
    bpos = (anchors[..., None] + torch.arange(B)).view(1, -1)
    masks = build_layer_masks(anchors, torch.ones(1, n, dtype=torch.bool), torch.zeros(1, S, dtype=torch.int32), B,
                              attentions=model.config.layer_attentions())
    with torch.no_grad():
        batched = model(block, ctx, bpos, pos, mask=masks).view(n, B, -1)
        for i, a in enumerate(anchors[0].tolist()):
            one = model(block[:, i * B:(i + 1) * B], ctx[:, :a], bpos[:, i * B:(i + 1) * B], pos[:, :a],
                        mask=serving_masks(dm, a, torch.device("cpu")))
            torch.testing.assert_close(one[0], batched[i], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ export

def test_export_fields_round_trip_through_qwen3config():
    model = windowed_drafter([S_, S_, S_, S_, F_], window=2048, block_size=16)
    hf = model.config.to_hf_config()
    assert hf["layer_types"] == [S_] * 4 + [F_]
    assert hf["use_sliding_window"] is True and hf["sliding_window"] == 2048 and hf["max_window_layers"] == 5
    assert "is_causal" not in hf  # the engines' default: sliding layers causal, the full layer not
    assert DrafterShape.from_hf_config(hf) == model.config
    q = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert q.layer_types == [S_] * 4 + [F_] and q.sliding_window == 2048 and q.use_sliding_window
    # Why use_sliding_window is written: without it Qwen3Config silently drops the window.
    dropped = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "use_sliding_window")})
    assert dropped.sliding_window is None
    explicit = windowed_drafter([S_, S_], window=64, is_causal=False).config
    hf2 = explicit.to_hf_config()
    assert hf2["is_causal"] is False and DrafterShape.from_hf_config(hf2) == explicit
    # vLLM also honours dflash_config.causal; an export carrying only that reads the same.
    other = dict(hf2, dflash_config=dict(hf2["dflash_config"], causal=False))
    del other["is_causal"]
    assert DrafterShape.from_hf_config(other).is_causal is False
    # A config whose window sits only in dflash_config.swa_window_size (vLLM reads it there too).
    swa = dict(hf2, sliding_window=None, use_sliding_window=False, dflash_config=dict(hf2["dflash_config"], swa_window_size=64))
    assert DrafterShape.from_hf_config(swa) == explicit
    full = windowed_drafter([F_, F_], window=None).config.to_hf_config()
    assert full["use_sliding_window"] is False and full["sliding_window"] is None and "is_causal" not in full


@pytest.mark.parametrize("layer_types, is_causal", [((S_, F_), None), ((S_, S_), False), ((F_, S_), True)])
def test_automodel_applies_the_windows(tmp_path, layer_types, is_causal):
    """The remote code's position rule equals the drafter's per-layer masks, batched with the training
    mask and in the serving call (no mask)."""
    from transformers import AutoModel

    from dflash_ds.eval.specdec import serving_masks
    from dflash_ds.export import load_drafter, save_drafter
    from dflash_ds.network.draft_model import DraftModel

    B, W, S = 4, 6, 24
    ours = windowed_drafter(layer_types, window=W, is_causal=is_causal, dtype=torch.float32)
    out = save_drafter(ours, tmp_path / "export")
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert [remote.config.layer_window_and_causal(i) for i in range(2)] == \
        [(a.window, a.causal) for a in ours.config.layer_attentions()]
    ours = load_drafter(out, dtype=torch.float32)  # the export is bf16: compare the same weights
    assert ours.config == windowed_drafter(layer_types, window=W, is_causal=is_causal).config
    case = block_case(32, B, seq=S, generator=torch.Generator().manual_seed(0))
    masks = build_layer_masks(case.anchors, case.valid, case.doc_ids, B, attentions=ours.config.layer_attentions())
    training = build_mask(case.anchors, case.valid, case.doc_ids, B)  # the un-windowed bidirectional mask
    got, want = training_call(remote, ours, case, masks, training.dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dm = DraftModel(ours, torch.zeros(1), torch.zeros(1))
    got1, want1 = serving_call(remote, ours, case, B, serving_masks(dm, S, torch.device("cpu")))
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
    # The windows matter here: the same weights with every layer full and bidirectional differ.
    with torch.no_grad():
        plain = DFlashDrafter(ours.config.replace(layer_types=(F_, F_), sliding_window=None, is_causal=None))
        plain.load_state_dict(ours.state_dict())
        other = plain(case.embeds, plain.fuse(case.taps), case.block_pos, case.ctx_pos, mask=training)
        assert not torch.allclose(other, want, rtol=1e-3, atol=1e-3)
    assert json.loads((out / "config.json").read_text())["layer_types"] == list(layer_types)


def test_automodel_refuses_a_window_shorter_than_the_block(tmp_path):
    """What load_drafter refuses, the remote code refuses too: such a window cuts into the block, and the
    engines cut a non-causal block differently (one-sided in llama.cpp, symmetric in vLLM and SGLang)."""
    from transformers import AutoModel

    from dflash_ds.export import save_drafter

    out = save_drafter(windowed_drafter((S_, S_), window=6, is_causal=False, dtype=torch.float32), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config.update(sliding_window=3)  # block_size is 4
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window=3 is shorter than block_size=4"):
        AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ recipe

@pytest.mark.parametrize("overrides, message", [
    (["drafter.layer_types=[sliding_attention]"], "drafter.layer_types lists 1 layers for 2 drafter layers"),
    (["drafter.layer_types=[sliding_attention,windowed]", "drafter.sliding_window=64"],
     "each entry must be one of full_attention, sliding_attention"),
    (["drafter.layer_types=[sliding_attention,full_attention]"], "drafter.sliding_window is not set"),
    (["drafter.sliding_window=64"], "no layer in layer_types is sliding_attention"),
    (["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=4"],
     "drafter.sliding_window = 4 is shorter than the block size 8"),
    (["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=0"],
     "drafter.sliding_window = 0 is shorter than the block size 8"),
])
def test_recipe_attention_keys_are_checked_before_launch(overrides, message):
    recipe = load_recipe("recipes/tiny.yaml", ["drafter.num_layers=2", "drafter.block_size=8"] + overrides)
    with pytest.raises(RecipeError) as err:
        resolve_run(recipe, world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_recipe_value_of_the_wrong_type_stops_at_load():
    with pytest.raises(RecipeError, match="drafter.is_causal: expected true or false"):
        load_recipe("recipes/tiny.yaml", ["drafter.is_causal=maybe"])


def test_recipe_attention_keys_reach_the_step_settings():
    from dflash_ds.objective.drafter_loss import StepSettings

    r = load_recipe("recipes/tiny.yaml", ["drafter.num_layers=3", "drafter.block_size=8",
                                          "drafter.layer_types=[sliding_attention,sliding_attention,full_attention]",
                                          "drafter.sliding_window=32", "drafter.target_layer_ids=[1,4,6]",
                                          "drafter.mask_token_id=63"])
    shape = drafter_shape(tgt_config(), r.drafter)
    assert (shape.layer_types, shape.sliding_window, shape.is_causal) == ((S_, S_, F_), 32, None)
    s = StepSettings.of(shape, r.objective, 0, torch.device("cpu"))
    assert s.attentions == (LayerAttention(32, True), LayerAttention(32, True), FULL)


def test_init_from_refuses_another_attention_layout():
    a = windowed_drafter([S_, F_], window=8).config
    assert [m[0] for m in a.mismatches(windowed_drafter([F_, F_], window=None).config)] == ["layer_types", "sliding_window"]
    assert [m[0] for m in a.mismatches(windowed_drafter([S_, F_], window=8, is_causal=False).config)] == ["is_causal"]


def test_bench_runs_the_recipe_layout_or_the_one_set():
    """`python -m dflash_ds.bench --role drafter` measures the flagship recipe's layout at the flagship
    geometry, full attention for a geometry with another layer count, and any layout given with --set."""
    from dflash_ds.bench.cli import parse_args
    from dflash_ds.bench.setup import resolve_setup

    cpu = torch.device("cpu")
    base = ["--role", "drafter", "--device", "cpu", "--seq-len", "512", "--anchors", "64"]
    flagship = resolve_setup(parse_args(base), cpu).drafter_config
    assert flagship.layer_types == (S_,) * 4 + (F_,) and flagship.sliding_window == 2048
    assert flagship.layer_attentions()[0] == LayerAttention(2048, True)
    tiny = resolve_setup(parse_args(base + ["--geometry", "tiny-qwen3"]), cpu).drafter_config
    assert tiny.layer_types == (F_, F_) and tiny.sliding_window is None
    chosen = resolve_setup(parse_args(base + ["--geometry", "tiny-qwen3", "--set", f"drafter.layer_types=[{S_},{F_}]",
                                              "--set", "drafter.sliding_window=32"]), cpu).drafter_config
    assert chosen.layer_types == (S_, F_) and chosen.sliding_window == 32
    full = resolve_setup(parse_args(base + ["--set", "drafter.layer_types=null", "--set", "drafter.sliding_window=null"]),
                         cpu).drafter_config
    assert full.layer_types == (F_,) * 5 and full.sliding_window is None
