"""SGLang's own model classes as the loader gate for every tiny export (opt-in: DFLASH_SGLANG=1).

SGLang 0.5.23 (scripts/build_sglang_cpu.sh: torch 2.14.1, transformers 5.19.0, about 6 GB) cannot
serve a DFlash drafter on a CPU, but its model classes import and build there: each export's
architecture resolves to the intended class in SGLang's registry, and the class's own `load_weights`
writes every parameter from the export with no tensor left over (tests/sglang_contract.py). DSpark's
confidence head is built only when SGLang verifies ragged blocks (SGLANG_RAGGED_VERIFY_MODE
cap-accept or compact); with the default static verification SGLang drops exactly its two tensors.

The tiny LiLiCorr export loads through SGLang's `LiLiCorrDraftModel` plain, with the block
convolution and full width, and the gate names what a broken one lacks or adds. SGLang's block
proposal has a torch path off CUDA (`lilicorr_utils.propose_lilicorr_block`: candidates by
`lilicorr_topk_lse`'s fallback, the head's scores, `_selector_walk_torch`), which
tests/sglang_lilicorr_walk.py runs on the drafted states of held-out blocks: the project's greedy walk
(`LiLiCorr.propose`) and sampled walk (`walk.sampled_path`, under SGLang's own uniforms) propose what
SGLang's code proposes.

Opt-in because the environment costs about 6 GB and several minutes to install, beyond what CI's
fresh machine has room for beside llama.cpp and vLLM; with DFLASH_SGLANG=1 a failed install skips
the tests with the reason (fails them under CI=true).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_ds.architectures.lilicorr import LILICORR, walk
from dflash_ds.export import load_drafter
from dflash_ds.network.draft_model import DraftModel
from tests import lilicorr_exports
from tests.llama_cpp import ROOT, built_env_python
from tests.test_engine import EXPORTS

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.environ.get("DFLASH_SGLANG") != "1",
                                 reason="SGLang tier is opt-in (about 6 GB): set DFLASH_SGLANG=1")]

TARGET = ROOT / "assets" / "tiny-target"
BUILD = ROOT / "scripts" / "build_sglang_cpu.sh"
CONTRACT = ROOT / "tests" / "sglang_contract.py"
WALK = ROOT / "tests" / "sglang_lilicorr_walk.py"
CONTRACT_TIMEOUT = 600
# The class each export's architecture must resolve to in SGLang's registry.
CLASSES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
TEMPERATURE = 0.7  # the sampled walk's


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    return built_env_python(BUILD)


def contract(python: Path, export: Path, *args: str, refused: bool = False, script: Path = CONTRACT, **env: str) -> dict:
    """`script`'s verdict on one export (tests/sglang_contract.py's module docstring; `args` follow the
    export); with `refused` it must carry the `error` that stopped SGLang's loader."""
    r = subprocess.run([str(python), str(script), str(TARGET), str(export), *args], capture_output=True, text=True,
                       timeout=CONTRACT_TIMEOUT, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1", **env))
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, f"{script.name} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert ("error" in result) == refused, f"{export.name}: {result.get('error')}\n{r.stderr[-3000:]}"
    return result


def tiny_export(name: str, path: Path) -> Path:
    """The recipe's drafter with every tensor distinct (so its values identify where SGLang put it)."""
    return lilicorr_exports.distinct_export(path, ROOT / EXPORTS[name])


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_sglang_loads_every_export(sglang_python, tmp_path, name):
    # DSpark with the verification mode that reads its confidence head (the other case is below).
    mode = {"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"} if name == "dspark" else {}
    result = contract(sglang_python, tiny_export(name, tmp_path / name), **mode)
    assert result["model_class"] == CLASSES[name], result
    assert result["missing"] == [] and result["unexpected"] == [], result


def test_sglang_static_verification_drops_only_the_confidence_head(sglang_python, tmp_path):
    """With SGLang's default (static) verification a DSpark drafter is built without its confidence
    head, and the head's two tensors are the only ones it leaves unread."""
    result = contract(sglang_python, tiny_export("dspark", tmp_path / "dspark"), SGLANG_RAGGED_VERIFY_MODE="static")
    assert result["missing"] == [], result
    assert result["unexpected"] == ["confidence_head.proj.bias", "confidence_head.proj.weight"], result


@pytest.fixture(scope="module")
def lilicorr(tmp_path_factory) -> dict:
    """The tiny LiLiCorr exports (lilicorr_exports.FORMS), every tensor distinct."""
    root = tmp_path_factory.mktemp("sglang_lilicorr")
    return {form: lilicorr_exports.distinct_export(root / form, overrides=o) for form, o in lilicorr_exports.FORMS.items()}


@pytest.mark.parametrize("form", sorted(lilicorr_exports.FORMS))
def test_sglang_loads_the_lilicorr_export(sglang_python, lilicorr, form):
    """SGLang's LiLiCorrDraftModel, whose own checks require every head parameter, refuse any other
    lilicorr.* tensor and match the convolution's tensors to the config's keys, takes the export whole."""
    result = contract(sglang_python, lilicorr[form])
    assert (result["architecture"], result["model_class"]) == ("LiLiCorrDraftModel", "LiLiCorrDraftModel"), result
    assert result["missing"] == [] and result["unexpected"] == [], result
    assert result["num_tensors"] == lilicorr_exports.TENSORS[form], result


def test_the_sglang_gate_names_what_a_lilicorr_export_lacks_or_adds(sglang_python, lilicorr, tmp_path):
    """A backbone tensor removed and an HF rotary cache added pass SGLang's loader without a word; the
    gate names exactly those two. Without a head tensor SGLang's own coverage check refuses the export."""
    result = contract(sglang_python, lilicorr_exports.tampered(lilicorr["conv"], tmp_path / "broken"))
    assert (result["missing"], result["unexpected"]) == ([lilicorr_exports.DROPPED], [lilicorr_exports.JUNK]), result
    headless = lilicorr_exports.tampered(lilicorr["plain"], tmp_path / "headless", drop="lilicorr.in_head.bias", junk=None)
    result = contract(sglang_python, headless, refused=True)
    assert "missing 1 head parameters" in result["error"] and "'lilicorr.in_head.bias'" in result["error"], result


@pytest.mark.parametrize("form", sorted(lilicorr_exports.FORMS))
def test_the_lilicorr_walk_is_sglangs_torch_walk(sglang_python, lilicorr, tmp_path, form):
    """SGLang's proposal (tests/sglang_lilicorr_walk.py) on 16 held-out blocks of the export: the same
    candidates, log-factors within float32 rounding, the same greedy draft with and without the anchor
    row, and the same sampled draft and proposal rows under SGLang's uniforms."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval().requires_grad_(False)
    model = DraftModel.from_target(load_drafter(lilicorr[form]), target)
    states, rows = lilicorr_exports.held_out_blocks(model, target, 16)
    n = states.shape[0]
    # SGLang reads the drafting slots 1 .. B - 1 of the block's states: slot 0 is NaN, which would
    # reach every draft if it were read.
    hidden = torch.cat([torch.full_like(states[:, :1], float("nan")), states], dim=1)
    inputs = dict(draft_hidden=hidden, anchor=rows, lm_head=model.lm_head.detach(), embed=model.embed.detach(),
                  temperature=TEMPERATURE, seed=7)
    torch.save(inputs, tmp_path / "inputs.pt")
    verdict = contract(sglang_python, lilicorr[form], str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), script=WALK)
    assert verdict["missing"] == [] and verdict["unexpected"] == [], verdict
    sglang = torch.load(tmp_path / "out.pt")

    found, factors = walk.score(model, states, rows, torch.ones(n, dtype=torch.bool))
    assert torch.equal(found.ids, sglang["candidates"])
    assert torch.allclose(found.log_probs, sglang["log_probs"], atol=1e-5, rtol=0)
    assert torch.allclose(factors.start, sglang["start"], atol=1e-4, rtol=0)
    assert torch.allclose(factors.pair, sglang["pair"], atol=1e-4, rtol=0)
    greedy = LILICORR.walk.propose(model, states, None, context=rows).tokens
    assert torch.equal(greedy, sglang["greedy"])
    no_row = LILICORR.walk.propose(model, states, None, context=rows, context_valid=torch.zeros(n, dtype=torch.bool))
    assert torch.equal(no_row.tokens, sglang["no_anchor"])
    path = walk.sampled_path(factors, TEMPERATURE, sglang["uniforms"].double())
    assert torch.equal(walk.chosen(found, path), sglang["sampled"])
    assert torch.allclose(path.rows.float(), sglang["q_rows"], atol=1e-5, rtol=0)
    # What was compared is the head's choice: off the backbone's argmax, and the draws off the greedy path.
    assert int((greedy != found.ids[..., 0]).sum()) >= 4
    assert int((sglang["sampled"] != greedy).sum()) >= 4
