"""The performance harness: FLOP counts by hand, the split planner, and CPU smoke runs of every role."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ds import bench
from dflash_ds.network.attention import LayerAttention, build_mask
from dflash_ds.objective.blocks import anchor_generator, sample_anchors
from dflash_ds.resolve.drafter import drafter_shape
from dflash_ds.target_model.presets import GEOMETRIES, target_config

REPO = Path(__file__).resolve().parent.parent

# Tiny shapes shared by the smoke runs and the hand computations below.
SEQ, ROWS, ANCHORS, BLOCK, STEPS, WARMUP, PROMPT = 64, 2, 8, 4, 2, 2, 8
COMMON = ["--device", "cpu", "--geometry", "tiny", "--seq-len", str(SEQ), "--rows", str(ROWS), "--anchors",
          str(ANCHORS), "--block-size", str(BLOCK), "--steps", str(STEPS), "--warmup", str(WARMUP)]


# ----------------------------------------------------------------------------- hand counts


def tiny_linear_params(cfg, layers_run: int) -> int:
    """Linear weights of the first `layers_run` decoder layers, from the config fields alone."""
    d, inter = cfg.hidden_size, cfg.intermediate_size
    mlp = 3 * d * inter
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    # Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj.
    linear_attn = (2 * nk * dk + nv * dv) * d + nv * dv * d + 2 * nv * d + d * nv * dv
    h, hk, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Gated full attention: q_proj also produces the output gate (2x), k, v, o.
    full_attn = 2 * h * hd * d + 2 * hk * hd * d + h * hd * d
    total = 0
    for t in cfg.layer_types[:layers_run]:
        total += mlp + (full_attn if t == "full_attention" else linear_attn)
    return total


def dense_mask_pairs(step: int) -> int:
    """Allowed (query, key) pairs of step `step`'s mask, read off the dense mask itself."""
    loss_mask = torch.ones(ROWS, SEQ, dtype=torch.bool)
    loss_mask[:, :PROMPT] = False
    doc_ids = torch.zeros(ROWS, SEQ, dtype=torch.int32)
    anchors, valid = sample_anchors(loss_mask, doc_ids, ANCHORS, anchor_generator(0, step))
    return int(build_mask(anchors, valid, doc_ids, BLOCK, kind="dense").dense.sum())


def tiny_drafter_flops(pairs: int) -> float:
    cfg = target_config("tiny")
    d, h, hk, hd, inter, vocab = 64, 4, 2, 32, 128, 512  # the tiny geometry's drafter (target's heads)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (d, h, hk, hd)
    layers, taps = GEOMETRIES["tiny"].drafter_layers, 2
    ctx, blk = ROWS * SEQ, ROWS * ANCHORS * BLOCK
    dense = 6 * layers * ((2 * d * h * hd + 3 * d * inter) * blk + 2 * d * hk * hd * (ctx + blk))
    fuse = 4 * taps * d * d * ctx
    attention = layers * 3 * 4 * pairs * h * hd
    head = 4 * vocab * d * ROWS * ANCHORS * (BLOCK - 1)  # the drafting slots: the loss skips each anchor
    return dense + fuse + attention + head


