"""RunView (app/render.py): events in, page values out, without a server or a browser."""

from __future__ import annotations

from PIL import Image

from app.render import BASE_COLOR, BASE_LABEL, IMAGE_TOKEN_GLYPH, RunView, color_map, sparkline
from models.document import Document, TokenRecord
from models.events import Finished, ImageDone, ImageProgress, ImageStarted, Notice, StepTiming, TextDelta


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
    assert view.text == "Arr, [image 1]"
    assert view.images == [image]
    assert view.routing_map()[:2] == [("Arr, ", "pirate"), ("", "mine")]
    assert view.routing_map()[2:] == [(IMAGE_TOKEN_GLYPH, "outline")] * 257
    html = view.document_html()
    assert "data:image/png;base64," in html and "<progress" not in html
    stats = view.stats_html({"slots": ["pirate", None], "hits": 3, "misses": 1, "evictions": 0},
                            color_map(["pirate"]), "done")
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
    colors = color_map(["a", "b", "a"])
    assert colors[BASE_LABEL] == BASE_COLOR and list(colors) == [BASE_LABEL, "a", "b"]
    assert colors["a"] != colors["b"]
    assert sparkline([1.0]) == "" and "<polyline" in sparkline([1.0, 2.0, 3.0])


def test_an_image_cut_off_by_the_token_budget_leaves_no_progress_bar_behind():
    view = RunView(label_of=label_of)
    view.apply(TextDelta("Draw:", [9], [None]))
    view.apply(ImageStarted(0))
    view.apply(ImageProgress(0, 32, 256))
    view.apply(Notice("image 0 was cut off after 40 of 256 tokens by the token budget and left out"))
    view.apply(Finished(Document(parts=["Draw:"]), reason="length"))
    assert view.text == "Draw:" and "<progress" not in view.document_html() and view.finish_reason == "length"
