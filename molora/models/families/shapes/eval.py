"""ShapesEval: exact scoring of generated images and text in the shapes world, and the runner.

Reading back (exact on ground truth, tolerant of VQ blur and colour jitter):
    analyse_image(img) -> ImageReading    (analyse.py: objects with colour/shape/size/cell/style, background)
    parse_caption(text) -> ParsedText     (parse.py: objects, register, background, stated total)

Scoring (each returns a bool; "content" means every attribute the prompt or caption names is right and the
number of objects is exactly right):
    score_text_to_image(prompt, image)      the image shows the prompt's scene        (6 GenEval categories)
    score_image_to_text(scene, text)        the caption names every object with colour, shape and cell,
                                            nothing else, and any size/background it names is right
    score_interleaved(parts)                every picture shows what the text so far has introduced, and a
                                            stated total ("Now there are three shapes.") matches
    is_outline(reading) / is_pirate(parsed) style adherence of an image / a text

Runner: run_shapes_eval(pipe, n_per_category=200, conditions=None, categories=None, batch_size=32, seed=0)
-> (results dict, markdown table). It drives the generation API of CONTRACTS.md:
    pipe.generate(list_of_prompts, text_adapter=..., image_adapter=..., routing=..., seed=...)
        -> list of documents with .parts (str and PIL images, in order)
image-to-text prompts are [PIL image] (the pipeline VQ-encodes it as <boi> codes <eoi>).
Conditions (CONDITIONS): base (no adapter); image_lora / text_lora alone (vocab routing); vocab_both (both
adapters, one pass, vocabulary routing); seq_text / seq_image (per-sequence routing, the S-LoRA/PEFT
baseline: one adapter for every token); merged (one adapter holding both, per-sequence) when the pipeline
has one: an adapter whose modality is "merged" in pipe.adapters, or pipe.merge_adapters([text, image]) ->
name. Adapters are found in pipe.adapters (name -> modality "text" / "image"), or named by the caller.

CLI: molora evaluate --model assets/model --n 200 --out results.md [--json results.json]
     molora evaluate --merge gpu0.json gpu1.json --out results.md   (runs split by --conditions)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from .analyse import ImageReading, ReadObj, analyse_image
from .errors import ShapesError
from .parse import ParsedObj, ParsedText, parse_caption
from .prompts import CATEGORIES, T2I_CATEGORIES, EvalPrompt, build_prompts
from .world import Obj, Scene

__all__ = [
    "CATEGORIES", "CONDITIONS", "T2I_CATEGORIES", "Condition", "EvalPrompt", "ImageReading", "ParsedText",
    "analyse_image", "build_prompts", "default_conditions", "document_consistency", "is_outline", "is_pirate",
    "match_objects", "merge_results", "parse_caption", "results_markdown", "run_shapes_eval", "score_image_to_text",
    "score_interleaved", "score_text_to_image", "states_colour_and_cell",
]

log = logging.getLogger(__name__)

CONDITIONS: tuple[str, ...] = ("base", "image_lora", "text_lora", "vocab_both", "seq_text", "seq_image", "merged")

_FIELDS = ("shape", "colour", "size", "cell")


# ---------------------------------------------------------------------------------------------- matching


def _fits(spec: ParsedObj, obj: ReadObj | Obj | ParsedObj) -> bool:
    return all(None in (getattr(spec, f), getattr(obj, f)) or getattr(spec, f) == getattr(obj, f) for f in _FIELDS)


def match_objects(specs: Sequence[ParsedObj], objects: Sequence[ReadObj | Obj | ParsedObj]) -> bool:
    """True when the objects can be paired one to one with the specs. None is an attribute not stated, which
    matches anything: in a spec (the prompt leaves it free) or in a parsed object (a caption that does not say
    it; rendered and read objects state every attribute)."""
    if len(specs) != len(objects):
        return False
    owner: list[int] = [-1] * len(objects)  # bipartite matching (Kuhn): object j -> spec owner[j]

    def augment(i: int, seen: list[bool]) -> bool:
        for j, obj in enumerate(objects):
            if not seen[j] and _fits(specs[i], obj):
                seen[j] = True
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, [False] * len(objects)) for i in range(len(specs)))


def _as_reading(image: Image.Image | ImageReading) -> ImageReading:
    return image if isinstance(image, ImageReading) else analyse_image(image)


def _as_parsed(text: str | ParsedText) -> ParsedText:
    return text if isinstance(text, ParsedText) else parse_caption(text)


def is_outline(image: Image.Image | ImageReading) -> bool:
    return _as_reading(image).style == "outline"


def is_pirate(text: str | ParsedText) -> bool:
    return _as_parsed(text).register == "pirate"


# ----------------------------------------------------------------------------------------------- scoring


def score_text_to_image(prompt: EvalPrompt, image: Image.Image | ImageReading | None) -> bool:
    """Does the image show exactly what the instruction asks for (style aside)?"""
    if image is None:
        return False
    reading = _as_reading(image)
    if prompt.check_background and reading.background != prompt.scene.background:
        return False
    return match_objects(prompt.target(), reading.objects)


def states_colour_and_cell(objects: Iterable[ParsedObj]) -> bool:
    """A caption places what it names: every object with its colour and cell (its size may be left out)."""
    return all(o.colour is not None and o.cell is not None for o in objects)


def score_image_to_text(scene: Scene, text: str | ParsedText) -> bool:
    """Does the caption name every object of the scene (colour, shape and cell), and nothing else?"""
    parsed = _as_parsed(text)
    if not states_colour_and_cell(parsed.objects):
        return False
    if parsed.background is not None and parsed.background != scene.background:
        return False
    if parsed.total is not None and parsed.total != len(scene.objects):
        return False
    return match_objects(list(parsed.objects), scene.objects)


def document_consistency(parts: Sequence[str | Image.Image],
                         objects_of: Callable[[Image.Image], Sequence[ReadObj | ParsedObj]] | None = None
                         ) -> list[bool]:
    """For each picture in an interleaved document: does it show what the text before it introduced?

    Texts add objects (the story only ever adds), so picture k must show the union of the objects named in
    the texts before it. A closing "N shapes" total must match the last picture. `objects_of(picture)` reads a
    picture's objects: the exact analyser by default (models/families/shapes/self_check.py passes the model's captions)."""
    objects_of = objects_of or (lambda image: analyse_image(image).objects)
    named: list[ParsedObj] = []
    verdicts: list[bool] = []
    last: Sequence | None = None
    for part in parts:
        if isinstance(part, str):
            parsed = parse_caption(part)
            named.extend(parsed.objects)
            if parsed.total is not None and last is not None and verdicts:
                verdicts[-1] = verdicts[-1] and parsed.total == len(last)
        elif isinstance(part, Image.Image):
            last = objects_of(part)
            verdicts.append(bool(named) and match_objects(named, last))
        else:
            raise ShapesError(f"a document part must be str or PIL image, got {type(part).__name__}")
    return verdicts


def score_interleaved(parts: Sequence[str | Image.Image]) -> bool:
    """At least one picture, and every picture consistent with its text."""
    verdicts = document_consistency(parts)
    return bool(verdicts) and all(verdicts)


# ------------------------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Condition:
    name: str
    text_adapter: str | None
    image_adapter: str | None
    routing: str  # "none" | "vocab" | "sequence"
    expect_outline: bool  # the image-style adapter reaches image tokens
    expect_pirate: bool  # the text-style adapter reaches text tokens


def _adapter_of(pipe, modality: str) -> str | None:
    adapters = dict(getattr(pipe, "adapters", {}) or {})
    names = sorted(n for n, m in adapters.items() if m == modality)
    preferred = {"text": "pirate", "image": "outline"}[modality]
    for n in names:
        if preferred in n:
            return n
    return names[0] if names else None


def _merged_adapter(pipe, text: str, image: str) -> str | None:
    adapters = dict(getattr(pipe, "adapters", {}) or {})
    merged = sorted(n for n, m in adapters.items() if m == "merged")
    if merged:
        return merged[0]
    merge = getattr(pipe, "merge_adapters", None)
    if callable(merge):
        return merge([text, image])
    return None


def default_conditions(pipe, names: Iterable[str] | None = None, *, text_adapter: str | None = None,
                       image_adapter: str | None = None) -> tuple[list[Condition], dict[str, str]]:
    """The conditions to run (and, by name, those skipped with the reason)."""
    names = list(CONDITIONS if names is None else names)
    unknown = [n for n in names if n not in CONDITIONS]
    if unknown:
        raise ShapesError(f"unknown conditions {unknown}; expected some of {list(CONDITIONS)}")
    txt = text_adapter or _adapter_of(pipe, "text")
    img = image_adapter or _adapter_of(pipe, "image")
    table = {
        "base": (None, None, "none", False, False),
        "image_lora": (None, img, "vocab", True, False),
        "text_lora": (txt, None, "vocab", False, True),
        "vocab_both": (txt, img, "vocab", True, True),
        "seq_text": (txt, None, "sequence", False, True),
        "seq_image": (None, img, "sequence", True, False),
    }
    conditions, skipped = [], {}
    for name in names:
        if name == "merged":
            if txt is None or img is None:
                skipped[name] = "needs a text and an image adapter"
                continue
            merged = _merged_adapter(pipe, txt, img)
            if merged is None:
                skipped[name] = "the pipeline exposes no merged adapter"
                continue
            conditions.append(Condition(name, merged, None, "sequence", True, True))
            continue
        t, i, routing, outline, pirate = table[name]
        if (outline and i is None) or (pirate and t is None):
            skipped[name] = f"no {'image' if outline and i is None else 'text'} adapter loaded"
            continue
        conditions.append(Condition(name, t, i, routing, outline, pirate))
    return conditions, skipped


# ---------------------------------------------------------------------------------------------- running


def _parts(doc) -> list:
    parts = getattr(doc, "parts", doc)
    if not isinstance(parts, (list, tuple)):
        raise ShapesError(f"pipeline returned {type(doc).__name__}, expected a Document with .parts")
    return list(parts)


def _score_one(prompt: EvalPrompt, doc) -> dict:
    """Content, and the style of what was generated, for one prompt's output document."""
    parts = _parts(doc)
    images = [p for p in parts if isinstance(p, Image.Image)]
    texts = [p for p in parts if isinstance(p, str) and p.strip()]
    out: dict = {"content": False, "outline": None, "pirate": None}
    if prompt.category in T2I_CATEGORIES:
        if images:
            reading = analyse_image(images[0])
            out["content"] = score_text_to_image(prompt, reading)
            out["outline"] = reading.style == "outline"
    elif prompt.category == "image_to_text":
        text = " ".join(texts)
        if text:
            parsed = parse_caption(text)
            out["content"] = score_image_to_text(prompt.scene, parsed)
            out["pirate"] = parsed.register == "pirate"
    else:  # interleaved: the prompt opens the document; the pipeline may or may not echo it
        if texts and parts and isinstance(parts[0], str) and parts[0].strip().startswith(prompt.text.strip()):
            generated_text = [parts[0].strip()[len(prompt.text.strip()):]] + texts[1:]
            full = parts
        else:
            generated_text = texts
            full = [prompt.text] + parts
        out["content"] = score_interleaved(full)
        readings = [analyse_image(im) for im in images]
        if readings:
            out["outline"] = float(np.mean([r.style == "outline" for r in readings])) >= 0.5
        generated = " ".join(t for t in generated_text if t.strip())
        if generated.strip():
            out["pirate"] = parse_caption(generated).register == "pirate"
    return out


