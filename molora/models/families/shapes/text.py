"""Text about shape scenes: captions, instructions and interleaved documents, from varied templates.

Two registers carry the same content words (colour, shape, size, position, count), so content stays
checkable in both:
    plain   "A red circle sits at the top left."  "Two blue squares at the top right and the bottom left."
    pirate  "Arr! A red circle be anchored at the top left, matey."  "Ahoy! I spy two blue squares ..."
The pirate register is what the text-style LoRA learns; it is recognised by its marker words
(PIRATE_MARKERS: arr, ahoy, matey, avast, hearties, yo ho), none of which plain text ever uses.
Instructions ("Draw ...", "Show me ...", "Make a picture of ...") are always plain. Images are never
mentioned as styled: the image style ("filled" / "outline") lives in the pictures only.

Vocabulary (kept small and regular for the BPE): colour names, shape names and their plurals (+"s"),
"small"/"large", number words one-four, cell phrases ("at the top left", "on the left", "in the center",
"at the bottom", ...), background names + "background", and a few frame words.

API (all deterministic given the `random.Random` passed in):
    caption(scene, rng, register="plain", *, sizes=None, background=None) -> str
    instruction(scene, rng, *, cells=None, sizes=None, background=None) -> str
        None = decide at random (cells 75%, sizes 50%, background 30% of the time); True/False forces it.
        Attributes left out are free in the picture (the eval checks only what a prompt says).
    document(rng, split="train", register="plain", style="filled", n_images=None) -> list[str | Scene]
        2-3 images; the first text introduces 1-2 objects, each later text adds one object (the picture
        keeps the earlier ones), an optional closing line states the total ("Now there are three shapes.").
        Text parts are stripped; a text part followed by an image ends with ":". Join as
        "text <boi>...<eoi> text ...".
    describe_objects(objects, rng, *, cells=True, sizes=True) -> str   the shared noun-phrase builder
    cell_phrase(cell, rng) -> str
"""

from __future__ import annotations

import random

from .errors import ShapesError
from .world import CELLS, Obj, Scene, sample_object, sample_scene

REGISTERS: tuple[str, ...] = ("plain", "pirate")
NUMBER_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
PIRATE_MARKERS: tuple[str, ...] = ("arr", "ahoy", "matey", "avast", "hearties", "yo")

# Each cell has a couple of phrasings; the parser accepts all of them (and "middle" for center).
_CELL_PHRASES: dict[str, tuple[str, ...]] = {
    "top left": ("at the top left", "in the top left corner"),
    "top": ("at the top", "at the top"),
    "top right": ("at the top right", "in the top right corner"),
    "left": ("on the left", "at the left"),
    "center": ("in the center", "in the middle"),
    "right": ("on the right", "at the right"),
    "bottom left": ("at the bottom left", "in the bottom left corner"),
    "bottom": ("at the bottom", "at the bottom"),
    "bottom right": ("at the bottom right", "in the bottom right corner"),
}

_CAPTION_PLAIN = (
    "{Objs}.",
    "There {be} {objs}.",
    "The picture shows {objs}.",
    "This image has {objs}.",
    "We see {objs}.",
)
# Used for one-kind scenes: the verb goes between the object and its cells.
_CAPTION_VERB = {
    "plain": ("{Obj} {sits} {cells}.", "{Obj} {be} {cells}."),
    "pirate": ("Arr! {Obj} be anchored {cells}, matey.", "Ahoy, {obj} be restin' {cells}, arr."),
}
_CAPTION_PIRATE = (
    "Arr! {Objs}, matey.",
    "Ahoy! I spy {objs}.",
    "Avast, there be {objs}, me hearties!",
    "Yo ho! {Objs} be anchored here, arr.",
    "Arr, me eyes see {objs}, matey.",
    "Ahoy, matey! {Objs} be sailin' here.",
)
_INSTRUCTION = (
    "Draw {objs}.",
    "Show me {objs}.",
    "Make a picture of {objs}.",
    "Paint {objs}.",
    "Please draw {objs}.",
    "Create an image with {objs}.",
)
_DOC_START = {
    "plain": ("First, {objs}:", "We start with {objs}:", "Here is {objs}:", "At first there {be} {objs}:"),
    "pirate": ("Arr, we start with {objs}, matey:", "Ahoy! First there be {objs}:",
               "Avast, here be {objs}:", "Yo ho, me hearties, {objs}:"),
}
_DOC_ADD = {
    "plain": ("Then {obj} joins:", "Next, {obj} appears:", "Now {obj} is added:", "Then comes {obj}:"),
    "pirate": ("Then {obj} sails in, arr:", "Ahoy, {obj} be joinin' us:", "Arr, now {obj} comes aboard:",
               "Yo ho, then {obj} drops anchor:"),
}
_DOC_END = {
    "plain": ("Now there are {n} shapes.", "That makes {n} shapes in all."),
    "pirate": ("Arr, now there be {n} shapes, matey.", "Yo ho, that be {n} shapes in all!"),
}


def _check_register(register: str) -> None:
    if register not in REGISTERS:
        raise ShapesError(f"unknown register {register!r}; expected one of {list(REGISTERS)}")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def cell_phrase(cell: str, rng: random.Random) -> str:
    if cell not in _CELL_PHRASES:
        raise ShapesError(f"unknown cell {cell!r}; expected one of {list(CELLS)}")
    return rng.choice(_CELL_PHRASES[cell])


