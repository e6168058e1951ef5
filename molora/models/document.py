"""Document: a generated sequence of text and images, with the adapter that produced every token.

Saved as one self-contained HTML file (images inline as base64 PNG, tokens coloured by adapter, and the whole
document as JSON in a <script> block) or as Markdown with the images beside it (plus document.json).
Document.load reads either back: text, images (pixel-exact: PNG is lossless), routing, prompt and metadata.

    doc = pipe.generate("a red circle")
    doc.save_html("out/doc.html"); doc.save_markdown("out/doc")
    assert Document.load("out/doc.html").text == doc.text

A document only records parts; models/engine/builder.py (the pipeline side) builds one from generated tokens, with
pictures decoded by the model family's image decode.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from molora.routing.errors import MoLoRAError

FORMAT = "molora-document"
VERSION = 1
JSON_SIDECAR = "document.json"
_SCRIPT_ID = "molora-document"
_IMG_RE = re.compile(r'<img id="(molora-[a-z-]+-\d+)"[^>]*?src="data:image/png;base64,([A-Za-z0-9+/=]*)"')
_SCRIPT_RE = re.compile(r'<script type="application/json" id="molora-document">(.*?)</script>', re.S)
# The one palette of adapter colours, for saved documents and the app alike (mid tones: dark text stays readable on
# them, in the light and the dark theme). adapter_colors() gives the request's text adapter the first colour and its
# image adapter the second, so an adapter has the same colour in the app, its download and save_html.
PALETTE = ("#f59e0b", "#38bdf8", "#34d399", "#f472b6", "#a78bfa", "#fb7185", "#facc15", "#2dd4bf", "#fb923c")
BASE_COLOR = "#cbd5e1"  # the base model (no adapter), where a colour is shown for it


def adapter_colors(text_adapter: str | None, image_adapter: str | None, others: Any = ()) -> dict[str, str]:
    """{adapter: colour}: the text adapter PALETTE[0], the image adapter PALETTE[1] (each keeps its colour when the
    other is None), every other adapter in `others` the following colours in order."""
    colors: dict[str, str] = {}
    for name, color in ((text_adapter, PALETTE[0]), (image_adapter, PALETTE[1])):
        if name is not None and name not in colors:
            colors[name] = color
    rest = iter(PALETTE[2:] * (1 + len(list(others)) // max(1, len(PALETTE) - 2)))
    for name in dict.fromkeys(others):
        if name is not None and name not in colors:
            colors[name] = next(rest)
    return colors


class DocumentError(MoLoRAError):
    """A document file that cannot be read back (not written by Document.save_*, or damaged)."""


@dataclass
class TokenRecord:
    """One generated token: its id, readable piece, modality ("text" | "image" | "special"), the adapter that
    produced it (None = base model), the index of the part it belongs to (None for <eos>), and with learned
    routing the top-k adapters and their routing weights (`mix`, e.g. (("count", 0.83), ("arith", 0.17)))."""

    id: int
    piece: str
    modality: str
    adapter: str | None
    part: int | None = None
    mix: tuple[tuple[str | None, float], ...] = ()

    def __post_init__(self) -> None:
        self.mix = tuple((None if n is None else str(n), float(w)) for n, w in self.mix)  # JSON gives lists

    def routing_note(self, labels: dict[str, str] | None = None) -> str:
        """"count" or, with learned routing, "count 0.83 · arith 0.17" (display names from `labels`)."""
        labels = labels or {}

        def label(name: str | None) -> str:
            return labels.get(name, name) if name else "base"
        if len(self.mix) > 1:
            return " · ".join(f"{label(n)} {w:.2f}" for n, w in self.mix)
        return label(self.adapter)


Part = str | Image.Image


@dataclass
class Document:
    """Ordered parts (str and PIL images) of the generated continuation, plus its prompt and routing."""

    parts: list[Part] = field(default_factory=list)
    routing: list[TokenRecord] = field(default_factory=list)
    prompt: list[Part] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """All generated text, images left out."""
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def images(self) -> list[Image.Image]:
        return [p for p in self.parts if isinstance(p, Image.Image)]

    def adapter_colors(self) -> dict[str, str]:
        """Colours of the adapters that produced this document's tokens, by `adapter_colors` (the request's text
        and image adapters from meta, then the others in order of appearance)."""
        used = list(dict.fromkeys(r.adapter for r in self.routing if r.adapter is not None))
        colors = adapter_colors(self.meta.get("text_adapter"), self.meta.get("image_adapter"), used)
        return {name: colors[name] for name in used}

    # --- JSON ---------------------------------------------------------------------------------
    def to_json_dict(self, image_ref: Any) -> dict:
        """The document as JSON-able data; `image_ref(kind, index, image)` names where an image is stored."""
        def encode(parts: list[Part], kind: str) -> list[dict]:
            out, n = [], 0
            for part in parts:
                if isinstance(part, Image.Image):
                    out.append({"type": "image", "src": image_ref(kind, n, part)})
                    n += 1
                else:
                    out.append({"type": "text", "text": part})
            return out

        return {"format": FORMAT, "version": VERSION, "prompt": encode(self.prompt, "prompt-image"),
                "parts": encode(self.parts, "image"), "routing": [asdict(r) for r in self.routing],
                "meta": self.meta, "notices": self.notices}

    @classmethod
    def from_json_dict(cls, data: dict, load_image: Any) -> Document:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DocumentError("not a MoLoRA document (missing format marker)")

        def decode(items: list[dict]) -> list[Part]:
            parts: list[Part] = []
            for item in items:
                if item.get("type") == "image":
                    parts.append(load_image(item["src"]))
                elif item.get("type") == "text":
                    parts.append(str(item["text"]))
                else:
                    raise DocumentError(f"unknown part {item!r}")
            return parts

        try:
            routing = [TokenRecord(**r) for r in data.get("routing", [])]
            return cls(decode(data.get("parts", [])), routing, decode(data.get("prompt", [])),
                       dict(data.get("meta", {})), list(data.get("notices", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise DocumentError(f"damaged document data: {exc}") from exc

    # --- HTML ---------------------------------------------------------------------------------
    def save_html(self, path: str | Path, *, color_tokens: bool = True, title: str = "MoLoRA document",
                  labels: dict[str, str] | None = None) -> Path:
        """One self-contained HTML file; Document.load(path) reads it back exactly. `labels` renames adapters in
        the page (e.g. an app's display names for internal ones); the stored routing keeps the real names."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        images: dict[str, str] = {}

        def ref(kind: str, index: int, image: Image.Image) -> str:
            key = f"molora-{kind}-{index}"
            images[key] = _png_b64(image)
            return "#" + key

        data = self.to_json_dict(ref)
        colors = self.adapter_colors() if color_tokens else {}
        labels = labels or {}
        body = [f"<h1>{html.escape(title)}</h1>"]
        if self.prompt:
            body.append('<section class="prompt"><h2>Prompt</h2>')
            body += _render_parts(self.prompt, "prompt-image", images, [], {})
            body.append("</section>")
        body.append('<section class="document">')
        body += _render_parts(self.parts, "image", images, self.routing, colors, labels)
        body.append("</section>")
        if colors:
            legend = " ".join(f'<span class="tok" style="background:{c}">{html.escape(labels.get(n, n))}</span>'
                              for n, c in colors.items())
            body.append(f'<p class="legend">Adapters: {legend} <span class="tok">base model</span></p>')
        for notice in self.notices:
            body.append(f'<p class="notice">{html.escape(notice)}</p>')
        payload = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
        page = _HTML_TEMPLATE.format(title=html.escape(title), body="\n".join(body), payload=payload)
        path.write_text(page, encoding="utf-8")
        return path

    # --- Markdown -----------------------------------------------------------------------------
    def save_markdown(self, directory: str | Path) -> Path:
        """document.md with image_<k>.png beside it, plus document.json for Document.load. Returns the .md path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)

        def ref(kind: str, index: int, image: Image.Image) -> str:
            name = f"{kind.replace('-', '_')}_{index}.png"
            image.save(directory / name, format="PNG")
            return name

        data = self.to_json_dict(ref)
        lines = []
        # text is escaped so generated "<script>" stays text in Markdown viewers; document.json keeps it exact
        if data["prompt"]:
            lines.append("**Prompt:** " + " ".join(
                html.escape(p["text"], quote=False) if p["type"] == "text" else f"![prompt image]({p['src']})"
                for p in data["prompt"]))
            lines.append("")
        images = 0
        for part in data["parts"]:
            if part["type"] == "text":
                lines.append(html.escape(part["text"], quote=False))
            else:
                images += 1
                lines.append(f"\n![image {images}]({part['src']})\n")
        for notice in self.notices:
            lines.append(f"\n> {notice}")
        (directory / JSON_SIDECAR).write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
        md = directory / "document.md"
        md.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return md

    # --- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Document:
        """Read a document saved by save_html (the .html) or save_markdown (its directory, .md or .json)."""
        path = Path(path)
        if path.is_dir():
            path = path / JSON_SIDECAR
        elif path.suffix.lower() == ".md":
            path = path.parent / JSON_SIDECAR
        if not path.is_file():
            raise DocumentError(f"{path} does not exist; load a .html written by save_html or the directory "
                                "written by save_markdown")
        if path.suffix.lower() in (".html", ".htm"):
            page = path.read_text(encoding="utf-8")
            match = _SCRIPT_RE.search(page)
            if match is None:
                raise DocumentError(f"{path} has no embedded MoLoRA document (not written by Document.save_html)")
            images = dict(_IMG_RE.findall(page))

            def load_image(src: str) -> Image.Image:
                key = src.lstrip("#")
                if key not in images:
                    raise DocumentError(f"{path}: image {key} is missing from the page")
                return _png_from_b64(images[key])

            return cls.from_json_dict(_parse_json(match.group(1), path), load_image)
        base = path.parent

        def load_file(src: str) -> Image.Image:
            image_path = base / src
            if not image_path.is_file() or Path(src).name != src:
                raise DocumentError(f"{path}: image file {src} is missing")
            with Image.open(image_path) as im:
                return im.convert("RGB") if im.mode not in ("RGB", "RGBA", "L") else im.copy()

        return cls.from_json_dict(_parse_json(path.read_text(encoding="utf-8"), path), load_file)


# --- rendering helpers -------------------------------------------------------------------------------

def _png_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _png_from_b64(data: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as im:
            im.load()
            return im.copy()
    except Exception as exc:  # PIL raises several types on damaged data
        raise DocumentError(f"an embedded image is not a valid PNG: {exc}") from exc


def _parse_json(text: str, path: Path) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DocumentError(f"{path}: the embedded document JSON is damaged ({exc})") from exc


def _render_parts(parts: list[Part], kind: str, images: dict[str, str], routing: list[TokenRecord],
                  colors: dict[str, str], labels: dict[str, str] | None = None) -> list[str]:
    labels = labels or {}
    out, n = [], 0
    for index, part in enumerate(parts):
        if isinstance(part, Image.Image):
            key = f"molora-{kind}-{n}"
            n += 1
            counts = Counter(r.adapter for r in routing if r.part == index and r.modality == "image")
            adapter = counts.most_common(1)[0][0] if counts else None
            style = f' style="border-color:{colors[adapter]}"' if adapter in colors else ""
            tip = f' title="adapter: {html.escape(labels.get(adapter, adapter))}"' if adapter else ""
            out.append(f'<figure><img id="{key}" alt="image {n}"{style}{tip} '
                       f'src="data:image/png;base64,{images[key]}"></figure>')
            continue
        records = [r for r in routing if r.part == index]
        if colors and records and "".join(r.piece for r in records) == part:
            spans = []
            for r in records:
                if not r.piece:
                    continue
                color = colors.get(r.adapter)
                style = f' style="background:{color}"' if color else ""
                tip = html.escape(f"{r.id} {r.routing_note(labels)}")
                spans.append(f'<span class="tok"{style} title="{tip}">{html.escape(r.piece)}</span>')
            out.append(f'<p class="text">{"".join(spans)}</p>')
        else:
            out.append(f'<p class="text">{html.escape(part)}</p>')
    return out


_HTML_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; line-height: 1.5; }}
.text {{ white-space: pre-wrap; }}
.prompt {{ color: #555; border-left: 3px solid #ccc; padding-left: 1rem; }}
figure {{ margin: 1rem 0; }}
figure img {{ width: 256px; image-rendering: pixelated; border: 4px solid transparent; }}
.tok {{ border-radius: 3px; }}
.legend .tok {{ padding: 0 .3rem; border: 1px solid #ccc; }}
.notice {{ color: #a60; font-size: .9rem; }}
</style>
</head>
<body>
{body}
<script type="application/json" id="molora-document">{payload}</script>
</body>
</html>
"""
