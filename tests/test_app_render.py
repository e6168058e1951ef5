"""RunView (app/render.py): events in, page values out, without a server or a browser."""

from __future__ import annotations

import html
import json
import re

from PIL import Image

from molora.app.render import BASE_COLOR, BASE_LABEL, IMAGE_TOKEN_GLYPH, RunView, color_map, sparkline
from molora.app.ui import best_of_status
from molora.models.document import Document, TokenRecord
from molora.models.engine.events import (
    Finished,
    ImageDone,
    ImageProgress,
    ImageStarted,
    Notice,
    Redraw,
    StepTiming,
    TextDelta,
)


def label_of(name: str | None) -> str:
    return BASE_LABEL if name is None else {"mine@abc": "mine"}.get(name, name)


def test_events_build_the_document_view_the_routing_map_and_the_latency():
    view = RunView(label_of=label_of, prompt="Draw <this>")
    assert "Draw &lt;this&gt;" in view.document_html()  # the prompt leads the document, escaped
    assert view.apply(TextDelta("Arr, ", [10], ["pirate"]))
    assert view.apply(TextDelta("", [11], ["mine@abc"]))  # a token ending inside a character: no text yet
    assert view.apply(ImageStarted(0))
    assert view.apply(ImageProgress(0, 16, 256))
    assert "<progress" in view.document_html() and "16/256" in view.document_html()
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    assert view.apply(ImageDone(0, image, ["outline"] * 256 + ["outline"]))
    assert not view.apply(StepTiming(0, 12.5))
    assert view.apply(Notice("the prompt was truncated"))
    assert view.text == "Draw <this>\nArr,\n[image 1]"  # the prompt, then each image on a line of its own
    assert view.images == [image]
    assert view.routing_map()[:2] == [("Arr, ", "pirate"), ("", "mine")]
    assert view.routing_map()[2:] == [(IMAGE_TOKEN_GLYPH, "outline")] * 257
    html = view.document_html()
    assert "data:image/png;base64," in html and "<progress" not in html
    stats = view.stats_html({"slots": ["pirate", None], "hits": 3, "misses": 1, "evictions": 0},
                            color_map("pirate", None, ["pirate"]), "done")
    assert "slot 0: pirate" in stats and "slot 1: empty" in stats and "hits 3" in stats
    assert "the prompt was truncated" in stats and "1 steps" in stats


def test_the_finished_document_replaces_the_streamed_map_with_every_token():
    view = RunView(label_of=label_of)
    view.apply(TextDelta("<b>hi</b>", [5], [None]))
    doc = Document(parts=["<b>hi</b>"], routing=[
        TokenRecord(5, "<b>hi</b>", "text", None, 0), TokenRecord(3, "<boi>", "special", "outline", 1),
        TokenRecord(900, "<img:7>", "image", "outline", 1), TokenRecord(2, "<eos>", "special", "mine@abc", None)])
    view.apply(Finished(doc))
    assert view.document is doc and view.finish_reason == "eos"
    assert view.routing_map() == [("<b>hi</b>", BASE_LABEL), ("<boi>", "outline"), (IMAGE_TOKEN_GLYPH, "outline"),
                                  ("<eos>", "mine")]
    assert "&lt;b&gt;hi&lt;/b&gt;" in view.document_html()  # model text is escaped, never markup


def test_colour_map_is_stable_and_gives_the_base_model_grey():
    colors = color_map(None, None, ["a", "b", "a"])
    assert colors[BASE_LABEL] == BASE_COLOR and list(colors) == [BASE_LABEL, "a", "b"]
    assert colors["a"] != colors["b"]


def test_the_app_and_a_saved_document_colour_each_adapter_alike(tmp_path):
    """One palette and one rule (models.document.adapter_colors): the run's text adapter first, its image adapter
    second, whatever order the app lists adapters in or the document uses them in."""
    app = color_map("pirate", "outline", ["outline", "pirate", "other"])  # the app lists adapters by name
    doc = Document(parts=[Image.new("RGB", (64, 64)), "Arr"], meta={"text_adapter": "pirate",
                                                                   "image_adapter": "outline"},
                   routing=[TokenRecord(3, "<boi>", "special", "outline", 0),
                            TokenRecord(900, "<img:7>", "image", "outline", 0),
                            TokenRecord(5, "Arr", "text", "pirate", 1)])  # the image came first
    assert doc.adapter_colors() == {"outline": app["outline"], "pirate": app["pirate"]}
    assert app["pirate"] != app["outline"]
    page = doc.save_html(tmp_path / "d.html").read_text()
    assert f'background:{app["pirate"]}' in page and f'border-color:{app["outline"]}' in page
    only_image = Document(parts=["x"], meta={"text_adapter": None, "image_adapter": "outline"},
                          routing=[TokenRecord(900, "<img:7>", "image", "outline", 0)])
    assert only_image.adapter_colors()["outline"] == color_map(None, "outline", ["outline"])["outline"]


