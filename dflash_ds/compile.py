"""One compiled instance per (function, options) per process.

Compiling is slow (seconds to minutes) and each `torch.compile` call makes a new wrapper with its
own cache; calling it at every use would recompile every time. Shapes are static in this project,
so one instance, compiled on first use, serves the whole run.
"""

from __future__ import annotations

from typing import Callable

import torch

_compiled: dict = {}


def compile_once(fn: Callable, **options) -> Callable:
    """`torch.compile(fn, **options)`, built on the first call and reused afterwards."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, **options)
    return _compiled[key]
