"""Read shapes text back into objects: the text half of ShapesEval's exact checker.

The grammar is the one text.py writes (and the model learns), read leniently:
  mention   = [a | an | one..four | 2..4] {size | colour}* shape[s]    "two small blue squares"
  cell      = (top | bottom) [left | right] | left | right | center | centre | middle
Cells that follow a mention (before the next mention) place that mention's objects in order; extra cells
are ignored, missing ones leave the cell unknown (None). "N shapes" states a total; a background name
anywhere gives the background; any PIRATE_MARKERS word makes the register "pirate".

parse_caption(text) -> ParsedText(objects=(ParsedObj, ...), register, background, total)
    ParsedObj(shape, colour, size, cell): None for an attribute the text does not give.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ShapesError
from .text import NUMBER_WORDS, PIRATE_MARKERS
from .world import BACKGROUNDS, COLOURS, SHAPES, SIZES

_NUMBERS = {w: n for n, w in NUMBER_WORDS.items()} | {str(n): n for n in NUMBER_WORDS} | {"a": 1, "an": 1}
_SIZE_WORDS = {s: s for s in SIZES} | {"big": "large", "little": "small", "tiny": "small"}
_SHAPE_WORDS = {s: (s, False) for s in SHAPES} | {s + "s": (s, True) for s in SHAPES}
_COLOUR_WORDS = {c: c for c in COLOURS}
_TOKEN = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


@dataclass(frozen=True)
class ParsedObj:
    shape: str
    colour: str | None
    size: str | None
    cell: str | None


@dataclass(frozen=True)
class ParsedText:
    objects: tuple[ParsedObj, ...]
    register: str  # "plain" | "pirate"
    background: str | None
    total: int | None  # "Now there are three shapes." -> 3

    @property
    def count(self) -> int:
        return len(self.objects)


def _cell_at(tokens: list[str], i: int) -> tuple[str | None, int]:
    """The cell named at tokens[i] (and how many tokens it used), or (None, 1)."""
    t = tokens[i]
    if t in ("top", "bottom"):
        if i + 1 < len(tokens) and tokens[i + 1] in ("left", "right"):
            return f"{t} {tokens[i + 1]}", 2
        return t, 1
    if t in ("left", "right"):
        return t, 1
    if t in ("center", "centre", "middle"):
        return "center", 1
    return None, 1


def _mention_at(tokens: list[str], i: int) -> tuple[dict | None, int]:
    """A mention starting at tokens[i]: {count, size, colour, shape} and its length, or (None, 1)."""
    j = i
    count = None
    if tokens[j] in _NUMBERS:
        count = _NUMBERS[tokens[j]]
        j += 1
    size = colour = None
    while j < len(tokens) and (tokens[j] in _SIZE_WORDS or tokens[j] in _COLOUR_WORDS):
        if tokens[j] in _SIZE_WORDS:
            size = _SIZE_WORDS[tokens[j]]
        else:
            colour = _COLOUR_WORDS[tokens[j]]
        j += 1
    if j < len(tokens) and tokens[j] in _SHAPE_WORDS:
        shape, plural = _SHAPE_WORDS[tokens[j]]
        if count is None:
            count = 2 if plural else 1  # "red circles" without a number: at least two; read as two
        return {"count": count, "size": size, "colour": colour, "shape": shape}, j + 1 - i
    return None, 1


def parse_caption(text: str) -> ParsedText:
    """Objects (shape, colour, size, cell), register, background and stated total of a caption."""
    if not isinstance(text, str):
        raise ShapesError(f"parse_caption expects a str, got {type(text).__name__}")
    tokens = _TOKEN.findall(text.lower())
    groups: list[tuple[dict, list[str]]] = []
    background = total = None
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in _NUMBERS and i + 1 < len(tokens) and tokens[i + 1] == "shapes":
            total = _NUMBERS[t]
            i += 2
            continue
        mention, used = _mention_at(tokens, i)
        if mention is not None:
            groups.append((mention, []))
            i += used
            continue
        cell, used = _cell_at(tokens, i)
        if cell is not None:
            if groups:
                groups[-1][1].append(cell)
            i += used
            continue
        if t in BACKGROUNDS and background is None:
            background = t
        i += 1
    objects = []
    for mention, cells in groups:
        for k in range(mention["count"]):
            objects.append(ParsedObj(shape=mention["shape"], colour=mention["colour"], size=mention["size"],
                                     cell=cells[k] if k < len(cells) else None))
    register = "pirate" if any(t in PIRATE_MARKERS for t in tokens) else "plain"
    return ParsedText(objects=tuple(objects), register=register, background=background, total=total)
