"""The procedurally generated shapes world the embedded model is trained on, and its exact checker.

    world.py   scenes (Obj, Scene), sampling with a held-out split, render(scene) -> 64x64 PIL image
    text.py    captions (plain / pirate register), instructions, interleaved documents
    eval.py    ShapesEval: analyse_image, parse_caption, scoring per category, prompt sets, the runner
"""

from .errors import ShapesError
from .text import REGISTERS, caption, document, instruction
from .world import (
    BACKGROUNDS,
    CELLS,
    COLOURS,
    HELDOUT_TRIPLES,
    PALETTE,
    SHAPES,
    SIZES,
    STYLES,
    Obj,
    Scene,
    is_heldout_scene,
    render,
    sample_scene,
)

__all__ = [
    "BACKGROUNDS", "CELLS", "COLOURS", "HELDOUT_TRIPLES", "PALETTE", "REGISTERS", "SHAPES",
    "SIZES", "STYLES", "Obj", "Scene", "ShapesError", "caption", "document", "instruction",
    "is_heldout_scene", "render", "sample_scene",
]
