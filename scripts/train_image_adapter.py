"""Train an image-style LoRA on the frozen embedded LM through the project's routed path: RoutedModel + LabelRouter,
the LoRA in the hot-set slot and trained through the kernels' autograd, acting on the picture's positions only
(`<boi>`, codes, row markers: the positions the image gates route), so it composes with the text router and the
other image adapters in one pass.

Data (models/families/shapes/styles.py): the requests of one style ("Here is a negative small red circle at the top left:")
and the picture that style draws (for `negative`, the shape filled in the complementary colour), a `--second` share
of them after another request's sentence and picture in one of the other styles (context, not trained on;
train_image_router.first_requests); next-token loss on the picture's ids only. A fresh PEFT-initialised LoRA (A
kaiming-uniform, B zero, scale alpha / r) on every routed linear, AdamW, warmup + cosine, trained in float32 and
stored as `--save-dtype`. Writes OUT/<name>/ (PEFT format + molora.json, modality "image") and
OUT/<name>/metrics.json: teacher-forced picture loss and code accuracy on held-out requests, base model against the
adapter.

    python scripts/train_image_adapter.py --out assets/adapters --style negative --device cuda --threads 12 \
        --rank 16 --alpha 32 --second 0.75 --steps 1600 --max-minutes 3.3
                                # the shipped `negative` LoRA (H100, 171 s; `--style filled` the `filled` one)
    python scripts/train_image_adapter.py --out /tmp/ad --style negative --steps 2 --n-train 12 --n-val 4
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_domain_adapters import fresh_adapter, read_slot, train_slot, trainable_slot  # noqa: E402
from train_image_router import batch_of, encode, picture_loss  # noqa: E402

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.shapes.image_tokenizer import ImageTokenizer  # noqa: E402
from molora.models.families.shapes.styles import STYLE_ADAPTERS, style_items  # noqa: E402
from molora.models.families.shapes.testing import LORA_TARGETS, set_base_model_name  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402
from molora.routing import LabelRouter  # noqa: E402
from molora.routing.adapters import save_peft_adapter  # noqa: E402
from molora.routing.model import RoutedModel, attach_routed_lora  # noqa: E402

log = logging.getLogger("train_image_adapter")
REPO = Path(__file__).resolve().parents[1]
DESCRIPTIONS = {"outline": "Image style: shapes drawn as outlines with hollow centres.",
                "filled": "Image style: shapes filled in the colour named, the requested scene alone (a picture after "
                          "another picture draws a new scene, not the earlier objects again).",
                "negative": "Image style: shapes filled in the complementary colour of the one named (a colour "
                            "negative: red <-> green, orange <-> blue, yellow <-> purple, pink <-> brown)."}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--out", type=Path, required=True, help="adapters directory (the adapter goes in OUT/<name>)")
    p.add_argument("--style", default="negative", choices=[s for s, a in STYLE_ADAPTERS.items() if a is not None])
    p.add_argument("--n-train", type=int, default=8000, help="training requests of the style (train split)")
    p.add_argument("--n-val", type=int, default=99, help="held-out requests scored at the end")
    p.add_argument("--second", type=float, default=0.5, help="share of requests after another style's picture")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--alpha", type=float, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-minutes", type=float, default=0.0)
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="the stored weights' dtype (trained in float32; the shipped ones are kept as bfloat16)")
    return p.parse_args(argv)


def requests(style: str, n: int, *, seed: str, split: str) -> list:
    """`n` requests of `style` (style_items cycles the styles: every len(STYLE_ADAPTERS)-th item is one)."""
    items = style_items(n * len(STYLE_ADAPTERS), seed=seed, split=split)
    return [it for it in items if it.style == style][:n]


def picture_router(name: str, picture: torch.Tensor) -> LabelRouter:
    """The adapter on the picture's positions; the base model on the words and on any earlier picture."""
    return LabelRouter([name], torch.where(picture, 0, -1))


