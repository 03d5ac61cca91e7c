"""GPU tier: packed rows on a hybrid target at real width (needs CUDA and flash-linear-attention)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention"),
]


def test_packed_taps_match_each_document_alone_at_27b_width():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_packing_check import TOLERANCE, check

    res = check(layers=8)
    assert res["finite"]
    assert res["packed_vs_alone_bf16"] < TOLERANCE, res
    # The tolerance discriminates: without document boundaries the error is far above it.
    assert res["stock_packed_vs_alone_leak"] > 5 * TOLERANCE, res
