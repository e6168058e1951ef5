"""Embedded default model: shapes world, tokenizers, the interleaved generation engine and the Python API.

    from molora.models import InterleavedPipeline, Document, GenerationConfig, SamplingConfig

The names are imported lazily (PEP 562), so `import models.vocab` (or a model family) does not load the pipeline,
the engine and transformers. Model families: models/families/family.py.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InterleavedPipeline": "molora.models.pipeline",
    "Document": "molora.models.document",
    "TokenRecord": "molora.models.document",
    "GenerationConfig": "molora.models.engine.generation",
    "SamplingConfig": "molora.models.engine.sampling",
    "GenerationError": "molora.models.engine.sampling",
    "ModelDirError": "molora.models.families.loading",
    "DocumentError": "molora.models.document",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
