"""DFlash (v1): the backbone alone, the argmax of every slot (docs/algorithm.md sections 1-7).

Every hook keeps `DrafterVariant`'s default; this module only names it.
"""

from __future__ import annotations

from dflash_ds.model.variants.base import DrafterVariant


class DFlash(DrafterVariant):
    name = "dflash"
    class_name = "DFlashDraftModel"
    title = "DFlash"
    auto_map = {"AutoConfig": "modeling_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlashDraftModel"}


VARIANT = DFlash()