def test_target_flops_by_hand():
    from transformers import AutoModelForCausalLM

    from dflash_ds.target_model.model import truncate_after

    cfg = target_config("tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    truncate_after(model, 5)
    layers = model.model.layers
    assert bench.count_linear_params(layers) == tiny_linear_params(cfg, 6)
    f = bench.target_forward_flops(tiny_linear_params(cfg, 6), 1, 4, 32, rows=ROWS, seq_len=SEQ)
    assert f["linear"] == 2 * tiny_linear_params(cfg, 6) * ROWS * SEQ
    assert f["attention"] == ROWS * 2 * SEQ * SEQ * 4 * 32  # 2*2*S^2*h*d/2 per row, one full layer


def test_visible_pairs_equals_dense_mask_count():
    g = torch.Generator().manual_seed(3)
    b, s, n, block = 3, 40, 6, 4
    doc_ids = torch.zeros(b, s, dtype=torch.int32)
    doc_ids[:, 13:] = 1
    doc_ids[1, 27:] = 2
    doc_ids[:, 36:] = -1  # padding tail
    loss_mask = (torch.rand(b, s, generator=g) > 0.3) & (doc_ids >= 0)
    anchors, valid = sample_anchors(loss_mask, doc_ids, n, g)
    valid[2, 0] = False  # an invalid block in the middle still sees its own block
    dense = build_mask(anchors, valid, doc_ids, block, kind="dense").dense
    assert bench.visible_pairs(anchors, valid, doc_ids, block) == int(dense.sum())
    for att in (LayerAttention(5, True), LayerAttention(9, False), LayerAttention(None, True)):
        dense = build_mask(anchors, valid, doc_ids, block, kind="dense", attention=att).dense
        assert bench.visible_pairs(anchors, valid, doc_ids, block, attention=att) == int(dense.sum()), att


def test_drafter_flops_by_hand():
    from dflash_ds.architectures.dflash2 import DFlash2Fields
    from dflash_ds.config import DrafterConfig
    from dflash_ds.network.shape import DrafterShape

    dcfg = drafter_shape(target_config("tiny"),
                                     DrafterConfig(num_layers=2, block_size=BLOCK, mask_token_id=5))
    f = bench.drafter_step_flops(dcfg, ROWS * SEQ, ROWS * ANCHORS * BLOCK, 1234)
    assert f["total"] == tiny_drafter_flops(1234)
    assert f["total"] == f["dense"] + f["fuse"] + f["attention"] + f["lm_head"]
    # DFlash2: the kernel projections (2 per layer of 2 layers, 64 x 2*2*64/16), the selector's projection
    # (32 x 64) and the unary scores from 16 gathered lm_head rows, per block token.
    v2 = drafter_shape(target_config("tiny"), DrafterConfig(
        num_layers=2, block_size=BLOCK, mask_token_id=5, architecture="dflash2",
        sections={"dflash2": DFlash2Fields(selector_rank=32)}))
    f2 = bench.drafter_step_flops(v2, ROWS * SEQ, ROWS * ANCHORS * BLOCK, 1234)
    per_token = 6 * (2 * 2 * 64 * 16 + 32 * 64)
    assert f2["dflash2"] == per_token * ROWS * ANCHORS * BLOCK + 4 * 16 * 64 * ROWS * ANCHORS * (BLOCK - 1)
    assert f2["total"] == tiny_drafter_flops(1234) + f2["dflash2"]


# ----------------------------------------------------------------------------- planner


def test_planner_anchor_rates_give_4_plus_4():
    splits = bench.plan_splits(9200, 10900, 8)
    assert [(s.targets, s.drafters) for s in splits] == [(t, 8 - t) for t in range(1, 8)]
    by_t = {s.targets: s.tok_s for s in splits}
    assert by_t[4] == 36800 and by_t[5] == 32700 and by_t[3] == 27600
    best = bench.best_split(splits)
    assert (best.targets, best.drafters, best.tok_s, best.bound) == (4, 4, 36800, "target")
    t, tok = bench.fractional_split(9200, 10900, 8)
    assert t == pytest.approx(8 * 10900 / 20100)
    assert tok == pytest.approx(8 * 9200 * 10900 / 20100)
    assert all(s.tok_s <= tok + 1e-9 for s in splits)  # no integer split beats the relaxation


def test_planner_ties_and_errors():
    best = bench.best_split(bench.plan_splits(1000, 1000, 3))
    assert (best.targets, best.drafters, best.tok_s) == (1, 2, 1000)  # 1+2 and 2+1 tie: more drafters
    with pytest.raises(ValueError, match="gpus-per-node"):
        bench.plan_splits(1, 1, 1)
    with pytest.raises(ValueError, match="rates"):
        bench.plan_splits(0, 1, 8)


# ----------------------------------------------------------------------------- setup


def test_geometries_match_the_published_shapes():
    big = target_config("qwen3.6-27b")
    assert (big.num_hidden_layers, big.hidden_size, big.vocab_size, big.intermediate_size) == (64, 5120, 248320, 17408)
    assert big.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert (big.num_attention_heads, big.num_key_value_heads, big.head_dim) == (24, 4, 256)
    assert (big.linear_num_key_heads, big.linear_num_value_heads, big.linear_key_head_dim,
            big.linear_value_head_dim, big.linear_conv_kernel_dim) == (16, 48, 128, 128, 4)
    assert big.rope_parameters["rope_theta"] == 1e7 and big.rope_parameters["partial_rotary_factor"] == 0.25
    assert big.tie_word_embeddings is False
    q8 = target_config("qwen3-8b")
    assert (q8.num_hidden_layers, q8.hidden_size, q8.num_attention_heads, q8.num_key_value_heads, q8.head_dim,
            q8.intermediate_size, q8.vocab_size, q8.rope_parameters["rope_theta"]) == (36, 4096, 32, 8, 128, 12288, 151936, 1e6)
    assert target_config("qwen3.6-27b", layers=8).layer_types == big.layer_types[:8]
    with pytest.raises(ValueError, match="unknown geometry"):
        target_config("qwen9")


def test_setup_27b_drafter_geometry_and_layers_override():
    args = bench.parse_args(["--role", "drafter", "--device", "cpu"])
    s = bench.resolve_setup(args, torch.device("cpu"))
    c = s.drafter_config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
            c.mask_token_id, c.vocab_size) == (5, 32, 8, 128, 17408, 248070, 248320)
    assert s.tap_ids == [1, 16, 31, 46, 61]
    # The recipe's rows: one 12,288-token row per micro-batch, 2,048 anchors, one micro-batch per step.
    assert s.payload.shape == (1, 12288, 5 * 5120 + 4)  # fp32 payload on CPU: 3 int32 metadata columns + 1 to align
    assert (s.recipe.objective.num_anchors, s.plan.grad_accum, s.recipe.data.max_length) == (2048, 1, 3072)
    # A shorter row keeps the recipe's anchors per token and cuts conversations to the row.
    args = bench.parse_args(["--role", "drafter", "--device", "cpu", "--seq-len", "3072", "--grad-accum", "4"])
    s = bench.resolve_setup(args, torch.device("cpu"))
    assert s.payload.shape[1] == 3072 and s.recipe.objective.num_anchors == 512 and s.plan.tokens_per_step == 4 * 3072
    args = bench.parse_args(["--role", "drafter", "--device", "cpu", "--seq-len", "1024"])
    s = bench.resolve_setup(args, torch.device("cpu"))
    assert (s.recipe.data.row_length, s.recipe.data.max_length, s.recipe.objective.num_anchors) == (1024, 1024, 171)
    args = bench.parse_args(["--role", "target", "--device", "cpu", "--layers", "16"])
    assert bench.resolve_setup(args, torch.device("cpu")).tap_ids == [1, 4, 7, 10, 13]


