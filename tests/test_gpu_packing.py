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
    from gpu_packing_check import BF16_SLACK, LEAK_FACTOR, check, passed

    res = check(layers=8)
    assert res["finite"]
    floor = res["alone_bf16_vs_alone_fp32"]
    # As close to the float32 reference as bf16 allows, and far from the leaking stock forward.
    assert res["packed_bf16_vs_alone_fp32"] <= BF16_SLACK * floor, res
    assert res["stock_packed_vs_alone_leak"] >= LEAK_FACTOR * floor, res
    assert passed(res)
