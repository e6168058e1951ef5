"""The shapes world's best-of-n check: the model captions its own pictures, and the captions must agree with the text.

For each generated document, every generated picture is captioned by the same pipeline with the same routing and
adapters (greedy text, no pictures). A document passes when each picture's caption names exactly the objects the
text before it introduced (the prompt's text included), and states each object's colour and cell (a size it leaves
out is not held against the picture), by the rule ShapesEval scores documents with
(eval.document_consistency). A document without generated pictures passes; pictures given in the prompt are not
read. The check needs no renderer or analyser, only the model and the caption grammar, so it is what a
deployment can run: ShapesEval's exact analyser stays the judge.

    check = CaptionCheck(pipe)
    check(documents) -> [True, False, ...]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .eval import document_consistency, states_colour_and_cell
from .parse import ParsedObj, parse_caption

CAPTION_TOKENS = 128  # the longest caption of the world (four objects with sizes, cells, background) is ~60 tokens


class CaptionCheck:
    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def __call__(self, documents: Sequence[Any]) -> list[bool]:
        objects_by_picture = self.caption_objects(documents)
        verdicts = []
        for document in documents:
            if not document.images:
                verdicts.append(True)
                continue
            if not all(states_colour_and_cell(objects_by_picture[id(image)]) for image in document.images):
                verdicts.append(False)  # ShapesEval's image-to-text rule
                continue
            parts = [p for p in document.prompt if isinstance(p, str)] + list(document.parts)
            found = document_consistency(parts, objects_of=lambda image: objects_by_picture[id(image)])
            verdicts.append(all(found))
        return verdicts

    def caption_objects(self, documents: Sequence[Any]) -> dict[int, tuple[ParsedObj, ...]]:
        """{id(picture): the objects its caption names} for every generated picture, one batch per routing mode."""
        by_routing: dict[str, list[tuple[Image.Image, dict]]] = defaultdict(list)
        for document in documents:
            for image in document.images:
                by_routing[document.meta.get("routing", "none")].append((image, document.meta))
        objects: dict[int, tuple[ParsedObj, ...]] = {}
        for routing, jobs in by_routing.items():
            captions = self.pipe.generate([[image] for image, _ in jobs], routing=routing,
                                          text_adapter=[meta.get("text_adapter") for _, meta in jobs],
                                          image_adapter=[meta.get("image_adapter") for _, meta in jobs],
                                          seed=0, text_temperature=0.0, max_images=0, start_image=False,
                                          max_new_tokens=CAPTION_TOKENS, min_new_tokens=0, best_of=1)
            for (image, _), caption in zip(jobs, captions):
                objects[id(image)] = parse_caption(caption.text).objects
        return objects


__all__ = ["CAPTION_TOKENS", "CaptionCheck"]
