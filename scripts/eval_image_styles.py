"""Per-picture learned routing among image adapters: does each picture come out in the style its words asked for?

Held-out requests (models/families/shapes/styles.py, split "heldout", drawn from --seed: another seed, other
requests; several seeds pool theirs), a third "outlined"/"hollow", a third
"filled"/"solid", a third "negative"/"inverted". Each row generates the pictures with the model's defaults and a
fixed seed, and ShapesEval's exact reader judges the style (models/families/shapes/styles.drawn_style); `content` also checks
the picture shows what the style draws for the words (shape, size, cell; the named colour, or its complement for
"negative").

    one picture        the sentence -> one picture
    second picture     a document that already holds a picture in ANOTHER style, then the sentence -> the
                       second picture (per-picture routing inside one document), in two rows: the first picture in
                       the style after the asked one in the cycle outline -> filled -> negative and in the style
                       before it (the other order; the report also pools all six orders); also how many second
                       pictures
                       hold more objects than asked, and how many redraw the first picture's object (its shape in
                       its cell): the base model's stories keep earlier objects in later pictures

Seed "eval" (the default) is the validation seed: image-gate variants were chosen on it, so its report opens with
NOT HELD OUT (models/families/shapes/eval_seeds.py); report on test seeds. Every rate carries its 95% Wilson interval
(models/families/shapes/stats.py). --sample-seed seeds the sampling of the pictures.

Rows: base (no adapter: filled), outline everywhere (vocabulary routing to the outline LoRA: what a per-request
choice gives a document that mixes styles), oracle (the requested style's expert for the request), and learned
(the router's image gates pick per picture from the words; text gates as shipped).

    python scripts/eval_image_styles.py --seed 1 2 3 --n 99 --json benchmarks/image_styles_eval.json
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
from molora.models.families.shapes.errors import ShapesError  # noqa: E402
from molora.models.families.shapes.eval import score_text_to_image  # noqa: E402
from molora.models.families.shapes.eval_seeds import VALIDATION_SEED, check_seeds, selection_warning  # noqa: E402
from molora.models.families.shapes.prompts import EvalPrompt  # noqa: E402
from molora.models.families.shapes.stats import wilson_interval  # noqa: E402
from molora.models.families.shapes.styles import STYLES, StyleItem, drawn_style, style_items  # noqa: E402
from molora.models.pipeline import InterleavedPipeline  # noqa: E402

log = logging.getLogger("eval_image_styles")
ROWS = ("base", "outline everywhere", "oracle (requested style's expert)", "learned image gates")


# The second-picture rows: the first picture in the style after the asked one in STYLES' cycle (outline before
# filled, filled before negative, negative before outline: the only orders in the training data until stop 48),
# then in the style before it (the other three orders; scripts/train_image_router.py first_requests draws both).
SECOND_KINDS = {"second picture": 1, "second picture, other order": 2}


def requests(seeds: list[str], n: int, shift: int = 1) -> tuple[list[StyleItem], list[StyleItem]]:
    """Every seed's `n` held-out requests, pooled, and for each the request whose picture comes first in a
    second-picture row (seed "<seed>-first"; style_items cycles the styles, so first request i + shift asks for the
    style `shift` steps after request i's: 1 and 2 give the two other styles)."""
    items, firsts = [], []
    for seed in seeds:
        items += style_items(n, seed=seed, split="heldout")
        firsts += style_items(n + shift, seed=f"{seed}-first", split="heldout")[shift:]
    if shift % len(STYLES) and any(it.style == first.style for it, first in zip(items, firsts)):
        raise AssertionError("style_items no longer cycles the styles from a fixed start; pick the firsts by style")
    return items, firsts


def prompts(items: list[StyleItem], second: bool, firsts: list[StyleItem] | None = None) -> list[list]:
    """One prompt per item: its sentence, or (second) another request's sentence and picture in another style,
    then its sentence."""
    if not second:
        return [[it.prompt] for it in items]
    if firsts is None:
        firsts = style_items(len(items) + 1, seed=f"{VALIDATION_SEED}-first", split="heldout")[1:]
    return [[first.prompt, world.render(first.drawn), it.prompt] for it, first in zip(items, firsts)]


def rate(hits: list[bool]) -> dict:
    """A rate with its 95% Wilson interval: {"p", "ci95": [lo, hi], "k", "n"}."""
    k, n = sum(hits), len(hits)
    return {"p": round(k / max(1, n), 4), "ci95": [round(x, 4) for x in wilson_interval(k, n)], "k": k, "n": n}


def of_style(hits: list[bool], items: list[StyleItem], style: str) -> list[bool]:
    """The hits of the requests that asked for `style`."""
    return [h for h, it in zip(hits, items) if it.style == style]


def carried_over(reading, item: StyleItem, first: StyleItem) -> tuple[bool, bool]:
    """(more objects than the request draws, the first picture's object redrawn: its shape in its cell); a missing
    picture (reading None) neither."""
    if reading is None:
        return False, False
    extra = len(reading.objects) > len(item.drawn.objects)
    return extra, any((o.shape, o.cell) == (f.shape, f.cell) for o in reading.objects for f in first.drawn.objects)


def run_row(pipe: InterleavedPipeline, items: list[StyleItem], batch: list[list], routing: str,
            image_adapter, seed: int, firsts: list[StyleItem] | None = None) -> dict:
    """One row's rates; `firsts` (second pictures): the requests whose pictures came first."""
    adapters = image_adapter if isinstance(image_adapter, list) else [image_adapter] * len(items)
    t0 = time.time()
    docs = pipe.generate(batch, routing=routing, image_adapter=adapters, text_adapter=None,
                         max_new_tokens=pipe.vocab.image_span_tokens + 1, max_images=1, seed=seed,
                         start_image=True)
    style_ok, content_ok, adapter_ok, extra, carried = [], [], [], [], []
    for i, (item, doc) in enumerate(zip(items, docs)):
        pictures = doc.images
        picture = pictures[0] if pictures else None
        reading = analyse_image(picture) if picture is not None else None
        style_ok.append(reading is not None and drawn_style(reading, item) == item.style)
        if firsts is not None:
            more, again = carried_over(reading, item, firsts[i])
            extra.append(more)
            carried.append(again)
        content_ok.append(score_text_to_image(EvalPrompt("text_to_image", item.prompt, item.drawn), picture))
        # every generated picture token drawn by the asked style's adapter (None would be the base expert); the
        # routing records cover generated tokens only, not a second-picture prompt's given first picture
        drawn_by = {r.adapter for r in doc.routing if r.modality == "image"}
        adapter_ok.append(picture is not None and drawn_by == {item.adapter})
    n = len(items)
    per_style, ci = {}, {"style": rate(style_ok), "content": rate(content_ok), "adapter": rate(adapter_ok)}
    if firsts is not None:
        ci |= {"extra_objects": rate(extra), "first_object_again": rate(carried)}
    for style in STYLES:
        asked = of_style(style_ok, items, style)
        per_style[f"style_{style}"] = round(sum(asked) / max(1, len(asked)), 4)
        ci[f"style_{style}"] = rate(asked)
        if firsts is not None:
            ci[f"extra_objects_{style}"] = rate(of_style(extra, items, style))
            ci[f"first_object_again_{style}"] = rate(of_style(carried, items, style))
    return {"style": round(sum(style_ok) / n, 4), "content": round(sum(content_ok) / n, 4),
            "adapter": round(sum(adapter_ok) / n, 4), **per_style,
            "ci95": ci, "style_hits": "".join("1" if ok else "0" for ok in style_ok),
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the repo's assets)")
    p.add_argument("--n", type=int, default=99, help="held-out requests per seed (a third of each style)")
    p.add_argument("--seed", nargs="+", default=[VALIDATION_SEED],
                   help=f"held-out request seeds; several pool their requests (default {VALIDATION_SEED!r}: the "
                        "validation seed, not held out; report on others, e.g. --seed 1 2 3)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the pictures' sampling")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                   help="which rows to run (default: all)")
    args = p.parse_args(argv)
    try:
        seeds, held_out = check_seeds(args.seed)
    except ShapesError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    pipe = InterleavedPipeline.from_pretrained(args.model, device=args.device)
    if pipe.image_gates is None and "learned image gates" in args.rows:  # (the other rows name their adapters)
        raise SystemExit("no image gates are loaded (train them: scripts/train_image_router.py)")
    items, _ = requests(seeds, args.n)
    rows: dict = {}
    for kind, shift in (("one picture", 0), *SECOND_KINDS.items()):
        second = shift > 0
        firsts = requests(seeds, args.n, shift)[1] if second else None
        batch = prompts(items, second, firsts)
        settings = {"base": ("none", None), "outline everywhere": ("vocab", "outline"),
                    "oracle (requested style's expert)": ("vocab", [it.adapter for it in items]),
                    "learned image gates": ("learned", None)}
        rows[kind] = {name: run_row(pipe, items, batch, *settings[name], args.sample_seed, firsts if second else None)
                      for name in args.rows}
        for name, r in rows[kind].items():
            log.info("%s / %s: %s", kind, name, {k: v for k, v in r.items() if k not in ("ci95", "style_hits")})
    # the router beside the model (--model an assets folder, or its model folder: the loader's <model>/../router)
    root = args.model or Path(__file__).resolve().parents[1] / "assets"
    config_path = next((p for p in (root / "router" / "config.json", root.parent / "router" / "config.json")
                        if p.is_file()), None)
    section = json.loads(config_path.read_text()).get("image_gates", {}) if config_path is not None else {}
    results = {"rows": rows, "setup": {"n": args.n, "seeds": seeds, "held_out": held_out,
                                       "sample_seed": args.sample_seed, "split": "heldout",
                                       "image_gates_context_decays": list(pipe.image_gates.context_decays)
                                       if pipe.image_gates is not None else None,
                                       "image_gates": {k: section[k] for k in ("steps", "second", "val") if k in section},
                                       "device": device_name(args.device), "torch": torch.__version__,
                                       "threads": torch.get_num_threads()}}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(report(results))
    return results


def report(results: dict) -> str:
    """Style rates with 95% Wilson intervals (NOT HELD OUT first on a selection seed); per seed when pooled."""
    rows, setup = results["rows"], results["setup"]
    seeds = setup["seeds"]
    lines = [] if setup["held_out"] else [selection_warning(seeds), ""]
    lines += [f"Seeds {' '.join(seeds)}: {setup['n']} held-out requests per seed; 95% Wilson intervals in brackets",
              "| row | one picture: style | outlined / filled / negative asked | content | asked style's adapter "
              "| second picture: style | outlined / filled / negative asked | content | asked style's adapter |",
              "|---|---|---|---|---|---|---|---|---|"]

    def ci(r: dict, key: str) -> str:
        c = r["ci95"][key]
        return f"{c['p']:.3f} ({c['ci95'][0]:.3f}–{c['ci95'][1]:.3f})"
    for name in rows["one picture"]:
        a, b = rows["one picture"][name], rows["second picture"][name]
        asked = [" / ".join(f"{r[f'style_{s}']:.3f}" for s in STYLES) for r in (a, b)]
        lines.append(f"| {name} | {ci(a, 'style')} | {asked[0]} | {ci(a, 'content')} | {ci(a, 'adapter')} "
                     f"| {ci(b, 'style')} | {asked[1]} | {ci(b, 'content')} | {ci(b, 'adapter')} |")
    other = rows.get("second picture, other order")
    if other:
        lines += ["", "Second pictures in the other order (the first picture in the style before the asked one in "
                  "the cycle outlined -> filled -> negative), and every second picture pooled (all six orders)",
                  "| row | style | outlined / filled / negative asked | content | asked style's adapter | all orders "
                  "pooled: style |", "|---|---|---|---|---|---|"]
        for name, r in other.items():
            both = [rows["second picture"][name]["ci95"]["style"], r["ci95"]["style"]]
            k, n = sum(c["k"] for c in both), sum(c["n"] for c in both)
            lo, hi = wilson_interval(k, n)
            asked = " / ".join(f"{r[f'style_{s}']:.3f}" for s in STYLES)
            lines.append(f"| {name} | {ci(r, 'style')} | {asked} | {ci(r, 'content')} | {ci(r, 'adapter')} "
                         f"| {k / max(1, n):.3f} ({lo:.3f}–{hi:.3f}) |")
    second = rows["second picture"]
    if any("extra_objects" in r["ci95"] for r in second.values()):
        lines += ["", "Second pictures: more objects than asked / the first picture's object drawn again (its shape "
                  "in its cell)", "| row | all | outlined asked | filled asked | negative asked |",
                  "|---|---|---|---|---|"]
        for name, r in second.items():
            if "extra_objects" in r["ci95"]:
                lines.append(f"| {name} | " + " | ".join(
                    f"{r['ci95']['extra_objects' + tail]['p']:.3f} / {r['ci95']['first_object_again' + tail]['p']:.3f}"
                    for tail in ("", *(f"_{s}" for s in STYLES))) + " |")
    if len(seeds) > 1:
        n = setup["n"]
        kinds = [k for k in ("one picture", *SECOND_KINDS) if k in rows]
        lines += ["", f"Style rate per seed ({' / '.join(kinds)})", "| row | " + " | ".join(seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        for name in rows["one picture"]:
            hits = [rows[k][name]["style_hits"] for k in kinds]
            lines.append(f"| {name} | " + " | ".join(
                " / ".join(f"{h[i * n:(i + 1) * n].count('1') / n:.3f}" for h in hits) for i in range(len(seeds)))
                + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
