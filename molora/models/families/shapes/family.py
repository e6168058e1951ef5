"""The shapes world as a model family: the embedded model's directory layout, its loader and its best_of check.

    assets/model/vocab.json, tokenizer.json, lm/, vq/    (models/families/shapes/loading.py load_model_dir)

Registers itself on import (models/families/family.py imports it on the first family lookup).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from molora.models.families.family import ModelFamily, register_family
from molora.models.families.shapes.loading import load_model_dir


def _detect(path: Path) -> bool:
    """The embedded model's own files: vocab.json (in the folder, or in its model/ subfolder)."""
    return (path / "vocab.json").is_file() or (path / "model" / "vocab.json").is_file()


_load = load_model_dir


def _caption_check(pipe: Any) -> Any:
    from molora.models.families.shapes.self_check import (
        CaptionCheck,  # the caption parser, loaded only when asked for
    )

    return CaptionCheck(pipe)


FAMILY = register_family(ModelFamily(
    "shapes", _detect, _load, checks={"shapes_caption": _caption_check},
    description="the embedded model: a Llama trained on the shapes world, a diffusers VQ, PEFT adapters"))
