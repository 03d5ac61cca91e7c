"""The frozen target: loading (+ PEFT adapters), tap capture, kernels (ZeRO-Inference loading, which
needs the target's process group, is runtime/zero_inference.py)."""