def test_setup_from_a_recipe_with_a_local_target(tmp_path):
    import yaml

    from dflash_ds.config import recipe_mapping

    target_config("tiny-qwen3").save_pretrained(tmp_path / "target")
    raw = recipe_mapping(REPO / "recipes" / "tiny.yaml")
    raw["target"]["path"] = str(tmp_path / "target")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    args = bench.parse_args(["--role", "drafter", "--device", "cpu", "--recipe", str(tmp_path / "r.yaml"),
                             "--seq-len", "64", "--anchors", "8", "--layers", "12"])
    s = bench.resolve_setup(args, torch.device("cpu"))
    assert s.target_config.num_hidden_layers == 12 and s.target_config.hidden_size == 64
    assert s.tap_ids == [1, 9]  # recomputed for 12 layers with the recipe's 2 drafter layers
    assert s.recipe.drafter.mask_token_id == raw["drafter"]["mask_token_id"]


# ----------------------------------------------------------------------------- smoke runs


def run_concurrently(commands: dict[str, list[str]], out: Path, timeout: int) -> dict:
    """`python ARGS... --out OUT/NAME.json` for every NAME, all at the same time (independent processes);
    NAME -> its JSON, with the process's output under "log"."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = {name: subprocess.Popen([sys.executable, *args, "--out", str(out / f"{name}.json")], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in commands.items()}
    results = {}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"{name} failed:\n{log[-4000:]}"
        results[name] = json.loads((out / f"{name}.json").read_text())
        results[name]["log"] = log
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every compute role once, as the CLI, all at the same time."""
    out = tmp_path_factory.mktemp("bench")
    roles = ("target", "drafter", "colocated", "transport")
    results = run_concurrently({r: ["-m", "dflash_ds.bench", "--role", r, *COMMON] for r in roles}, out, 240)
    results["dir"] = out
    return results


def check_common(report: dict, role: str) -> dict:
    assert report["role"] == role
    env = report["env"]
    assert env["torch"] == torch.__version__ and env["transformers"] and env["deepspeed"] and env["device_name"]
    assert report["args"]["seq_len"] == SEQ and report["args"]["role"] == role
    assert report["ceiling"]["tflops"] > 0 and report["ceiling"]["dtype"] == "float32"
    r = report["result"]
    assert r["tok_s"] > 0 and math.isfinite(r["tok_s"])
    assert f"role {role}" in report["log"]
    return r


def check_timed(r: dict, tokens_per_step: int) -> None:
    assert len(r["step_s"]["all"]) == STEPS and all(t > 0 for t in r["step_s"]["all"])
    assert r["tokens_per_step"] == tokens_per_step
    assert r["tok_s"] == pytest.approx(tokens_per_step * STEPS / r["timed_s"])
    assert r["tok_s_median"] == pytest.approx(tokens_per_step / r["step_s"]["median"])
    assert r["steadiness"]["steady"] is None  # 2 timed steps: too few to tell
    assert r["first_step_s"] > 0 and r["first_step_since_build_s"] >= r["first_step_s"]
    assert r["first_step_since_process_start_s"] >= r["first_step_since_build_s"]
    assert r["compile"]["timed"]["unique_graphs"] == 0  # nothing compiled on CPU
    assert r["memory"]["host_max_rss_gib"] > 0


