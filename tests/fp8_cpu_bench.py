"""`python -m dflash_ds.bench` with the drafter.fp8 machine check lifted, for the CPU smoke runs of the
FP8 modes (tests/test_bench_fp8.py): CPU has no FP8 tensor cores, so the bench refuses them, but
torchao's float8 layers and the FP8 lm_head's emulation run there as the GPU path is wired."""

import sys

from dflash_ds.resolve import quantization

quantization.check_drafter_quantization = lambda fp8, device, shape: None

from dflash_ds.bench.cli import main  # noqa: E402

raise SystemExit(main(sys.argv[1:]))
