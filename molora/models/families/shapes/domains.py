"""Question-answer domains over the shapes world, with exact answers: the data of the MoLoRA domain adapters.

Every item is text only: a scene in words, one or two questions, and the answer as spans, each span tagged with
the domain that answers it (what the oracle routes by and what routing agreement is measured against):

    "A large blue square at the top, a small red circle on the left and a small red star at the bottom.
     How many red shapes are there? What is above the red star? A:"          -> " two." (count) " the blue square." (spatial)

    count    How many circles / red shapes / large shapes / shapes are there?            -> " one." ... " four."
    arith    How many circles and stars are there together? / How many more red shapes than blue shapes are
             there? / How many shapes are not circles?                                    -> " one." ... " four."
    spatial  What is left of / right of / above / below the red circle? (exactly one object is)
                                                                                          -> " the blue square."
    size     Which is larger / smaller, the red circle or the blue square? / What size is the red circle?
                                                                                          -> " the red circle." / " small."
    mix      What colour do you get if you mix the red circle and the yellow star?       -> " orange."  (MIXES)

Answers use only words the embedded base already writes in captions (number words one-four, colours, shapes,
small / large, "the"), because a LoRA on the linear layers cannot lift output rows the base never trained.
A cell's row is CELLS.index // 3 (0 = top), its column CELLS.index % 3 (0 = left).

Splits come from the world's split (models/families/shapes/world.py): "train" scenes hold no held-out (colour, shape, cell)
triple, "heldout" scenes at least one, and each split has its own seeds, so evaluation items are never trained on.

    domain_items(domain, n, seed=, split=, two_questions=0.3) -> list[Item]   one domain; some items ask two
                                                                             questions of that same domain
    mixed_items(n, seed=, split=, domains=DOMAINS) -> list[Item]            two questions of two domains
    make_question(domain, scene, rng) -> (question, answer) | None           None: this scene cannot ask it
    Item.prompt / .answer / .text / .spans / .domains / .to_json() / Item.from_json(d)
    exact_match(item, generated) -> bool
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import ShapesError
from .text import NUMBER_WORDS, cell_phrase
from .world import CELLS, COLOURS, SHAPES, SIZES, SPLITS, Obj, Scene, sample_scene

DOMAINS: tuple[str, ...] = ("count", "arith", "spatial", "size")
EXTRA_DOMAINS: tuple[str, ...] = ("mix",)  # the fifth adapter, added later to a trained router
ALL_DOMAINS: tuple[str, ...] = DOMAINS + EXTRA_DOMAINS
DESCRIPTIONS: dict[str, str] = {
    "count": "Domain: counting the shapes of a scene described in words (how many circles / red shapes / ...).",
    "arith": "Domain: arithmetic over counts (sums, differences, complements) in a scene described in words.",
    "spatial": "Domain: spatial relations (what is left of / right of / above / below an object) in a scene.",
    "size": "Domain: comparing sizes (which is larger / smaller, what size is an object) in a scene.",
    "mix": "Domain: colour mixing (what colour two objects' colours make, by a fixed table) in a scene.",
}
# colour mixing table over the palette (symmetric); every result is a palette colour word the base knows
MIXES: dict[frozenset[str], str] = {
    frozenset(("red", "yellow")): "orange", frozenset(("yellow", "blue")): "green",
    frozenset(("red", "blue")): "purple", frozenset(("orange", "blue")): "brown",
    frozenset(("red", "green")): "brown", frozenset(("purple", "yellow")): "brown",
    frozenset(("red", "pink")): "pink", frozenset(("blue", "green")): "blue",
}
PROMPT_END = " A:"


@dataclass(frozen=True)
class Span:
    text: str  # starts with a space, ends with "."
    domain: str


@dataclass(frozen=True)
class Item:
    scene: Scene
    scene_text: str
    questions: tuple[str, ...]
    spans: tuple[Span, ...]
    split: str = "train"

    @property
    def prompt(self) -> str:
        return f"{self.scene_text} {' '.join(self.questions)}{PROMPT_END}"

    @property
    def answer(self) -> str:
        return "".join(s.text for s in self.spans)

    @property
    def text(self) -> str:
        return self.prompt + self.answer

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(s.domain for s in self.spans)

    @property
    def kind(self) -> str:
        """The domain for single-domain items, "mixed" when the spans need two or more domains."""
        distinct = set(self.domains)
        return self.domains[0] if len(distinct) == 1 else "mixed"

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "spans": [[s.text, s.domain] for s in self.spans], "kind": self.kind,
                "split": self.split}


def exact_match(item: Item, generated: str) -> bool:
    """The generated answer (text after the prompt, up to the end of sequence) equals the item's answer,
    ignoring surrounding whitespace and letter case."""
    return " ".join(generated.split()).lower() == " ".join(item.answer.split()).lower()


# --- scene facts -------------------------------------------------------------------------------------------

def row(obj: Obj) -> int:
    return CELLS.index(obj.cell) // 3


def col(obj: Obj) -> int:
    return CELLS.index(obj.cell) % 3


def _name(obj: Obj) -> str:
    return f"the {obj.colour} {obj.shape}"


def _unique(scene: Scene) -> list[Obj]:
    """Objects whose (colour, shape) no other object of the scene shares: "the red circle" names one thing."""
    pairs = [(o.colour, o.shape) for o in scene.objects]
    return [o for o in scene.objects if pairs.count((o.colour, o.shape)) == 1]


def _number(n: int) -> str:
    if n not in NUMBER_WORDS:
        raise ShapesError(f"no number word for {n}; answers are one to four")
    return f" {NUMBER_WORDS[n]}."


def scene_text(scene: Scene, rng: random.Random) -> str:
    """Every object named alone with its size, colour and cell, in random order: "A small red circle at the top
    left, a large blue square on the right and ..." (no grouping, so counting means counting)."""
    objs = list(scene.objects)
    rng.shuffle(objs)
    parts = [f"a {o.size} {o.colour} {o.shape} {cell_phrase(o.cell, rng)}" for o in objs]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


