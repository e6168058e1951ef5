"""Specialisation vs scale (issue 12): the helpers of scripts/scale_vs_specialise.sh.

Arm "1x + adapters + router": a fresh 1x LM (train_lm.py), the four domain adapters on it
(train_domain_adapters.py), a router over them (train_router.py). Arm "4x base": an LM of about four times the
parameters, no adapters, trained on as many ids as the whole of arm 1, with the adapters' and the router's train
items mixed into its data in the same share of ids (train_lm.py --domain-share). Three steps:

    plan       the token budget: the ids arm 1's adapters and router will train on (their steps x batch x the mean
               length of their train items, which their seeded generators fix), the 1x LM's ids a step (from the
               length batches of the base mixture), hence the 4x's steps, --domain-share and --domain-router-share
    eval-base  a plain LM (no adapters) on scripts/eval_molora.py's held-out items and scoring (the same items and
               the same teacher-forced greedy exact match as its "base" row)
    report     one table (per domain, mixed, mixed spans, all) and the budgets, from the runs' JSON files

    python scripts/scale_vs_specialise.py plan --model-dir assets/model --lm-steps 2000 --adapter-steps 500 \\
        --router-steps 500 > plan.json
    python scripts/scale_vs_specialise.py eval-base --model-dir runs/scale/big/model --n 200 --device cuda \\
        --json runs/scale/big/eval.json
    python scripts/scale_vs_specialise.py report --run runs/scale
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from molora.models.families.shapes.data import ExampleSpec, length_batches, sample_examples  # noqa: E402
from molora.models.families.shapes.domain_batches import encode_item  # noqa: E402
from molora.models.families.shapes.domains import DOMAINS, domain_items, mixed_items  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402

log = logging.getLogger("scale_vs_specialise")
REPO = Path(__file__).resolve().parents[1]
COLUMNS = (*DOMAINS, "mixed", "mixed_spans", "all")


# --- plan ----------------------------------------------------------------------------------------------------

def mean_length(tok: UnifiedTokenizer, items: list) -> float:
    return sum(len(encode_item(tok, it)) for it in items) / max(1, len(items))


def base_ids_per_step(tok: UnifiedTokenizer, n: int, tokens_per_batch: int, seed: int) -> float:
    """Mean real ids in one LM step of train_lm.py on the base mixture: n examples' lengths (text ids + 274 ids an
    image: <boi>, 16 rows of 16 codes and a marker, <eoi>; <bos> and <eos>), batched as train_lm batches them.
    No picture is rendered: a length does not depend on the picture."""
    examples = sample_examples(n, seed=f"lm{seed}", spec=ExampleSpec(split="train"))
    rows, cols = tok.vocab.image_grid
    image_len = 2 + rows * (cols + 1)
    lengths = []
    for e in examples:
        texts = [p for p in e.parts if isinstance(p, str)]
        lengths.append(2 + sum(len(ids) for ids in tok.encode_batch(texts)) + image_len * (len(e.parts) - len(texts)))
    batches = length_batches(lengths, tokens_per_batch, seed=seed, epoch=0)
    return sum(lengths) / len(batches)


def plan(args: argparse.Namespace) -> dict:
    tok = UnifiedTokenizer.load(args.model_dir)
    probe = min(args.n_train, 2000)
    adapter_len = {d: mean_length(tok, domain_items(d, probe, seed=f"{args.seed}", split="train", foreign=0.4))
                   for d in DOMAINS}
    n_mixed = args.n_per_domain if args.n_mixed is None else args.n_mixed
    probe = min(args.n_per_domain, 1000)
    domain_len = mean_length(tok, [it for d in DOMAINS for it in domain_items(d, probe, seed=f"router{args.seed}",
                                                                              split="train")])
    mixed_len = mean_length(tok, mixed_items(min(n_mixed, 1000), seed=f"router{args.seed}", split="train",
                                             domains=DOMAINS))
    mixed_share = n_mixed / (len(DOMAINS) * args.n_per_domain + n_mixed)  # train_router's items: n a domain + mixed
    router_len = (1 - mixed_share) * domain_len + mixed_share * mixed_len
    adapter_ids = {d: args.adapter_steps * args.adapter_batch_size * mean for d, mean in adapter_len.items()}
    router_ids = args.router_steps * args.batch_size * router_len
    domain_ids = sum(adapter_ids.values()) + router_ids
    per_step = base_ids_per_step(tok, args.fill_examples, args.tokens_per_batch, args.seed)
    lm_ids = args.lm_steps * per_step
    big_steps = args.lm_steps + math.ceil(domain_ids / per_step)
    out = {
        "lm_steps": args.lm_steps, "tokens_per_batch": args.tokens_per_batch,
        "lm_ids_per_step_est": round(per_step, 1), "lm_ids_est": round(lm_ids),
        "adapter_steps": args.adapter_steps, "router_steps": args.router_steps,
        "adapter_batch_size": args.adapter_batch_size, "router_batch_size": args.batch_size,
        "n_per_domain": args.n_per_domain, "n_mixed": n_mixed,
        "adapter_item_mean_ids": {d: round(v, 2) for d, v in adapter_len.items()},
        "router_item_mean_ids": round(router_len, 2),
        "adapter_ids_est": {d: round(v) for d, v in adapter_ids.items()}, "router_ids_est": round(router_ids),
        "domain_ids_est": round(domain_ids), "arm1_ids_est": round(lm_ids + domain_ids),
        "big_steps": big_steps,
        "domain_share": round(domain_ids / (lm_ids + domain_ids), 6),
        "domain_router_share": round(router_ids / domain_ids, 6) if domain_ids else 0.0,
    }
    print(json.dumps(out, indent=2))
    return out


# --- eval-base -----------------------------------------------------------------------------------------------

def eval_base(args: argparse.Namespace) -> dict:
    """scripts/eval_molora.py's items and scoring, on the LM alone (its --rows base needs adapter folders of the
    model's shape, which the 4x base has none of)."""
    from eval_molora import eval_items, score, summarise, table
    from transformers import LlamaForCausalLM

    from molora.models.engine.runtime import device_name

    torch.set_num_threads(args.threads)
    tok = UnifiedTokenizer.load(args.model_dir)
    lm = LlamaForCausalLM.from_pretrained(args.model_dir / "lm", dtype=torch.float32).to(args.device)
    lm.eval().requires_grad_(False)
    encoded = eval_items(tok, list(DOMAINS), args.n)
    t0 = time.time()
    hits = score(lambda b: lm(input_ids=b.ids, use_cache=False).logits, encoded, tok.vocab.pad_id, list(DOMAINS),
                 args.batch_size, args.device)
    row = {**summarise(hits, encoded), "seconds": round(time.time() - t0, 1)}
    import transformers
    results = {"rows": {args.name: row},
               "setup": {"n_per_domain": args.n, "n_mixed": args.n, "split": "heldout", "seed": "eval",
                         "model_dir": str(args.model_dir), "params": sum(p.numel() for p in lm.parameters()),
                         "device": device_name(args.device), "torch": torch.__version__,
                         "transformers": transformers.__version__}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results, list(DOMAINS)))
    return results


