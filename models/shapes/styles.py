"""Picture-style requests, the image side of learned MoLoRA: words ask for a style, the learned image gates pick
the adapter that draws it.

An item is a sentence asking for one shape in a named style ("Here is an outlined small red circle at the top
left:") and the scene it asks for, rendered in that style. The embedded model draws filled shapes by itself and
outlined ones with the shipped `outline` LoRA, so "filled" is the base expert's style and "outline" the adapter's.
The words alone carry the request (the base model never saw a style word in training); a picture is judged by
ShapesEval's exact reader (models/shapes/eval.is_outline).

    style_items(n, seed=0, split="train") -> list[StyleItem]      styles alternate: exactly half outlined
    STYLE_ADAPTERS = {"outline": "outline", "filled": None}          the expert that draws each style
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import world
from .text import _article, cell_phrase

STYLE_WORDS: dict[str, tuple[str, ...]] = {"outline": ("outlined", "hollow"), "filled": ("filled", "solid")}
STYLE_ADAPTERS: dict[str, str | None] = {"outline": "outline", "filled": None}


@dataclass(frozen=True)
class StyleItem:
    prompt: str
    scene: world.Scene  # one object, in the requested style
    style: str

    @property
    def adapter(self) -> str | None:
        return STYLE_ADAPTERS[self.style]


def style_items(n: int, *, seed: int | str, split: str = "train") -> list[StyleItem]:
    """`n` requests, styles alternating (outline first), scenes from `split` ("train" / "heldout")."""
    rng = random.Random(f"styles:{seed}:{split}")
    items = []
    for i in range(n):
        style = ("outline", "filled")[i % 2]
        scene = world.sample_scene(rng, split, n_objects=1, style=style)
        obj = scene.objects[0]
        word = rng.choice(STYLE_WORDS[style])
        prompt = f"Here is {_article(word)} {word} {obj.size} {obj.colour} {obj.shape} {cell_phrase(obj.cell, rng)}:"
        items.append(StyleItem(prompt, scene, style))
    return items


__all__ = ["STYLE_ADAPTERS", "STYLE_WORDS", "StyleItem", "style_items"]