@pytest.mark.launcher
def test_target_role(runs):
    report = runs["target"]
    r = check_common(report, "target")
    check_timed(r, ROWS * SEQ)
    assert r["engine"] == "replica" and r["taps"] == [1, 5]
    cfg = target_config("tiny")
    layers_run = 6  # truncated after the last tap, layer 5
    expected = 2 * tiny_linear_params(cfg, layers_run) * ROWS * SEQ + 1 * ROWS * 2 * SEQ * SEQ * 4 * 32
    assert r["flops_per_step"] == expected
    assert r["flops_per_micro"]["layers_run"] == layers_run and r["flops_per_micro"]["full_attention_layers_run"] == 1
    assert r["mfu"] == pytest.approx(expected * r["tok_s"] / (ROWS * SEQ) / 1e12 / report["ceiling"]["tflops"])
    assert r["payload_bytes"] == ROWS * SEQ * (2 * 64 + 4) * 4  # 3 int32 metadata columns + 1 to align


@pytest.mark.launcher
def test_drafter_role(runs):
    report = runs["drafter"]
    r = check_common(report, "drafter")
    check_timed(r, ROWS * SEQ)
    expected = sum(tiny_drafter_flops(dense_mask_pairs(s)) for s in range(WARMUP, WARMUP + STEPS)) / STEPS
    assert r["flops_per_step"] == pytest.approx(expected, rel=1e-12)
    assert r["mfu"] == pytest.approx(expected * r["tok_s"] / (ROWS * SEQ) / 1e12 / report["ceiling"]["tflops"])
    assert r["drafter_flops"]["valid_blocks_per_micro"] == ROWS * ANCHORS
    assert r["mask"]["kind"] == "dense" and r["mask"]["first_build_s"] > 0 and r["mask"]["build_s"] > 0
    from dflash_ds.config import DrafterConfig
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.network.shape import DrafterShape

    dcfg = drafter_shape(target_config("tiny"),
                                     DrafterConfig(num_layers=2, block_size=BLOCK, mask_token_id=5))
    assert r["drafter_params"] == sum(p.numel() for p in DFlashDrafter(dcfg).parameters())
    assert r["zero_stage"] == 2 and r["compiled_layers"] is False
    assert report["recipe"]["drafter_ds_config"].endswith("drafter_zero2_cpu.json")


@pytest.mark.launcher
def test_colocated_role(runs):
    report = runs["colocated"]
    r = check_common(report, "colocated")
    check_timed(r, ROWS * SEQ)
    target = 2 * tiny_linear_params(target_config("tiny"), 6) * ROWS * SEQ + ROWS * 2 * SEQ * SEQ * 4 * 32
    drafter = sum(tiny_drafter_flops(dense_mask_pairs(s)) for s in range(WARMUP, WARMUP + STEPS)) / STEPS
    assert r["flops_per_step"] == pytest.approx(target + drafter, rel=1e-12)
    assert r["engine_target"] == "replica"


@pytest.mark.launcher
def test_transport_role(runs):
    report = runs["transport"]
    r = check_common(report, "transport")
    nbytes = ROWS * SEQ * (2 * 64 + 8) * 2  # bf16 taps of 2 layers x D 64 + 6 metadata columns + 2 to align
    assert r["payload_bytes"] == nbytes and r["payload_shape"] == [ROWS, SEQ, 2 * 64 + 8]
    assert r["payloads"] == STEPS and r["seconds"] > 0
    assert r["payloads_per_s"] == pytest.approx(STEPS / r["seconds"])
    assert r["gb_s"] == pytest.approx(r["payloads_per_s"] * nbytes / 1e9)
    assert r["tok_s"] == pytest.approx(r["payloads_per_s"] * ROWS * SEQ)


@pytest.mark.launcher
def test_plan_role_reads_bench_outputs(runs, capsys):
    d = runs["dir"]
    out = d / "plan.json"
    rc = bench.main(["--role", "plan", "--from", str(d / "target.json"), str(d / "drafter.json"),
                     "--gpus-per-node", "4", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["result"]
    t_rate, d_rate = runs["target"]["result"]["tok_s"], runs["drafter"]["result"]["tok_s"]
    assert (r["target_rate"], r["drafter_rate"]) == (t_rate, d_rate)
    want = max(range(1, 4), key=lambda t: (min(t * t_rate, (4 - t) * d_rate), -t))
    assert r["best"]["targets"] == want and r["best"]["tok_s"] == pytest.approx(min(want * t_rate, (4 - want) * d_rate))
    assert "<- best" in capsys.readouterr().out
    # A transport output carries no compute rate: refused with a message naming the fix.
    rc = bench.main(["--role", "plan", "--from", str(d / "transport.json"), "--drafter-rate", "1"])
    assert rc == 2 and "--role target" in capsys.readouterr().err
