"""DocumentBuilder: one row's generated tokens -> events (models/engine/events.py) and, at the end, its Document.

The pipeline side of a document: the builder records text and picture parts into a Document as tokens arrive; a
finished picture's ids are turned into an image by the `decode_image` the pipeline passes (the family's image
decode, InterleavedPipeline.decode_image), so models/document.py only holds and saves parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from molora.models.document import Document, Part, TokenRecord
from molora.models.engine.events import (
    Event,
    Finished,
    ImageDone,
    ImageProgress,
    ImageStarted,
    Notice,
    TextDelta,
)


class DocumentBuilder:
    """Turns one row's generated tokens into events, then into a Document.

    Text is detokenised incrementally: a token is committed once its text no longer ends inside a multi-byte
    character, so TextDelta pieces always concatenate to the document's text.
    """

    def __init__(self, tokenizer: Any, decode_image: Callable[[Sequence[int]], Image.Image], *, row: int = 0,
                 prompt: list[Part] | None = None, meta: dict | None = None, notices: list[str] | None = None,
                 image_open: bool = False) -> None:
        self.tok, self.decode_image, self.row = tokenizer, decode_image, row
        self.vocab = tokenizer.vocab
        self.doc = Document(prompt=list(prompt or []), meta=dict(meta or {}), notices=list(notices or []))
        self._text_ids: list[int] = []  # current text segment
        self._pending: list[int] = []  # its tokens whose text is not out yet (inside a character)
        self._seg_records: list[TokenRecord] = []
        self._seg_text = ""
        self._image: list[int] | None = None  # ids of the open image span
        self._image_adapters: list[str | None] = []
        self._images = 0
        rows, cols = self.vocab.image_grid
        self._row_len = cols + (1 if self.vocab.row_end_ids else 0)
        self._opened_events = [ImageStarted(0, row)] if image_open else []
        if image_open:
            self._open_image()

    @property
    def in_image(self) -> bool:
        """Whether a picture is being drawn (its <boi> came, its <eoi> not yet)."""
        return self._image is not None

    @property
    def images(self) -> int:
        """Pictures finished so far."""
        return self._images

    def text_so_far(self) -> str:
        """The text written since the last picture (or the start), whole characters only."""
        return self._seg_text

    def start(self) -> list[Event]:
        """Events due before the first token (an image opened by the prompt, notices)."""
        return [Notice(n, self.row) for n in self.doc.notices] + self._opened_events

    def add(self, token: int, adapter: str | None, mix: tuple[tuple[str | None, float], ...] = ()) -> list[Event]:
        """Record one generated token (`mix`: learned routing's top-k adapters and weights); returns the events
        it causes."""
        v = self.vocab
        if self._image is not None:
            if token == v.eoi_id:
                return self._close_image(adapter)
            self._image.append(token)
            self._image_adapters.append(adapter)
            self.doc.routing.append(TokenRecord(token, self.tok.token_piece(token), "image", adapter,
                                                len(self.doc.parts)))
            done = len(self._image)
            in_rows = done - len(v.image_prefix_ids)  # a row's progress event after its last code (or marker)
            if in_rows > 0 and in_rows % self._row_len == 0:
                adapters, self._mapped = self._image_adapters[self._mapped:], len(self._image_adapters)
                return [ImageProgress(self._images, done, v.tokens_per_image, self.row, adapters)]
            return []
        if token == v.boi_id:
            events = self._close_text()
            self._open_image()
            self.doc.routing.append(TokenRecord(token, "<boi>", "special", adapter, len(self.doc.parts)))
            return events + [ImageStarted(self._images, self.row)]
        if token == v.eos_id:
            events = self._close_text()
            self.doc.routing.append(TokenRecord(token, "<eos>", "special", adapter, None))
            return events
        return self._add_text(token, adapter, mix)

    def finish(self, reason: str) -> list[Event]:
        """Close the document (reason "eos", "length" or "stopped"); returns the last events, ending with
        Finished."""
        events = self._close_text()
        if self._image is not None:
            cause = "when the generation was stopped" if reason == "stopped" else "by the token budget"
            self.doc.notices.append(f"image {self._images + 1} was cut off after {len(self._image)} of "
                                    f"{self.vocab.tokens_per_image} tokens {cause} and left out")
            events.append(Notice(self.doc.notices[-1], self.row))
            self._image = None
        self.doc.meta["finish_reason"] = reason
        return events + [Finished(self.doc, self.row, reason)]

    # --- internals ---------------------------------------------------------------------------
    def _add_text(self, token: int, adapter: str | None, mix: tuple[tuple[str | None, float], ...]) -> list[Event]:
        part = len(self.doc.parts)
        record = TokenRecord(token, "", "text" if self._is_text(token) else "special", adapter, part, mix)
        self.doc.routing.append(record)
        self._seg_records.append(record)
        self._text_ids.append(token)
        self._pending.append(token)
        new = self.tok.decode_text(self._pending)
        if new.endswith("\ufffd") and len(self._pending) < 8:
            return [TextDelta("", [token], [adapter], self.row, [mix])]
        self._pending = []
        record.piece = new
        self._seg_text += new
        return [TextDelta(new, [token], [adapter], self.row, [mix])]

    def _close_text(self) -> list[Event]:
        events: list[Event] = []
        if self._pending:
            new = self.tok.decode_text(self._pending)
            self._pending = []
            if new:
                self._seg_records[-1].piece += new
                self._seg_text += new
                events.append(TextDelta(new, [], [], self.row))
        if self._text_ids:
            final = self.tok.decode_text(self._text_ids)
            if final != self._seg_text:  # decoding in pieces differed (invalid bytes): trust the whole
                self._seg_text = final
            if final:
                self.doc.parts.append(final)
            else:  # a segment of tokens without text (e.g. lone bytes): nothing to show
                for record in self._seg_records:
                    record.part = None
        self._text_ids, self._seg_records, self._seg_text = [], [], ""
        return events

    def _open_image(self) -> None:
        self._image, self._image_adapters, self._mapped = [], [], 0

    def _close_image(self, adapter: str | None) -> list[Event]:
        image = self.decode_image(self._image)
        part = len(self.doc.parts)
        self.doc.parts.append(image)
        self.doc.routing.append(TokenRecord(self.vocab.eoi_id, "<eoi>", "special", adapter, part))
        event = ImageDone(self._images, image, [*self._image_adapters, adapter], self.row)
        self._images += 1
        self._image = None
        return [event]

    def _is_text(self, token: int) -> bool:
        v = self.vocab
        return v.text_start <= token < v.text_start + v.text_size


__all__ = ["DocumentBuilder"]
