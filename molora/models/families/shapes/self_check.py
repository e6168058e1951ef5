"""The shapes world's best-of-n check: the model captions its own pictures, and the captions must agree with the text.

For each generated document, every generated picture is captioned by the same pipeline with the same routing and
adapters (greedy text, no pictures). A document passes when each picture's caption names exactly the objects the
text before it introduced (the prompt's text included), and states each object's colour and cell (a size it leaves
out is not held against the picture), by the rule ShapesEval scores documents with
(eval.document_consistency). A document without generated pictures passes; pictures given in the prompt are not
read. The check needs no renderer or analyser, only the model and the caption grammar, so it is what a
deployment can run: ShapesEval's exact analyser stays the judge.

    check = CaptionCheck(pipe)
    check(documents) -> [True, False, ...]   # and document.meta["check"] = {passed, reason, captions}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .eval import document_consistency, states_colour_and_cell
from .parse import parse_caption

CAPTION_TOKENS = 128  # the longest caption of the world (four objects with sizes, cells, background) is ~60 tokens


class CaptionCheck:
    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def __call__(self, documents: Sequence[Any]) -> list[bool]:
        """One verdict per document; each document's meta["check"] records it with the reason and the captions."""
        captions = self.captions(documents)
        verdicts = []
        for document in documents:
            said = [captions[id(image)] for image in document.images]
            objects = {id(image): parse_caption(caption).objects for image, caption in zip(document.images, said)}
            reason = ""
            vague = [i for i, image in enumerate(document.images) if not states_colour_and_cell(objects[id(image)])]
            if vague:  # ShapesEval's image-to-text rule
                reason = (f"the model's caption of picture {vague[0] + 1} (\"{said[vague[0]].strip()}\") does not "
                          "state each object's colour and cell")
            elif document.images:
                parts = [p for p in document.prompt if isinstance(p, str)] + list(document.parts)
                found = document_consistency(parts, objects_of=lambda image, seen=objects: seen[id(image)])
                if not all(found):
                    k = found.index(False)
                    reason = (f"the model's caption of picture {k + 1} (\"{said[k].strip()}\") does not name "
                              "exactly the objects the text introduced")
            document.meta["check"] = {"name": "shapes_caption", "passed": not reason, "reason": reason,
                                      "captions": said}
            verdicts.append(not reason)
        return verdicts

    def captions(self, documents: Sequence[Any]) -> dict[int, str]:
        """{id(picture): the model's caption of it} for every generated picture, one batch per routing mode."""
        by_routing: dict[str, list[tuple[Image.Image, dict]]] = defaultdict(list)
        for document in documents:
            for image in document.images:
                by_routing[document.meta.get("routing", "none")].append((image, document.meta))
        captions: dict[int, str] = {}
        for routing, jobs in by_routing.items():
            docs = self.pipe.generate([[image] for image, _ in jobs], routing=routing,
                                      text_adapter=[meta.get("text_adapter") for _, meta in jobs],
                                      image_adapter=[meta.get("image_adapter") for _, meta in jobs],
                                      seed=0, text_temperature=0.0, max_images=0, start_image=False,
                                      max_new_tokens=CAPTION_TOKENS, min_new_tokens=0, best_of=1)
            for (image, _), caption in zip(jobs, docs):
                captions[id(image)] = caption.text
        return captions


__all__ = ["CAPTION_TOKENS", "CaptionCheck"]
