"""Turning the pipeline's event stream into what the page shows.

`RunView` folds events (models/engine/events.py) into one run's picture: the interleaved document so far (text, finished
images, a progress bar for the image being drawn), the token-level routing map (every generated token with the
adapter that produced it), the images, and the per-step latencies. Its methods return plain values for Gradio
components (HTML strings, (token, label) lists), so the view is testable without a browser.
"""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from PIL import Image

from molora.models.document import BASE_COLOR, adapter_colors
from molora.models.engine.events import (
    Event,
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
IMAGE_TOKEN_GLYPH = "■"
IMAGE_SCALE = 3  # 64x64 images are shown at 192x192, pixelated, so the shapes stay crisp


def color_map(text_label: str | None, image_label: str | None, adapter_labels: Iterable[str]) -> dict[str, str]:
    """Colours by the documents' own rule (models.document.adapter_colors: the run's text adapter first, its image
    adapter second, the rest after), so the page and the downloaded document agree; grey for the base model."""
    return {BASE_LABEL: BASE_COLOR, **adapter_colors(text_label, image_label, adapter_labels)}


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
    mapped: int = 0  # its tokens already on the routing map


@dataclass
class _Draft:
    candidate: int
    text: str
    images: list[Image.Image]
    reason: str


def rejection_reason(document: object | None) -> str:
    """Why best-of-n turned a candidate down, from what its check recorded in the document's meta["check"]."""
    check = getattr(document, "meta", {}).get("check") if document is not None else None
    if not check:
        return "the check did not pass it"
    return str(check.get("reason") or "the check did not pass it")


@dataclass
class RunView:
    """One generation's state as seen by the UI, updated event by event.

    `label_of` maps an internal adapter name (or None) to what the visitor sees. While streaming, the routing map
    is built from the events; when the document is finished it is rebuilt from `Document.routing`, which also
    holds the special tokens (<boi>, <eoi>, <eos>) and the pieces of tokens that ended inside a character.
    """

    label_of: Callable[[str | None], str]
    prompt: str = ""  # shown, muted, before the generated parts so the document reads as a whole
    image_tokens: int = 0  # what a whole image span costs (<boi> + codes + row ends + <eoi>); 0 = unknown
    parts: list[str | _ImageSlot] = field(default_factory=list)
    tokens: list[tuple[str, str]] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    document: object | None = None
    finish_reason: str | None = None
    candidate: int = 0  # best-of-n: the candidate being drawn (a Redraw event starts the next)
    best_of: int = 1
    rejected: list[_Draft] = field(default_factory=list)  # best-of-n: the candidates the check turned down
    tips: dict[int, str] = field(default_factory=dict)  # learned routing: token index -> "count .83 · arith .17"

    # --- folding events ------------------------------------------------------------------------
    def apply(self, event: Event) -> bool:
        """Fold one event in; return True when the page should be refreshed for it."""
        if isinstance(event, TextDelta):
            self._add_text(event)
            return True
        if isinstance(event, ImageStarted):
            self.parts.append(_ImageSlot(event.index))
            return True
        if isinstance(event, ImageProgress):  # the map grows row by row while the picture is drawn
            slot = self._slot(event.index)
            slot.done, slot.total = event.done, event.total
            self.tokens.extend((IMAGE_TOKEN_GLYPH, self.label_of(name)) for name in event.adapters)
            slot.mapped += len(event.adapters)
            return True
        if isinstance(event, ImageDone):
            slot = self._slot(event.index)
            slot.image = event.image
            slot.data_uri = image_data_uri(event.image)
            slot.done = slot.total = max(slot.total, len(event.adapters))
            labels = [self.label_of(name) for name in event.adapters[slot.mapped:]]
            self.tokens.extend((IMAGE_TOKEN_GLYPH, label) for label in labels)
            slot.mapped = len(event.adapters)
            return True
        if isinstance(event, StepTiming):
            self.step_ms.append(float(event.ms))
            return False
        if isinstance(event, Notice):
            self.notices.append(event.message)
            return True
        if isinstance(event, Redraw):  # best-of-n: the check rejected what is shown; the next candidate starts
            self.rejected.append(_Draft(self.candidate, self._plain(self.parts), self.images,
                                        rejection_reason(event.rejected)))
            self.parts, self.tokens, self.candidate, self.best_of = [], [], event.candidate, event.best_of
            self.tips = {}
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
            self.tokens, self.tips = [], {}
            for record in event.document.routing:
                self._add_token(IMAGE_TOKEN_GLYPH if record.modality == "image" else record.piece, record.adapter,
                                record.mix)
            return True
        return False

    def _add_text(self, event: TextDelta) -> None:
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += event.text
        else:
            self.parts.append(event.text)
        # a delta carries one token (or none: the tail of a character); its text goes with its first token
        pieces = [event.text] + [""] * (len(event.token_ids) - 1)
        mixes = event.mixes or [()] * len(pieces)
        for piece, name, mix in zip(pieces, event.adapters, mixes):
            self._add_token(piece, name, mix)

    def _add_token(self, piece: str, name: str | None, mix: tuple[tuple[str | None, float], ...] = ()) -> None:
        """A token on the routing map, labelled by its adapter (learned routing: its top-1, so the legend has one
        chip per adapter); with learned routing its top-k adapters and weights ("count .83 · arith .17", averaged
        over blocks) become the token's hover text (`routing_tips_html`)."""
        if len(mix) >= 2:
            self.tips[len(self.tokens)] = " · ".join(f"{self.label_of(n)} {w:.2f}".replace(" 0.", " .")
                                                     for n, w in mix)
        self.tokens.append((piece, self.label_of(name)))

    def routing_colors(self, colors: dict[str, str]) -> dict[str, str]:
        """The routing map's colours: one per adapter label (learned routing's tokens are labelled by their
        top-1 adapter, so no label is added)."""
        return dict(colors)

    def routing_tips_html(self) -> str:
        """Hidden data for the page's script (ROUTING_TIPS_JS in app/ui.py), which puts each learned-routing
        token's weights in its hover text; sent with each routing map (an empty list clears the last run's)."""
        tips = [[piece, self.tips.get(i, "")] for i, (piece, _) in enumerate(self.tokens)] if self.tips else []
        return f'<div hidden class="molora-routing-tips" data-tips="{html.escape(json.dumps(tips))}"></div>'

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
        """The prompt (a line of its own) and the document as plain text, each image as an "[image k]" line."""
        body = self._plain(self.parts)
        return f"{self.prompt}\n{body.lstrip(' ')}" if self.prompt and body else self.prompt or body

    @staticmethod
    def _plain(parts: list) -> str:
        """Text parts as they are; each image on a line of its own, so "[image 1]" never runs into the text."""
        out, after_image = "", False
        for part in parts:
            if isinstance(part, str):
                out += part.lstrip(" ") if after_image else part
                after_image = False
            else:
                out = out.rstrip(" ")
                out += ("\n" if out and not out.endswith("\n") else "") + f"[image {part.index + 1}]\n"
                after_image = True
        return out.rstrip("\n") if after_image else out

    def rejected_html(self) -> str:
        """Best-of-n: each candidate the check turned down, with its text, pictures and the reason."""
        if not self.rejected:
            return ""
        out = [f'<div class="molora-drafts"><b>Rejected drafts ({len(self.rejected)})</b>']
        for draft in self.rejected:
            pictures = "".join(
                f'<img class="molora-draft-image" alt="draft {draft.candidate + 1} image {i + 1}" '
                f'src="{image_data_uri(image)}" width="{image.width * 2}" style="image-rendering: pixelated">'
                for i, image in enumerate(draft.images))
            out.append(f'<div class="molora-draft"><div>candidate {draft.candidate + 1}: '
                       f'{html.escape(draft.reason)}</div><div>{pictures}</div>'
                       f'<pre class="molora-draft-text">{html.escape(draft.text)}</pre></div>')
        out.append("</div>")
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
                # counted like the whole span (<boi> + codes + row ends + <eoi>), so the bar ends at the same number
                # the max-tokens slider names
                done, total = (part.done + 1, self.image_tokens) if self.image_tokens else (part.done, part.total)
                out.append(
                    f'<figure class="molora-figure molora-drawing"><progress max="{max(total, 1)}" value="{done}">'
                    f'</progress><figcaption>drawing image {part.index + 1}: {done}/{total or "?"} '
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
