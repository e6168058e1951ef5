"""ShapesEval prompt sets: for each category, distinct prompts on held-out combinations, from fixed seeds.

Categories mirror GenEval's, made exact by the shapes world (every attribute a prompt names is checked, and
the number of objects must match exactly):
    single_object       one object carrying a held-out pair          "Draw a red star."
    colour              one object, held-out (colour, shape), no cell  "Show me a blue triangle."
    counting            2-4 copies of a held-out (colour, shape)      "Paint three green circles."
    position            one object, held-out (shape, cell)            "Draw a pink star at the top left."
    two_objects         a held-out (colour, shape) + a train object   "Draw a yellow square and an orange star."
    colour_attribution  two held-out (colour, shape) pairs whose swap is in train: a binding test
                        "Draw a red star and a blue triangle." (blue stars and red triangles are trained)
    image_to_text       a held-out scene's render is the prompt; the caption must name every object
    interleaved         the opening line of a held-out document; the model continues text and pictures
Text-to-image categories: T2I_CATEGORIES; all: CATEGORIES.

build_prompts(category, n=200, seed=0) -> list[EvalPrompt]   (deterministic; distinct prompts)
EvalPrompt.pipeline_prompt() -> str | list (for image_to_text: [PIL image], which the pipeline VQ-encodes)
EvalPrompt.target() -> list[ParsedObj]                          (what a text-to-image answer must show)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from .errors import ShapesError
from .parse import ParsedObj
from .text import document, instruction
from .world import (
    CELLS,
    HELDOUT_COLOUR_SHAPE,
    HELDOUT_SHAPE_CELL,
    SIZES,
    Obj,
    Scene,
    is_heldout_scene,
    render,
    sample_object,
    sample_scene,
)

T2I_CATEGORIES: tuple[str, ...] = (
    "single_object", "colour", "counting", "position", "two_objects", "colour_attribution",
)
CATEGORIES: tuple[str, ...] = T2I_CATEGORIES + ("image_to_text", "interleaved")

_COLOUR_SHAPE = sorted(HELDOUT_COLOUR_SHAPE)
_SHAPE_CELL = sorted(HELDOUT_SHAPE_CELL)


@dataclass(frozen=True)
class EvalPrompt:
    category: str
    text: str | None  # the instruction (text-to-image), the document opening (interleaved), None (image)
    scene: Scene  # the target (text-to-image), the shown image (image-to-text), the first picture (doc)
    check_cells: bool = True
    check_sizes: bool = True
    check_background: bool = False

    def pipeline_prompt(self) -> str | list:
        if self.category == "image_to_text":
            return [self.image()]
        return self.text

    def image(self) -> Image.Image:
        return render(self.scene)

    def target(self) -> list[ParsedObj]:
        """The objects a text-to-image answer must show (None = not named in the prompt, so free)."""
        return [ParsedObj(shape=o.shape, colour=o.colour, size=o.size if self.check_sizes else None,
                          cell=o.cell if self.check_cells else None) for o in self.scene.objects]


def _free_cells(rng: random.Random, n: int) -> list[str]:
    return rng.sample(CELLS, n)


def _t2i(category: str, rng: random.Random, objects: list[Obj], cells: bool) -> EvalPrompt:
    scene = Scene(tuple(objects), background=rng.choice(("white", "cream", "grey", "sky")))
    sizes = rng.random() < 0.5
    background = rng.random() < 0.3
    text = instruction(scene, rng, cells=cells, sizes=sizes, background=background)
    return EvalPrompt(category, text, scene, check_cells=cells, check_sizes=sizes, check_background=background)


def _one(category: str, rng: random.Random) -> EvalPrompt:
    if category == "single_object":
        obj = sample_object(rng, "heldout", CELLS, must_be_heldout=True)
        needs_cell = (obj.shape, obj.cell) in HELDOUT_SHAPE_CELL and (obj.colour, obj.shape) not in \
            HELDOUT_COLOUR_SHAPE
        return _t2i(category, rng, [obj], cells=needs_cell or rng.random() < 0.5)
    if category == "colour":
        colour, shape = rng.choice(_COLOUR_SHAPE)
        return _t2i(category, rng, [Obj(shape, colour, rng.choice(SIZES), rng.choice(CELLS))], cells=False)
    if category == "counting":
        colour, shape = rng.choice(_COLOUR_SHAPE)
        size = rng.choice(SIZES)
        cells = _free_cells(rng, rng.choice((2, 3, 4)))
        return _t2i(category, rng, [Obj(shape, colour, size, c) for c in cells], cells=False)
    if category == "position":
        shape, cell = rng.choice(_SHAPE_CELL)
        return _t2i(category, rng, [sample_object(rng, "heldout", [cell], shape=shape)], cells=True)
    if category == "two_objects":
        colour, shape = rng.choice(_COLOUR_SHAPE)
        c1, c2 = _free_cells(rng, 2)
        first = Obj(shape, colour, rng.choice(SIZES), c1)
        while True:
            second = sample_object(rng, "train", [c2])
            if second.shape != shape and second.colour != colour:
                break
        return _t2i(category, rng, [first, second], cells=False)
    if category == "colour_attribution":
        (col1, sh1), (col2, sh2) = rng.sample(_COLOUR_SHAPE, 2)
        c1, c2 = _free_cells(rng, 2)
        return _t2i(category, rng, [Obj(sh1, col1, rng.choice(SIZES), c1), Obj(sh2, col2, rng.choice(SIZES), c2)],
                    cells=False)
    if category == "image_to_text":
        return EvalPrompt(category, None, sample_scene(rng, "heldout"))
    if category == "interleaved":
        parts = document(rng, "heldout", "plain", "filled")
        return EvalPrompt(category, parts[0], parts[1])
    raise ShapesError(f"unknown ShapesEval category {category!r}; expected one of {list(CATEGORIES)}")


def build_prompts(category: str, n: int = 200, seed: int = 0) -> list[EvalPrompt]:
    """`n` distinct prompts of `category` (distinct text, or distinct scene for image_to_text)."""
    if category not in CATEGORIES:
        raise ShapesError(f"unknown ShapesEval category {category!r}; expected one of {list(CATEGORIES)}")
    if n < 1:
        raise ShapesError(f"n must be >= 1, got {n}")
    rng = random.Random(f"shapes-eval:{category}:{seed}")
    prompts: list[EvalPrompt] = []
    seen: set = set()
    attempts = 0
    while len(prompts) < n:
        attempts += 1
        if attempts > 50 * n:
            raise ShapesError(f"only {len(prompts)} distinct {category} prompts exist; asked for {n}")
        p = _one(category, rng)
        key = p.scene.sorted() if category == "image_to_text" else p.text
        if key in seen:
            continue
        if not is_heldout_scene(p.scene):
            raise ShapesError(f"internal: {category} prompt without a held-out combination: {p}")
        seen.add(key)
        prompts.append(p)
    return prompts
