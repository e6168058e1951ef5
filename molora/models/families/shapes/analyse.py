"""Read a 64x64 shapes image back into objects: the image half of ShapesEval's exact checker.

How (each step chosen to survive a VQ decoder's colour jitter, blur and specks):
  1. background: median colour of the 1-px frame (no object ever reaches it) -> nearest BACKGROUND_RGB;
  2. foreground: pixels nearer to a palette colour than to the measured background, and not far from every
     colour (FOREGROUND_MAX_DIST);
  3. per grid cell (objects never leave their cell, so this also splits same-coloured neighbours that blur
     has joined): connected components, specks under MIN_PIXELS dropped, the rest is the object;
  4. colour: majority vote of the nearest palette colour over the object's most saturated pixels; the mask is
     then redrawn with that colour (pixels nearer to it than to the background: unbiased under blur);
  5. shape and size: the best IoU against the exact templates (5 shapes x 2 sizes) placed at the object's
     bounding-box centre: the hole-filled mask (scipy binary_fill_holes) against the filled template, or,
     for an outline ring left open by a gap, the raw mask against the outline template;
  6. style: how object-coloured the template's hole region is (fill_score, soft per pixel): an exact
     filled render gives 1.0, an outline 0.0; FILL_THRESHOLD splits them with room for blur.

analyse_image(img) -> ImageReading(objects=(ReadObj, ...), background, style)
    ReadObj: shape, colour, size, cell, style, iou (template fit, 1.0 on exact renders), pixels, hole_fraction
    ImageReading.style: "filled" | "outline" by majority of objects (None when there are none)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy import ndimage

from .errors import ShapesError
from .world import (
    BACKGROUND_RGB,
    BACKGROUNDS,
    CELL_SIZE,
    CELLS,
    COLOURS,
    GRID_ORIGIN,
    IMAGE_SIZE,
    PALETTE,
    SHAPES,
    SIZE_PX,
    SIZES,
    shape_mask,
)

MIN_PIXELS = 20  # smallest real object (a small outlined star) has ~65 px; VQ specks have a handful
FOREGROUND_MAX_DIST = 140.0  # a pixel further than this from every colour is noise, not an object
MIN_IOU = 0.35
FILL_THRESHOLD = 0.75  # fill_score: exact renders give 1.0 (filled) / 0.0 (outline); blur pulls both inward  # below this the blob matches no shape: shape "unknown"

_PALETTE_ARR = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32)  # [8, 3]
_BG_ARR = np.array([BACKGROUND_RGB[b] for b in BACKGROUNDS], dtype=np.float32)


@dataclass(frozen=True)
class ReadObj:
    shape: str  # a SHAPES name or "unknown"
    colour: str
    size: str
    cell: str
    style: str
    iou: float
    pixels: int
    hole_fraction: float
    fill_score: float  # how object-coloured the template's hole region is: ~1 filled, ~0 outline

    @property
    def kind(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.size)


@dataclass(frozen=True)
class ImageReading:
    objects: tuple[ReadObj, ...]
    background: str
    style: str | None

    @property
    def count(self) -> int:
        return len(self.objects)


def _to_array(img: Image.Image | np.ndarray) -> np.ndarray:
    if isinstance(img, Image.Image):
        img = np.asarray(img.convert("RGB"))
    if not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[2] != 3:
        raise ShapesError(f"analyse_image expects a PIL image or an [H, W, 3] array, got {type(img).__name__}"
                          f"{getattr(img, 'shape', '')}")
    if img.shape[:2] != (IMAGE_SIZE, IMAGE_SIZE):
        img = np.asarray(Image.fromarray(img.astype(np.uint8)).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR))
    return img.astype(np.float32)


def _frame(arr: np.ndarray) -> np.ndarray:
    return np.concatenate([arr[0], arr[-1], arr[1:-1, 0], arr[1:-1, -1]], axis=0)


# Templates depend only on (shape, size, style) and the sub-pixel centre; objects are matched in a window
# around their bounding-box centre, so cache by the centre rounded to half pixels.
_TEMPLATE_CACHE: dict[tuple, np.ndarray] = {}
_WIN = 12  # half window: the largest object (18 px) plus blur fits in 24 px


def _template(shape: str, size: str, style: str, fx: float, fy: float) -> np.ndarray:
    key = (shape, size, style, fx, fy)
    if key not in _TEMPLATE_CACHE:
        ys, xs = np.mgrid[-_WIN:_WIN, -_WIN:_WIN].astype(np.float64) + 0.5
        _TEMPLATE_CACHE[key] = shape_mask(shape, fx, fy, SIZE_PX[size] / 2.0, style, xs=xs, ys=ys)
    return _TEMPLATE_CACHE[key]


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.count_nonzero(a | b)
    return np.count_nonzero(a & b) / union if union else 0.0


def _fit(mask: np.ndarray, filled: np.ndarray) -> tuple[str, str, float, tuple[float, float]]:
    """Best (shape, size) for an object: its hole-filled mask against the filled templates, or (for an
    outline ring that blur or a gap left open) its raw mask against the outline templates."""
    ys, xs = np.nonzero(filled)
    cx = (xs.min() + xs.max() + 1) / 2.0
    cy = (ys.min() + ys.max() + 1) / 2.0
    ox, oy = int(np.floor(cx)), int(np.floor(cy))  # window origin (integer), centre offset in [0, 1)
    fx, fy = round((cx - ox) * 2) / 2.0, round((cy - oy) * 2) / 2.0
    win_mask = np.pad(mask, _WIN)[oy:oy + 2 * _WIN, ox:ox + 2 * _WIN]
    win_filled = np.pad(filled, _WIN)[oy:oy + 2 * _WIN, ox:ox + 2 * _WIN]
    best = ("unknown", "small", -1.0)
    for shape in SHAPES:
        for size in SIZES:
            iou = max(_iou(win_filled, _template(shape, size, "filled", fx, fy)),
                      _iou(win_mask, _template(shape, size, "outline", fx, fy)))
            if iou > best[2]:
                best = (shape, size, iou)
    shape, size, iou = best
    if iou < MIN_IOU:
        shape = "unknown"
    return shape, size, float(iou), (cx, cy)


def _fill_score(arr: np.ndarray, bg_rgb: np.ndarray, colour_rgb: np.ndarray, shape: str, size: str,
                cx: float, cy: float) -> float:
    """Mean 'object-ness' of the pixels an outline would leave empty (the template's hole region).

    Soft per pixel (distance to background over the sum of distances to background and object colour),
    so a blurred hole still reads as mostly background while a filled interior reads as object."""
    ox, oy = int(np.floor(cx)), int(np.floor(cy))
    fx, fy = round((cx - ox) * 2) / 2.0, round((cy - oy) * 2) / 2.0
    hole = _template(shape, size, "filled", fx, fy) & ~_template(shape, size, "outline", fx, fy)
    padded = np.pad(arr, ((_WIN, _WIN), (_WIN, _WIN), (0, 0)), mode="edge")
    window = padded[oy:oy + 2 * _WIN, ox:ox + 2 * _WIN][hole]
    if window.size == 0:
        return 1.0
    d_bg = np.sqrt(((window - bg_rgb) ** 2).sum(-1))
    d_obj = np.sqrt(((window - colour_rgb) ** 2).sum(-1))
    return float(np.mean(d_bg / np.maximum(d_bg + d_obj, 1e-6)))


def _cell_span(k: int) -> slice:
    """Cell k's pixels on one axis, [GRID_ORIGIN + CELL_SIZE * k, ... + CELL_SIZE); the outer cells also take
    the 2 px margin to the image edge (empty on exact renders, but a blurred edge may spill into it)."""
    lo = 0 if k == 0 else GRID_ORIGIN + CELL_SIZE * k
    hi = IMAGE_SIZE if k == 2 else GRID_ORIGIN + CELL_SIZE * (k + 1)
    return slice(lo, hi)


def _cell_slices(index: int) -> tuple[slice, slice]:
    row, col = divmod(index, 3)
    return _cell_span(row), _cell_span(col)


def analyse_image(img: Image.Image | np.ndarray) -> ImageReading:
    """Every object in the image with its colour, shape, size, cell and style, plus the background."""
    arr = _to_array(img)
    bg_rgb = np.median(_frame(arr), axis=0)
    background = BACKGROUNDS[int(np.argmin(((_BG_ARR - bg_rgb) ** 2).sum(1)))]

    flat = arr.reshape(-1, 3)
    d_pal = np.sqrt(((flat[:, None, :] - _PALETTE_ARR[None]) ** 2).sum(-1))  # [4096, 8]
    d_bg = np.sqrt(((flat - bg_rgb) ** 2).sum(-1))
    nearest = d_pal.argmin(1)
    d_near = d_pal.min(1)
    fg = ((d_near < d_bg) & (d_near < FOREGROUND_MAX_DIST)).reshape(IMAGE_SIZE, IMAGE_SIZE)
    nearest = nearest.reshape(IMAGE_SIZE, IMAGE_SIZE)
    d_bg_img = d_bg.reshape(IMAGE_SIZE, IMAGE_SIZE)

    objects = []
    structure = np.ones((3, 3), dtype=bool)
    for index in range(9):
        sy, sx = _cell_slices(index)
        cell_fg = fg[sy, sx]
        if np.count_nonzero(cell_fg) < MIN_PIXELS:
            continue
        labels, n = ndimage.label(cell_fg, structure=structure)
        sizes = ndimage.sum_labels(cell_fg, labels, index=np.arange(1, n + 1))
        keep = np.isin(labels, 1 + np.nonzero(sizes >= MIN_PIXELS)[0])
        if not keep.any():
            continue
        mask = np.zeros_like(fg)
        mask[sy, sx] = keep
        # Vote with the most saturated half of the pixels (furthest from the background): blurred edge
        # pixels are colour/background mixes that can sit nearer to another palette colour (red -> pink).
        strength = d_bg_img[mask]
        votes = nearest[mask][strength >= np.median(strength)]
        colour = COLOURS[Counter(votes.tolist()).most_common(1)[0][0]]
        colour_rgb = _PALETTE_ARR[COLOURS.index(colour)]
        # Refine with the object's own colour: a pixel belongs to it when nearer to its colour than to the
        # background. That halfway rule keeps blurred edges where they were (a mixed edge pixel may be
        # nearest to a third palette colour, which would otherwise grow the object).
        d_obj = np.sqrt(((arr[sy, sx] - colour_rgb) ** 2).sum(-1))
        near = ndimage.binary_dilation(keep, structure=structure) & (d_obj < d_bg_img[sy, sx])
        labels, n = ndimage.label(near, structure=structure)
        if n:
            sizes = ndimage.sum_labels(near, labels, index=np.arange(1, n + 1))
            near = np.isin(labels, 1 + np.nonzero(sizes >= MIN_PIXELS)[0])
        if np.count_nonzero(near) >= MIN_PIXELS:
            mask[sy, sx] = near
        filled = ndimage.binary_fill_holes(mask)
        shape, size, iou, (cx, cy) = _fit(mask, filled)
        fill_score = 1.0
        if shape != "unknown":
            fill_score = _fill_score(arr, bg_rgb, colour_rgb, shape, size, cx, cy)
        style = "filled" if fill_score >= FILL_THRESHOLD else "outline"
        hole_fraction = 1.0 - np.count_nonzero(mask) / max(1, np.count_nonzero(filled))
        objects.append(ReadObj(shape=shape, colour=colour, size=size, cell=CELLS[index], style=style,
                               iou=iou, pixels=int(np.count_nonzero(mask)), hole_fraction=float(hole_fraction),
                               fill_score=fill_score))
    styles = Counter(o.style for o in objects)
    style = None
    if objects:
        style = "outline" if styles["outline"] > styles["filled"] else "filled"
    return ImageReading(objects=tuple(objects), background=background, style=style)
