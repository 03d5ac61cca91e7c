"""The frozen target: loading (+ PEFT adapters), tap capture, kernels, ZeRO-Inference loading."""
