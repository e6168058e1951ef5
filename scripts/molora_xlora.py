"""The peft X-LoRA row of scripts/eval_molora.py: its classifier trained on the router's data and steps budget.

X-LoRA (peft XLoraConfig) runs a scaling pass of the base model without adapters, a classifier on its hidden
states gives dense per-token scalings of every adapter (softmax, here one per layer: layerwise_scalings), and the
real pass mixes all adapters with them. Only the classifier trains, on the same next-token answer loss, the same
generated training records, batch size, steps and learning rate as our gates (read from the router's
config.json).

Two peft 0.21.2 quirks, measured here: X-LoRA refuses a model whose config has use_cache=True ("`use_cache` must
be False"), and it loads the adapters under the names "0", "1", ... but then activates the keys of
`XLoraConfig.adapters`, so any other keys fail at the first forward with KeyError; the adapters are passed as
{"0": path, "1": path, ...}.
"""

from __future__ import annotations

import json
import random
import time

import torch
from tqdm import tqdm
from train_router import shapes_data

from molora.models.families.shapes.data import Schedule
from molora.models.families.shapes.domain_batches import answer_loss, make_batch


def xlora_row(args, adapters: list[str], tok, encoded, pad: int, record, fresh_lm, score) -> None:
    """Train peft's X-LoRA classifier over the domain adapters on a fresh base model (`fresh_lm(model_dir,
    device)`) and record its row, scored by `score`: both eval_molora's, passed in, so this module imports nothing
    from the script that calls it."""
    from peft import XLoraConfig, get_peft_model
    config_path = args.router.parent / "config.json"
    cfg = json.loads(config_path.read_text())
    steps = args.xlora_steps or int(cfg["steps"])
    batch_size, lr, seed = int(cfg["batch_size"]), float(cfg["lr"]), int(cfg["seed"])
    torch.manual_seed(seed)
    lm = fresh_lm(args.model_dir, args.device)
    lm.config.use_cache = False
    xcfg = XLoraConfig(task_type="CAUSAL_LM", hidden_size=int(lm.config.hidden_size), xlora_depth=1,
                       layerwise_scalings=True,
                       adapters={str(i): str(args.adapters_dir / a) for i, a in enumerate(adapters)})
    model = get_peft_model(lm, xcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    train = shapes_data(tok, adapters, int(cfg["n_per_domain"]), f"router{seed}", "train",
                        int(cfg.get("n_mixed", cfg["n_per_domain"])))
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = Schedule(steps, max(1, steps // 10))
    rng = random.Random(f"{seed}:router-order")  # the same batches as the router
    order: list[int] = []
    t0 = time.time()
    model.train()
    for step in tqdm(range(steps), desc="x-lora classifier", mininterval=5):
        if len(order) < batch_size:
            order += rng.sample(range(len(train)), len(train))
        rows, order = order[:batch_size], order[batch_size:]
        batch = make_batch(train, rows, pad, adapters, args.device)
        for group in opt.param_groups:
            group["lr"] = lr * sched.factor(step)
        loss = answer_loss(model(input_ids=batch.ids).logits, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    train_s = time.time() - t0
    model.eval()
    t0 = time.time()
    hits = score(lambda b: model(input_ids=b.ids).logits, encoded, pad, adapters, args.batch_size, args.device)
    record("peft_xlora", hits, time.time() - t0, train_steps=steps, train_seconds=round(train_s, 1),
           classifier_params=sum(p.numel() for p in params), final_train_loss=round(float(loss.detach()), 4))
