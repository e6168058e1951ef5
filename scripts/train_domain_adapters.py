"""Train one LoRA per question domain (models/families/shapes/domains.py), each independently on its own domain only,
through the project's routed path: RoutedModel + LabelRouter, the LoRA living in the hot-set slot and trained
through the kernels' autograd (kernels/autograd.py). The base stays frozen; the routing rule exists once.

The adapter acts only on the positions that predict its own answer span; the prompt (scene and questions) and
other domains' spans are read as the base model writes them. This is the contract that lets adapters trained
apart compose token by token in one pass: whichever adapters a request mixes, each meets the context it was
trained on (the learned gates send context positions to their base expert).

Per domain: a fresh PEFT-initialised LoRA (A kaiming-uniform, B zero, scale alpha / r) on every routed linear,
AdamW on the answer ids (prompt = context), warmup + cosine, then exact-match accuracy (greedy, teacher-forced:
models/families/shapes/domain_batches.py) on held-out items. Writes OUT/<domain>/adapter_config.json +
adapter_model.safetensors (PEFT format, routing.adapters.save_peft_adapter) + molora.json, and
OUT/domain_metrics.json (one entry per domain, merged with what is already there).

    python scripts/train_domain_adapters.py --out assets/adapters --domains count arith spatial size
    python scripts/train_domain_adapters.py --out /tmp/ad --domains count --steps 3 --n-train 64 --n-val 16
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.shapes.data import Schedule  # noqa: E402
from molora.models.families.shapes.domain_batches import answer_loss, encode_item, exact_matches, make_batch  # noqa: E402
from molora.models.families.shapes.domains import ALL_DOMAINS, DESCRIPTIONS, domain_items  # noqa: E402
from molora.models.families.shapes.testing import LORA_TARGETS, set_base_model_name  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402
from molora.routing import LabelRouter  # noqa: E402
from molora.routing.adapters import LoraAdapter, save_peft_adapter  # noqa: E402
from molora.routing.lora import RoutedLoRALinear  # noqa: E402
from molora.routing.model import RoutedModel, attach_routed_lora  # noqa: E402

log = logging.getLogger("train_domain_adapters")
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--out", type=Path, required=True, help="adapters directory (one folder per domain)")
    p.add_argument("--domains", nargs="+", default=["count", "arith", "spatial", "size"], choices=ALL_DOMAINS)
    p.add_argument("--n-train", type=int, default=12_000, help="training items per domain (train split)")
    p.add_argument("--n-val", type=int, default=200, help="held-out items per domain scored at the end")
    p.add_argument("--foreign", type=float, default=0.4,
                   help="share of training items that also ask another domain's question (its answer is context)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps a shared machine usable)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the shipped adapters: see their domain_metrics.json)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="per domain; 0 = no time limit")
    return p.parse_args(argv)


def fresh_adapter(routed: RoutedModel, name: str, rank: int, alpha: float, gen: torch.Generator) -> LoraAdapter:
    """PEFT's default LoRA init on every routed layer: A kaiming-uniform(a=sqrt 5), B = 0, scale alpha / r."""
    weights, scales = {}, {}
    for module, layer in routed.cache.layers.items():
        bound = 1.0 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        a = (torch.rand(rank, layer.in_features, generator=gen) * 2 - 1) * bound
        weights[module] = (a, torch.zeros(layer.out_features, rank))
        scales[module] = alpha / rank
    targets = sorted({m.rsplit(".", 1)[-1] for m in weights})
    config = {"r": rank, "lora_alpha": alpha, "target_modules": targets,
              "base_model_name_or_path": routed.name_or_path}
    return LoraAdapter(name, weights, scales, config)


def trainable_slot(routed: RoutedModel, name: str) -> tuple[int, list[torch.Tensor]]:
    """Pin `name` in the hot set once (its weights are copied into a slot) and make the slot buffers the
    trainable tensors: every later forward is a cache hit, so training updates them in place."""
    slot = routed.cache.acquire([name])[0]
    routed.cache.release([name])
    params = []
    for layer in routed.cache.layers.values():
        assert isinstance(layer, RoutedLoRALinear)
        params += [layer.lora_A.requires_grad_(True), layer.lora_B.requires_grad_(True)]
    return slot, params


def read_slot(routed: RoutedModel, adapter: LoraAdapter, slot: int) -> LoraAdapter:
    rank = adapter.rank
    weights = {m: (layer.lora_A[slot, :rank].detach().clone().cpu(), layer.lora_B[slot, :, :rank].detach().clone().cpu())
               for m, layer in routed.cache.layers.items()}
    return LoraAdapter(adapter.name, weights, dict(adapter.scales), dict(adapter.config))


def own_span_router(domain: str, batch) -> LabelRouter:
    """The adapter on the positions that predict its own span's ids; the base model everywhere else."""
    return LabelRouter([domain], batch.labels)


