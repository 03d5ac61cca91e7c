"""The conformance suite, a tiny recipe through the launcher: an architecture's tiny recipe runs end to end
through the real `deepspeed` launcher on gloo (a target rank sending what its loss reads, a drafter rank),
its split run's losses equal the single-process reference (tests/reference.py), its own log fields are
logged (every field its log view shows), the export is its architecture's (config.json's class, read
back by the evaluator's loader) and tau is reported after training. A row's own checks follow (DFlash2's
selector warm-up, LiLiCorr's lattice, XPress's passes).

The rows are the architectures whose tiny recipe this tier has launched all along: v1's launcher runs are
tests/test_runtime.py's (split, colocated, resumed), and DSpark's tiny recipe trains in process (the
steps suite, tests/test_dspark_recipes.py); one more launch costs the CPU tier a minute and a half, which
XPress's row spends (its rounds' gradients, taken through the head after the fused loss, in a split run)."""

from __future__ import annotations

import json
import string

import pytest

from dflash_ds.architectures import VARIANTS
from dflash_ds.metrics import read_metrics

from .launch_util import launch, output
from .reference import recipe_reference_losses

pytestmark = pytest.mark.launcher

FAST = ["optim.max_steps=4", "log.every_steps=1", "eval.at_start=false", "log.progress=false", "data.num_eval=4",
        "eval.max_new_tokens=16"]


def dflash2_own(run_dir, recs, config, reference):
    """The selector term changes training once its weight is on (warm-up: step 1 only)."""
    no_selector = reference(["objective.dflash2.selector_alpha=0"])
    want = reference([])
    assert want[:2] == pytest.approx(no_selector[:2], rel=1e-6) and abs(want[-1] - no_selector[-1]) > 1e-5
    assert all(r["selector_loss"] >= 0 and 0 <= r["selector_recall"] <= 1 for r in recs)
    assert recs[-1]["selector_loss"] > 0
    assert config["dflash_config"]["selector_top_k"] == 10
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["is_causal"] is False
    tau = [r for r in read_metrics(run_dir) if "tau" in r]
    assert tau and len(tau[-1]["tau_position_acceptance"]) == 7
    from dflash_ds.export import load_drafter

    assert load_drafter(run_dir / "export").candidate_selector.successor_codebook.abs().sum() > 0


def lilicorr_own(run_dir, recs, config, reference):
    """The target sent its final-norm states (the penalty reads the target's logits at the candidates)."""
    last = recs[-1]
    assert last["lilicorr_oracle_prefix"] >= last["lilicorr_selected_prefix"] >= 0
    assert last["lilicorr_ce"] > 0 and last["lilicorr_penalty"] >= 0
    assert config["dflash_config"]["projector_type"] == "lilicorr", config["dflash_config"]


def xpress_own(run_dir, recs, config, reference):
    """Each pass's acceptance proxy is logged (the base draft, then every consistency round), the refiner's
    bias grows from its start, and the export names vLLM 0.34's keys at the top level."""
    last = recs[-1]
    assert len(last["xpress_accept_pass"]) == 3 + 1 and all(a >= 1 for a in last["xpress_accept_pass"])
    assert last["xpress_bias_rms"] > 0 and last["xpress_consistency_ce"] > 0
    assert config["architectures"] == ["Qwen3XPressModel"] and config["sample_from_anchor"] is False
    assert (config["xpress_rank"], config["xpress_block_size"], config["xpress_topc"]) == (32, 8, 64)


# name -> (its tiny recipe, overrides, its own checks)
ROWS = {
    "dflash2": ("recipes/tiny-dflash2.yaml", ["objective.dflash2.selector_warmup_ratio=0.25",
                                               "objective.dflash2.selector_ramp_ratio=0.5"], dflash2_own),
    "lilicorr": ("recipes/tiny-lilicorr.yaml", [], lilicorr_own),
    "xpress": ("recipes/tiny-xpress.yaml", [], xpress_own),
}


def shown_fields(name: str) -> set[str]:
    """Every metrics field the architecture's log view shows (progress entries and report series)."""
    logs = VARIANTS[name].spec.logs
    fields = {f for t in logs.progress for _, f, _, _ in string.Formatter().parse(t) if f}
    return fields | {field for _, field, _ in logs.series}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_architectures_tiny_recipe_trains_split_exports_and_evaluates(name, tmp_path):
    recipe, overrides, own = ROWS[name]
    run_dir = tmp_path / "run"
    proc = launch(recipe, FAST + overrides + [f"run.output_dir={run_dir}"], procs=2, timeout=400)
    out = output(proc)
    assert proc.returncode == 0, out[-6000:]
    recs = [r for r in read_metrics(run_dir) if "loss" in r]
    runs: dict[tuple, list[float]] = {}

    def reference(extra: list[str]) -> list[float]:
        """The single-process reference's losses with `extra` overrides (each computed once)."""
        key = tuple(extra)
        if key not in runs:
            runs[key] = recipe_reference_losses(recipe, FAST + overrides + extra, tmp_path / f"ref{len(runs)}", steps=4)
        return runs[key]

    assert [r["loss"] for r in recs] == pytest.approx(reference([]), rel=2e-4)
    assert shown_fields(name) <= set(recs[-1]), sorted(shown_fields(name) - set(recs[-1]))
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["architectures"] == [VARIANTS[name].spec.class_name]
    assert "tau after training" in out and "acceptance by position" in out
    from dflash_ds.export import load_drafter

    assert load_drafter(run_dir / "export").config.architecture == name
    own(run_dir, recs, config, reference)
