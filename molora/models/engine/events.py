"""Events streamed while a document is generated; the Python API and the Gradio app consume the same ones.

Every event carries `row`: the index of its prompt in a batched call (0 for a single prompt). With best_of > 1,
the events of each candidate stream as it decodes, a Redraw starts the next candidate of a row, and Finished
carries the document kept (which may be an earlier candidate than the last one streamed).
`adapters` lists, per token, the adapter that *produced* it (the one active at the position that predicted it;
None = base model), so a UI can colour each token by adapter; with learned routing `mixes` gives, per token, the
top-k adapters and their routing weights.

    for event in pipe.stream("a red circle"):
        if isinstance(event, TextDelta): print(event.text, end="")
        elif isinstance(event, ImageDone): event.image.save(f"image{event.index}.png")
        elif isinstance(event, Finished): doc = event.document
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from molora.models.document import Document


@dataclass
class TextDelta:
    """New text. `text` may be empty when a token ends inside a multi-byte character (it comes with the next)."""

    text: str
    token_ids: list[int]
    adapters: list[str | None]
    row: int = 0
    mixes: list[tuple[tuple[str | None, float], ...]] = field(default_factory=list)  # learned routing, per token


@dataclass
class ImageStarted:
    """The model opened image number `index` (0-based within this document) with <boi>."""

    index: int
    row: int = 0


@dataclass
class ImageProgress:
    """`done` of `total` image tokens of image `index` generated (sent once per grid row); `adapters`: the
    adapter of each image token since the previous ImageProgress of this image (so a routing map can grow while
    the picture is drawn)."""

    index: int
    done: int
    total: int
    row: int = 0
    adapters: list[str | None] = field(default_factory=list)


@dataclass
class ImageDone:
    """Image `index` finished (<eoi>) and decoded by the VQ; `adapters` covers its tokens and the <eoi>."""

    index: int
    image: Image.Image
    adapters: list[str | None]
    row: int = 0


@dataclass
class StepTiming:
    """Wall time of one decode step of the whole batch (step 0 includes the prompt's prefill)."""

    step: int
    ms: float
    batch: int = 1
    row: int = 0


@dataclass
class Notice:
    """Something the caller should know that is not an error (e.g. the prompt was truncated to fit)."""

    message: str
    row: int = 0


@dataclass
class Redraw:
    """Best-of-n (models/engine/best_of.py): the check rejected every candidate of this row so far, so candidate
    `candidate` (of at most `best_of`) is drawn from here on. A UI clears what it showed of the last candidate;
    `rejected` is that candidate's document (its meta["check"] says why the check turned it down, where the check
    records it), so a UI can still show it as a rejected draft."""

    candidate: int
    best_of: int
    row: int = 0
    rejected: Document | None = None


@dataclass
class Finished:
    """The document of `row` is complete (eos, token budget or stop)."""

    document: Document
    row: int = 0
    reason: str = field(default="eos")


Event = TextDelta | ImageStarted | ImageProgress | ImageDone | StepTiming | Notice | Redraw | Finished
