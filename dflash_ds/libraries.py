"""What third-party libraries print that says nothing about the run, kept out at the entry points.

transformers imports torchao at its own import whenever torchao is installed (its quantizers check
for it), and torchao's import prints a "Failed to load ..." line for each GPU kernel library it cannot
load on a CPU machine, and makes torch log two deprecation warnings for the enums it registers. Only
the FP8 drafter layers use torchao (quantization/fp8_drafter.py, which imports it itself), so without them
transformers is told torchao is absent before it is imported; the warnings torchao's import causes are
filtered either way.
"""

from __future__ import annotations

import logging
import sys

# Known messages of no use to a run (the logger, a text each message holds).
KNOWN = (
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
)


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_libraries(*, torchao: bool = False) -> None:
    """Call at an entry point once HF_HUB_OFFLINE is settled (importing transformers fixes it) and before
    transformers' models are imported; `torchao`: the run uses it
    (drafter.fp8.layers). Idempotent."""
    for name, text in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.text == text for f in logger.filters):
            logger.addFilter(_Drop(text))
    if torchao or "torchao" in sys.modules:
        return
    try:
        import transformers.utils as utils
        from transformers.utils import import_utils
    except ImportError:
        return

    def absent(*args, **kwargs) -> bool:
        return False

    # transformers reads the name from both modules when its quantizers and models are imported.
    import_utils.is_torchao_available = absent
    utils.is_torchao_available = absent
