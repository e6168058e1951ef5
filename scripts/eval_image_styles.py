"""Per-picture learned routing among image adapters: does each picture come out in the style its words asked for?

Held-out requests (models/families/shapes/styles.py, split "heldout"), a third "outlined"/"hollow", a third
"filled"/"solid", a third "negative"/"inverted". Each row generates the pictures with the model's defaults and a
fixed seed, and ShapesEval's exact reader judges the style (models/families/shapes/styles.drawn_style); `content` also checks
the picture shows what the style draws for the words (shape, size, cell; the named colour, or its complement for
"negative").

    one picture        the sentence -> one picture
    second picture     a document that already holds a picture in ANOTHER style, then the sentence -> the
                       second picture (per-picture routing inside one document)

Rows: base (no adapter: filled), outline everywhere (vocabulary routing to the outline LoRA: what a per-request
choice gives a document that mixes styles), oracle (the requested style's expert for the request), and learned
(the router's image gates pick per picture from the words; text gates as shipped).

    python scripts/eval_image_styles.py --json benchmarks/image_styles_eval.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.shapes import world  # noqa: E402
from molora.models.families.shapes.analyse import analyse_image  # noqa: E402
from molora.models.families.shapes.eval import score_text_to_image  # noqa: E402
from molora.models.families.shapes.prompts import EvalPrompt  # noqa: E402
from molora.models.families.shapes.styles import STYLES, StyleItem, drawn_style, style_items  # noqa: E402
from molora.models.pipeline import InterleavedPipeline  # noqa: E402

log = logging.getLogger("eval_image_styles")
ROWS = ("base", "outline everywhere", "oracle (requested style's expert)", "learned image gates")


def prompts(items: list[StyleItem], second: bool) -> list[list]:
    """One prompt per item: its sentence, or (second) another request's sentence and picture in another style,
    then its sentence (style_items cycles the styles, so the request after item i asks for another one)."""
    if not second:
        return [[it.prompt] for it in items]
    firsts = style_items(len(items) + 1, seed="eval-first", split="heldout")
    return [[first.prompt, world.render(first.drawn), it.prompt] for it, first in zip(items, firsts[1:])]


def run_row(pipe: InterleavedPipeline, items: list[StyleItem], batch: list[list], routing: str,
            image_adapter, seed: int) -> dict:
    adapters = image_adapter if isinstance(image_adapter, list) else [image_adapter] * len(items)
    t0 = time.time()
    docs = pipe.generate(batch, routing=routing, image_adapter=adapters, text_adapter=None,
                         max_new_tokens=pipe.vocab.image_span_tokens + 1, max_images=1, seed=seed,
                         start_image=True)
    style_ok, content_ok = [], []
    for item, doc in zip(items, docs):
        pictures = doc.images
        picture = pictures[0] if pictures else None
        style_ok.append(picture is not None and drawn_style(analyse_image(picture), item) == item.style)
        content_ok.append(score_text_to_image(EvalPrompt("text_to_image", item.prompt, item.drawn), picture))
    n = len(items)
    per_style = {}
    for style in STYLES:
        asked = [ok for ok, it in zip(style_ok, items) if it.style == style]
        per_style[f"style_{style}"] = round(sum(asked) / max(1, len(asked)), 4)
    return {"style": round(sum(style_ok) / n, 4), "content": round(sum(content_ok) / n, 4), **per_style,
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the repo's assets)")
    p.add_argument("--n", type=int, default=99, help="held-out requests (a third of each style)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                   help="which rows to run (default: all)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    pipe = InterleavedPipeline.from_pretrained(args.model, device=args.device)
    if pipe.image_gates is None:
        raise SystemExit("no image gates are loaded (train them: scripts/train_image_router.py)")
    items = style_items(args.n, seed="eval", split="heldout")
    rows: dict = {}
    for kind, second in (("one picture", False), ("second picture", True)):
        batch = prompts(items, second)
        settings = {"base": ("none", None), "outline everywhere": ("vocab", "outline"),
                    "oracle (requested style's expert)": ("vocab", [it.adapter for it in items]),
                    "learned image gates": ("learned", None)}
        rows[kind] = {name: run_row(pipe, items, batch, *settings[name], args.seed) for name in args.rows}
        for name, r in rows[kind].items():
            log.info("%s / %s: %s", kind, name, r)
    config_path = (args.model or Path(__file__).resolve().parents[1] / "assets") / "router" / "config.json"
    section = json.loads(config_path.read_text()).get("image_gates", {}) if config_path.is_file() else {}
    results = {"rows": rows, "setup": {"n": args.n, "seed": args.seed, "split": "heldout",
                                       "image_gates_context_decays": list(pipe.image_gates.context_decays),
                                       "image_gates": {k: section[k] for k in ("steps", "second", "val") if k in section},
                                       "device": device_name(args.device), "torch": torch.__version__,
                                       "threads": torch.get_num_threads()}}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    lines = ["| row | one picture: style | outlined / filled / negative asked | content | second picture: style "
             "| outlined / filled / negative asked | content |", "|---|---|---|---|---|---|---|"]
    for name in rows["one picture"]:
        a, b = rows["one picture"][name], rows["second picture"][name]
        asked = [" / ".join(f"{r[f'style_{s}']:.3f}" for s in STYLES) for r in (a, b)]
        lines.append(f"| {name} | {a['style']:.3f} | {asked[0]} | {a['content']:.3f} | {b['style']:.3f} | {asked[1]} | "
                     f"{b['content']:.3f} |")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
