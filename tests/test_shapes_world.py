"""The shapes world: deterministic scenes and renders, a held-out split that never leaks, flat-colour images,
and text in both registers that carries the scene's content."""

from __future__ import annotations

import random

import numpy as np
import pytest

from molora.models.families.shapes import ShapesError
from molora.models.families.shapes.text import PIRATE_MARKERS, caption, document, instruction
from molora.models.families.shapes.world import (
    BACKGROUND_RGB,
    CELLS,
    COLOURS,
    HELDOUT_TRIPLES,
    PALETTE,
    SHAPES,
    STYLES,
    Obj,
    Scene,
    cell_center,
    is_heldout_obj,
    is_heldout_scene,
    is_train_scene,
    object_mask,
    render,
    sample_scene,
)


def _scenes(seed: int, n: int, split: str = "train", style: str = "filled") -> list[Scene]:
    rng = random.Random(seed)
    return [sample_scene(rng, split, style=style) for _ in range(n)]


def test_same_seed_gives_same_scenes_and_byte_identical_images():
    a, b = _scenes(7, 50, "heldout", "outline"), _scenes(7, 50, "heldout", "outline")
    assert a == b
    assert all(render(x).tobytes() == render(y).tobytes() for x, y in zip(a, b))
    assert _scenes(8, 50, "heldout", "outline") != a


def test_text_is_deterministic_given_rng():
    def texts(seed):
        rng = random.Random(seed)
        out = []
        for scene in _scenes(seed, 30):
            out += [caption(scene, rng), caption(scene, rng, "pirate"), instruction(scene, rng)]
        out += [str(document(rng, "train", "pirate", "outline")) for _ in range(10)]
        return out

    assert texts(3) == texts(3)
    assert texts(3) != texts(4)


def test_train_split_never_contains_a_heldout_combination():
    scenes = _scenes(0, 5000, "train")
    for scene in scenes:
        for o in scene.objects:
            assert (o.colour, o.shape, o.cell) not in HELDOUT_TRIPLES, scene
    # and the split still covers every attribute value and object count
    objs = [o for s in scenes for o in s.objects]
    assert {o.shape for o in objs} == set(SHAPES) and {o.colour for o in objs} == set(COLOURS)
    assert {o.cell for o in objs} == set(CELLS) and {len(s.objects) for s in scenes} == {1, 2, 3, 4}


def test_heldout_triples_are_the_documented_set_and_every_pair_is_still_trained():
    expected = {(COLOURS[i % 8], SHAPES[i % 5], CELLS[(4 * i) % 9]) for i in range(20)}
    assert HELDOUT_TRIPLES == expected and len(HELDOUT_TRIPLES) == 20
    # every pair of attributes occurs in train through other triples, in the sampled train data too
    objs = [o for s in _scenes(10, 4000, "train") for o in s.objects]
    for attrs in (("colour", "shape"), ("shape", "cell"), ("colour", "cell")):
        seen = {tuple(getattr(o, a) for a in attrs) for o in objs}
        values = [{"colour": COLOURS, "shape": SHAPES, "cell": CELLS}[a] for a in attrs]
        assert seen == {(x, y) for x in values[0] for y in values[1]}, attrs
    assert is_heldout_obj(Obj("circle", "red", "small", "top left"))
    assert not is_heldout_obj(Obj("circle", "red", "small", "top"))


def test_train_documents_never_contain_a_heldout_combination():
    rng = random.Random(1)
    for _ in range(500):
        for part in document(rng, "train", rng.choice(("plain", "pirate"))):
            if isinstance(part, Scene):
                assert is_train_scene(part)


def test_heldout_scenes_all_carry_a_heldout_combination():
    scenes = _scenes(2, 1000, "heldout")
    assert all(is_heldout_scene(s) for s in scenes)
    triples = {(o.colour, o.shape, o.cell) for s in scenes for o in s.objects} & HELDOUT_TRIPLES
    assert triples == HELDOUT_TRIPLES


def test_render_is_64x64_flat_colours_without_antialiasing():
    for scene in _scenes(5, 200) + _scenes(6, 200, style="outline"):
        img = render(scene)
        assert img.size == (64, 64) and img.mode == "RGB"
        colours = {tuple(c) for c in np.asarray(img).reshape(-1, 3)}
        allowed = {BACKGROUND_RGB[scene.background]} | {PALETTE[o.colour] for o in scene.objects}
        assert colours == allowed


