"""The export: a trained drafter in the serving format SGLang, vLLM and transformers load
(docs/algorithm.md section 6).

- drafter.py: `save_drafter` / `load_drafter` (`load_backbone`: another architecture's backbone), the directory's config.json, weights and the
  architecture's remote code (which each architecture's package under architectures/ owns);
- card.py: the export's README.md model card (target, data, steps, tau, serving commands).

The names below are the package's public face: callers import them from `dflash_ds.export`.
"""

from dflash_ds.export.card import TauFacts, add_benchmarks_to_card, model_card
from dflash_ds.export.drafter import (ExportWriteError, expected_shapes, is_export, load_backbone, load_drafter,
                                      read_export_config, save_drafter, write_card)

__all__ = ["ExportWriteError", "TauFacts", "add_benchmarks_to_card", "expected_shapes", "is_export", "load_backbone", "load_drafter",
           "model_card", "read_export_config", "save_drafter", "write_card"]
