"""python -m dflash_ds.report: PNGs and one HTML page from a run's metrics.jsonl."""

import json
import struct

import pytest

from dflash_ds.export.card import TauFacts
from dflash_ds.network.shape import DrafterShape
from dflash_ds.report import finish_run, main, page_html, report_contents, split_records, write_report


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def write_metrics(run_dir, resumed=True):
    recs = [{"step": 0, "tau": 1.0, "tau_pooled": 1.0, "tau_histogram": [4, 0, 0, 0],
             "tau_position_acceptance": [0.0, None, None], "eval": "before training"}]
    for s in range(1, 21):
        recs.append({"step": s, "loss": 3.0 / s, "accept_proxy": 1 + s / 10, "lr": 1e-3 * (1 - s / 21),
                     "tok_per_s": 1000 + s, "drafter_tok_per_s": 1000 + s, "target_tok_per_s": 900,
                     "drafter_wait_share": 0.1, "target_send_wait_share": 0.7, "kl": 0.5 / s})
    if resumed:  # a resume re-logs step 20 after its checkpoint: the later record wins
        recs.append(dict(recs[-1], loss=0.123))
    recs.append({"step": 20, "tau": 2.5, "tau_pooled": 2.25, "tau_histogram": [1, 1, 1, 1],
                 "tau_position_acceptance": [0.75, 0.5, 1.0], "eval": "after training"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_report_pages_and_pictures(tmp_path, capsys):
    write_metrics(tmp_path)
    steps, taus = split_records([json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()])
    assert len(steps) == 20 and steps[-1]["loss"] == 0.123 and [t["step"] for t in taus] == [0, 20]
    assert main([str(tmp_path)]) == 0
    out = tmp_path / "report"
    assert capsys.readouterr().out.strip() == str(out / "index.html")
    stems = ["loss", "accept_proxy", "tau", "position_acceptance", "throughput", "wait", "lr", "accepted_histogram"]
    for stem in stems:
        w, h = png_size(out / f"{stem}.png")
        assert (w, h) == (640, 400), stem
    w, h = png_size(out / "overview.png")
    assert w > 1000 and h > 500
    page = (out / "index.html").read_text()
    assert all(f'src="{s}.png"' in page for s in stems)
    assert "<td>0.1230</td>" in page and "3.157" not in page
    assert "tau, step 20 (after training)</th><td>2.500 (pooled 2.250)" in page
    assert "1:0.75 2:0.50 3:1.00" in page


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_report_errors_and_end_of_run_hook(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # no such folder: the argument's own check, exit 2
        main([str(tmp_path / "nothing")])
    assert stop.value.code == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()  # a folder without a run in it: named by what it lacks
    assert main([str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    # The end-of-run hook rewrites the export's card and draws the report; a broken export
    # does not fail the finished run, it is reported.
    write_metrics(tmp_path, resumed=False)
    (tmp_path / "export").mkdir()
    finish_run(tmp_path, {"steps": 20})
    printed = capsys.readouterr().err
    assert "report failed" in printed and "python -m dflash_ds.report" in printed
    from dflash_ds.export import save_drafter
    from dflash_ds.network.drafter import DFlashDrafter

    cfg = DrafterShape(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                        max_position_embeddings=64, vocab_size=32, num_target_layers=4, target_layer_ids=(1,),
                        block_size=4, mask_token_id=3, tie_word_embeddings=False)
    save_drafter(DFlashDrafter(cfg), tmp_path / "export2")
    (tmp_path / "export").rmdir()
    (tmp_path / "export2").rename(tmp_path / "export")
    finish_run(tmp_path, {"steps": 20, "tau": TauFacts(2.5, "8 prompts")})
    assert "report:" in capsys.readouterr().err
    assert "2.500 (exact offline" in (tmp_path / "export" / "README.md").read_text()
    assert (tmp_path / "report" / "overview.png").is_file()


def write_dspark_run(run_dir, with_bins=True):
    """Steps 1-20 of a DSpark run whose confidence head predicts 0.12 in bin 2 and 0.87 in bin 17 of 20,
    where 1 - TV averages 0.2 and 0.8 from step 11 on (0.9 and 0.1 before: the pooled last 10 steps
    must not see them); even steps put 1/4 of their weight in bin 2, odd steps 3/4."""
    (run_dir / "recipe.yaml").write_text("drafter:\n  architecture: dspark\n  block_size: 4\n")
    recs = []
    for s in range(1, 21):
        low = 0.25 if s % 2 == 0 else 0.75
        share = {2: low, 17: 1 - low}
        late = {2: 0.2, 17: 0.8} if s > 10 else {2: 0.9, 17: 0.1}
        rec = {"step": s, "loss": 3.0 / s, "accept_proxy": 1.5, "l1": 0.4, "tau_probabilistic": 2.0,
               "confidence_mae": 0.1 if s > 10 else 0.6,
               "confidence_bias": low * (0.12 - late[2]) + (1 - low) * (0.87 - late[17])}
        if with_bins:
            rec["confidence_bin_weight"] = [share.get(i, 0.0) for i in range(20)]
            rec["confidence_bin_pred"] = [share[i] * {2: 0.12, 17: 0.87}[i] if i in share else 0.0 for i in range(20)]
            rec["confidence_bin_target"] = [share[i] * late[i] if i in share else 0.0 for i in range(20)]
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_dspark_report_has_the_reliability_curve_and_its_ece(tmp_path):
    from matplotlib.figure import Figure

    write_dspark_run(tmp_path)
    contents = report_contents(tmp_path)
    panels = dict(contents.panels)
    assert list(panels)[-1] == "confidence_reliability"
    # Pooled over steps 11-20: bin 2 predicts 0.12 for 0.2, bin 17 0.87 for 0.8, half the weight each.
    row = ("confidence calibration, last 10 logged steps (11-20)", "ECE 0.075, MAE 0.100, bias -0.005")
    assert row in contents.rows
    page = page_html(tmp_path, contents)
    assert 'src="confidence_reliability.png"' in page and "ECE 0.075" in page
    ax = Figure().add_subplot()
    panels["confidence_reliability"](ax)
    diagonal, curve = ax.get_lines()
    assert list(diagonal.get_xdata()) == [0.0, 1.0] == list(diagonal.get_ydata())
    assert list(curve.get_xdata()) == pytest.approx([0.12, 0.87]) and list(curve.get_ydata()) == pytest.approx([0.2, 0.8])
    heights = [bar.get_height() for bar in ax.patches]
    assert len(heights) == 20 and heights[2] == pytest.approx(0.5) and heights[17] == pytest.approx(0.5)
    assert sum(heights) == pytest.approx(1.0)


def test_reports_without_reliability_bins_have_no_reliability_curve(tmp_path):
    """A v1 run, a run with no recipe record, and a DSpark run without a confidence head (no bins logged)."""
    v1, bare, headless = (tmp_path / name for name in ("v1", "bare", "headless"))
    for d in (v1, bare, headless):
        d.mkdir()
    write_metrics(v1)
    (v1 / "recipe.yaml").write_text("drafter:\n  architecture: dflash\n")
    write_metrics(bare)
    write_dspark_run(headless, with_bins=False)
    for run in (v1, bare, headless):
        contents = report_contents(run)
        assert "confidence_reliability" not in dict(contents.panels), run
        assert not any("ECE" in v for _, v in contents.rows), run
        assert "reliability" not in page_html(run, contents)
    # The v1 panels stay those the report always drew.
    assert [s for s, _ in report_contents(v1).panels] == [
        "loss", "accept_proxy", "tau", "position_acceptance", "throughput", "wait", "lr", "accepted_histogram"]


@pytest.mark.integration  # end to end in process, seconds (README, "Tests")
def test_a_dspark_report_draws_the_reliability_png(tmp_path):
    write_dspark_run(tmp_path)
    page = write_report(tmp_path).read_text()
    assert png_size(tmp_path / "report" / "confidence_reliability.png") == (640, 400)
    assert 'src="confidence_reliability.png"' in page and "ECE 0.075, MAE 0.100, bias -0.005" in page


def write_lilicorr_run(run_dir, with_prefixes=True):
    """Steps 1-20 of a LiLiCorr run: the reranked prefix 0.04 * s, the top-1 path's 0.3, the oracle's
    1.0 - the last 10 steps average 0.62, 0.3 and 1.0; step 7 logged no valid block (no prefixes)."""
    (run_dir / "recipe.yaml").write_text("drafter:\n  architecture: lilicorr\n  block_size: 4\n")
    recs = []
    for s in range(1, 21):
        rec = {"step": s, "loss": 3.0 / s, "accept_proxy": 1.2, "lilicorr_ce": 1.0 / s}
        if with_prefixes and s != 7:
            rec |= {"lilicorr_selected_prefix": 0.04 * s, "lilicorr_top1_prefix": 0.3, "lilicorr_oracle_prefix": 1.0}
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_lilicorr_report_has_its_prefix_panel(tmp_path):
    from matplotlib.figure import Figure

    with_panel, without = tmp_path / "with", tmp_path / "without"
    for d in (with_panel, without):
        d.mkdir()
    write_lilicorr_run(with_panel)
    write_lilicorr_run(without, with_prefixes=False)
    contents = report_contents(with_panel)
    panels = dict(contents.panels)
    assert list(panels)[-1] == "lilicorr_prefix"
    row = ("prefix of a block, mean of the last 10 logged steps (11-20)",
           "reranked 0.62 / top-1 0.30 / oracle 1.00: +0.32 over top-1, 62% of the oracle")
    assert row in contents.rows
    assert 'src="lilicorr_prefix.png"' in page_html(with_panel, contents)
    ax = Figure().add_subplot()
    panels["lilicorr_prefix"](ax)
    oracle, selected, top1 = ax.get_lines()
    steps = [s for s in range(1, 21) if s != 7]
    assert list(selected.get_xdata()) == steps and list(selected.get_ydata()) == pytest.approx([0.04 * s for s in steps])
    assert list(top1.get_ydata()) == [0.3] * 19 and list(oracle.get_ydata()) == [1.0] * 19
    assert len(ax.collections) == 1  # the shaded oracle gap
    # A run whose records carry no prefix lengths has no panel and no row.
    bare = report_contents(without)
    assert "lilicorr_prefix" not in dict(bare.panels) and not any("prefix of a block" in k for k, _ in bare.rows)
    write_report(with_panel)
    assert png_size(with_panel / "report" / "lilicorr_prefix.png")[0] > 0