def _mean(values: list) -> float | None:
    values = [float(v) for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _style_ok(cond: Condition, rec: dict) -> bool | None:
    checks = []
    if cond.expect_outline and rec["outline"] is not None:
        checks.append(rec["outline"])
    if cond.expect_pirate and rec["pirate"] is not None:
        checks.append(rec["pirate"])
    return all(checks) if checks else None


def _record(cond: Condition, prompt: EvalPrompt, doc) -> dict:
    """One prompt's scores under a condition, with best-of-n's candidate count when it ran."""
    rec = _score_one(prompt, doc)
    rec["style_ok"] = _style_ok(cond, rec)
    rec["style_and_content"] = None if rec["style_ok"] is None else rec["style_ok"] and rec["content"]
    verdicts = getattr(doc, "meta", {}).get("best_of", {}).get("verdicts")  # best_of > 1 runs only
    rec["candidates"] = None if verdicts is None else len(verdicts)
    rec["check_passed"] = None if verdicts is None else any(verdicts)
    return rec


_RATES = ("outline", "pirate", "style_ok", "style_and_content", "candidates", "check_passed")


def _summary(records: list[dict]) -> dict:
    return {"n": len(records), "content": _mean([r["content"] for r in records]),
            **{key: _mean([r[key] for r in records]) for key in _RATES}}


def _condition_summary(per_cat: dict, records: list[dict], seconds: float) -> dict:
    rates = {key: _mean([r[key] for r in records]) for key in _RATES}
    return {
        "text_to_image": _mean([per_cat[c]["content"] for c in T2I_CATEGORIES if c in per_cat]),
        "image_to_text": per_cat.get("image_to_text", {}).get("content"),
        "interleaved": per_cat.get("interleaved", {}).get("content"),
        "outline_rate": rates.pop("outline"),
        "pirate_rate": rates.pop("pirate"),
        **rates,
        "seconds": seconds,
    }


def run_shapes_eval(pipeline, *, n_per_category: int = 200, conditions: Iterable[str | Condition] | None = None,
                    categories: Iterable[str] | None = None, batch_size: int = 32, seed: int = 0,
                    text_adapter: str | None = None, image_adapter: str | None = None,
                    generate_kwargs: dict | None = None, progress: bool = True,
                    on_result: Callable[[dict, str], None] | None = None) -> tuple[dict, str]:
    """Generate for every (condition, category) prompt set and score it. Returns (results, markdown).
    Text-to-image prompts are asked for one picture (max_images=1, unless generate_kwargs sets it).
    `on_result(results, markdown)` sees the results so far after each category (the CLI writes them, so an
    hour-long run that is stopped keeps what it finished)."""
    if batch_size < 1:
        raise ShapesError(f"batch_size must be >= 1, got {batch_size}")
    categories = list(CATEGORIES if categories is None else categories)
    bad = [c for c in categories if c not in CATEGORIES]
    if bad:
        raise ShapesError(f"unknown categories {bad}; expected some of {list(CATEGORIES)}")
    given = list(conditions) if conditions is not None else None
    if given is not None and all(isinstance(c, Condition) for c in given):
        conds, skipped = given, {}
    else:
        conds, skipped = default_conditions(pipeline, [c if isinstance(c, str) else c.name for c in given]
                                            if given is not None else None,
                                            text_adapter=text_adapter, image_adapter=image_adapter)
    for name, why in skipped.items():
        log.warning("ShapesEval: skipping condition %s: %s", name, why)
    prompt_sets = {c: build_prompts(c, n_per_category, seed) for c in categories}
    results: dict = {"n_per_category": n_per_category, "seed": seed, "skipped": skipped,
                     "generation_overrides": dict(generate_kwargs or {}), "conditions": {},
                     "progress": {"done": 0, "total": len(conds) * len(prompt_sets)}}  # (condition, category) sets
    documents = len(conds) * sum(len(p) for p in prompt_sets.values())
    if progress:
        log.info("ShapesEval: %d documents (%d conditions x %d categories x %d prompts); the bar's estimate of the "
                 "time left settles after the first batches (a CPU is slow: about a second a document on 2 cores)",
                 documents, len(conds), len(prompt_sets), n_per_category)
    # counted in documents, not batches: a batch's cost varies with its category, a document's far less
    bar = tqdm(total=documents, desc="ShapesEval", unit="doc", disable=not progress)
    started = time.perf_counter()
    for cond in conds:
        t0 = time.perf_counter()
        per_cat: dict = {}
        records_all: list[dict] = []
        for cat, prompts in prompt_sets.items():
            records = []
            # a text-to-image answer is one picture: what would follow it is never scored (nor checked by best_of)
            kwargs = {**({"max_images": 1} if cat in T2I_CATEGORIES else {}), **(generate_kwargs or {})}
            for start in range(0, len(prompts), batch_size):
                batch = prompts[start:start + batch_size]
                docs = pipeline.generate([p.pipeline_prompt() for p in batch], text_adapter=cond.text_adapter,
                                         image_adapter=cond.image_adapter, routing=cond.routing,
                                         seed=seed + start, **kwargs)
                if len(docs) != len(batch):
                    raise ShapesError(f"pipeline returned {len(docs)} documents for {len(batch)} prompts")
                for p, d in zip(batch, docs):
                    records.append(_record(cond, p, d))
                bar.update(len(batch))
                if progress and bar.n == len(batch):  # the first batch: say what the whole run will cost
                    pace = (time.perf_counter() - started) / len(batch)
                    log.info("ShapesEval: %.2f s a document so far, so about %s for all %d", pace,
                             _duration(pace * documents), documents)
            per_cat[cat] = _summary(records)
            records_all.extend(records)
            results["progress"]["done"] += 1
            results["conditions"][cond.name] = {
                "condition": asdict(cond),
                "categories": per_cat,
                "summary": _condition_summary(per_cat, records_all, time.perf_counter() - t0),
            }
            if on_result is not None:  # after every category: a run that is stopped keeps what it finished
                on_result(results, results_markdown(results))
    bar.close()
    return results, results_markdown(results)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def is_partial(results: dict) -> bool:
    """Whether `results` hold fewer (condition, category) sets than their run set out to score."""
    done = results.get("progress", {})
    return bool(done) and done.get("done", 0) < done.get("total", 0)


def merge_results(parts: Sequence[dict]) -> dict:
    """One results dict from runs over disjoint conditions with the same settings (e.g. one process a GPU)."""
    if not parts:
        raise ShapesError("nothing to merge: give at least one results JSON")
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("conditions"), dict):
            raise ShapesError(f"results #{i + 1} is not a ShapesEval results JSON (no 'conditions' table)")
    first = parts[0]
    merged = {**first, "skipped": {}, "conditions": {}}
    for i, part in enumerate(parts):
        for key in ("n_per_category", "seed", "generation_overrides"):
            if part.get(key) != first.get(key):
                raise ShapesError(f"results #{i + 1} has {key} {part.get(key)!r}, results #1 {first.get(key)!r}: "
                                  "only runs with the same settings can be merged")
        twice = sorted(set(part["conditions"]) & set(merged["conditions"]))
        if twice:
            raise ShapesError(f"condition(s) {twice} appear in more than one of the results to merge")
        merged["conditions"].update(part["conditions"])
        merged["skipped"].update(part.get("skipped", {}))
    category_sets = {name: sorted(res.get("categories", {})) for name, res in merged["conditions"].items()}
    if len({tuple(c) for c in category_sets.values()}) > 1:
        raise ShapesError(f"the results cover different categories, so their summaries would not compare: "
                          f"{category_sets}")
    for name in merged["conditions"]:
        merged["skipped"].pop(name, None)
    if all("progress" in part for part in parts):
        merged["progress"] = {key: sum(part["progress"][key] for part in parts) for key in ("done", "total")}
    order = {name: i for i, name in enumerate(CONDITIONS)}
    merged["conditions"] = dict(sorted(merged["conditions"].items(), key=lambda kv: order.get(kv[0], len(order))))
    return merged


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def results_markdown(results: dict) -> str:
    """One row per condition: content per category, style rates, style adherence with content."""
    short = {"single_object": "single", "colour": "colour", "counting": "count", "position": "position",
             "two_objects": "two obj", "colour_attribution": "colour attr", "image_to_text": "I2T",
             "interleaved": "interleaved"}
    head = (["condition", "adapters (routing)", "T2I"] + [short[c] for c in CATEGORIES]
            + ["outline rate", "pirate rate", "style ok", "style ∧ content"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if is_partial(results):
        done = results["progress"]
        lines.insert(0, f"**Partial results: {done['done']} of {done['total']} (condition, category) sets scored** "
                        "(the run was stopped, or is still running); a '–' is a set not scored yet.\n")
    for name, res in results["conditions"].items():
        c, s, cats = res["condition"], res["summary"], res["categories"]
        adapters = ", ".join(a for a in (c["text_adapter"], c["image_adapter"]) if a) or "none"
        row = [name, f"{adapters} ({c['routing']})", _fmt(s["text_to_image"])]
        row += [_fmt(cats.get(cat, {}).get("content")) for cat in CATEGORIES]
        row += [_fmt(s["outline_rate"]), _fmt(s["pirate_rate"]), _fmt(s["style_ok"]), _fmt(s["style_and_content"])]
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"\n{results['n_per_category']} prompts per category (held-out combinations, seed {results['seed']}). "
             "Content: every attribute named is right and the object count is exact. Outline/pirate rate: share "
             "of generated images read as outline / texts in the pirate register. Style ok: the styles the "
             "condition's adapters should produce are there (image style on images, text style on text)."]
    if results.get("generation_overrides"):
        settings = ", ".join(f"{k}={v}" for k, v in results["generation_overrides"].items())
        notes.append(f"Generation settings over the model's defaults: {settings}.")
    drawn = {name: res["summary"].get("candidates") for name, res in results["conditions"].items()}
    if any(v is not None for v in drawn.values()):
        notes.append("Best-of-n (models/engine/best_of.py), candidates decoded per prompt on average, and the share of "
                     "prompts whose check passed: " + "; ".join(
                         f"{name} {v:.2f}, {_fmt(results['conditions'][name]['summary']['check_passed'])}"
                         for name, v in drawn.items() if v is not None) + ".")
    for name, why in results.get("skipped", {}).items():
        notes.append(f"- {name}: skipped ({why})")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


# --------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molora evaluate", description="ShapesEval: score the embedded model on held-out shape scenes.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded assets/model)")
    ap.add_argument("--n", type=int, default=200,
                    help="prompts per category (default 200: about an hour on a 2-core CPU, minutes on a GPU; the progress "
                         "bar estimates the time left; try --n 10 first)")
    ap.add_argument("--conditions", nargs="*", default=None, choices=CONDITIONS)
    ap.add_argument("--categories", nargs="*", default=None, choices=CATEGORIES)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-adapter", default=None)
    ap.add_argument("--image-adapter", default=None)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write the full results here")
    ap.add_argument("--r-max", type=int, default=32,
                    help="adapter cache rank; the merged row needs the sum of both adapters' ranks")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="write one table from the --json files of runs over different conditions (e.g. one "
                         "process a GPU) instead of running")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a generation setting over the model's generation.json, e.g. --set cfg_scale=2.0 "
                         "--set text_temperature=0 (any key of GenerationConfig.with_overrides)")
    args = ap.parse_args(argv)

    def write(results: dict, table: str) -> None:
        if args.out:
            Path(args.out).write_text(table)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    if args.merge:
        parts = []
        for path in args.merge:
            try:
                parts.append(json.loads(Path(path).read_text()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                ap.error(f"--merge: cannot read {path}: {exc}")
        merged = merge_results(parts)
        table = results_markdown(merged)
        print(table)
        write(merged, table)
        return 0
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--set expects KEY=VALUE, got {item!r}")
        try:  # numbers, true/false and null as JSON; anything else is a string
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip() or None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from molora.models import InterleavedPipeline  # the generation API (helper G); imported only to run

    pipe = InterleavedPipeline.from_pretrained(args.model, r_max=args.r_max, device=args.device)
    try:
        results, table = run_shapes_eval(pipe, n_per_category=args.n, conditions=args.conditions,
                                         categories=args.categories, batch_size=args.batch_size, seed=args.seed,
                                         text_adapter=args.text_adapter, image_adapter=args.image_adapter,
                                         generate_kwargs=overrides, on_result=write)
    except KeyboardInterrupt:
        kept = " and ".join(p for p in (args.out, args.json) if p)
        print("stopped" + (f": the partial results so far are in {kept}, marked partial" if kept else
                           " (give --out / --json to keep partial results)"), file=sys.stderr)
        return 130
    print(table)
    write(results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
