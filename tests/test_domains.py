"""The MoLoRA question domains: answers recomputed independently from the scene, splits, seeds, mixed spans."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
from PIL import Image

from molora.models.families.shapes import world
from molora.models.families.shapes.domains import (
    ALL_DOMAINS,
    DOMAINS,
    MIXES,
    Item,
    ShapesError,
    domain_items,
    exact_match,
    make_question,
    mixed_items,
    sample_item,
)

WORDS = {"one": 1, "two": 2, "three": 3, "four": 4}


def rc(obj: world.Obj) -> tuple[int, int]:
    i = world.CELLS.index(obj.cell)
    return i // 3, i % 3


def find(scene: world.Scene, colour: str, shape: str) -> world.Obj:
    hits = [o for o in scene.objects if (o.colour, o.shape) == (colour, shape)]
    assert len(hits) == 1, f"'the {colour} {shape}' must name exactly one object"
    return hits[0]


def matches(obj: world.Obj, noun: str) -> bool:
    """'circles', 'red shapes', 'large shapes', 'shapes' (as the questions phrase them)."""
    if noun == "shapes":
        return True
    word = noun.split()[0]
    return obj.shape + "s" == word or obj.colour == word or obj.size == word


def solve(scene: world.Scene, question: str) -> str:
    """An independent solver: parses the question with regular expressions and reads the answer off the scene."""
    objs = scene.objects
    if m := re.fullmatch(r"How many (.+) and (.+) are there together\?", question):
        return str(sum(matches(o, m[1]) for o in objs) + sum(matches(o, m[2]) for o in objs))
    if m := re.fullmatch(r"How many more (.+) than (.+) are there\?", question):
        return str(sum(matches(o, m[1]) for o in objs) - sum(matches(o, m[2]) for o in objs))
    if m := re.fullmatch(r"How many shapes are not (\w+)\?", question):
        word = m[1]
        return str(sum(not (o.shape + "s" == word or o.colour == word or o.size == word) for o in objs))
    if m := re.fullmatch(r"How many (.+) are there\?", question):
        return str(sum(matches(o, m[1]) for o in objs))
    if m := re.fullmatch(r"What is (left of|right of|above|below) the (\w+) (\w+)\?", question):
        ref = find(scene, m[2], m[3])
        (r0, c0), rel = rc(ref), m[1]
        hits = [o for o in objs if o is not ref and {"left of": rc(o)[1] < c0, "right of": rc(o)[1] > c0,
                                                      "above": rc(o)[0] < r0, "below": rc(o)[0] > r0}[rel]]
        assert len(hits) == 1
        return f"the {hits[0].colour} {hits[0].shape}"
    if m := re.fullmatch(r"Which is (larger|smaller), the (\w+) (\w+) or the (\w+) (\w+)\?", question):
        a, b = find(scene, m[2], m[3]), find(scene, m[4], m[5])
        assert a.size != b.size
        want = "large" if m[1] == "larger" else "small"
        hit = a if a.size == want else b
        return f"the {hit.colour} {hit.shape}"
    if m := re.fullmatch(r"What size is the (\w+) (\w+)\?", question):
        return find(scene, m[1], m[2]).size
    if m := re.fullmatch(r"What colour do you get if you mix the (\w+) (\w+) and the (\w+) (\w+)\?", question):
        a, b = find(scene, m[1], m[2]), find(scene, m[3], m[4])
        return MIXES[frozenset((a.colour, b.colour))]
    raise AssertionError(f"unparsed question {question!r}")


def normalise(span: str) -> str:
    word = span.strip().rstrip(".")
    return str(WORDS[word]) if word in WORDS else word


def scene_from_text(text: str) -> set[tuple[str, str, str, str]]:
    found = re.findall(r"(small|large) (\w+) (\w+) (?:at|in|on) the ([a-z ]+?)(?: corner)?(?=,| and |\.)", text)
    cells = {"middle": "center"}
    return {(size, colour, shape, cells.get(cell, cell)) for size, colour, shape, cell in found}


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_every_answer_equals_an_independent_solution_read_off_the_scene(domain):
    for split in ("train", "heldout"):
        for item in domain_items(domain, 150, seed=3, split=split):
            assert item.domains == (domain,) * len(item.questions)
            for question, span in zip(item.questions, item.spans):
                assert normalise(span.text) == solve(item.scene, question), (item.text, question)


def test_the_scene_in_words_names_every_object_with_size_colour_and_cell():
    for item in domain_items("count", 100, seed=1):
        objs = {(o.size, o.colour, o.shape, o.cell) for o in item.scene.objects}
        assert scene_from_text(item.scene_text) == objs, item.scene_text


def test_number_answers_stay_within_the_words_the_base_writes():
    for domain in ("count", "arith"):
        for item in domain_items(domain, 300, seed=2):
            assert all(s.text.strip(" .") in WORDS for s in item.spans)


def test_mixed_requests_record_two_different_domains_in_order_of_the_questions():
    items = mixed_items(300, seed=0)
    assert all(len(i.spans) == 2 and len(set(i.domains)) == 2 and i.kind == "mixed" for i in items)
    pairs = {i.domains for i in items}
    assert len(pairs) == len(DOMAINS) * (len(DOMAINS) - 1)  # every ordered pair occurs
    for item in items:
        for question, span in zip(item.questions, item.spans):
            assert normalise(span.text) == solve(item.scene, question)
        assert item.answer == "".join(s.text for s in item.spans) and item.text.endswith(item.answer)


def test_splits_follow_the_world_split_and_seeds_reproduce():
    train = domain_items("spatial", 200, seed=0, split="train")
    held = domain_items("spatial", 200, seed=0, split="heldout")
    assert all(world.is_train_scene(i.scene) for i in train)
    assert all(world.is_heldout_scene(i.scene) for i in held)
    assert not {i.text for i in train} & {i.text for i in held}
    assert domain_items("spatial", 50, seed=0) == train[:50]
    assert domain_items("spatial", 50, seed=1) != train[:50]


def test_single_domain_items_sometimes_ask_two_questions_of_the_same_domain():
    items = domain_items("size", 400, seed=0, two_questions=0.3)
    two = [i for i in items if len(i.questions) == 2]
    assert 0.2 < len(two) / len(items) < 0.4 and all(i.kind == "size" for i in two)
    assert all(len(i.questions) == 1 for i in domain_items("size", 50, seed=0, two_questions=0.0))


def test_exact_match_ignores_spacing_and_case_only():
    item = domain_items("count", 1, seed=0)[0]
    assert exact_match(item, item.answer) and exact_match(item, "  " + item.answer.upper() + " ")
    assert not exact_match(item, item.answer + " one.")


def test_item_json_keeps_spans_and_domains():
    item = mixed_items(1, seed=5)[0]
    d = item.to_json()
    assert d["prompt"] == item.prompt and [tuple(s) for s in d["spans"]] == [(s.text, s.domain) for s in item.spans]
    assert isinstance(item, Item) and d["kind"] == "mixed"


def test_bad_requests_are_clear_errors():
    rng = random.Random(0)
    with pytest.raises(ShapesError, match="unknown domain"):
        make_question("poetry", world.sample_scene(rng), rng)
    with pytest.raises(ShapesError, match="unknown split"):
        sample_item(rng, ["count"], split="test")
    with pytest.raises(ShapesError, match="two domains"):
        mixed_items(3, seed=0, domains=["count"])


def test_foreign_items_ask_one_question_of_another_domain_and_train_only_the_own_span():
    from molora.models.families.shapes.domain_batches import encode_item, make_batch
    from molora.models.families.shapes.tokenizer import build_tiny_tokenizer
    items = domain_items("count", 300, seed=0, foreign=0.4)
    foreign = [i for i in items if len(set(i.domains)) == 2]
    assert 0.3 < len(foreign) / len(items) < 0.5
    assert all("count" in i.domains and len(i.domains) == 2 for i in foreign)
    assert {i.domains.index("count") for i in foreign} == {0, 1}  # the own question comes first or second
    for item in foreign:
        for question, span in zip(item.questions, item.spans):
            assert normalise(span.text) == solve(item.scene, question)
    tok = build_tiny_tokenizer([i.text for i in foreign[:20]])
    encoded = [encode_item(tok, i) for i in foreign[:20]]
    batch = make_batch(encoded, range(20), tok.vocab.pad_id, [], only="count")
    for b, e in enumerate(encoded):
        scored = batch.target[b, e.answer_start:len(e)].tolist()
        assert scored == [d == "count" for d in e.span_domain] and any(scored) and not all(scored)


def test_style_requests_cycle_name_their_style_and_render_in_it():
    from molora.models.families.shapes.analyse import analyse_image
    from molora.models.families.shapes.styles import (
        NEGATIVE_COLOUR,
        STYLE_WORDS,
        STYLES,
        drawn_style,
        style_items,
    )
    from molora.models.families.shapes.world import render
    items = style_items(9, seed=0, split="heldout")
    assert [it.style for it in items] == list(STYLES) * 3 == ["outline", "filled", "negative"] * 3
    assert items == style_items(9, seed=0, split="heldout")  # seeded
    for it in items:
        words = it.prompt.split()
        asked = it.scene.objects[0]
        assert sum(w in words for w in STYLE_WORDS[it.style]) == 1 and asked.colour in words
        assert not any(w in words for other in STYLE_WORDS if other != it.style for w in STYLE_WORDS[other])
        drawn = it.drawn.objects[0]
        assert (drawn.shape, drawn.size, drawn.cell) == (asked.shape, asked.size, asked.cell)
        assert drawn.colour == (NEGATIVE_COLOUR[asked.colour] if it.style == "negative" else asked.colour)
        assert drawn_style(analyse_image(render(it.drawn)), it) == it.style  # the exact reader tells all three apart
        assert it.adapter == {"outline": "outline", "filled": "filled", "negative": "negative"}[it.style]


def test_negative_colours_pair_every_colour_with_another():
    from molora.models.families.shapes.styles import NEGATIVE_COLOUR
    from molora.models.families.shapes.world import COLOURS
    assert sorted(NEGATIVE_COLOUR) == sorted(COLOURS)
    assert all(NEGATIVE_COLOUR[NEGATIVE_COLOUR[c]] == c != NEGATIVE_COLOUR[c] for c in COLOURS)


def test_drawn_style_says_none_for_an_empty_picture_or_a_third_colour():
    from molora.models.families.shapes.analyse import analyse_image
    from molora.models.families.shapes.styles import NEGATIVE_COLOUR, drawn_style, style_items
    from molora.models.families.shapes.world import BACKGROUND_RGB, COLOURS, Scene, render
    item = style_items(3, seed=1, split="heldout")[2]
    asked = item.scene.objects[0]
    third = next(c for c in COLOURS if c not in (asked.colour, NEGATIVE_COLOUR[asked.colour]))
    blank = Image.new("RGB", (64, 64), BACKGROUND_RGB["white"])
    assert drawn_style(analyse_image(blank), item) is None
    assert drawn_style(analyse_image(render(Scene((replace(asked, colour=third),)))), item) is None
