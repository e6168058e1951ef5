"""Train the style adapters (PEFT LoRA) on the frozen embedded LM, routed the way inference routes them.

    pirate   (text adapter)  captions and document text in the pirate register
    outline  (image adapter) shapes drawn as outlines

Vocabulary routing (models/engine/vocab.py modality_table) applies the image adapter at positions whose input is
<boi> or an image code and the text adapter everywhere else.  Training does exactly that: both adapters live
in one peft model, and a forward hook on every lora_B multiplies its output by a per-token mask
[B,T,1] = (the adapter is on for this sequence) x (the position routes to the adapter's modality).  The data mixes
pirate-only (plain pictures), outline-only (plain text) and both-at-once sequences, so each adapter works alone
and both work together in ONE pass, as inference will run them.  The loss covers every generated token (not
the prompt of a text->image example, nor the given picture of an image->text one), so an adapter also learns not
to disturb the other modality's content.  The given picture of an image->text example is drawn in either style:
the image adapter reads it at inference too, and must not spoil the reading.

Writes OUT/<name>/adapter_config.json + adapter_model.safetensors (peft's save_pretrained) + molora.json.

    python scripts/train_adapters.py --model-dir runs/model --out runs/adapters --workers 16
    python scripts/train_adapters.py --model-dir /tmp/m --out /tmp/ad --tiny --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from tqdm import tqdm
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.vocab import IMAGE, TEXT, UnifiedVocab  # noqa: E402
from molora.models.families.shapes.data import (  # noqa: E402
    ADAPTER_MIX,
    Example,
    ExampleSpec,
    Schedule,
    collate,
    encode_examples,
    example_scenes,
    length_batches,
    prompt_length,
    sample_examples,
)
from molora.models.families.shapes.image_tokenizer import ImageTokenizer  # noqa: E402
from molora.models.families.shapes.testing import LORA_TARGETS, set_base_model_name  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402
from molora.models.families.shapes.world import STYLES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import encode_scenes  # noqa: E402

log = logging.getLogger("train_adapters")

ADAPTERS = {  # name -> (modality, description)
    "pirate": ("text", "Text style: captions and stories in the pirate register (arr, ahoy, matey)."),
    "outline": ("image", "Image style: shapes drawn as outlines with hollow centres."),
}
# (register, style, weight): pirate only, outline only, both in one sequence
LOOKS = (("pirate", "filled", 0.35), ("plain", "outline", 0.35), ("pirate", "outline", 0.30))


class RoutedLoraMask:
    """Per-token gates on peft LoRA branches: the branch of adapter `a` contributes only where mask[a] is 1.

    Hooks every `lora_B[a]` of the peft model (its output is the LoRA delta before scaling), so one forward
    with several active adapters applies each at its own positions, as vocabulary routing does at inference.
    """

    def __init__(self, peft_model: PeftModel, adapter_names: list[str]) -> None:
        self.masks: dict[str, torch.Tensor | None] = {a: None for a in adapter_names}
        self.handles = []
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                for a in adapter_names:
                    self.handles.append(module.lora_B[a].register_forward_hook(self._hook(a)))
        if not self.handles:
            raise ValueError("the model has no peft LoRA layers to mask")

    def _hook(self, adapter: str):
        def hook(_module, _inputs, output):
            mask = self.masks[adapter]
            if mask is None:
                raise RuntimeError(f"RoutedLoraMask: no mask set for adapter {adapter!r} before forward")
            return output * mask.to(output.dtype)
        return hook

    def set(self, input_ids: torch.Tensor, vocab_table: torch.Tensor, enabled: dict[str, torch.Tensor],
            modality: dict[str, int]) -> None:
        """mask[a][b,t] = enabled[a][b] and modality of input_ids[b,t] == modality[a]."""
        routed = vocab_table[input_ids]
        for a in self.masks:
            on = (routed == modality[a]) & enabled[a].bool()[:, None]
            self.masks[a] = on.unsqueeze(-1).float()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="adapters directory (one folder per adapter)")
    p.add_argument("--n-examples", type=int, default=60_000)
    p.add_argument("--n-val", type=int, default=768)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--tokens-per-batch", type=int, default=65_536)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=0.0)
    p.add_argument("--tiny", action="store_true", help="tiny data (CPU smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.n_examples, args.n_val, args.tokens_per_batch, args.rank = 48, 12, 4096, 4
    return args


def build(tok: UnifiedTokenizer, vq: ImageTokenizer, n: int, *, seed: str, split: str, workers: int
          ) -> tuple[list[list[int]], list[dict[str, bool]], list[int]]:
    """Sequences, which adapters are on for each, and the length of each one's prompt (not trained on)."""
    spec = ExampleSpec(mix=tuple(ADAPTER_MIX.items()), looks=LOOKS, split=split)
    examples = given_pictures_in_either_style(sample_examples(n, seed=seed, spec=spec, workers=workers), seed)
    codes = encode_scenes(vq, example_scenes(examples), workers)
    seqs = encode_examples(examples, tok, codes, seed=zlib.crc32(seed.encode()), cfg_dropout=0.0, max_len=10**9)
    flags = [{"pirate": e.register == "pirate", "outline": e.style == "outline"} for e in examples]
    prompts = [prompt_length(e, s, tok.vocab) for e, s in zip(examples, seqs)]
    return seqs, flags, prompts


def given_pictures_in_either_style(examples: list[Example], seed: str) -> list[Example]:
    """An image->text example's picture is the user's input, not the adapters' output; vocabulary routing still
    runs the image adapter over it, so that adapter must read pictures of either style and leave the caption to
    the text side. Such pictures are drawn filled or outlined at random, whatever the adapter flags say."""
    rng = random.Random(f"{seed}:given-picture-style")
    return [dataclasses.replace(e, parts=(e.parts[0].with_style(rng.choice(STYLES)), *e.parts[1:]))
            if e.kind == "i2t" else e for e in examples]


