"""The shapes world: procedurally generated scenes and their exact 64x64 renders.

Everything the embedded model learns (and everything ShapesEval checks) comes from here, so the world is
small, regular and exactly readable back:

    SHAPES       circle, square, triangle, star, diamond
    COLOURS      8 flat, well separated RGB colours (PALETTE); a nearest-palette read is exact
    BACKGROUNDS  4 light colours (BACKGROUND_RGB)
    SIZES        small (14 px), large (18 px)
    CELLS        a 3x3 grid of 20 px cells: "top left", "top", "top right", "left", "center", "right",
                 "bottom left", "bottom", "bottom right"; at most one object per cell, 1-4 objects.
                 Cell bounds [2, 22), [22, 42), [42, 62) on both axes (GRID_ORIGIN + CELL_SIZE * k), centres at
                 12, 32, 52 px: multiples of the VQ tokenizer's 4 px patch, so an object covers the same code
                 pattern in every cell (with 21 px cells the offset to the 4 px grid changed per column/row
                 and a held-out combination needed code patterns never produced in training)
    STYLES       "filled" (default) and "outline" (the shape with a hollow centre: the interior, a scaled copy
                 of the shape, is left in the background colour; the ring is ~2-4 px wide)

Images are rasterised at pixel centres with no anti-aliasing, so every pixel is either the background colour
or exactly one palette colour (the VQ tokenizer then has crisp flat regions to reconstruct).

Held-out split by (colour, shape, cell) TRIPLE, so evaluation sees combinations never trained on:
    HELDOUT_TRIPLES = {(COLOURS[i % 8], SHAPES[i % 5], CELLS[(4 * i) % 9]) for i in range(20)}
        (red circle top left) (orange square center) (yellow triangle bottom right) (green star left)
        (blue diamond bottom) (purple circle top right) (pink square bottom left) (brown triangle top)
        (red star right) (orange diamond top left) (yellow circle center) (green square bottom right)
        (blue triangle left) (purple star bottom) (pink diamond top right) (brown circle bottom left)
        (red square top) (orange triangle right) (yellow star top left) (green diamond center)
A held-out object is one whose triple is in the set (either size). No object of a "train" scene is held out;
every "heldout" scene has at least one that is. Every (colour, shape), (shape, cell) and (colour, cell) pair
still occurs in train through other triples (e.g. red circles elsewhere, circles at the top left in other
colours, red things at the top left of other shapes), so a held-out object is a new composition of parts
all seen in training; the colour-swapped versions of two held-out objects (same cells) are train objects,
which makes the colour-attribution prompts a real binding test.

API:
    Obj(shape, colour, size, cell)                       frozen dataclass
    Scene(objects, background="white", style="filled")   frozen dataclass; .with_style(style), .counts()
    sample_scene(rng, split="train", n_objects=None, style="filled", background=None) -> Scene
    sample_object(rng, split, free_cells, ...) -> Obj     (one object allowed in split, in a free cell)
    render(scene) -> PIL.Image.Image (64x64 RGB)          object_mask(obj, style) -> bool [64,64]
    triple(obj) / is_heldout_obj(obj) / is_train_obj(obj) / is_heldout_scene(scene) / is_train_scene(scene)
    cell_center(cell) -> (x, y)
Eval scenes per category (held-out combinations, fixed seeds): models/families/shapes/prompts.py build_prompts.

All randomness comes from the `random.Random` the caller passes: same seed, same scenes, same bytes.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from .errors import ShapesError

IMAGE_SIZE = 64
CELL_SIZE = 20
GRID_ORIGIN = 2  # cell k spans [GRID_ORIGIN + CELL_SIZE * k, GRID_ORIGIN + CELL_SIZE * (k + 1)) on each axis

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond")
COLOURS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown")
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "orange": (245, 135, 20),
    "yellow": (230, 205, 0),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "purple": (140, 60, 200),
    "pink": (240, 110, 190),
    "brown": (125, 75, 35),
}
BACKGROUNDS: tuple[str, ...] = ("white", "cream", "grey", "sky")
BACKGROUND_RGB: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "cream": (250, 240, 215),
    "grey": (222, 222, 222),
    "sky": (215, 232, 250),
}
SIZES: tuple[str, ...] = ("small", "large")
SIZE_PX: dict[str, int] = {"small": 14, "large": 18}
STYLES: tuple[str, ...] = ("filled", "outline")
CELLS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
SPLITS: tuple[str, ...] = ("train", "heldout")
MAX_OBJECTS = 4

# 20 of the 360 (colour, shape, cell) triples, spread so that no pair of attributes is held out entirely:
# i % 8 and i % 5 give 20 distinct (colour, shape) pairs (lcm 40), (4 * i) % 9 walks every cell.
HELDOUT_TRIPLES: frozenset[tuple[str, str, str]] = frozenset(
    (COLOURS[i % 8], SHAPES[i % 5], CELLS[(4 * i) % 9]) for i in range(20)
)

# Probability that a new object repeats the colour, shape and size of one already in the scene, so that
# counting ("three red stars") is common in the data.
_REPEAT_P = 0.35


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    size: str
    cell: str

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.shape, SHAPES, "shape"), (self.colour, COLOURS, "colour"),
                                     (self.size, SIZES, "size"), (self.cell, CELLS, "cell")):
            if value not in allowed:
                raise ShapesError(f"unknown {what} {value!r}; expected one of {list(allowed)}")

    @property
    def kind(self) -> tuple[str, str, str]:
        """What makes two objects 'the same thing' for counting: colour, shape and size."""
        return (self.colour, self.shape, self.size)


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    background: str = "white"
    style: str = "filled"

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        if not 1 <= len(self.objects) <= MAX_OBJECTS:
            raise ShapesError(f"a scene holds 1-{MAX_OBJECTS} objects, got {len(self.objects)}")
        cells = [o.cell for o in self.objects]
        if len(set(cells)) != len(cells):
            raise ShapesError(f"two objects share a cell: {cells}")
        if self.background not in BACKGROUNDS:
            raise ShapesError(f"unknown background {self.background!r}; expected one of {list(BACKGROUNDS)}")
        if self.style not in STYLES:
            raise ShapesError(f"unknown style {self.style!r}; expected one of {list(STYLES)}")

    def with_style(self, style: str) -> Scene:
        return replace(self, style=style)

    def sorted(self) -> Scene:
        """The same scene with objects in grid order (top left first): a canonical form."""
        return replace(self, objects=tuple(sorted(self.objects, key=lambda o: CELLS.index(o.cell))))

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.objects)


# ---------------------------------------------------------------------------------------------- split


def triple(obj: Obj) -> tuple[str, str, str]:
    """The (colour, shape, cell) combination the split is defined on."""
    return (obj.colour, obj.shape, obj.cell)


def is_heldout_obj(obj: Obj) -> bool:
    return triple(obj) in HELDOUT_TRIPLES


def is_train_obj(obj: Obj) -> bool:
    return triple(obj) not in HELDOUT_TRIPLES


def is_heldout_scene(scene: Scene) -> bool:
    return any(is_heldout_obj(o) for o in scene.objects)


def is_train_scene(scene: Scene) -> bool:
    return all(is_train_obj(o) for o in scene.objects)


# Every possible object once, in a fixed order (so draws from them are reproducible).
_ALL_OBJECTS: tuple[Obj, ...] = tuple(Obj(s, c, z, cell) for s in SHAPES for c in COLOURS for z in SIZES
                                      for cell in CELLS)
_TRAIN_OBJECTS: tuple[Obj, ...] = tuple(o for o in _ALL_OBJECTS if is_train_obj(o))
_HELDOUT_OBJECTS: tuple[Obj, ...] = tuple(o for o in _ALL_OBJECTS if is_heldout_obj(o))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ShapesError(f"unknown split {split!r}; expected one of {list(SPLITS)}")


# -------------------------------------------------------------------------------------------- sampling


def _candidates(split: str, free_cells: list[str] | tuple[str, ...], must_be_heldout: bool, shape: str | None,
                colour: str | None, size: str | None) -> list[Obj]:
    """Every object allowed in `split` that sits in a free cell and has the fixed attributes (draws nothing)."""
    _check_split(split)
    if split == "train" and must_be_heldout:
        raise ShapesError("a train object cannot be held out")
    pool = _TRAIN_OBJECTS if split == "train" else _HELDOUT_OBJECTS if must_be_heldout else _ALL_OBJECTS
    free = set(free_cells)
    return [o for o in pool if o.cell in free and (shape is None or o.shape == shape)
            and (colour is None or o.colour == colour) and (size is None or o.size == size)]


def sample_object(rng: random.Random, split: str, free_cells: list[str] | tuple[str, ...], *,
                  must_be_heldout: bool = False, shape: str | None = None, colour: str | None = None,
                  size: str | None = None) -> Obj:
    """One object in one of `free_cells`, allowed in `split` (a train object's triple is not held out;
    `must_be_heldout` asks for one whose triple is). Fixed attributes narrow the draw."""
    candidates = _candidates(split, free_cells, must_be_heldout, shape, colour, size)
    if not candidates:
        raise ShapesError(f"no {split} object fits shape={shape} colour={colour} size={size} "
                          f"cells={list(free_cells)} (held_out={must_be_heldout})")
    return rng.choice(candidates)


def sample_scene(rng: random.Random, split: str = "train", n_objects: int | None = None,
                 style: str = "filled", background: str | None = None) -> Scene:
    """A random scene of `split`. n_objects None draws 1-4 (fewer objects more often)."""
    _check_split(split)
    if style not in STYLES:
        raise ShapesError(f"unknown style {style!r}; expected one of {list(STYLES)}")
    if n_objects is None:
        n_objects = rng.choices((1, 2, 3, 4), weights=(4, 3, 2, 1))[0]
    if not 1 <= n_objects <= MAX_OBJECTS:
        raise ShapesError(f"n_objects must be 1-{MAX_OBJECTS}, got {n_objects}")
    bg = background if background is not None else rng.choice(BACKGROUNDS)
    heldout_slot = rng.randrange(n_objects) if split == "heldout" else -1
    objects: list[Obj] = []
    for i in range(n_objects):
        free = [c for c in CELLS if c not in {o.cell for o in objects}]
        obj_split = "heldout" if i == heldout_slot else "train"
        kind: dict[str, str] = {}
        if objects and rng.random() < _REPEAT_P:
            proto = rng.choice(objects)
            kind = dict(shape=proto.shape, colour=proto.colour, size=proto.size)
            if not _candidates(obj_split, free, i == heldout_slot, **kind):
                kind = {}  # that kind cannot go in any free cell of this split: draw a fresh one
        objects.append(sample_object(rng, obj_split, free, must_be_heldout=i == heldout_slot, **kind))
    return Scene(tuple(objects), background=bg, style=style)


# ------------------------------------------------------------------------------------------- rendering


def cell_center(cell: str) -> tuple[float, float]:
    """Centre (x, y) of a grid cell in pixel coordinates (pixel i spans [i, i+1)): 12, 32 or 52, multiples
    of 4, so an object's pixels fall on the 4 px VQ patch grid the same way in every cell."""
    if cell not in CELLS:
        raise ShapesError(f"unknown cell {cell!r}; expected one of {list(CELLS)}")
    row, col = divmod(CELLS.index(cell), 3)
    half = CELL_SIZE / 2.0
    return (GRID_ORIGIN + CELL_SIZE * col + half, GRID_ORIGIN + CELL_SIZE * row + half)


