"""Picture-style requests, the image side of learned MoLoRA: words ask for a style, the learned image gates pick
the adapter that draws it.

An item is a sentence asking for one shape in a named style ("Here is an outlined small red circle at the top
left:") and the scene it asks for, drawn in that style. Three styles, an image adapter each:

    filled    the shipped `filled` LoRA: the embedded model's own drawing (the base draws a first picture filled, but a
              second one carries the first picture's objects over, as its training stories do; the LoRA draws the
              new scene alone)
    outline   the shipped `outline` LoRA: the shape with a hollow centre
    negative  the shipped `negative` LoRA: the shape filled in its complementary colour (NEGATIVE_COLOUR: red <->
              green, orange <-> blue, yellow <-> purple, pink <-> brown), as a colour negative shows it; the
              words name the colour asked for, the picture holds its complement

The words alone carry the request (the base model never saw a style word in training); a picture is judged by
ShapesEval's exact reader (`drawn_style`: outline or filled from models/families/shapes/analyse, and for a filled shape
whether its colour is the one asked for or its complement).

    style_items(n, seed=0, split="train") -> list[StyleItem]   styles cycle outline, filled, negative
    STYLE_ADAPTERS = {"outline": "outline", "filled": "filled", "negative": "negative"}   who draws each style
    drawn_style(reading, item) -> "outline" | "filled" | "negative" | None   the style a picture shows for `item`
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from . import world
from .analyse import ImageReading
from .text import _article, cell_phrase

STYLES: tuple[str, ...] = ("outline", "filled", "negative")
STYLE_WORDS: dict[str, tuple[str, ...]] = {"outline": ("outlined", "hollow"), "filled": ("filled", "solid"),
                                           "negative": ("negative", "inverted")}
STYLE_ADAPTERS: dict[str, str | None] = {"outline": "outline", "filled": "filled", "negative": "negative"}
_PAIRS = (("red", "green"), ("orange", "blue"), ("yellow", "purple"), ("pink", "brown"))
NEGATIVE_COLOUR: dict[str, str] = {**dict(_PAIRS), **{b: a for a, b in _PAIRS}}


@dataclass(frozen=True)
class StyleItem:
    prompt: str
    scene: world.Scene  # one object as the words ask for it (its colour is the one named)
    style: str

    @property
    def drawn(self) -> world.Scene:
        """The picture the requested style draws: outlined, filled, or filled in the complementary colour."""
        if self.style == "negative":
            obj = self.scene.objects[0]
            return world.Scene((replace(obj, colour=NEGATIVE_COLOUR[obj.colour]),), background=self.scene.background)
        return self.scene.with_style(self.style)

    @property
    def adapter(self) -> str | None:
        return STYLE_ADAPTERS[self.style]


def style_items(n: int, *, seed: int | str, split: str = "train") -> list[StyleItem]:
    """`n` requests, styles cycling through STYLES (item i+1 never asks item i's style), scenes from `split`
    ("train" / "heldout")."""
    rng = random.Random(f"styles:{seed}:{split}")
    items = []
    for i in range(n):
        style = STYLES[i % len(STYLES)]
        scene = world.sample_scene(rng, split, n_objects=1)
        obj = scene.objects[0]
        word = rng.choice(STYLE_WORDS[style])
        prompt = f"Here is {_article(word)} {word} {obj.size} {obj.colour} {obj.shape} {cell_phrase(obj.cell, rng)}:"
        items.append(StyleItem(prompt, scene, style))
    return items


def drawn_style(reading: ImageReading, item: StyleItem) -> str | None:
    """The style a picture shows for `item`: "outline" or "filled" as ShapesEval reads it, "negative" for a filled
    shape in the complement of the colour asked for; None when the picture holds no object or a filled one in
    another colour."""
    if reading.style is None:
        return None
    if reading.style == "outline":
        return "outline"
    asked = item.scene.objects[0].colour
    colours = {o.colour for o in reading.objects}
    if colours == {asked}:
        return "filled"
    if colours == {NEGATIVE_COLOUR[asked]}:
        return "negative"
    return None


__all__ = ["NEGATIVE_COLOUR", "STYLES", "STYLE_ADAPTERS", "STYLE_WORDS", "StyleItem", "drawn_style", "style_items"]