def test_outline_is_a_hollow_subset_of_filled_and_objects_stay_in_their_cells():
    for shape in SHAPES:
        for size in ("small", "large"):
            for cell in CELLS:
                obj = Obj(shape, "red", size, cell)
                filled, outline = object_mask(obj, "filled"), object_mask(obj, "outline")
                assert (outline <= filled).all()
                assert 0.05 < 1 - outline.sum() / filled.sum() < 0.6  # a visible hole, a visible ring
                row, col = divmod(CELLS.index(cell), 3)
                ys, xs = np.nonzero(filled)
                x0, y0 = 2 + 20 * col, 2 + 20 * row  # cells [2, 22), [22, 42), [42, 62)
                assert x0 < xs.min() and xs.max() < x0 + 19  # >= 1 px from the cell border
                assert y0 < ys.min() and ys.max() < y0 + 19
                assert cell_center(cell) == (x0 + 10, y0 + 10) and (x0 + 10) % 4 == 0


def test_an_object_covers_the_same_4px_code_pattern_in_every_cell():
    # the VQ tokenizer codes 4x4 patches: an object's patch grid must not depend on its cell
    for shape in SHAPES:
        for size in ("small", "large"):
            for style in STYLES:
                crops = []
                for cell in CELLS:
                    cx, cy = (int(v) for v in cell_center(cell))
                    crops.append(object_mask(Obj(shape, "red", size, cell), style)[cy - 10:cy + 10, cx - 10:cx + 10])
                assert all((c == crops[0]).all() for c in crops)


def test_palette_colours_are_well_separated():
    def min_dist(a, b, same=False):
        a, b = np.array(a, dtype=float), np.array(b, dtype=float)
        d = np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1))
        return d[~np.eye(len(a), dtype=bool)].min() if same else d.min()

    palette, backgrounds = [PALETTE[c] for c in COLOURS], list(BACKGROUND_RGB.values())
    assert min_dist(palette, palette, same=True) > 70  # object colours: far apart (orange-yellow 74)
    assert min_dist(palette, backgrounds) > 100  # objects stand out from every background
    assert min_dist(backgrounds, backgrounds, same=True) > 25  # backgrounds: read from 250+ frame pixels


def test_captions_keep_content_words_in_both_registers():
    rng = random.Random(9)
    for scene in _scenes(9, 300):
        for register in ("plain", "pirate"):
            text = caption(scene, rng, register).lower()
            for o in scene.objects:
                assert o.colour in text and o.shape in text
            words = set(text.replace(",", " ").replace(".", " ").replace("!", " ").split())
            assert bool(words & set(PIRATE_MARKERS)) == (register == "pirate"), text
            assert 4 <= len(text.split()) <= 45


def test_instructions_are_plain_requests():
    rng = random.Random(10)
    for scene in _scenes(10, 200):
        text = instruction(scene, rng)
        assert text.split()[0] in {"Draw", "Show", "Make", "Paint", "Please", "Create"}
        assert not set(text.lower().split()) & set(PIRATE_MARKERS)


def test_documents_interleave_text_and_growing_scenes():
    rng = random.Random(11)
    for _ in range(200):
        parts = document(rng, "heldout", "pirate", "outline")
        scenes = [p for p in parts if isinstance(p, Scene)]
        assert 2 <= len(scenes) <= 3 and isinstance(parts[0], str)
        assert all(s.style == "outline" for s in scenes)
        for before, after in zip(scenes, scenes[1:]):
            assert set(before.objects) < set(after.objects)  # later pictures keep earlier objects
        for i, p in enumerate(parts):  # every picture follows a text part
            if isinstance(p, Scene):
                assert isinstance(parts[i - 1], str) and parts[i - 1].endswith(":")


def test_bad_inputs_raise_shapes_error():
    rng = random.Random(0)
    with pytest.raises(ShapesError, match="split"):
        sample_scene(rng, "test")
    with pytest.raises(ShapesError, match="style"):
        sample_scene(rng, style="dotted")
    with pytest.raises(ShapesError, match="colour"):
        Obj("circle", "teal", "small", "center")
    with pytest.raises(ShapesError, match="share a cell"):
        Scene((Obj("circle", "red", "small", "top"), Obj("star", "blue", "large", "top")))
    with pytest.raises(ShapesError, match="1-4"):
        sample_scene(rng, n_objects=5)
    with pytest.raises(ShapesError, match="register"):
        caption(_scenes(0, 1)[0], rng, "shakespeare")
    assert STYLES == ("filled", "outline")