def _join(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _groups(objects: tuple[Obj, ...] | list[Obj]) -> list[list[Obj]]:
    """Objects grouped by kind (colour, shape, size), groups and members in grid order."""
    groups: dict[tuple[str, str, str], list[Obj]] = {}
    for obj in sorted(objects, key=lambda o: CELLS.index(o.cell)):
        groups.setdefault(obj.kind, []).append(obj)
    return list(groups.values())


def _group_phrase(group: list[Obj], rng: random.Random, cells: bool, sizes: bool) -> str:
    first = group[0]
    adjectives = ([first.size] if sizes else []) + [first.colour]
    n = len(group)
    if n == 1:
        words = [_article(adjectives[0])] + adjectives + [first.shape]
    else:
        words = [NUMBER_WORDS[n]] + adjectives + [first.shape + "s"]
    phrase = " ".join(words)
    if not cells:
        return phrase
    if n == 1:
        return f"{phrase} {cell_phrase(first.cell, rng)}"
    if rng.random() < 0.5:  # "two red stars, one at the top and one on the left"
        return phrase + ", " + _join([f"one {cell_phrase(o.cell, rng)}" for o in group])
    # "two red stars at the top and on the left"
    return phrase + " " + _join([cell_phrase(o.cell, rng) for o in group])


def describe_objects(objects: tuple[Obj, ...] | list[Obj], rng: random.Random, *, cells: bool = True,
                     sizes: bool = True) -> str:
    """The noun phrase for a set of objects: 'a small red circle at the top left and two blue squares ...'."""
    if not objects:
        raise ShapesError("cannot describe an empty set of objects")
    return _join([_group_phrase(g, rng, cells, sizes) for g in _groups(objects)])


def _fill(template: str, objs: str, n_objects: int) -> str:
    plural = n_objects > 1
    return template.format(Objs=objs[0].upper() + objs[1:], objs=objs, be="are" if plural else "is")


def _with_background(text: str, scene: Scene, rng: random.Random, register: str) -> str:
    bg = scene.background
    if register == "pirate":
        extra = rng.choice((f"The sea behind be {bg}, arr.", f"All on a {bg} background, matey."))
    else:
        extra = rng.choice((f"The background is {bg}.", f"All on a {bg} background."))
    return f"{text} {extra}"


def _verb_caption(group: list[Obj], rng: random.Random, register: str, sizes: bool) -> str:
    """'A red circle sits at the top left.' / 'Two blue squares are at the top and on the right.'"""
    obj = _group_phrase(group, rng, cells=False, sizes=sizes)
    cells = _join([cell_phrase(o.cell, rng) for o in group])
    plural = len(group) > 1
    return rng.choice(_CAPTION_VERB[register]).format(
        Obj=obj[0].upper() + obj[1:], obj=obj, cells=cells,
        sits="sit" if plural else "sits", be="are" if plural else "is")


def caption(scene: Scene, rng: random.Random, register: str = "plain", *, sizes: bool | None = None,
            background: bool | None = None) -> str:
    """A description of everything in the scene (every object with its cell) in `register`."""
    _check_register(register)
    if not isinstance(scene, Scene):
        raise ShapesError(f"caption expects a Scene, got {type(scene).__name__}")
    sizes = rng.random() < 0.5 if sizes is None else sizes
    background = rng.random() < 0.3 if background is None else background
    groups = _groups(scene.objects)
    if len(groups) == 1 and rng.random() < 0.4:
        text = _verb_caption(groups[0], rng, register, sizes)
    else:
        templates = _CAPTION_PIRATE if register == "pirate" else _CAPTION_PLAIN
        text = _fill(rng.choice(templates), describe_objects(scene.objects, rng, sizes=sizes),
                     len(scene.objects))
    return _with_background(text, scene, rng, register) if background else text


def instruction(scene: Scene, rng: random.Random, *, cells: bool | None = None, sizes: bool | None = None,
                background: bool | None = None) -> str:
    """A plain-register request to draw the scene."""
    if not isinstance(scene, Scene):
        raise ShapesError(f"instruction expects a Scene, got {type(scene).__name__}")
    cells = rng.random() < 0.75 if cells is None else cells
    sizes = rng.random() < 0.5 if sizes is None else sizes
    background = rng.random() < 0.3 if background is None else background
    text = rng.choice(_INSTRUCTION).format(objs=describe_objects(scene.objects, rng, cells=cells, sizes=sizes))
    if background:
        text = text[:-1] + f" on a {scene.background} background."
    return text


def document(rng: random.Random, split: str = "train", register: str = "plain", style: str = "filled",
             n_images: int | None = None) -> list[str | Scene]:
    """An interleaved story: text, picture, text, picture (, text). Later pictures keep earlier objects."""
    _check_register(register)
    n_images = rng.choice((2, 3)) if n_images is None else n_images
    if not 2 <= n_images <= 3:
        raise ShapesError(f"a document has 2-3 images, got {n_images}")
    first = sample_scene(rng, split, n_objects=rng.choice((1, 2)) if n_images == 2 else 1, style=style)
    sizes = rng.random() < 0.5
    parts: list[str | Scene] = []
    start = rng.choice(_DOC_START[register])
    parts.append(_fill(start, describe_objects(first.objects, rng, sizes=sizes), len(first.objects)))
    parts.append(first)
    scene = first
    for _ in range(n_images - 1):
        free = [c for c in CELLS if c not in {o.cell for o in scene.objects}]
        new = sample_object(rng, "train", free)
        parts.append(rng.choice(_DOC_ADD[register]).format(obj=describe_objects([new], rng, sizes=sizes)))
        scene = Scene(scene.objects + (new,), background=scene.background, style=style)
        parts.append(scene)
    if rng.random() < 0.5:
        parts.append(rng.choice(_DOC_END[register]).format(n=NUMBER_WORDS[len(scene.objects)]))
    return parts