# --- questions per domain ----------------------------------------------------------------------------------

def _attributes(scene: Scene) -> list[tuple[str, str, Callable[[Obj], bool]]]:
    """(noun phrase, kind, predicate) for every shape, colour and size present, and "shapes" (all)."""
    out: list[tuple[str, str, Callable[[Obj], bool]]] = []
    for shape in sorted({o.shape for o in scene.objects}, key=SHAPES.index):
        out.append((f"{shape}s", "shape", lambda o, s=shape: o.shape == s))
    for colour in sorted({o.colour for o in scene.objects}, key=COLOURS.index):
        out.append((f"{colour} shapes", "colour", lambda o, c=colour: o.colour == c))
    for size in sorted({o.size for o in scene.objects}, key=SIZES.index):
        out.append((f"{size} shapes", "size", lambda o, s=size: o.size == s))
    return out


def _count(scene: Scene, pred: Callable[[Obj], bool]) -> int:
    return sum(1 for o in scene.objects if pred(o))


def _q_count(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    options = _attributes(scene) + [("shapes", "all", lambda o: True)]
    noun, _, pred = rng.choice(options)
    return f"How many {noun} are there?", _number(_count(scene, pred))


def _q_arith(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    attrs = _attributes(scene)
    op = rng.choice(("sum", "diff", "not"))
    if op == "not":
        noun, kind, pred = rng.choice(attrs)
        n = len(scene.objects) - _count(scene, pred)
        if n < 1:
            return None
        what = {"shape": f"{noun}", "colour": noun.split()[0], "size": noun.split()[0]}[kind]
        return f"How many shapes are not {what}?", _number(n)
    # two attributes of the same kind (two shapes, two colours or two sizes), so the sets are disjoint
    kinds = [k for k in ("shape", "colour", "size") if sum(1 for a in attrs if a[1] == k) >= 2]
    if not kinds:
        return None
    kind = rng.choice(kinds)
    (na, _, pa), (nb, _, pb) = rng.sample([a for a in attrs if a[1] == kind], 2)
    ca, cb = _count(scene, pa), _count(scene, pb)
    if op == "sum":
        return f"How many {na} and {nb} are there together?", _number(ca + cb)
    if ca == cb:
        return None
    if ca < cb:
        (na, ca), (nb, cb) = (nb, cb), (na, ca)
    return f"How many more {na} than {nb} are there?", _number(ca - cb)


_RELATIONS: dict[str, Callable[[Obj, Obj], bool]] = {  # relation(candidate, reference)
    "left of": lambda o, r: col(o) < col(r),
    "right of": lambda o, r: col(o) > col(r),
    "above": lambda o, r: row(o) < row(r),
    "below": lambda o, r: row(o) > row(r),
}


def _q_spatial(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    options = []
    for ref in _unique(scene):
        for rel, test in _RELATIONS.items():
            hits = [o for o in scene.objects if o is not ref and test(o, ref)]
            if len(hits) == 1:
                options.append((ref, rel, hits[0]))
    if not options:
        return None
    ref, rel, hit = rng.choice(options)
    return f"What is {rel} {_name(ref)}?", f" {_name(hit)}."


def _q_size(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    unique = _unique(scene)
    pairs = [(a, b) for a in unique for b in unique if a is not b and a.size != b.size]
    if pairs and rng.random() < 0.75:
        a, b = rng.choice(pairs)
        which = rng.choice(("larger", "smaller"))
        want = "large" if which == "larger" else "small"
        hit = a if a.size == want else b
        return f"Which is {which}, {_name(a)} or {_name(b)}?", f" {_name(hit)}."
    if not unique:
        return None
    obj = rng.choice(unique)
    return f"What size is {_name(obj)}?", f" {obj.size}."


def _q_mix(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    unique = _unique(scene)
    pairs = [(a, b) for i, a in enumerate(unique) for b in unique[i + 1:]
             if frozenset((a.colour, b.colour)) in MIXES]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    if rng.random() < 0.5:
        a, b = b, a
    return (f"What colour do you get if you mix {_name(a)} and {_name(b)}?",
            f" {MIXES[frozenset((a.colour, b.colour))]}.")


QUESTIONS: dict[str, Callable[[Scene, random.Random], tuple[str, str] | None]] = {
    "count": _q_count, "arith": _q_arith, "spatial": _q_spatial, "size": _q_size, "mix": _q_mix,
}


def make_question(domain: str, scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer span text) of `domain` about `scene`, or None when the scene cannot ask one."""
    if domain not in QUESTIONS:
        raise ShapesError(f"unknown domain {domain!r}; expected one of {list(QUESTIONS)}")
    return QUESTIONS[domain](scene, rng)


# --- items -------------------------------------------------------------------------------------------------

def sample_item(rng: random.Random, domains: Sequence[str], split: str = "train", *, tries: int = 200) -> Item:
    """One item asking one question per entry of `domains` (in that order) about one scene of `split`."""
    if split not in SPLITS:
        raise ShapesError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    for _ in range(tries):
        scene = sample_scene(rng, split, n_objects=rng.choice((2, 3, 3, 4, 4)))
        asked = [make_question(d, scene, rng) for d in domains]
        if any(q is None for q in asked) or len({q[0] for q in asked}) != len(asked):
            continue
        return Item(scene, scene_text(scene, rng), tuple(q for q, _ in asked),
                    tuple(Span(a, d) for (_, a), d in zip(asked, domains)), split)
    raise ShapesError(f"no {split} scene in {tries} draws could ask {list(domains)}")


def domain_items(domain: str, n: int, *, seed: int | str, split: str = "train",
                 two_questions: float = 0.3, foreign: float = 0.0) -> list[Item]:
    """`n` items of one domain; a share `two_questions` asks two questions of that domain in one prompt (so an
    adapter trained on its own domain alone still learns that a second answer follows the first).

    A share `foreign` (drawn first) asks one question of `domain` and one of another domain (DOMAINS), in
    random order: the request shape of mixed requests. The foreign span is recorded with its own domain; an
    adapter trained on its own domain takes the loss on its own spans only (domain_batches.make_batch(only=)),
    so it learns to answer its question wherever it sits, and never learns the other domain's answers.
    """
    rng = random.Random(f"domain:{domain}:{split}:{seed}" + (f":foreign{foreign}" if foreign else ""))
    others = [d for d in DOMAINS if d != domain]
    items = []
    for _ in range(n):
        if foreign and rng.random() < foreign:
            pair = [domain, rng.choice(others)]
            rng.shuffle(pair)
            items.append(sample_item(rng, pair, split))
        else:
            items.append(sample_item(rng, [domain] * (2 if rng.random() < two_questions else 1), split))
    return items


def mixed_items(n: int, *, seed: int | str, split: str = "heldout",
                domains: Sequence[str] = DOMAINS) -> list[Item]:
    """`n` requests that each need two different domains in one answer (the ordered pair drawn uniformly)."""
    if len(set(domains)) < 2:
        raise ShapesError(f"mixed requests need at least two domains, got {list(domains)}")
    rng = random.Random(f"mixed:{','.join(domains)}:{split}:{seed}")
    return [sample_item(rng, rng.sample(list(domains), 2), split) for _ in range(n)]
