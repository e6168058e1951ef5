"""Turning the pipeline's event stream into what the page shows.

`RunView` folds events (models/events.py) into one run's picture: the interleaved document so far (text, finished
images, a progress bar for the image being drawn), the token-level routing map (every generated token with the
adapter that produced it), the images, and the per-step latencies. Its methods return plain values for Gradio
components (HTML strings, (token, label) lists), so the view is testable without a browser.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from PIL import Image

from models.events import (
    Finished,
    ImageDone,
    ImageProgress,
    ImageStarted,
    Notice,
    Redraw,
    StepTiming,
    TextDelta,
)

BASE_LABEL = "base (no adapter)"
BASE_COLOR = "#cbd5e1"
# Distinct on white and in the dark theme; the first two go to the shipped text/image adapters.
PALETTE = ("#f59e0b", "#38bdf8", "#34d399", "#f472b6", "#a78bfa", "#fb7185", "#facc15", "#2dd4bf", "#fb923c")
IMAGE_TOKEN_GLYPH = "■"
IMAGE_SCALE = 3  # 64x64 images are shown at 192x192, pixelated, so the shapes stay crisp


def color_map(adapter_labels: Iterable[str]) -> dict[str, str]:
    """A stable colour per adapter label (in the given order), plus grey for the base model."""
    colors = {BASE_LABEL: BASE_COLOR}
    for i, label in enumerate(dict.fromkeys(adapter_labels)):
        colors[label] = PALETTE[i % len(PALETTE)]
    return colors


def image_data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class _ImageSlot:
    index: int
    done: int = 0
    total: int = 0
    image: Image.Image | None = None
    data_uri: str | None = None  # encoded once: the document view is re-rendered on every refresh


@dataclass
class RunView:
    """One generation's state as seen by the UI, updated event by event.

    `label_of` maps an internal adapter name (or None) to what the visitor sees. While streaming, the routing map
    is built from the events; when the document is finished it is rebuilt from `Document.routing`, which also
    holds the special tokens (<boi>, <eoi>, <eos>) and the pieces of tokens that ended inside a character.
    """

    label_of: Callable[[str | None], str]
    prompt: str = ""  # shown, muted, before the generated parts so the document reads as a whole
    parts: list[str | _ImageSlot] = field(default_factory=list)
    tokens: list[tuple[str, str]] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    document: object | None = None
    finish_reason: str | None = None
    candidate: int = 0  # best-of-n: the candidate being drawn (a Redraw event starts the next)
    best_of: int = 1

    # --- folding events ------------------------------------------------------------------------
    def apply(self, event: object) -> bool:
        """Fold one event in; return True when the page should be refreshed for it."""
        if isinstance(event, TextDelta):
            self._add_text(event)
            return True
        if isinstance(event, ImageStarted):
            self.parts.append(_ImageSlot(event.index))
            return True
        if isinstance(event, ImageProgress):
            slot = self._slot(event.index)
            slot.done, slot.total = event.done, event.total
            return True
        if isinstance(event, ImageDone):
            slot = self._slot(event.index)
            slot.image = event.image
            slot.data_uri = image_data_uri(event.image)
            slot.done = slot.total = max(slot.total, len(event.adapters))
            labels = [self.label_of(name) for name in event.adapters]
            self.tokens.extend((IMAGE_TOKEN_GLYPH, label) for label in labels)
            return True
        if isinstance(event, StepTiming):
            self.step_ms.append(float(event.ms))
            return False
        if isinstance(event, Notice):
            self.notices.append(event.message)
            return True
        if isinstance(event, Redraw):  # best-of-n: the check rejected what is shown; the next candidate starts
            self.parts, self.tokens, self.candidate, self.best_of = [], [], event.candidate, event.best_of
            return True
        if isinstance(event, Finished):
            self.document = event.document
            self.finish_reason = event.reason
            # the document kept: best-of-n may keep an earlier candidate than the one shown, and an image the token
            # budget cut off is left out of the document (a Notice says so)
            shown = {id(p.image): p.data_uri for p in self.parts if isinstance(p, _ImageSlot)}
            self.parts = []
            for part in event.document.parts:
                if isinstance(part, str):
                    self.parts.append(part)
                else:
                    index = sum(isinstance(p, _ImageSlot) for p in self.parts)
                    self.parts.append(_ImageSlot(index, 1, 1, part, shown.get(id(part)) or image_data_uri(part)))
            self.tokens = [(IMAGE_TOKEN_GLYPH if record.modality == "image" else record.piece,
                            self.label_of(record.adapter)) for record in event.document.routing]
            return True
        return False

    def _add_text(self, event: TextDelta) -> None:
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += event.text
        else:
            self.parts.append(event.text)
        # a delta carries one token (or none: the tail of a character); its text goes with its first token
        pieces = [event.text] + [""] * (len(event.token_ids) - 1)
        for piece, name in zip(pieces, event.adapters):
            self.tokens.append((piece, self.label_of(name)))

    def _slot(self, index: int) -> _ImageSlot:
        for part in reversed(self.parts):
            if isinstance(part, _ImageSlot) and part.index == index:
                return part
        slot = _ImageSlot(index)
        self.parts.append(slot)
        return slot

    # --- values for components -----------------------------------------------------------------
    @property
    def images(self) -> list[Image.Image]:
        return [part.image for part in self.parts if isinstance(part, _ImageSlot) and part.image is not None]

    @property
    def text(self) -> str:
        """The document as plain text, with a marker where each image sits."""
        out = []
        for part in self.parts:
            out.append(part if isinstance(part, str) else f"[image {part.index + 1}]")
        return "".join(out)

    def routing_map(self) -> list[tuple[str, str]]:
        return list(self.tokens)

    def document_html(self) -> str:
        """The interleaved document: escaped text, finished images, and a progress bar for the one being drawn."""
        out = ['<div class="molora-doc">']
        if self.prompt:
            out.append(f'<span class="molora-prompt">{html.escape(self.prompt)}</span>')
        if not self.parts:
            out.append('<span class="molora-empty"> …</span>')
        for part in self.parts:
            if isinstance(part, str):
                out.append(f'<span class="molora-text">{html.escape(part)}</span>')
            elif part.image is not None:
                size = part.image.width * IMAGE_SCALE
                out.append(
                    f'<figure class="molora-figure"><img class="molora-image" alt="image {part.index + 1}" '
                    f'width="{size}" height="{size}" src="{part.data_uri or image_data_uri(part.image)}" '
                    f'style="image-rendering: pixelated"><figcaption>image {part.index + 1}</figcaption></figure>')
            else:
                total = max(part.total, 1)
                out.append(
                    f'<figure class="molora-figure molora-drawing"><progress max="{total}" value="{part.done}">'
                    f'</progress><figcaption>drawing image {part.index + 1}: {part.done}/{part.total or "?"} '
                    'tokens</figcaption></figure>')
        out.append("</div>")
        return "".join(out)

    def stats_html(self, cache: dict | None, colors: dict[str, str], status: str) -> str:
        """Hot-set cache slots and counters, the per-step latency (summary + sparkline), and a status line."""
        rows = [f'<div class="molora-status">{html.escape(status)}</div>']
        rows += [f'<div class="molora-notice">{html.escape(message)}</div>' for message in self.notices]
        if cache:
            chips = []
            for i, name in enumerate(cache.get("slots", [])):
                label = self.label_of(name) if name is not None else "empty"
                color = colors.get(label, "#e5e7eb")
                chips.append(f'<span class="molora-slot" style="background:{color}">slot {i}: '
                             f'{html.escape(label)}</span>')
            counters = " · ".join(f"{key} {cache[key]}" for key in ("hits", "misses", "evictions")
                                  if key in cache)
            if "bytes_copied" in cache:
                counters += f" · copied {cache['bytes_copied'] / 1e6:.2f} MB"
            rows.append(f'<div class="molora-cache"><b>Hot-set cache</b> {"".join(chips)}'
                        f'<div>{html.escape(counters)}</div></div>')
        rows.append(f'<div class="molora-latency">{latency_summary(self.step_ms)}{sparkline(self.step_ms)}</div>')
        return "".join(rows)


def latency_summary(step_ms: list[float]) -> str:
    if not step_ms:
        return "<b>Per-step latency</b> no steps yet"
    ordered = sorted(step_ms)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    mean = statistics.fmean(step_ms)
    return (f"<b>Per-step latency</b> {len(step_ms)} steps · median {statistics.median(step_ms):.1f} ms · "
            f"p95 {p95:.1f} ms · {1000.0 / mean:.0f} steps/s")


def sparkline(values: list[float], width: int = 320, height: int = 48) -> str:
    """An inline SVG line of the per-step times (the first step, the prefill, is usually the tallest)."""
    if len(values) < 2:
        return ""
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    return (f'<svg class="molora-spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="per-step latency"><polyline fill="none" stroke="#38bdf8" stroke-width="1.5" '
            f'points="{points}"/></svg>')
