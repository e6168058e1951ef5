"""The app's example prompts on the SHIPPED model (assets/): each shows the point of the project.

Every example is run through the app's own handler, exactly as clicking it and pressing Generate does (the page's
default settings, the example's seed, pirate text adapter, outline image adapter, vocabulary routing), and the
document it produces must hold both styles at once (pirate text, outlined pictures) with correct content: every
picture shows what the text before it introduced, by ShapesEval's exact analyser.
The learned router's examples (mixed questions) must get both answers right, one domain adapter per answer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from molora.app.ui import EXAMPLES, LEARNED_EXAMPLES, LEARNED_PICTURE_EXAMPLES, MoLoRAApp
from molora.models import InterleavedPipeline
from molora.models.document import Document
from molora.models.families.shapes.analyse import analyse_image
from molora.models.families.shapes.eval import document_consistency, is_outline, is_pirate
from molora.models.families.shapes.styles import STYLES, drawn_style, style_items

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def app():
    app = MoLoRAApp(InterleavedPipeline.from_pretrained(device="cpu"))
    yield app
    app.close()


def click_example(app: MoLoRAApp, row: list) -> Document:
    """The handler's inputs as the page sends them after an example click: the row's prompt, routing, start with an
    image, seed and max new tokens, every other control at its default."""
    prompt, routing, start_image, seed, max_new_tokens = row
    d = app.defaults
    state = app.sessions.new_state()
    outputs = list(app.generate(prompt, app.default_adapter("text"), app.default_adapter("image"), routing,
                                start_image, d.text.temperature, d.text.top_k,
                                d.text.top_p, d.image.temperature, min(d.image.top_k, app.codebook_size),
                                d.cfg_scale, seed, max_new_tokens, 1, state,
                                SimpleNamespace(session_hash=f"example-{seed}-{prompt[:12]}")))
    return Document.load(outputs[-1][2])  # the download offered at the end


def test_the_examples_are_distinct_and_the_first_is_the_page_default(app):
    assert len({prompt for prompt, _, _ in EXAMPLES}) == len(EXAMPLES) >= 3
    assert EXAMPLES[0][2] == 0  # the page's default seed: the first click on Generate shows the first example
    # the pickers start on the style adapters, whatever other text adapters (domains) the model ships
    assert (app.default_adapter("text"), app.default_adapter("image")) == ("pirate", "outline")


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_each_example_shows_both_adapters_in_one_document_with_correct_content(app, index):
    row = app.example_rows()[index]
    prompt = row[0]
    doc = click_example(app, row)
    assert doc.images and all(is_outline(image) for image in doc.images), "pictures in the image adapter's style"
    assert doc.text.strip() and is_pirate(doc.text), f"text in the text adapter's style: {doc.text!r}"
    verdicts = document_consistency([prompt, *doc.parts])
    assert verdicts and all(verdicts), f"a picture does not show what the text introduced: {verdicts} {doc.text!r}"


@pytest.mark.parametrize("index", range(len(LEARNED_EXAMPLES)))
def test_each_learned_example_answers_both_questions_with_two_domain_adapters(app, index):
    from molora.models.families.shapes.domains import DOMAINS, mixed_items
    row = app.learned_example_rows()[index]
    item = next((it for it in mixed_items(40, seed="app", split="heldout") if it.prompt == row[0]), None)
    assert item is not None, "the example is a held-out mixed request (its true answer is known)"
    doc = click_example(app, row)  # at the page's own budget, as a click runs it
    assert doc.text.strip() == "".join(span.text for span in item.spans).strip()
    used = {r.adapter for r in doc.routing if r.modality == "text"}
    assert len(used & set(DOMAINS)) >= 2, f"one domain adapter per answer span: {used}"


def picture_request(prompt: str):
    """The held-out style request an example is (its asked style and colour are known), or None."""
    return next((it for it in style_items(60, seed="app", split="heldout") if it.prompt == prompt), None)


@pytest.mark.parametrize("index", range(len(LEARNED_PICTURE_EXAMPLES)))
def test_each_learned_picture_example_draws_what_its_words_ask_in_the_style_they_ask(app, index):
    """Learned mode with the shipped image gates: the image picker is not used, the words pick the adapter. The
    picture must be right in content (shape, colour as the style draws it, size, place) and in style, and nothing
    but the picture follows (no fragment such as "Then a small.")."""
    row = app.picture_example_rows()[index]
    item = picture_request(row[0])
    assert item is not None, "the example is a held-out style request (its style and colour are known)"
    doc = click_example(app, row)
    assert len(doc.images) == 1 and doc.text.strip() == "", f"a picture alone: {doc.text!r}"
    reading = analyse_image(doc.images[0])
    assert drawn_style(reading, item) == item.style
    want = item.drawn.objects[0]
    assert [(o.shape, o.colour, o.size, o.cell) for o in reading.objects] == [
        (want.shape, want.colour, want.size, want.cell)], f"{row[0]!r} drew {reading.objects}"
    drawn_by = {r.adapter for r in doc.routing if r.modality == "image"}
    assert drawn_by == {item.adapter}


def test_the_picture_examples_ask_for_every_style():
    assert sorted(picture_request(p).style for p, _ in LEARNED_PICTURE_EXAMPLES) == sorted(STYLES)