def batch_tensors(idx: list[int], seqs, flags, prompts, vocab: UnifiedVocab, device: torch.device):
    ids, mask = collate([seqs[i] for i in idx], vocab.pad_id, context=[prompts[i] for i in idx])
    weight = mask.float()  # targets ids[:, t+1]; weight of target position t+1
    enabled = {a: torch.tensor([flags[i][a] for i in idx], device=device) for a in ADAPTERS}
    return ids.to(device), weight.to(device), enabled


def forward_loss(model, masker: RoutedLoraMask, table: torch.Tensor, ids, weight, enabled, amp: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target loss [B,T-1] and its weights (padding and prompts weigh 0). Batches are right-padded, so the
    causal mask alone keeps real tokens from seeing padding (as in train_lm.token_losses)."""
    masker.set(ids, table, enabled, {a: (IMAGE if m == "image" else TEXT) for a, (m, _) in ADAPTERS.items()})
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return loss, weight[:, 1:]


@torch.no_grad()
def evaluate(model, masker, table, val, vocab, device, amp, tokens_per_batch) -> dict:
    """Validation loss per look (which adapters are on) and per target modality."""
    model.eval()
    seqs, flags, prompts = val
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for batch in length_batches([len(s) for s in seqs], tokens_per_batch, seed=0, epoch=0):
        ids, weight, enabled = batch_tensors(batch, seqs, flags, prompts, vocab, device)
        loss, w = forward_loss(model, masker, table, ids, weight, enabled, amp)
        is_image = table[ids[:, :-1]] == IMAGE
        for row, i in enumerate(batch):
            look = "+".join(a for a in ADAPTERS if flags[i][a])
            for name, sel in (("text", ~is_image[row]), ("image", is_image[row])):
                key = f"val_{look}_{name}_loss"
                sel_w = w[row] * sel
                sums[key] = sums.get(key, 0.0) + float((loss[row] * sel_w).sum())
                counts[key] = counts.get(key, 0) + int(sel_w.sum())
    model.train()
    return {k: sums[k] / counts[k] for k in sorted(sums) if counts[k]}  # a look with no such targets: no entry


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()

    tok = UnifiedTokenizer.load(args.model_dir)
    vq = ImageTokenizer.from_pretrained(args.model_dir / "vq", device=device)
    train = build(tok, vq, args.n_examples, seed=f"ad{args.seed}", split="train", workers=args.workers)
    val = build(tok, vq, args.n_val, seed=f"ad-val{args.seed}", split="heldout", workers=args.workers)
    del vq
    log.info("data: %d sequences (%.1fM ids), %d val, in %.0fs", len(train[0]),
             sum(map(len, train[0])) / 1e6, len(val[0]), time.time() - t0)

    lm = LlamaForCausalLM.from_pretrained(args.model_dir / "lm", dtype=torch.float32)
    set_base_model_name(lm)
    names = list(ADAPTERS)
    cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    model = get_peft_model(lm, cfg, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, cfg)
    model.base_model.set_adapter(names)  # all active at once; the masks decide where each one applies
    model.to(device).train()  # from_pretrained returns eval mode (as in train_lm)
    masker = RoutedLoraMask(model, names)
    table = tok.vocab.modality_table(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    log.info("adapters %s: %.2fM trainable parameters (r=%d)", names, sum(p.numel() for p in trainable) / 1e6,
             args.rank)
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    seqs, flags, prompts = train
    lengths = [len(s) for s in seqs]
    epoch, batches, step, curve = 0, [], 0, []
    t_train = time.time()
    sched = Schedule(args.steps, min(100, args.steps // 10), args.max_minutes)
    bar = tqdm(total=args.steps, desc="adapters", mininterval=10)
    while not sched.done(step):
        if not batches:
            batches = length_batches(lengths, args.tokens_per_batch, seed=args.seed, epoch=epoch)
            epoch += 1
        ids, weight, enabled = batch_tensors(batches.pop(), seqs, flags, prompts, tok.vocab, device)
        for group in opt.param_groups:
            group["lr"] = args.lr * sched.factor(step)
        per_token, w = forward_loss(model, masker, table, ids, weight, enabled, amp)
        loss = (per_token * w).sum() / w.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % 50 == 0 or step == args.steps:
            curve.append((step, loss.item()))
            bar.set_postfix(loss=f"{curve[-1][1]:.4f}")
    bar.close()
    metrics = evaluate(model, masker, table, val, tok.vocab, device, amp, args.tokens_per_batch)
    metrics.update(train_loss=float(loss.item()), steps=step, planned_steps=args.steps, rank=args.rank,
                   alpha=args.alpha, sequences=len(seqs), seed=args.seed, loss_curve=curve,
                   train_seconds=round(time.time() - t_train, 1), total_seconds=round(time.time() - t0, 1),
                   device=torch.cuda.get_device_name() if amp else "cpu")
    log.info("adapters: %s", {k: round(v, 4) for k, v in metrics.items() if k.startswith("val_")})
    masker.remove()
    model.to("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (modality, description) in ADAPTERS.items():
        # peft writes a non-default adapter to OUT/<name>/
        model.save_pretrained(args.out, selected_adapters=[name], safe_serialization=True,
                              save_embedding_layers=False)
        (args.out / name / "molora.json").write_text(json.dumps(
            {"modality": modality, "description": description}, indent=2))
    # peft also leaves an empty model-card template in OUT; the adapters are described in assets/model/README.md
    (args.out / "README.md").unlink(missing_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    main()
