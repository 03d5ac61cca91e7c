"""The LiLiCorr package for its own tests while it is not in model/variants/__init__.py's list: importing
it registers it (`@register`), which would put it into every test that iterates the registered
architectures (the conformance suite, the structure checks). This module imports it once and takes the
registration back; a test that needs it registered uses `registered` (tests/test_lilicorr.py's `pkg`)."""

from dflash_ds.model.variants import lilicorr as pkg
from dflash_ds.model.variants.registry import entries

for _registry, _key, _value in entries(pkg.LiLiCorr):
    _registry.pop(_key, None)


def registered(monkeypatch):
    """LiLiCorr registered for the calling test only."""
    for registry, key, value in entries(pkg.LiLiCorr):
        registry.pop(key, None)
        monkeypatch.setitem(registry, key, value)
    return pkg