# --- report --------------------------------------------------------------------------------------------------

def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _params(path: Path) -> int | None:
    """Number of parameters in a safetensors file (None when it is missing)."""
    if not path.is_file():
        return None
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _cells(row: dict) -> str:
    return " | ".join(f"{row[c]:.3f}" if c in row else "–" for c in COLUMNS)


def report(args: argparse.Namespace) -> dict:
    run = args.run
    plan_ = _read(run / "plan.json")
    lm1, lm4 = _read(run / "arm1" / "model" / "lm" / "metrics.json"), _read(run / "big" / "model" / "lm" / "metrics.json")
    arm1 = _read(run / "arm1" / "eval.json").get("rows", {})
    check = _read(run / "arm1" / "eval_base_check.json").get("rows", {})
    big = _read(run / "big" / "eval.json").get("rows", {})
    adapters = {d: _read(run / "arm1" / f"ad_{d}" / "domain_metrics.json").get(d, {}) for d in DOMAINS}
    router = _read(run / "arm1" / "router" / "config.json")
    shipped = _read(args.shipped).get("rows", {})

    rows = [(f"shipped 1x base ({args.shipped.name})", shipped.get("base")),
            ("shipped 1x + adapters + router, ours top-2", shipped.get("ours_top2")),
            ("shipped oracle per span", shipped.get("oracle_span")),
            ("arm 1: 1x base, no adapters", arm1.get("base")),
            ("arm 1: 1x + adapters + router, ours top-1", arm1.get("ours_top1")),
            ("arm 1: 1x + adapters + router, ours top-2", arm1.get("ours_top2")),
            ("arm 1: oracle per span", arm1.get("oracle_span")),
            ("arm 4x: 4x base (domain items in its data), no adapters", big.get("base_4x"))]
    # the training scripts' own validation, on other held-out items (same split and scoring, other seeds, and
    # another mix: 30% of their one-domain items ask two questions, eval_molora's none): a fallback when the eval
    # above was cut short, and a check of it
    own = {d: m["val_exact_match"] for d, m in adapters.items() if "val_exact_match" in m}
    rows.append(("arm 1: each adapter on its own spans, train_domain_adapters.py's validation", own or None))
    for k in ("top1", "top2"):
        v = router.get("val", {}).get(k)
        if v:
            rows.append((f"arm 1: ours {k[:3]}-{k[3:]}, train_router.py's validation",
                         {**{c: v[f"exact_{c}"] for c in (*DOMAINS, "mixed") if f"exact_{c}" in v},
                          "all": v.get("exact_all")}))
    lines = ["| row | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    lines += [f"| {name} | {_cells(r)} |" for name, r in rows if r]

    ad_ids = {d: m.get("steps", 0) * m.get("batch_size", 0) * plan_.get("adapter_item_mean_ids", {}).get(d, 0.0)
              for d, m in adapters.items()}
    rt_ids = router.get("steps", 0) * router.get("batch_size", 0) * plan_.get("router_item_mean_ids", 0.0)
    arm1_ids = lm1.get("ids_seen", 0) + sum(ad_ids.values()) + rt_ids
    budget = {
        "arm1_lm": {k: lm1.get(k) for k in ("params", "steps", "planned_steps", "ids_seen", "train_seconds",
                                            "total_seconds", "epochs", "val_text_loss", "val_image_loss", "compiled",
                                            "lr")},
        "arm1_adapters": {d: {"steps": m.get("steps"), "planned_steps": m.get("planned_steps"),
                              "ids_est": round(ad_ids[d]), "seconds": m.get("seconds"),
                              "val_exact_match": m.get("val_exact_match")} for d, m in adapters.items()},
        "arm1_router": {"steps": router.get("steps"), "ids_est": round(rt_ids), "seconds": router.get("seconds"),
                        "params": _params(run / "arm1" / "router" / "gates.safetensors"),
                        "val": router.get("val")},
        "arm1_adapter_params": {d: _params(run / "arm1" / "adapters" / d / "adapter_model.safetensors")
                                for d in DOMAINS},
        "arm1_ids": round(arm1_ids),
        "big_lm": {k: lm4.get(k) for k in ("params", "steps", "planned_steps", "ids_seen", "domain_ids_seen",
                                           "domain_share_actual", "train_seconds", "total_seconds", "epochs",
                                           "val_text_loss", "val_image_loss", "compiled", "lr")},
        "big_ids": lm4.get("ids_seen"),
        "big_over_arm1_ids": round(lm4["ids_seen"] / arm1_ids, 4) if arm1_ids and lm4.get("ids_seen") else None,
        "big_over_1x_params": round(lm4["params"] / lm1["params"], 3) if lm1.get("params") and lm4.get("params")
        else None,
        "base_check": {"eval_molora_base": arm1.get("base"), "eval_base": check.get("base_1x")},
    }
    summary = {"plan": plan_, "budget": budget, "rows": {n: r for n, r in rows if r}}
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    text = "\n".join(lines) + "\n\n" + json.dumps(budget, indent=2)
    (run / "table.md").write_text(text + "\n")
    print(text)
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="the token budget and the 4x's steps and domain share (JSON on stdout)")
    pl.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model", help="its tokenizer")
    pl.add_argument("--lm-steps", type=int, required=True)
    pl.add_argument("--tokens-per-batch", type=int, default=65_536)
    pl.add_argument("--adapter-steps", type=int, required=True, help="per adapter (four adapters)")
    pl.add_argument("--router-steps", type=int, required=True)
    pl.add_argument("--batch-size", type=int, default=32, help="train_router.py --batch-size")
    pl.add_argument("--adapter-batch-size", type=int, default=32, help="train_domain_adapters.py --batch-size")
    pl.add_argument("--n-train", type=int, default=12_000, help="train_domain_adapters.py --n-train")
    pl.add_argument("--n-per-domain", type=int, default=3000, help="train_router.py --n-per-domain")
    pl.add_argument("--n-mixed", type=int, default=None, help="train_router.py --n-mixed (default --n-per-domain)")
    pl.add_argument("--fill-examples", type=int, default=20_000,
                    help="base-mixture examples whose length batches estimate the LM's ids a step")
    pl.add_argument("--seed", type=int, default=0)
    ev = sub.add_parser("eval-base", help="a plain LM on eval_molora.py's held-out items")
    ev.add_argument("--model-dir", type=Path, required=True)
    ev.add_argument("--name", default="base")
    ev.add_argument("--n", type=int, default=200)
    ev.add_argument("--batch-size", type=int, default=50)
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--threads", type=int, default=1)
    ev.add_argument("--json", type=Path, default=None)
    rp = sub.add_parser("report", help="the table and the budgets of a run folder")
    rp.add_argument("--run", type=Path, required=True)
    rp.add_argument("--shipped", type=Path, default=REPO / "benchmarks" / "molora_eval.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return {"plan": plan, "eval-base": eval_base, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