def _star_polygon(outer: float = 1.05, ratio: float = 0.5) -> list[tuple[float, float]]:
    # A five-pointed star, point up, centred so its bounding box is centred on the origin.
    pts = []
    for k in range(10):
        r = outer if k % 2 == 0 else outer * ratio
        a = math.pi * k / 5
        pts.append((r * math.sin(a), -r * math.cos(a)))
    top, bottom = min(p[1] for p in pts), max(p[1] for p in pts)
    dy = -(top + bottom) / 2
    return [(x, y + dy) for x, y in pts]


# Unit polygons in [-1, 1]^2 (y down); the circle is analytic.
_POLYGONS: dict[str, list[tuple[float, float]]] = {
    "square": [(-1, -1), (1, -1), (1, 1), (-1, 1)],
    "triangle": [(0, -1), (1, 1), (-1, 1)],
    "diamond": [(0, -1), (1, 0), (0, 1), (-1, 0)],
    "star": _star_polygon(),
}
# Outline style: the hole is the shape scaled by HOLE_SCALE about HOLE_ANCHOR (the incentre for the
# triangle), chosen so the ring is ~3 px wide at the large size and >= 2 px at the small size.
HOLE_SCALE: dict[str, float] = {"circle": 0.6, "square": 0.6, "triangle": 0.4, "star": 0.35, "diamond": 0.5}
HOLE_ANCHOR: dict[str, tuple[float, float]] = {
    "circle": (0.0, 0.0), "square": (0.0, 0.0), "diamond": (0.0, 0.0), "star": (0.0, 0.0),
    "triangle": (0.0, 1.0 - 2.0 / (1.0 + math.sqrt(5.0))),  # inradius 0.618 above the base
}