@torch.no_grad()
def picture_metrics(routed: RoutedModel, name: str | None, records, device: str, batch_size: int = 32) -> dict:
    """Teacher-forced next-token loss and accuracy on the pictures' ids (name None: the base model alone)."""
    loss_sum, hits, count = 0.0, 0, 0
    for i in range(0, len(records), batch_size):
        ids, picture, _, _ = batch_of(records[i:i + batch_size], device)
        logits = routed(ids, routers=picture_router(name, picture) if name else None, use_cache=False).logits
        mask = picture[:, :-1]
        n = int(mask.sum())
        loss_sum += float(picture_loss(logits, ids, picture)) * n
        hits += int((logits[:, :-1].argmax(-1)[mask] == ids[:, 1:][mask]).sum())
        count += n
    return {"picture_loss": round(loss_sum / count, 4), "picture_code_accuracy": round(hits / count, 4)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    torch.manual_seed(args.seed)
    name = STYLE_ADAPTERS[args.style]
    tok = UnifiedTokenizer.load(args.model_dir)
    vq = ImageTokenizer.from_pretrained(args.model_dir / "vq", device=args.device)
    lm = LlamaForCausalLM.from_pretrained(args.model_dir / "lm", dtype=torch.float32).to(args.device)
    set_base_model_name(lm)
    lm.requires_grad_(False).train()  # dropout is 0: train mode only avoids building a KV cache
    routed = attach_routed_lora(lm, target_modules=LORA_TARGETS, num_slots=1, r_max=args.rank)
    adapter = fresh_adapter(routed, name, args.rank, args.alpha, torch.Generator().manual_seed(args.seed))
    routed.add_adapter(adapter)
    slot, params = trainable_slot(routed, name)

    experts = list(STYLE_ADAPTERS.values())
    train = encode(tok, vq, requests(args.style, args.n_train, seed=f"{args.seed}", split="train"), experts,
                   seed=args.seed, split="train", second=args.second)
    val = encode(tok, vq, requests(args.style, args.n_val, seed=f"val{args.seed}", split="heldout"), experts,
                 seed=f"val{args.seed}", split="heldout", second=args.second)
    base = picture_metrics(routed, None, val, args.device)

    def loss_of(rows: list[int]) -> torch.Tensor:
        ids, picture, _, _ = batch_of([train[r] for r in rows], args.device)
        return picture_loss(routed(ids, routers=picture_router(name, picture), use_cache=False).logits, ids, picture)

    step, curve = train_slot(params, len(train), loss_of, args, adapter=name, desc=f"image adapter {name}")
    trained = picture_metrics(routed, name, val, args.device)
    folder = args.out / name
    save_peft_adapter(read_slot(routed, adapter, slot), folder, dtype=getattr(torch, args.save_dtype))
    (folder / "molora.json").write_text(json.dumps(
        {"modality": "image", "style": args.style, "description": DESCRIPTIONS[args.style],
         "context": "base: the adapter acts on its picture's positions only"}, indent=2))
    metrics = {"val_base": base, "val_adapter": trained, "val_requests": len(val), "train_requests": len(train),
               "second": args.second, "steps": step, "planned_steps": args.steps, "batch_size": args.batch_size,
               "lr": args.lr, "rank": args.rank, "alpha": args.alpha, "seed": args.seed, "threads": args.threads,
               "save_dtype": args.save_dtype,
               "train_loss": curve[-1][1] if curve else None, "loss_curve": curve,
               "seconds": round(time.time() - t0, 1), "device": device_name(args.device), "torch": torch.__version__}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("%s: held-out picture loss %.3f (base %.3f), code accuracy %.3f (base %.3f), %d steps, %.0f s", name,
             trained["picture_loss"], base["picture_loss"], trained["picture_code_accuracy"],
             base["picture_code_accuracy"], step, metrics["seconds"])
    return metrics


if __name__ == "__main__":
    main()