@torch.no_grad()
def accuracy(routed: RoutedModel, domain: str | None, encoded, pad_id: int, device: str, batch_size: int = 64
             ) -> float:
    """Held-out exact match with the adapter on its own spans (domain None: the base model alone)."""
    hits = []
    for i in range(0, len(encoded), batch_size):
        batch = make_batch(encoded, range(i, min(i + batch_size, len(encoded))), pad_id, [domain] if domain else [],
                           device)
        router = own_span_router(domain, batch) if domain else None
        logits = routed(batch.ids, routers=router, use_cache=False).logits
        hits += exact_matches(logits, batch, encoded)[0]
    return sum(hits) / max(1, len(hits))


def train_slot(params: list[torch.Tensor], n_items: int, loss_of, args: argparse.Namespace, *, adapter: str,
               desc: str) -> tuple[int, list[tuple[int, float]]]:
    """Train one slot's LoRA tensors: AdamW, warmup + cosine (`Schedule`, bounded by args.max_minutes), gradient
    clipping 1.0, batches of args.batch_size drawn from shuffled passes over the n_items training items;
    `loss_of(rows)` is the loss of those items; the order is seeded by args.seed and the adapter's name. Returns the steps taken and the loss every 10 steps; the tensors
    are frozen again at the end."""
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = Schedule(args.steps, max(1, args.steps // 10), args.max_minutes)
    rng = random.Random(f"{args.seed}:{adapter}:order")
    order: list[int] = []
    step, curve = 0, []
    bar = tqdm(total=args.steps, desc=desc, mininterval=5)
    while not sched.done(step):
        if len(order) < args.batch_size:
            order += rng.sample(range(n_items), n_items)
        rows, order = order[:args.batch_size], order[args.batch_size:]
        for group in opt.param_groups:
            group["lr"] = args.lr * sched.factor(step)
        loss = loss_of(rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % 10 == 0 or step == args.steps:
            curve.append((step, round(loss.item(), 4)))
            bar.set_postfix(loss=f"{curve[-1][1]:.3f}")
    bar.close()
    for p in params:
        p.requires_grad_(False)
    return step, curve


def train_domain(args: argparse.Namespace, tok: UnifiedTokenizer, domain: str) -> dict:
    t0 = time.time()
    torch.manual_seed(args.seed)
    lm = LlamaForCausalLM.from_pretrained(args.model_dir / "lm", dtype=torch.float32).to(args.device)
    set_base_model_name(lm)
    lm.requires_grad_(False).train()  # dropout is 0: train mode only avoids building a KV cache
    routed = attach_routed_lora(lm, target_modules=LORA_TARGETS, num_slots=1, r_max=args.rank)
    gen = torch.Generator().manual_seed(args.seed)
    adapter = fresh_adapter(routed, domain, args.rank, args.alpha, gen)
    routed.add_adapter(adapter)
    slot, params = trainable_slot(routed, domain)
    pad = tok.vocab.pad_id

    items = domain_items(domain, args.n_train, seed=f"{args.seed}", split="train", foreign=args.foreign)
    train = [encode_item(tok, it) for it in items]
    val = [encode_item(tok, it) for it in domain_items(domain, args.n_val, seed=f"val{args.seed}", split="heldout")]
    base_acc = accuracy(routed, None, val, pad, args.device)

    def loss_of(rows: list[int]) -> torch.Tensor:
        batch = make_batch(train, rows, pad, [domain], args.device, only=domain)
        return answer_loss(routed(batch.ids, routers=own_span_router(domain, batch), use_cache=False).logits, batch)

    step, curve = train_slot(params, len(train), loss_of, args, adapter=domain, desc=f"adapter {domain}")
    acc = accuracy(routed, domain, val, pad, args.device)
    trained = read_slot(routed, adapter, slot)
    folder = args.out / domain
    save_peft_adapter(trained, folder)
    (folder / "molora.json").write_text(json.dumps(
        {"modality": "text", "domain": domain, "description": DESCRIPTIONS[domain],
         "context": "base: the adapter acts on the positions that predict its own answer span only"}, indent=2))
    metrics = {"val_exact_match": round(acc, 4), "val_exact_match_base": round(base_acc, 4), "val_items": len(val),
               "train_items": len(train), "steps": step, "planned_steps": args.steps, "batch_size": args.batch_size,
               "lr": args.lr, "foreign": args.foreign, "rank": args.rank, "alpha": args.alpha, "seed": args.seed,
               "threads": args.threads,
               "train_loss": curve[-1][1] if curve else None, "loss_curve": curve,
               "seconds": round(time.time() - t0, 1), "device": device_name(args.device),
               "torch": torch.__version__}
    log.info("%s: held-out exact match %.3f (base %.3f) after %d steps, %.0f s", domain, acc, base_acc, step,
             metrics["seconds"])
    return metrics


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    tok = UnifiedTokenizer.load(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    metrics_path = args.out / "domain_metrics.json"
    results = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    for domain in args.domains:
        results[domain] = train_domain(args, tok, domain)
        metrics_path.write_text(json.dumps(results, indent=2))  # after every domain: a stopped run keeps them
    return results


if __name__ == "__main__":
    main()