def test_the_plain_text_keeps_parts_apart_and_starts_with_the_prompt():
    view = RunView(label_of=label_of, prompt="Draw a red circle.")
    view.apply(ImageStarted(0))
    view.apply(ImageDone(0, Image.new("RGB", (64, 64)), ["outline"]))
    view.apply(TextDelta(" Yo ho, a circle.", [5], ["pirate"]))
    view.apply(ImageStarted(1))
    view.apply(ImageDone(1, Image.new("RGB", (64, 64)), ["outline"]))
    assert view.text == "Draw a red circle.\n[image 1]\nYo ho, a circle.\n[image 2]"


def test_the_progress_bar_counts_an_image_as_the_slider_does():
    view = RunView(label_of=label_of, image_tokens=274)
    view.apply(ImageStarted(0))
    view.apply(ImageProgress(0, 17, 272))
    assert "18/274 tokens" in view.document_html()  # <boi> and 17 codes of the 274 the slider names
    assert sparkline([1.0]) == "" and "<polyline" in sparkline([1.0, 2.0, 3.0])


def test_an_image_cut_off_by_the_token_budget_leaves_no_progress_bar_behind():
    view = RunView(label_of=label_of)
    view.apply(TextDelta("Draw:", [9], [None]))
    view.apply(ImageStarted(0))
    view.apply(ImageProgress(0, 32, 256))
    view.apply(Notice("image 0 was cut off after 40 of 256 tokens by the token budget and left out"))
    view.apply(Finished(Document(parts=["Draw:"]), reason="length"))
    assert view.text == "Draw:" and "<progress" not in view.document_html() and view.finish_reason == "length"


def test_a_redraw_clears_the_view_and_finished_shows_the_candidate_kept():
    """Best-of-n: each candidate streams; the document kept may be an earlier one than the last shown."""
    first, second = Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (64, 64), (30, 30, 200))
    view = RunView(label_of=label_of)
    view.apply(TextDelta("One", [9], [None]))
    view.apply(ImageDone(0, first, ["outline"]))
    rejected = Document(parts=["One", first], meta={"check": {"passed": False, "reason": "the model's caption of "
                                                              "picture 1 (\"a blue square\") does not name ..."}})
    assert view.apply(Redraw(1, 4, rejected=rejected))
    assert (view.candidate, view.best_of, view.text, view.routing_map()) == (1, 4, "", [])
    drafts = view.rejected_html()  # the rejected candidate stays visible, with why it was rejected
    assert "candidate 1:" in drafts and "a blue square" in drafts and "data:image/png" in drafts and "One" in drafts
    view.apply(TextDelta("Two", [8], [None]))
    view.apply(ImageDone(0, second, ["outline"]))
    assert view.images == [second]
    kept = Document(parts=["One", first], routing=[TokenRecord(9, "One", "text", None, 0)])
    view.apply(Finished(kept))
    assert view.text == "One\n[image 1]" and view.images == [first] and view.routing_map() == [("One", BASE_LABEL)]
    assert "data:image/png;base64," in view.document_html()


def test_the_status_line_says_which_candidate_was_kept():
    assert best_of_status(None) == "" and best_of_status({"n": 1, "verdicts": [True], "candidate": 0}) == ""
    assert "kept candidate 2 of 2 drawn" in best_of_status({"n": 4, "verdicts": [False, True], "candidate": 1})
    assert "none of 4 candidates passed" in best_of_status({"n": 4, "verdicts": [False] * 4, "candidate": 0})


def test_an_image_is_one_number_explained_the_same_everywhere(tiny_pipeline):
    vocab = tiny_pipeline.vocab
    assert vocab.image_span_tokens == vocab.tokens_per_image + 2 == 274  # 16 rows of 16 codes + a row end, <boi>, <eoi>
    assert vocab.image_span_note() == "an image is 274 tokens: <boi>, 256 codes and 16 row ends, <eoi>"


def test_learned_routing_labels_each_token_by_its_top_one_with_its_weights_as_hover_text(tmp_path):
    view = RunView(label_of=label_of)
    view.apply(TextDelta(" large", [40], ["size"], mixes=[(("size", 0.6628), ("arith", 0.211))]))
    view.apply(TextDelta(" three", [41], ["count"], mixes=[(("count", 0.52), (None, 0.31))]))
    view.apply(TextDelta(".", [42], ["count"]))  # static routing: the adapter alone
    # one legend chip per adapter, not one per weight combination
    assert view.routing_map() == [(" large", "size"), (" three", "count"), (".", "count")]
    colors = {"size": "#0f0", "count": "#f00", "arith": "#00f", BASE_LABEL: BASE_COLOR}
    assert view.routing_colors(colors) == colors
    tips = re.search(r'data-tips="([^"]*)"', view.routing_tips_html()).group(1)
    assert json.loads(html.unescape(tips)) == [[" large", "size .66 · arith .21"],
                                               [" three", f"count .52 · {BASE_LABEL} .31"], [".", ""]]
    # the document keeps the weights (JSON round trip) and its HTML shows them on hover
    record = TokenRecord(40, " large", "text", "size", 0, (("size", 0.6628), ("arith", 0.211)))
    doc = Document([" large"], [record])
    path = doc.save_html(tmp_path / "d.html")
    assert Document.load(path).routing[0].mix == (("size", 0.6628), ("arith", 0.211))
    assert 'title="40 size 0.66 · arith 0.21"' in path.read_text()