_YS, _XS = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float64) + 0.5  # pixel centres


def _inside_polygon(px: np.ndarray, py: np.ndarray, poly: list[tuple[float, float]]) -> np.ndarray:
    """Even-odd rule at every point, vectorised over the grid."""
    inside = np.zeros(px.shape, dtype=bool)
    n = len(poly)
    for i in range(n):
        x1, y1 = poly[i]
        x2, y2 = poly[(i + 1) % n]
        if y1 == y2:
            continue
        crosses = (y1 > py) != (y2 > py)
        x_at = x1 + (py - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (px < x_at)
    return inside


def unit_shape_mask(shape: str, ux: np.ndarray, uy: np.ndarray) -> np.ndarray:
    """Membership of points given in the shape's unit frame ([-1, 1]^2 is the bounding box)."""
    if shape == "circle":
        return ux * ux + uy * uy <= 1.0
    if shape not in _POLYGONS:
        raise ShapesError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")
    return _inside_polygon(ux, uy, _POLYGONS[shape])


def shape_mask(shape: str, cx: float, cy: float, half: float, style: str = "filled",
               xs: np.ndarray = _XS, ys: np.ndarray = _YS) -> np.ndarray:
    """Pixels (by centre) covered by `shape` with bounding box centre (cx, cy) and half-size `half`."""
    ux, uy = (xs - cx) / half, (ys - cy) / half
    mask = unit_shape_mask(shape, ux, uy)
    if style == "outline":
        s = HOLE_SCALE[shape]
        ax, ay = HOLE_ANCHOR[shape]
        mask &= ~unit_shape_mask(shape, (ux - ax) / s + ax, (uy - ay) / s + ay)
    elif style != "filled":
        raise ShapesError(f"unknown style {style!r}; expected one of {list(STYLES)}")
    return mask


def object_mask(obj: Obj, style: str = "filled") -> np.ndarray:
    cx, cy = cell_center(obj.cell)
    return shape_mask(obj.shape, cx, cy, SIZE_PX[obj.size] / 2.0, style)


def render_array(scene: Scene) -> np.ndarray:
    """The scene as a uint8 [64, 64, 3] array."""
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    img[:] = BACKGROUND_RGB[scene.background]
    for obj in scene.objects:
        img[object_mask(obj, scene.style)] = PALETTE[obj.colour]
    return img


def render(scene: Scene) -> Image.Image:
    """The scene as a 64x64 RGB PIL image (flat colours, no anti-aliasing)."""
    if not isinstance(scene, Scene):
        raise ShapesError(f"render expects a Scene, got {type(scene).__name__}")
    return Image.fromarray(render_array(scene), mode="RGB")
