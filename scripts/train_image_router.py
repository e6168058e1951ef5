"""Train the image gates of a hierarchical MoLoRA router: the vocabulary decides the modality, the text gates route
text positions among the domain adapters, and these gates route image positions among the image adapters and the
base expert, per picture, from what the words before it asked for. Base, adapters and text gates stay frozen.

Data (models/families/shapes/styles.py): "Here is an outlined small red circle at the top left:" + the picture in that
style; the shipped `outline` LoRA draws outlined shapes, the `negative` LoRA shapes in the complementary colour, the
`filled` LoRA filled ones (the base expert stays a choice: no request asks for it). Per block a gate
Linear(d_model, 4) on the block input of image positions (`<boi>`, codes, row markers, `<eoi>`), and with
--context-decays also on a routing state updated by the text positions (the words before the picture); loss =
next-token loss on the picture's ids + lb * load-balance + z * z-loss + label * cross-entropy of every block's gate
against the requested style's expert on the picture's positions. The gates train at k = 2 (with k = 1 the kept
weight is always 1 and the next-token loss gives the gate no gradient) and serve at k = 1: one expert a picture.

Writes OUT/image_gates.safetensors and an "image_gates" section in OUT/config.json (merged with what is there:
the text router's own entries are kept). InterleavedPipeline.from_pretrained loads the image gates beside the text
gates; routing="learned" then draws each picture in the style its words ask for.

    python scripts/train_image_router.py --out assets/router --device cuda --n 3000 --n-val 99 --steps 300 \
        --lr 2e-2 --threads 8 --max-minutes 1.8   # the shipped image gates (H200, 153 s; benchmarks/RESULTS.md)
    python scripts/train_image_router.py --out /tmp/r --steps 2 --n 16 --n-val 4     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.family import load_family_model  # noqa: E402
from molora.models.families.loading import adapter_weights_hash  # noqa: E402
from molora.models.families.shapes import world  # noqa: E402
from molora.models.families.shapes.data import Schedule  # noqa: E402
from molora.models.families.shapes.image_tokenizer import ImageTokenizer  # noqa: E402
from molora.models.families.shapes.styles import STYLE_ADAPTERS, StyleItem, style_items  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402
from molora.models.pipeline import InterleavedPipeline  # noqa: E402
from molora.routing import LearnedGates, LearnedRouter  # noqa: E402

log = logging.getLogger("train_image_router")
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters",
                   help="where the image adapters' files are (their hashes go in the config)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=2000, help="training requests (a third of each style)")
    p.add_argument("--n-val", type=int, default=100, help="held-out requests scored at the end")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--second", type=float, default=0.5,
                   help="share of requests that follow a picture in the other style (a two-picture document; "
                        "without a routing state 0.5 did not help the second picture: benchmarks/RESULTS.md)")
    p.add_argument("--context-decays", type=float, nargs="*", default=[0.5, 0.8, 0.97],
                   help="the gates also read a routing state: causal moving averages of the TEXT positions' "
                        "embeddings at these decays (the sentence before a picture); none = block input only")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lb-coef", type=float, default=0.01)
    p.add_argument("--z-coef", type=float, default=1e-3)
    p.add_argument("--label-coef", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-minutes", type=float, default=0.0)
    p.add_argument("--init-from", type=Path, default=None,
                   help="image gates (a .safetensors) to go on training from, over the same or more adapters")
    return p.parse_args(argv)


def first_requests(items: list[StyleItem], *, seed: int | str, split: str, second: float) -> list[StyleItem | None]:
    """For a `second` share of the items (seeded), the request whose sentence and picture come first: another
    request in one of the two other styles, either with even odds (style_items cycles the styles, so requests i + 1
    and i + 2 of another list ask for the two styles other than request i's). Both orders, so the gates cannot
    learn the style that follows a style in place of reading the words. None: the item stands alone."""
    pool = style_items(len(items) + 2, seed=f"first:{seed}", split=split)
    rng = random.Random(f"second:{seed}")
    lead = [rng.random() < second for _ in items]
    shifts = [1 + (rng.random() < 0.5) for _ in items]
    return [pool[i + shift] if use else None for i, (use, shift) in enumerate(zip(lead, shifts))]


def encode(tok: UnifiedTokenizer, vq: ImageTokenizer, items: list[StyleItem], experts: list[str | None], *,
           seed: int | str, split: str, second: float) -> list[tuple[list[int], int, int]]:
    """(ids, index of the scored picture's <boi>, the requested style's expert index) of each item: <bos> +
    sentence + picture; a `second` share of them first hold another request's sentence and picture in another
    style (context, not scored; first_requests), so the gates learn to follow the words, not the document's last
    picture."""
    firsts = first_requests(items, seed=seed, split=split, second=second)
    scenes = [it.drawn for it in items] + [f.drawn for f in firsts if f is not None]
    codes = iter(vq.encode([world.render(scene) for scene in scenes]))
    pictures = [next(codes) for _ in items]
    out = []
    for item, first, picture in zip(items, firsts, pictures):
        head = [tok.vocab.bos_id]
        if first is not None:
            head += [*tok.encode_text(first.prompt), *tok.image_span(next(codes))]
        head += tok.encode_text(item.prompt)
        out.append((head + tok.image_span(picture), len(head), experts.index(item.adapter)))
    return out


def batch_of(records: list[tuple[list[int], int, int]], device: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T] (right-padded), picture mask [B, T] (the positions from <boi> on), the <boi> positions [B, T]
    and the expert label of each row [B]."""
    width = max(len(ids) for ids, _, _ in records)
    ids = torch.zeros(len(records), width, dtype=torch.long)
    picture = torch.zeros(len(records), width, dtype=torch.bool)
    boi = torch.zeros(len(records), width, dtype=torch.bool)
    for b, (row, start, _) in enumerate(records):
        ids[b, :len(row)] = torch.tensor(row)
        picture[b, start:len(row)] = True
        boi[b, start] = True
    labels = torch.tensor([label for _, _, label in records])
    return ids.to(device), picture.to(device), boi.to(device), labels.to(device)


def picture_loss(logits: torch.Tensor, ids: torch.Tensor, picture: torch.Tensor) -> torch.Tensor:
    """Next-token loss on the picture's ids (codes, row markers, <eoi>): predicted from <boi> on."""
    mask = picture[:, :-1]
    return F.cross_entropy(logits[:, :-1][mask].float(), ids[:, 1:][mask])


def gate_label_loss(decisions: dict, picture: torch.Tensor, boi: torch.Tensor, labels: torch.Tensor
                    ) -> torch.Tensor:
    """Every block's image-gate logits against the row's requested expert: at `<boi>` and, weighted the same in
    all, over the picture's other positions. `<boi>` decides how the first codes are drawn, and only the words
    can tell it the style; later positions also see the codes drawn so far (a gate fitted to all positions
    alike learns the codes' style, and stays at chance at `<boi>`: 0.52 in a first run)."""
    target = labels[:, None].expand_as(picture).reshape(-1)
    first = boi.reshape(-1)
    losses = []
    for ds in decisions.values():
        image = ds[-1]  # the router's gate sets run text gates first, image gates last
        rest = image.mask & picture.reshape(-1) & ~first
        losses += [F.cross_entropy(image.logits[first], target[first]),
                   F.cross_entropy(image.logits[rest], target[rest])]
    return torch.stack(losses).mean()


@torch.no_grad()
def agreement(pipe: InterleavedPipeline, router: LearnedRouter, records, device: str) -> dict:
    """Teacher-forced: share of pictures whose <boi> position's top-1 (averaged over blocks) is the requested
    expert, per block too."""
    per_block = torch.zeros(pipe.routed.num_blocks)
    for i in range(0, len(records), 16):
        chunk = records[i:i + 16]
        ids, _, boi, labels = batch_of(chunk, device)
        out = pipe.routed(ids, routers=router, use_cache=False)
        for block, ds in out.decisions.items():
            per_block[block] += float((ds[-1].topk[boi.reshape(-1), 0] == labels).sum())
    per_block /= len(records)
    return {"picture_agreement_per_block": [round(float(a), 4) for a in per_block],
            "picture_agreement": round(float(per_block.mean()), 4)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    # the text gates, not the image gates these replace (trained over the image adapters of before, they would be
    # refused once those adapters are retrained)
    loaded = load_family_model(args.model_dir, device=args.device, dtype=torch.float32)
    gates_path, loaded.gates_path = loaded.gates_path, None
    pipe = InterleavedPipeline(loaded)
    if gates_path is not None:
        pipe.load_learned_router(gates_path, image_gates=False)
    if pipe.gates is None:
        raise SystemExit("the image gates extend a text router: the model needs its learned text gates loaded")
    image_adapters = [a for a in dict.fromkeys(STYLE_ADAPTERS.values()) if a is not None]
    missing = [a for a in image_adapters if pipe.adapters.get(a) != "image"]
    if missing:
        raise SystemExit(f"image adapters {missing} are not loaded as image adapters (loaded: {pipe.adapters})")
    routed = pipe.routed
    routed.requires_grad_(False)
    torch.manual_seed(args.seed)
    if args.init_from is not None:  # go on from trained image gates (their context decays, not the flag's)
        gates = LearnedGates.load(args.init_from, device=args.device).with_adapters(image_adapters)
    else:
        gates = LearnedGates.for_model(routed, image_adapters, base_expert=True, context_decays=args.context_decays)
    train_router = LearnedRouter(pipe.gates, top_k=pipe.learned_top_k, vocab=pipe.vocab, image_gates=gates,
                                 image_top_k=gates.num_experts)
    tok, vq = pipe.tokenizer, pipe.image_tokenizer
    train = encode(tok, vq, style_items(args.n, seed=args.seed, split="train"), gates.experts, seed=args.seed,
                   split="train", second=args.second)
    val_items = style_items(args.n_val, seed=f"val{args.seed}", split="heldout")
    val = encode(tok, vq, val_items, gates.experts, seed=f"val{args.seed}", split="heldout", second=0.0)
    val_second = encode(tok, vq, val_items, gates.experts, seed=f"val{args.seed}", split="heldout", second=1.0)
    opt = torch.optim.AdamW(gates.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = Schedule(args.steps, max(1, args.steps // 10), args.max_minutes)
    rng = random.Random(f"{args.seed}:image-router-order")
    order: list[int] = []
    step, curve = 0, []
    bar = tqdm(total=args.steps, desc="image router", mininterval=5)
    while not sched.done(step):
        if len(order) < args.batch_size:
            order += rng.sample(range(len(train)), len(train))
        rows, order = order[:args.batch_size], order[args.batch_size:]
        ids, picture, boi, labels = batch_of([train[r] for r in rows], args.device)
        for group in opt.param_groups:
            group["lr"] = args.lr * sched.factor(step)
        out = routed(ids, routers=train_router, use_cache=False, aux_losses=True)
        nll = picture_loss(out.logits, ids, picture)
        loss = (nll + args.lb_coef * out.load_balance_loss + args.z_coef * out.z_loss
                + args.label_coef * gate_label_loss(out.decisions, picture, boi, labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % 10 == 0 or step == args.steps:
            curve.append((step, round(nll.item(), 4), round(loss.item(), 4)))
            bar.set_postfix(nll=f"{curve[-1][1]:.3f}", loss=f"{curve[-1][2]:.3f}")
    bar.close()
    serve = LearnedRouter(pipe.gates, top_k=pipe.learned_top_k, vocab=pipe.vocab, image_gates=gates, image_top_k=1)
    val_metrics = {"one picture": agreement(pipe, serve, val, args.device),
                   "second picture": agreement(pipe, serve, val_second, args.device)}
    log.info("validation: %s", val_metrics)
    args.out.mkdir(parents=True, exist_ok=True)
    gates.save(args.out / "image_gates.safetensors")
    config_path = args.out / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    hashes = {a: adapter_weights_hash(args.adapters_dir / a) for a in image_adapters}
    before = config.get("image_gates")  # the image gates these replace: kept under "history", less their curve
    history = [] if before is None else [*before.pop("history", []), {k: v for k, v in before.items() if k != "curve"}]
    config["image_gates"] = {
        "file": "image_gates.safetensors", "adapters": image_adapters, "base_expert": True, "top_k": 1,
        "styles": {style: adapter for style, adapter in STYLE_ADAPTERS.items()},
        "loss": {"next_token": 1.0, "load_balance": args.lb_coef, "z": args.z_coef, "label": args.label_coef},
        "context_decays": list(gates.context_decays), "state_updated_by": "text positions",
        "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed, "second": args.second, "steps": step,
        "train_records": len(train),
        "val_records": len(val), "data": "models/families/shapes/styles.py", "adapter_sha256_16": hashes,
        "seconds": round(time.time() - t0, 1), "device": device_name(args.device), "threads": args.threads,
        "torch": torch.__version__, "init_from": str(args.init_from) if args.init_from else None,
        "first_pictures": "either other style (first_requests)", "curve": curve, "val": val_metrics,
        "history": history}
    config_path.write_text(json.dumps(config, indent=2))
    return config["image_gates"]


if __name__ == "__main__":
    main()
