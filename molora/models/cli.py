"""Command line: write generated documents of text and images (`molora generate`).

    molora generate "a red circle in the top left" --out out/doc.html --start-image --seed 0
    molora generate "describe:" --image photo.png --out out/caption.html --markdown out/caption
    molora generate "two stars" --image-adapter outline --routing vocab --cfg-scale 3 --out out/stars.html
    molora generate "Draw a blue diamond at the bottom." --best-of 4 --max-images 1 --out out/diamond.html
    molora generate --prompts prompts.jsonl --out out/docs/        # a batch (models/batch.py)
    accelerate launch --num_processes 2 -m molora generate --prompts prompts.jsonl --out out/docs/   # one a GPU

Prints the paths it wrote (a batch: its run summary). Errors of the project (unknown adapter, missing model files,
a bad prompts file, ...) exit with status 2 and their message.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

from PIL import Image

from molora.models.batch import read_prompts, run_data_parallel
from molora.models.engine.generation import check_text
from molora.models.engine.runtime import configure_cpu_threads
from molora.models.engine.sampling import check_seed
from molora.models.pipeline import ROUTING_MODES, InterleavedPipeline
from molora.routing.errors import MoLoRAError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="molora generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default=None, help="text prompt ('' is allowed)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a batch instead of one prompt: a .jsonl file (one object a line: prompt, and optionally "
                        "seed, text_adapter, image_adapter, start_image, max_new_tokens) or a text file (one prompt a "
                        "line); --out is then a directory, and a prompt without a seed gets --seed (default 0) + "
                        "its index")
    p.add_argument("--image", action="append", default=[], type=Path,
                   help="image file(s) placed before the text prompt (image -> text); repeatable")
    p.add_argument("--out", type=Path, default=None,
                   help="HTML file to write (default document.html); with --prompts, the output directory")
    p.add_argument("--markdown", type=Path, default=None, help="also write Markdown + PNGs into this directory")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the repo's assets/model)")
    p.add_argument("--adapters-dir", type=Path, default=None, help="adapters folder (default: beside the model)")
    p.add_argument("--adapter", action="append", default=[], type=Path, help="extra adapter folder to load")
    p.add_argument("--text-adapter", default=None)
    p.add_argument("--image-adapter", default=None)
    p.add_argument("--routing", default="vocab", choices=ROUTING_MODES)
    p.add_argument("--router", type=Path, default=None,
                   help="learned-router gates (.safetensors; a config.json beside them is checked too) for --routing "
                        "learned (default: the model's assets/router)")
    p.add_argument("--seed", type=int, default=None, help="0 to 2**31 - 1 (default: a fresh one, recorded)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None, help="text temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="text top-p")
    p.add_argument("--image-temperature", type=float, default=None)
    p.add_argument("--image-top-k", type=int, default=None)
    p.add_argument("--max-images", type=int, default=None)
    p.add_argument("--start-image", action="store_true", help="begin the continuation with an image")
    p.add_argument("--best-of", type=int, default=None,
                   help="draw up to N candidates and keep the first that passes the model's check (the embedded "
                        "model's: its own captions of its pictures match the text)")
    p.add_argument("--no-color", action="store_true", help="do not colour tokens by adapter in the HTML")
    p.add_argument("--negative-prompt", default=None, help="what guidance steers pictures away from (needs CFG)")
    p.add_argument("--grid", default=None, metavar="ROWSxCOLS",
                   help="picture size in codes, for families that take it per load (Emu3), e.g. 32x32")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: $MOLORA_THREADS, else 1, the fastest for the small "
                        "embedded model and robust when other processes share the cores; 0 = torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = {key: value for key, value in {
        "seed": args.seed, "max_new_tokens": args.max_new_tokens, "cfg_scale": args.cfg_scale,
        "text_temperature": args.temperature, "text_top_p": args.top_p,
        "image_temperature": args.image_temperature, "image_top_k": args.image_top_k,
        "max_images": args.max_images, "best_of": args.best_of,
        "negative_prompt": args.negative_prompt}.items() if value is not None}
    if args.start_image:
        overrides["start_image"] = True
    try:
        configure_cpu_threads(args.threads)
        if args.seed is not None:
            overrides["seed"] = check_seed(args.seed, "--seed")
        if (args.prompt is None) == (args.prompts is None):
            raise MoLoRAError("give one prompt or --prompts FILE, not both and not neither")
        if args.prompt is not None:
            check_text(args.prompt)  # before the model loads: bytes that are not UTF-8 are refused at once
        if args.prompts is not None:
            return _generate_batch(args, overrides)
        _check_outputs(args)  # before the model loads and generates: not after
        images = []
        for path in args.image:
            try:
                with Image.open(path) as im:
                    images.append(im.convert("RGB"))
            except OSError as exc:
                raise MoLoRAError(f"cannot read image {path}: {exc}") from exc
        pipe = _load(args, args.device)
        prompt = [*images, args.prompt] if images else args.prompt
        doc = pipe.generate(prompt, text_adapter=args.text_adapter, image_adapter=args.image_adapter,
                            routing=args.routing, **overrides)
    except MoLoRAError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for notice in doc.notices:  # e.g. a prompt cut to fit the model's positions: said, not only in the page
        print(f"note: {notice}", file=sys.stderr)
    print(doc.save_html(args.out or Path("document.html"), color_tokens=not args.no_color))
    if args.markdown is not None:
        print(doc.save_markdown(args.markdown))
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse outputs that cannot be written (--out naming a folder, --markdown naming a file) up front."""
    out = args.out or Path("document.html")
    if out.is_dir():
        raise MoLoRAError(f"--out {out} is a directory; give the HTML file to write, e.g. {out / 'document.html'} "
                          "(a directory is for --prompts)")
    if out.parent.exists() and not out.parent.is_dir():
        raise MoLoRAError(f"--out {out}: {out.parent} is a file, not a directory")
    if args.markdown is not None and args.markdown.exists() and not args.markdown.is_dir():
        raise MoLoRAError(f"--markdown {args.markdown} is a file; give a directory for the Markdown and its PNGs")


