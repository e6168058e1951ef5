"""The shipped embedded model (assets/) loads with no path, writes text and images, and the README's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from molora.models import InterleavedPipeline
from molora.models.families.shapes.eval import analyse_image

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def embedded():
    return InterleavedPipeline.from_pretrained()


def expected_adapter(prev_id: int, vocab, text: str | None, image: str | None) -> str | None:
    """DESIGN.md §2: the position holding `prev_id` predicts the next token; <boi>, image codes and the row
    markers inside an image -> image."""
    in_image = prev_id == vocab.boi_id or vocab.is_image_code(prev_id) or vocab.is_row_end(prev_id)
    return image if in_image else text


def test_embedded_model_writes_an_image_and_pirate_text_in_one_pass(embedded):
    assert {"outline": "image", "pirate": "text"}.items() <= embedded.adapters.items()  # + the domain adapters
    doc = embedded.generate("First, a green triangle in the center:", text_adapter="pirate",
                            image_adapter="outline", routing="vocab", seed=0)
    assert len(doc.images) >= 1 and all(im.size == (64, 64) for im in doc.images)
    assert doc.text.strip(), "the model wrote no text after its image"
    reading = analyse_image(doc.images[0])
    assert reading.objects, "the generated image shows no shape"
    assert reading.style == "outline"  # the image adapter's style
    # every generated token was produced by the adapter the routing rule names
    prompt_ids = [embedded.vocab.bos_id, *embedded.tokenizer.encode_text("First, a green triangle in the center:")]
    previous = [prompt_ids[-1]] + [r.id for r in doc.routing[:-1]]
    for prev, record in zip(previous, doc.routing):
        assert record.adapter == expected_adapter(prev, embedded.vocab, "pirate", "outline"), record


def test_readme_python_example_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Python API\n.*?```python\n(.*?)```", readme, re.S)
    assert block, "README.md has no Python API example"
    monkeypatch.chdir(tmp_path)
    printed: list[tuple] = []
    exec(compile(block.group(1), "README.md", "exec"), {"print": lambda *a, **k: printed.append(a)})
    # the files land in out/ (git-ignored), and the stream prints the story, not a line per decode step
    assert (tmp_path / "out" / "circle.html").exists() and (tmp_path / "out" / "circle").is_dir()
    assert printed and not any("StepTiming" in str(line) for line in printed)


def test_a_budget_too_small_for_the_next_picture_ends_the_text_cleanly_instead_of_word_salad(embedded):
    """The engine masks <boi> once a picture no longer fits, and the model then writes its next-best words where
    the picture was due ("…added:First is added:First The background is added"). The pipeline sees the model's
    wish for a picture and ends the document before it: the tokens are exactly those of a run with room to spare."""
    prompt = "First, a red circle at the top left:"
    roomy = embedded.generate(prompt, max_new_tokens=600, seed=1)
    short = embedded.generate(prompt, max_new_tokens=300, seed=1)
    ids, roomy_ids = [r.id for r in short.routing], [r.id for r in roomy.routing]
    assert ids == roomy_ids[:len(ids)], f"the short run wrote other words than the roomy one: {short.text!r}"
    assert roomy_ids[len(ids)] == embedded.vocab.boi_id  # it stopped where the roomy run began a picture
    assert short.meta["finish_reason"] == "length" and short.text.rstrip().endswith(":")
    assert any("raise max_new_tokens" in notice for notice in short.notices)


def test_the_last_positions_end_at_a_sentence_end_when_no_picture_would_fit_after_them(embedded):
    doc = embedded.generate("First, a red circle at the top left:", max_new_tokens=1000, seed=1)
    assert doc.text.rstrip().endswith((".", ":", "!", "?")), doc.text
    assert doc.meta["finish_reason"] == "length" and any("sentence end" in n for n in doc.notices)
