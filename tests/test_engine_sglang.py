"""SGLang's own model classes as the loader gate for every tiny export (opt-in: DFLASH_SGLANG=1).

SGLang 0.5.23 (scripts/build_sglang_cpu.sh: torch 2.14.1, transformers 5.19.0, about 6 GB) cannot
serve a DFlash drafter on a CPU, but its model classes import and build there: each export's
architecture resolves to the intended class in SGLang's registry, and the class's own `load_weights`
writes every parameter from the export with no tensor left over (tests/sglang_contract.py). DSpark's
confidence head is built only when SGLang verifies ragged blocks (SGLANG_RAGGED_VERIFY_MODE
cap-accept or compact); with the default static verification SGLang drops exactly its two tensors.

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

from dflash_ds.config import load_recipe
from dflash_ds.export import save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.resolve.drafter import drafter_shape
from tests.llama_cpp import ROOT, built_env_python
from tests.test_engine import EXPORTS

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.environ.get("DFLASH_SGLANG") != "1",
                                 reason="SGLang tier is opt-in (about 6 GB): set DFLASH_SGLANG=1")]

TARGET = ROOT / "assets" / "tiny-target"
BUILD = ROOT / "scripts" / "build_sglang_cpu.sh"
CONTRACT = ROOT / "tests" / "sglang_contract.py"
CONTRACT_TIMEOUT = 600
# The class each export's architecture must resolve to in SGLang's registry.
CLASSES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    return built_env_python(BUILD)


def contract(python: Path, export: Path, **env: str) -> dict:
    """tests/sglang_contract.py's verdict on one export (its module docstring)."""
    r = subprocess.run([str(python), str(CONTRACT), str(TARGET), str(export)], capture_output=True, text=True,
                       timeout=CONTRACT_TIMEOUT, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1", **env))
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, f"{CONTRACT.name} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert "error" not in result, f"{export.name}: {result['error']}\n{r.stderr[-3000:]}"
    return result


def tiny_export(name: str, path: Path) -> Path:
    """The recipe's drafter with every tensor distinct (so its values identify where SGLang put it)."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_shape(AutoConfig.from_pretrained(TARGET), load_recipe(ROOT / EXPORTS[name]).drafter))
    with torch.no_grad():
        for w in drafter.parameters():
            w.add_(torch.randn_like(w) * 0.1)
    save_drafter(drafter, path, dtype=torch.float32)
    return path


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
