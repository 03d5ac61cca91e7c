"""dflash-ds: train DFlash block-diffusion speculative-decoding drafters with DeepSpeed."""

__version__ = "0.1.0"