def _load(args: argparse.Namespace, device: str | None) -> InterleavedPipeline:
    """The pipeline the arguments ask for (model, adapters, router) on `device`."""
    family_options = {}
    if args.grid is not None:
        try:
            family_options["grid"] = tuple(int(n) for n in args.grid.lower().split("x"))
        except ValueError:
            raise MoLoRAError(f"--grid takes ROWSxCOLS, e.g. 32x32; got {args.grid!r}") from None
    pipe = InterleavedPipeline.from_pretrained(args.model, adapters_dir=args.adapters_dir, device=device,
                                               **family_options)
    for path in args.adapter:
        pipe.load_adapter(path)
    if args.router is not None:
        pipe.load_learned_router(args.router)
    return pipe


def _generate_batch(args: argparse.Namespace, overrides: dict) -> int:
    """--prompts: this process's share of the file (all of it without `accelerate launch`); models/batch.py."""
    if args.out is None or args.out.suffix.lower() in (".html", ".htm"):
        raise MoLoRAError("--prompts writes one page per prompt: give --out a directory")
    if args.image or args.markdown is not None:
        raise MoLoRAError("--image and --markdown are for one prompt; a batch takes prompts only")
    items = read_prompts(args.prompts, overrides.pop("seed", 0))

    def load(device: str) -> InterleavedPipeline:
        pipe = _load(args, device)
        pipe.generate = functools.partial(pipe.generate, text_adapter=args.text_adapter,
                                          image_adapter=args.image_adapter, routing=args.routing)
        return pipe

    summary = run_data_parallel(load, items, args.out, overrides, device=args.device,
                                color_tokens=not args.no_color)
    print(json.dumps(summary))
    return 1 if summary.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
