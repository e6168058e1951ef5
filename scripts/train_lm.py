"""Train the embedded LM (transformers LlamaForCausalLM, ~7M parameters) on shapes-world sequences.

Base data (plain register, filled style only; the adapters learn the rest):
    38% text->image from an instruction, 14% text->image from a caption, 29% image->text captions,
    14% interleaved documents, 5% text-only pirate sentences (never beside a picture: they train the output rows
    of pirate words so a LoRA can use them; see models/families/shapes/data.py); text before <boi> dropped 10% of the time
    (classifier-free guidance).
Image spans are the VQ codes row by row, each row closed by its row marker (vocab.json row_end_ids).
Needs tokenizer.json, vocab.json and vq/ in the model directory (train_tokenizer.py, train_vq.py); writes
lm/ (safetensors, bf16 by default: the loader upcasts on CPU) and lm/metrics.json (with the validation
losses every --val-every steps).

    python scripts/train_lm.py --model-dir runs/model --workers 16          # the real run (GPU)
    python scripts/train_lm.py --model-dir /tmp/m --tiny --steps 3           # a CPU smoke run
    python scripts/train_lm.py --model-dir runs/model --init-from runs/stage1/lm --seed 1 --lr 1e-3
                                # a second stage: continue from stage 1's weights on fresh examples (seed 1)
    torchrun --standalone --nproc_per_node 2 scripts/train_lm.py --model-dir runs/model --workers 16
                                # data parallel, one process a GPU (gloo on CPU)
    python scripts/train_lm.py --model-dir runs/big --hidden 512 --intermediate 2048 --heads 8 --domain-share 0.04
                                # a base that also reads the question domains (scripts/scale_vs_specialise.sh)

--domain-share F mixes the question-domain items of models/families/shapes/domains.py (train split) into the training
sequences, F of the training ids of every epoch: the very items scripts/train_domain_adapters.py and
scripts/train_router.py train on with --seed --domain-seed (prefixes of their generators), a share
--domain-router-share of the domain ids as the router's data (each domain, and as many mixed requests), the rest as
the adapters' (each domain, 40% also asking another domain's question). Each item is one sequence, encoded as those
scripts read it ([<bos>] prompt answer [<eos>]); the loss covers all of its ids like any other sequence's, or with
--targets-only the answer ids only (the prompt is context, as for the adapters). The default, 0, adds nothing.

Data parallel: each rank renders and encodes its own share of the --n-examples sequences (the shares together
are exactly the single-process examples) and trains on --tokens-per-batch ids a step (so a step sees world-size
times as many); DDP averages the gradients. Rank 0 decides the learning rate and when to stop (the time limit)
and sends both to every rank each step, so all ranks take identical steps; it alone validates and saves.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.vocab import IMAGE  # noqa: E402
from molora.models.families.shapes.data import (  # noqa: E402
    ExampleSpec,
    Schedule,
    collate,
    encode_examples,
    example_scenes,
    images_to_tensor,
    length_batches,
    load_checkpoint,
    prompt_length,
    render_batch,
    sample_examples,
    save_checkpoint,
)
from molora.models.families.shapes.image_tokenizer import ImageTokenizer  # noqa: E402
from molora.models.families.shapes.testing import llama_config  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402

log = logging.getLogger("train_lm")
VAL_SEED = "lm-val0"  # the same held-out sequences whatever --seed is, so stages and runs compare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--n-examples", type=int, default=320_000)
    p.add_argument("--n-val", type=int, default=1024, help="held-out-split examples for validation loss")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--tokens-per-batch", type=int, default=65_536, help="padded ids a step, per process")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop early (and still save) after this much training time; 0 = no limit")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--val-every", type=int, default=1000, help="validation losses every N steps (0 = at the end)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (dynamic shapes); falls back to eager if the first step fails")
    p.add_argument("--resume", action="store_true", help="continue from LM_DIR/checkpoint.safetensors")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this saved LM (a second training stage) instead of random weights; its "
                        "vocabulary and shape win over --hidden/--layers/...")
    p.add_argument("--targets-only", action="store_true",
                   help="loss on generated tokens only: a text->image example's prompt and an image->text example's "
                        "picture are context, as in train_adapters (validation still scores every target)")
    p.add_argument("--domain-share", type=float, default=0.0,
                   help="share of each epoch's training ids that are question-domain items (the adapters' and the "
                        "router's train data, models/families/shapes/domains.py); 0 = none (see the module docstring)")
    p.add_argument("--domain-router-share", type=float, default=0.2,
                   help="with --domain-share: share of the domain ids drawn as train_router.py's data, the rest as "
                        "train_domain_adapters.py's")
    p.add_argument("--domain-router-mixed", type=float, default=1.0,
                   help="with --domain-share: mixed requests a domain item in train_router.py's data (its --n-mixed "
                        "over --n-per-domain)")
    p.add_argument("--domain-seed", type=int, default=0,
                   help="with --domain-share: the --seed of the adapters and router whose train items are mirrored")
    p.add_argument("--tiny", action="store_true", help="tiny model and data (CPU smoke test)")
    args = p.parse_args(argv)
    if not 0.0 <= args.domain_share < 1.0 or not 0.0 <= args.domain_router_share <= 1.0:
        p.error("--domain-share must lie in [0, 1) and --domain-router-share in [0, 1]")
    if args.domain_router_mixed < 0:
        p.error("--domain-router-mixed must be >= 0")
    if args.tiny:
        args.n_examples, args.n_val, args.hidden, args.layers, args.heads = 48, 8, 32, 2, 2
        args.intermediate, args.tokens_per_batch = 64, 4096
    return args


@torch.no_grad()
def encode_scenes(vq: ImageTokenizer, scenes: list, workers: int, batch: int = 1024) -> torch.Tensor:
    """VQ codes [N, rows, cols] (cpu) of the renders of `scenes`."""
    images = render_batch(scenes, workers=workers)
    codes = [vq.encode(images_to_tensor(images[i:i + batch])).cpu()
             for i in tqdm(range(0, len(images), batch), desc="vq-encode", mininterval=10)]
    return torch.cat(codes) if codes else torch.zeros((0, *vq.grid), dtype=torch.long)


def build_sequences(tok: UnifiedTokenizer, vq: ImageTokenizer, n: int, *, seed: str, split: str, workers: int,
                    cfg_dropout: float, shard: tuple[int, int] = (0, 1)) -> tuple[list[list[int]], list[int]]:
    """The id sequences of `n` seeded examples and each one's prompt_length, or of shard (rank, world size)'s
    share of them: every world-size-th example from the rank-th, so the shards of all ranks together are exactly
    the unsharded examples (which prompts lose their text for CFG is drawn per shard). Drawing examples is cheap;
    rendering and VQ-encoding them, which each rank does for its share only, is not."""
    rank, world_size = shard
    examples = sample_examples(n, seed=seed, spec=ExampleSpec(split=split), workers=workers)[rank::world_size]
    codes = encode_scenes(vq, example_scenes(examples), workers)
    seqs = encode_examples(examples, tok, codes, seed=zlib.crc32(seed.encode()), cfg_dropout=cfg_dropout,
                           max_len=10**9)
    return seqs, [prompt_length(e, s, tok.vocab) for e, s in zip(examples, seqs, strict=True)]


def domain_sequences(tok: UnifiedTokenizer, n_ids: int, *, router_share: float, seed: int,
                     router_mixed: float = 1.0) -> tuple[list[list[int]], list[int]]:
    """About `n_ids` ids of question-domain items (train split) and each one's prompt length (its answer's first
    index), encoded as train_domain_adapters.py and train_router.py read them ([<bos>] prompt answer [<eos>]).

    A share `router_share` of the ids are train_router.py's items with --seed `seed` (per domain, and `router_mixed`
    mixed requests of two domains for each: its --n-mixed over --n-per-domain), the rest train_domain_adapters.py's
    (per domain, 40% also asking another domain's question): prefixes of the same seeded generators, so these are the
    items those scripts train on, up to the count that fills the budget. The counts come from the mean length of the
    first ~64 items of each list."""
    from molora.models.families.shapes.domain_batches import encode_item
    from molora.models.families.shapes.domains import DOMAINS, domain_items, mixed_items

    def adapter_items(n: int) -> list:
        return [it for d in DOMAINS for it in domain_items(d, n, seed=f"{seed}", split="train", foreign=0.4)]

    def router_items(n: int) -> list:
        return ([it for d in DOMAINS for it in domain_items(d, n, seed=f"router{seed}", split="train")]
                + mixed_items(round(n * router_mixed), seed=f"router{seed}", split="train", domains=DOMAINS))

    items = []
    for make, share, kinds in ((adapter_items, 1.0 - router_share, len(DOMAINS)),
                               (router_items, router_share, len(DOMAINS) + router_mixed)):
        probe = [len(encode_item(tok, it)) for it in make(int(64 // kinds) + 1)]
        n = round(n_ids * share / kinds / (sum(probe) / len(probe)))
        items += make(n) if n > 0 else []
    encoded = [encode_item(tok, it) for it in items]
    return [e.ids for e in encoded], [e.answer_start for e in encoded]


def token_losses(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, amp: bool) -> torch.Tensor:
    """Per-position next-token loss [B, T-1] (0 at padding).

    Batches are right-padded, so the causal mask alone keeps every real token from seeing padding: no attention
    mask is passed, and attention runs as plain causal (flash) attention."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return loss * mask[:, 1:]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, seqs: list[list[int]], tok: UnifiedTokenizer, device: torch.device,
             amp: bool, tokens_per_batch: int) -> dict:
    """Mean loss on text targets and on image targets (image codes and <eoi>) of held-out sequences."""
    model.eval()
    table = tok.vocab.modality_table(device)
    sums = {"text": 0.0, "image": 0.0}
    counts = {"text": 0, "image": 0}
    for batch in length_batches([len(s) for s in seqs], tokens_per_batch, seed=0, epoch=0):
        ids, mask = collate([seqs[i] for i in batch], tok.vocab.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        loss = token_losses(model, ids, mask, amp)
        # a target is an image target when the position predicting it is routed to the image side
        is_image = (table[ids[:, :-1]] == IMAGE) & (mask[:, 1:] > 0)
        is_text = (table[ids[:, :-1]] != IMAGE) & (mask[:, 1:] > 0)
        for name, sel in (("text", is_text), ("image", is_image)):
            sums[name] += float(loss[sel].sum())
            counts[name] += int(sel.sum())
    model.train()
    return {f"val_{k}_loss": sums[k] / max(1, counts[k]) for k in sums}


def init_distributed(device_name: str) -> tuple[int, int, torch.device, dist.ProcessGroup | None]:
    """(rank, world size, this process's device, a CPU group for the per-step schedule) from torchrun's
    environment; (0, 1, device, None) when not launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(device_name)
    if world_size == 1:
        return 0, 1, device, None
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda"
                            else None)
    # the schedule travels on a CPU (gloo) group: a broadcast there does not wait for the GPU's queue to drain
    return dist.get_rank(), world_size, device, dist.new_group(backend="gloo")


def synced_schedule(sched: Schedule, step: int, group: dist.ProcessGroup | None) -> tuple[float, bool]:
    """Rank 0's (learning-rate factor, done) for this step, on every rank: the time limit reads each rank's own
    clock, and ranks that disagreed would take different steps."""
    state = torch.tensor([sched.factor(step), float(sched.done(step))], dtype=torch.float64)
    if group is not None:
        dist.broadcast(state, src=0, group=group)
    return float(state[0]), bool(state[1])


def check_ranks_agree(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Every rank must end with the same weights (same gradients, same learning rates): compare a checksum."""
    checksum = sum(p.detach().double().sum() for p in model.parameters()).cpu()
    extremes = torch.stack([checksum, -checksum])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if extremes[0] != -extremes[1]:
        raise RuntimeError(f"data-parallel ranks ended with different weights (checksums {-extremes[1]:.6g} to "
                           f"{extremes[0]:.6g}): a step differed between ranks")


def main(argv: list[str] | None = None) -> dict | None:
    """Train; returns the metrics on rank 0 (None on the other ranks of a data-parallel run)."""
    args = parse_args(argv)
    rank, world_size, device, sched_group = init_distributed(args.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    if args.n_examples < world_size:
        raise SystemExit(f"--n-examples {args.n_examples} leaves some of the {world_size} processes no data")
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    amp = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()

    tok = UnifiedTokenizer.load(args.model_dir)
    vq = ImageTokenizer.from_pretrained(args.model_dir / "vq", device=device)
    if vq.codebook_size != tok.vocab.image_size or tuple(vq.grid) != tuple(tok.vocab.image_grid):
        raise SystemExit(f"vocab.json (image_size {tok.vocab.image_size}, grid {tok.vocab.image_grid}) does not "
                         f"match the VQ (codebook {vq.codebook_size}, grid {vq.grid}): retrain the tokenizer")
    train, prompts = build_sequences(tok, vq, args.n_examples, seed=f"lm{args.seed}", split="train",
                                     workers=args.workers, cfg_dropout=0.1, shard=(rank, world_size))
    val = [] if rank else build_sequences(tok, vq, args.n_val, seed=VAL_SEED, split="heldout", workers=args.workers,
                                          cfg_dropout=0.0)[0]
    too_long = sum(len(s) > args.max_positions for s in train)
    keep = [i for i, s in enumerate(train) if len(s) <= args.max_positions]
    train, prompts = [train[i] for i in keep], [prompts[i] for i in keep]
    val = [s for s in val if len(s) <= args.max_positions]
    totals = torch.tensor([len(train), sum(len(s) for s in train), too_long])  # over all ranks
    if world_size > 1:
        dist.all_reduce(totals, group=sched_group)
    n_sequences, n_tokens, too_long = totals.tolist()
    log.info("data: %d sequences on %d process(es) (%.1fM ids, %d over %d dropped), %d val, in %.0fs", n_sequences,
             world_size, n_tokens / 1e6, too_long, args.max_positions, len(val), time.time() - t0)
    n_base = len(train)  # this process's sequences before the domain items: indices >= n_base are domain items
    domain = {}
    if args.domain_share > 0:
        # the same global item list on every rank (sized from the global id count), each rank taking its share
        d_seqs, d_prompts = domain_sequences(tok, round(n_tokens * args.domain_share / (1.0 - args.domain_share)),
                                             router_share=args.domain_router_share, seed=args.domain_seed,
                                             router_mixed=args.domain_router_mixed)
        d_ids = sum(len(s) for s in d_seqs)
        train += d_seqs[rank::world_size]
        prompts += d_prompts[rank::world_size]
        domain = {"domain_share": args.domain_share, "domain_router_share": args.domain_router_share,
                  "domain_seed": args.domain_seed, "domain_sequences": len(d_seqs), "domain_ids_per_epoch": d_ids,
                  "domain_share_actual": round(d_ids / (n_tokens + d_ids), 5)}
        log.info("domain items: %d sequences, %.2fM ids (%.2f%% of the epoch's ids)", len(d_seqs), d_ids / 1e6,
                 100 * domain["domain_share_actual"])
        n_sequences, n_tokens = n_sequences + len(d_seqs), n_tokens + d_ids
    del vq
    gc.freeze()  # millions of id lists: keep the garbage collector from walking them during training

    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if model.config.vocab_size != tok.vocab.vocab_size:
            raise SystemExit(f"--init-from {args.init_from} has vocab_size {model.config.vocab_size}, but vocab.json "
                             f"has {tok.vocab.vocab_size}: it was trained with another tokenizer")
        model = model.to(device)
        log.info("initialised from %s", args.init_from)
    else:
        config = llama_config(tok.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                              intermediate_size=args.intermediate, max_positions=args.max_positions)
        model = LlamaForCausalLM(config).to(device)
    # from_pretrained returns a model in eval mode, which builds a KV cache every step (and a compiled step would
    # be traced for eval): the --init-from stages ran 40% slower until the first validation switched it back
    model.train()
    # step_model runs the training steps and shares model's parameters; model itself validates and saves
    eager_model = DistributedDataParallel(model) if world_size > 1 else model
    step_model = torch.compile(eager_model, dynamic=True) if args.compile else eager_model
    n_params = sum(p.numel() for p in model.parameters())
    log.info("LlamaForCausalLM: %.2fM parameters, vocab %d", n_params / 1e6, model.config.vocab_size)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=amp)
    lm_dir = args.model_dir / "lm"
    lm_dir.mkdir(parents=True, exist_ok=True)
    ckpt = lm_dir / "checkpoint.safetensors"
    start = 0
    if args.resume and ckpt.is_file():
        start = load_checkpoint(ckpt, model, opt)["step"]
        log.info("resumed from step %d", start)

    lengths = [len(s) for s in train]
    epoch, batches = 0, []
    seen = 0
    for epoch in range(10**6):  # skip the batches a resumed run already trained on
        batches = length_batches(lengths, args.tokens_per_batch, seed=args.seed, epoch=epoch)
        if seen + len(batches) > start:
            batches = batches[start - seen:]
            break
        seen += len(batches)
    t_train, step, losses, val_curve, loss = time.time(), start, [], [], None
    # real (non-padding) ids this process trains on from here (a resumed run: not those before its checkpoint)
    trained_ids = {"ids": 0, "domain_ids": 0}
    sched = Schedule(args.steps, min(200, args.steps // 10), args.max_minutes)
    bar = tqdm(total=args.steps, initial=start, desc="lm", mininterval=10, disable=rank > 0)
    while True:
        lr_factor, done = synced_schedule(sched, step, sched_group)
        if done:
            break
        if not batches:
            epoch += 1
            batches = length_batches(lengths, args.tokens_per_batch, seed=args.seed, epoch=epoch)
        batch = batches.pop()
        trained_ids["ids"] += sum(lengths[i] for i in batch)  # on the host, from the lengths: no device sync
        trained_ids["domain_ids"] += sum(lengths[i] for i in batch if i >= n_base)
        ids, mask = collate([train[i] for i in batch], tok.vocab.pad_id,
                            context=[prompts[i] for i in batch] if args.targets_only else None)
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor
        opt.zero_grad(set_to_none=True)
        try:
            loss = token_losses(step_model, ids, mask, amp).sum() / mask[:, 1:].sum()
            loss.backward()
        except Exception as exc:  # a compiler failure must not cost the run: continue in eager mode
            if step_model is eager_model or step > start:
                raise
            log.warning("torch.compile failed (%s: %s); training in eager mode", type(exc).__name__, exc)
            step_model = eager_model
            opt.zero_grad(set_to_none=True)
            loss = token_losses(eager_model, ids, mask, amp).sum() / mask[:, 1:].sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % 50 == 0 or step == args.steps:
            losses.append((step, round(time.time() - t_train, 2), loss.item()))  # (step, seconds, loss)
            bar.set_postfix(loss=f"{losses[-1][2]:.4f}", epoch=epoch)
        if rank == 0 and args.val_every and step % args.val_every == 0 and not sched.done(step):
            val_curve.append({"step": step, **evaluate(model, val, tok, device, amp, args.tokens_per_batch)})
            log.info("step %d: %s", step, val_curve[-1])
        if rank == 0 and args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps:
            save_checkpoint(ckpt, model, opt, {"step": step})
    bar.close()
    seen_all = torch.tensor([trained_ids["ids"], trained_ids["domain_ids"]], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(seen_all, group=sched_group)
        check_ranks_agree(model, sched_group)
        dist.destroy_process_group()
        if rank > 0:
            return None
    train_seconds = time.time() - t_train
    final_loss = None if loss is None else loss.item()  # None: no step was taken
    metrics = evaluate(model, val, tok, device, amp, args.tokens_per_batch)
    metrics.update(train_loss=final_loss, steps=step, planned_steps=args.steps, epochs=epoch + 1,
                   sequences=n_sequences, train_tokens_per_epoch=n_tokens, params=n_params, seed=args.seed,
                   processes=world_size, tokens_per_batch=args.tokens_per_batch, lr=args.lr,
                   ids_seen=int(seen_all[0]), domain_ids_seen=int(seen_all[1]), **domain,
                   train_seconds=round(train_seconds, 1),
                   total_seconds=round(time.time() - t0, 1), loss_curve=losses,
                   val_curve=[*val_curve, {"step": step, "val_text_loss": metrics["val_text_loss"],
                                           "val_image_loss": metrics["val_image_loss"]}],
                   compiled=step_model is not eager_model, targets_only=args.targets_only,
                   init_from=str(args.init_from) if args.init_from else None,
                   device=torch.cuda.get_device_name() if amp else "cpu")
    log.info("step %d: train loss %s, val text %.4f, val image %.4f", step, final_loss,
             metrics["val_text_loss"], metrics["val_image_loss"])
    model.to("cpu", dtype=getattr(torch, args.save_dtype)).save_pretrained(lm_dir, safe_serialization=True)
    (lm_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    ckpt.unlink(missing_ok=True)
    return metrics


if __name__ == "__main__":
    main()
