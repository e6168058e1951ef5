"""The serving engine: one running batch for every live request, and what a request is made of.

    core.py         Engine: the scheduler thread, prefill, the captured decode step, streaming
    row_states.py   the per-row decode state as device tensors written in place
    kv_cache.py     the static KV cache addressed by (row, position)
    sampling.py     masks, guidance, temperature / top-k / top-p per row
    generation.py   GenerationConfig, Request and the grammar of interleaved sequences
    vocab.py        the unified vocabulary (text, image codes, markers) every family maps onto
    events.py       the events a generation streams; builder.py turns a row's tokens into them and a Document
    best_of.py      best-of-n over candidate documents and a named check
    runtime.py      process-wide CPU thread settings
    synthetic.py    random stand-in models for benchmarks and GPU tests

It knows no model family (models/families/ registers them).  `Engine` and its types are imported lazily (PEP 562),
so `import molora.models.engine.vocab` does not load torch's model stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = ("Engine", "EngineConfig", "Token", "Done", "RequestHandle")

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module("molora.models.engine.core"), name)
    raise AttributeError(f"module 'molora.models.engine' has no attribute {name!r}")
