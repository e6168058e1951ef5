"""ShapesEval prompt sets: for each category, distinct prompts on held-out combinations, from fixed seeds.

Categories mirror GenEval's, made exact by the shapes world (every attribute a prompt names is checked, and
the number of objects must match exactly). Every prompt carries at least one held-out (colour, shape, cell)
triple (world.HELDOUT_TRIPLES) and names what makes it held out, so cells are always named (and checked)
for held-out objects:
    single_object       one held-out object                           "Draw a red circle at the top left."
    colour              one held-out object, size left free: colour (with shape and cell) is what is checked
                        "Show me a yellow circle in the center."
    counting            2-4 copies of a held-out object's colour+shape+size, one of them in its held-out cell,
                        cells named            "Paint three green stars on the left, at the top and ..."
    position            one held-out object, cell checked, no background named
                        "Draw a small purple star at the bottom."
    two_objects         a held-out object + a train object of another colour and shape, cells named
    colour_attribution  two held-out objects (different colours and shapes) whose colour-swapped versions
                        (same cells) are train objects: a binding test
                        "Draw a red circle at the top left and a blue triangle on the left." (a blue circle at
                        the top left and a red triangle on the left are trained)
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
    HELDOUT_TRIPLES,
    SIZES,
    Obj,
    Scene,
    is_heldout_scene,
    is_train_obj,
    render,
    sample_object,
    sample_scene,
)

T2I_CATEGORIES: tuple[str, ...] = (
    "single_object", "colour", "counting", "position", "two_objects", "colour_attribution",
)
CATEGORIES: tuple[str, ...] = T2I_CATEGORIES + ("image_to_text", "interleaved")

_TRIPLES = sorted(HELDOUT_TRIPLES)
# Pairs of held-out objects for colour attribution: different colours, shapes and cells, and swapping their
# colours gives two train objects (so the model has drawn both swapped objects and must bind correctly).
_ATTRIBUTION_PAIRS = [
    (a, b) for a in _TRIPLES for b in _TRIPLES
    if a < b and a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    and (b[0], a[1], a[2]) not in HELDOUT_TRIPLES and (a[0], b[1], b[2]) not in HELDOUT_TRIPLES
]


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


def _heldout(rng: random.Random, size: str | None = None) -> Obj:
    colour, shape, cell = rng.choice(_TRIPLES)
    return Obj(shape, colour, size if size is not None else rng.choice(SIZES), cell)


def _t2i(category: str, rng: random.Random, objects: list[Obj], *, sizes: bool | None = None,
         background: bool | None = None) -> EvalPrompt:
    """A text-to-image prompt naming every object's cell (held-out objects are held out by their cell)."""
    scene = Scene(tuple(objects), background=rng.choice(("white", "cream", "grey", "sky")))
    sizes = rng.random() < 0.5 if sizes is None else sizes
    background = rng.random() < 0.3 if background is None else background
    text = instruction(scene, rng, cells=True, sizes=sizes, background=background)
    return EvalPrompt(category, text, scene, check_cells=True, check_sizes=sizes, check_background=background)


def _one(category: str, rng: random.Random) -> EvalPrompt:
    if category == "single_object":
        return _t2i(category, rng, [_heldout(rng)])
    if category == "colour":
        return _t2i(category, rng, [_heldout(rng)], sizes=False)
    if category == "counting":
        first = _heldout(rng)
        others = rng.sample([c for c in CELLS if c != first.cell], rng.choice((1, 2, 3)))
        copies = [Obj(first.shape, first.colour, first.size, c) for c in others]
        return _t2i(category, rng, [first, *copies])
    if category == "position":
        return _t2i(category, rng, [_heldout(rng)], background=False)
    if category == "two_objects":
        first = _heldout(rng)
        while True:
            second = sample_object(rng, "train", [c for c in CELLS if c != first.cell])
            if second.shape != first.shape and second.colour != first.colour:
                break
        return _t2i(category, rng, [first, second])
    if category == "colour_attribution":
        (col1, sh1, c1), (col2, sh2, c2) = rng.choice(_ATTRIBUTION_PAIRS)
        objects = [Obj(sh1, col1, rng.choice(SIZES), c1), Obj(sh2, col2, rng.choice(SIZES), c2)]
        if rng.random() < 0.5:
            objects.reverse()
        swapped = [Obj(sh1, col2, "small", c1), Obj(sh2, col1, "small", c2)]
        if not all(is_train_obj(o) for o in swapped):
            raise ShapesError(f"internal: colour-swapped objects are not in train: {swapped}")
        return _t2i(category, rng, objects)
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
