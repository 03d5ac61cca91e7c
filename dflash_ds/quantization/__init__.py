"""FP8's mechanism, in one place: what the recipe's FP8 settings run (their policy, which recipes may
run on which GPU, is resolve/quantization.py's; runtime/engines.py applies the resolved recipe).

- fp8.py: FP8 linear layers (`Fp8Linear`), row / group / block quantization, the scaled matmul, and
  reading fine-grained FP8 checkpoints (the target's `target.quantization: fp8`);
- fp8_head.py: the frozen lm_head's two GEMMs of the fused loss in FP8 (`drafter.fp8.lm_head`);
- fp8_drafter.py: the drafter's projections as torchao float8 training layers (`drafter.fp8.layers`).

It sits below model/ and target_model/: it knows tensors and nn.Linear, not which model holds them
(the routed experts' FP8 layout is target_model/moe.py's, built from `quantize_rows`).
"""
