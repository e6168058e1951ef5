"""Train the VQ image tokenizer (diffusers.VQModel, 64x64 -> 16x16 codes) on shapes-world renders.

Data: train-split scenes in both styles (filled, outline) on every background; evaluation on held-out-split
scenes (attribute combinations never trained on).  Dead codes are restarted from encoder outputs during the
first 80% of training so the whole codebook is used.  Writes a VQModel directory (safetensors) plus
metrics.json (PSNR on held-out renders, codebook usage).

    python scripts/train_vq.py --out runs/vq                      # the real run (GPU)
    python scripts/train_vq.py --out /tmp/vq --tiny --steps 3     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import VQModel
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.families.shapes.data import (  # noqa: E402
    SceneSpec,
    Schedule,
    cycle_batches,
    images_to_tensor,
    load_checkpoint,
    psnr,
    render_batch,
    sample_scenes,
    save_checkpoint,
)
from molora.models.families.shapes.image_tokenizer import vq_config  # noqa: E402

log = logging.getLogger("train_vq")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output VQModel directory")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-train", type=int, default=60_000, help="training renders")
    p.add_argument("--n-eval", type=int, default=1024, help="held-out renders for PSNR")
    p.add_argument("--codebook", type=int, default=512)
    p.add_argument("--channels", type=str, default="64,128,128")
    p.add_argument("--layers", type=int, default=1, help="resnet layers per block")
    p.add_argument("--latent", type=int, default=64, help="latent / codebook vector size")
    p.add_argument("--restart-every", type=int, default=100, help="steps between dead-code restarts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes for scene sampling / rendering")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="end training (annealed, saved) after this long even if --steps is not reached")
    p.add_argument("--ckpt-every", type=int, default=1000, help="steps between resumable checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.safetensors")
    p.add_argument("--tiny", action="store_true", help="tiny model and data (CPU smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.channels, args.latent, args.n_train, args.n_eval, args.batch = "8,8,8", 8, 64, 16, 8
        args.codebook = min(args.codebook, 32)
    return args


def make_model(args: argparse.Namespace) -> VQModel:
    channels = tuple(int(c) for c in args.channels.split(","))
    groups = math.gcd(32, *channels)
    return VQModel(**vq_config(block_out_channels=channels, layers_per_block=args.layers, latent_channels=args.latent,
                               codebook_size=args.codebook, norm_num_groups=groups))


def forward(vq: VQModel, x: torch.Tensor, amp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reconstruction, quantiser loss, code indices and pre-quantisation latents (for restarts)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        h = vq.encode(x).latents
    h = h.float()  # nearest-code search and codebook losses in fp32
    z_q, q_loss, (_, _, idx) = vq.quantize(h)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        rec = vq.decode(z_q, force_not_quantize=True).sample
    return rec.float(), q_loss, idx.reshape(-1), h


@torch.no_grad()
def restart_dead_codes(vq: VQModel, counts: torch.Tensor, h: torch.Tensor) -> int:
    """Move unused codebook vectors onto random encoder outputs of the current batch."""
    dead = (counts == 0).nonzero().reshape(-1)
    if dead.numel() == 0:
        return 0
    flat = h.permute(0, 2, 3, 1).reshape(-1, h.shape[1])
    pick = torch.randint(0, flat.shape[0], (dead.numel(),), device=flat.device)
    vq.quantize.embedding.weight.data[dead] = flat[pick] + 1e-3 * torch.randn_like(flat[pick])
    return int(dead.numel())


@torch.no_grad()
def evaluate(vq: VQModel, images: torch.Tensor, codebook: int, batch: int, amp: bool) -> dict:
    vq.eval()
    scores, used = [], torch.zeros(codebook, dtype=torch.long, device=images.device)
    for i in range(0, images.shape[0], batch):
        x = images[i:i + batch]
        rec, _, idx, _ = forward(vq, x, amp)
        scores.append(psnr(rec, x))
        used += torch.bincount(idx, minlength=codebook)
    vq.train()
    scores = torch.cat(scores)
    p = used.float() / used.sum()
    perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
    return {"psnr_mean": float(scores.mean()), "psnr_min": float(scores.min()),
            "psnr_p05": float(scores.quantile(0.05)), "codes_used": int((used > 0).sum()),
            "codebook_usage": float((used > 0).float().mean()), "perplexity": perplexity}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    t0 = time.time()

    styles = ("filled", "outline")
    train_scenes = sample_scenes(args.n_train, seed=f"vq{args.seed}", spec=SceneSpec("train", styles),
                                 workers=args.workers)
    eval_scenes = sample_scenes(args.n_eval, seed=f"vq-eval{args.seed}", spec=SceneSpec("heldout", styles),
                                workers=args.workers)
    train = images_to_tensor(render_batch(train_scenes, workers=args.workers)).to(device)
    held = images_to_tensor(render_batch(eval_scenes, workers=args.workers)).to(device)
    log.info("data: %d train / %d held-out renders in %.1fs", len(train), len(held), time.time() - t0)

    vq = make_model(args).to(device)
    n_params = sum(p.numel() for p in vq.parameters())
    log.info("VQModel: %.2fM parameters, codebook %d", n_params / 1e6, args.codebook)
    opt = torch.optim.AdamW(vq.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoint.safetensors"
    start = 0
    if args.resume and ckpt.is_file():
        start = load_checkpoint(ckpt, vq, opt)["step"]
        log.info("resumed from step %d", start)

    batches = cycle_batches(len(train), min(args.batch, len(train)), seed=args.seed)
    for _ in range(start):
        next(batches)
    counts = torch.zeros(args.codebook, dtype=torch.long, device=device)
    restarts, initialised = 0, start > 0
    sched = Schedule(args.steps, min(200, args.steps // 10), args.max_minutes)
    bar = tqdm(total=args.steps, initial=start, desc="vq", mininterval=5)
    step = start
    while not sched.done(step):
        for group in opt.param_groups:
            group["lr"] = args.lr * sched.factor(step)
        x = train[next(batches).to(device)]
        if not initialised:  # codebook starts on encoder outputs, not on the unit-normal init
            with torch.no_grad():
                restart_dead_codes(vq, torch.zeros_like(counts), forward(vq, x, amp)[3])
            initialised = True
        rec, q_loss, idx, h = forward(vq, x, amp)
        rec_loss = F.mse_loss(rec, x) + 0.5 * F.l1_loss(rec, x)
        loss = rec_loss + q_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vq.parameters(), 1.0)
        opt.step()
        counts += torch.bincount(idx.detach(), minlength=args.codebook)
        if (step + 1) % args.restart_every == 0:
            if sched.progress(step) < 0.8:
                restarts += restart_dead_codes(vq, counts, h.detach())
            counts.zero_()
        if step % 100 == 0:
            bar.set_postfix(rec=f"{rec_loss.item():.4f}", q=f"{q_loss.item():.4f}", restarts=restarts)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            save_checkpoint(ckpt, vq, opt, {"step": step + 1})
        step += 1
        bar.update(1)
    bar.close()

    metrics = evaluate(vq, held, args.codebook, 256, amp)
    metrics.update(steps=step, planned_steps=args.steps, batch=args.batch, n_train=args.n_train, n_eval=args.n_eval,
                   params=n_params, codebook=args.codebook, code_restarts=restarts, seed=args.seed,
                   seconds=round(time.time() - t0, 1), device=torch.cuda.get_device_name() if amp else "cpu",
                   final_rec_loss=float(rec_loss.item()))
    log.info("held-out PSNR %.2f dB (min %.2f), codebook usage %d/%d", metrics["psnr_mean"], metrics["psnr_min"],
             metrics["codes_used"], args.codebook)
    vq.to("cpu").save_pretrained(str(args.out), safe_serialization=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    ckpt.unlink(missing_ok=True)
    return metrics


if __name__ == "__main__":
    main()
