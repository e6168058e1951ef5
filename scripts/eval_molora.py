"""Evaluate learned MoLoRA routing against the oracle and what a user can already do with `peft` alone.

Same held-out items for every row (models/families/shapes/domains.py, split "heldout", seed "eval"): --n per domain
(one question each) and --n mixed requests (two questions of two domains). Exact match of greedy decoding, scored
from one teacher-forced forward per batch (models/families/shapes/domain_batches.py: identical to greedy exact match for
every causal routing). Rows:

    base              no adapter
    single:<name>     one adapter on every answer position, the prompt read by the base model (the contract the
                      domain adapters are trained with: scripts/train_domain_adapters.py)
    every:<name>      one adapter on every position, the prompt included (how peft applies an adapter)
    oracle_request    per request, the best of the adapters of its true domains (max over them, per item)
    peft_cat / peft_ties / peft_dare_ties   peft add_weighted_adapter of all domain adapters (weights 1,
                      density 0.5 for ties / dare_ties; dare is seeded)
    peft_arrow        peft create_arrow_model (ArrowConfig top_k = 2): training-free per-token top-k
    peft_xlora        peft X-LoRA, its classifier trained on the router's data and steps budget (--xlora-steps)
    ours_top1 / ours_top2   learned gates (--router) at k = 1 / 2
    oracle_span       every answer position routed to the true domain of the span it predicts, the prompt to
                      the base model (LabelRouter)
    oracle_span_rerun not one pass: each span scored with its own domain's adapter on the whole sequence

Mixed requests are scored twice: the whole answer (both spans), and per span given the right earlier span
(mixed_spans, teacher forced).

Reports per row: accuracy per domain and on mixed requests; oracle recovery on mixed requests
(ours - base) / (oracle_span - base); routing agreement of the gates' top-1 with the span labels per block (and
at span starts, where a gate must switch: train_router.py's span_starts), and the share of prompt positions the
gates send to their base expert. peft's rows apply adapters to every position (peft has no per-position routing
besides Arrow's and X-LoRA's own).

    python scripts/eval_molora.py --json benchmarks/molora_eval.json
    python scripts/eval_molora.py --rows base ours oracle_span --n 50     # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_router import GateAgreement, load_routed  # noqa: E402

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.shapes.domain_batches import EncodedItem, encode_item, exact_matches, make_batch  # noqa: E402
from molora.models.families.shapes.domains import DOMAINS, domain_items, mixed_items  # noqa: E402
from molora.routing import LabelRouter, LearnedGates, LearnedRouter, SequenceRouter  # noqa: E402

log = logging.getLogger("eval_molora")
REPO = Path(__file__).resolve().parents[1]
ROWS = ("base", "single", "every", "oracle_request", "peft_cat", "peft_ties", "peft_dare_ties", "peft_arrow", "peft_xlora",
        "ours", "oracle_span")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    p.add_argument("--adapters", nargs="+", default=list(DOMAINS))
    p.add_argument("--router", type=Path, default=REPO / "assets" / "router" / "gates.safetensors")
    p.add_argument("--n", type=int, default=200, help="held-out items per domain, and mixed requests")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--xlora-steps", type=int, default=0, help="0: the router's steps (its config.json)")
    p.add_argument("--json", type=Path, default=None, help="write (and merge into) this results file")
    return p.parse_args(argv)


def eval_items(tok, adapters: list[str], n: int) -> list[EncodedItem]:
    items = [it for d in adapters for it in domain_items(d, n, seed="eval", split="heldout", two_questions=0.0)]
    items += mixed_items(n, seed="eval", split="heldout", domains=adapters)
    return [encode_item(tok, it) for it in items]


def batch_rows(encoded: list[EncodedItem], size: int) -> list[list[int]]:
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


Hits = tuple[list[bool], list[list[bool]]]  # per item: whole answer right; per span right (given gold earlier spans)


@torch.no_grad()
def score(logits_of: Callable, encoded: list[EncodedItem], pad: int, adapters: list[str], size: int,
          device: str, on_output: Callable | None = None) -> Hits:
    """Per item: greedy exact match of the whole answer, and of each span given the right earlier spans
    (teacher forced). logits_of(batch) -> logits [B, T, V] (or an output with .logits)."""
    whole: list[bool] = [False] * len(encoded)
    spans: list[list[bool]] = [[] for _ in encoded]
    for rows in batch_rows(encoded, size):
        batch = make_batch(encoded, rows, pad, adapters, device)
        out = logits_of(batch)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        if on_output is not None:
            on_output(batch, out)
        for r, ok, per in zip(rows, *exact_matches(logits, batch, encoded)):
            whole[r], spans[r] = ok, per
    return whole, spans


def summarise(hits: Hits, encoded: list[EncodedItem]) -> dict:
    whole, spans = hits
    by: dict[str, list[bool]] = {}
    for h, e in zip(whole, encoded):
        by.setdefault(e.kind, []).append(h)
    out = {k: round(sum(v) / len(v), 4) for k, v in by.items()}
    out["all"] = round(sum(whole) / len(whole), 4)
    mixed = [x for s, e in zip(spans, encoded) if e.kind == "mixed" for x in s]
    if mixed:
        out["mixed_spans"] = round(sum(mixed) / len(mixed), 4)
    return out


# --- peft baselines ----------------------------------------------------------------------------------------

def fresh_lm(model_dir: Path, device: str):
    from transformers import LlamaForCausalLM

    from molora.models.families.shapes.testing import set_base_model_name
    lm = LlamaForCausalLM.from_pretrained(model_dir / "lm", dtype=torch.float32).to(device)
    set_base_model_name(lm)
    return lm.eval().requires_grad_(False)


def peft_merges(args, adapters: list[str]) -> dict[str, Callable]:
    """One peft model with every domain adapter, and the three weighted merges built from them."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(fresh_lm(args.model_dir, args.device), str(args.adapters_dir / adapters[0]),
                                      adapter_name=adapters[0])
    for name in adapters[1:]:
        model.load_adapter(str(args.adapters_dir / name), adapter_name=name)
    torch.manual_seed(0)  # dare drops at random
    out = {}
    for kind in ("cat", "ties", "dare_ties"):
        kw = {} if kind == "cat" else {"density": 0.5}
        model.add_weighted_adapter(adapters, [1.0] * len(adapters), f"merge_{kind}", combination_type=kind, **kw)

        def run(batch, name=f"merge_{kind}"):
            model.set_adapter(name)
            return model(input_ids=batch.ids, use_cache=False).logits
        out[f"peft_{kind}"] = run
    return out


def arrow_model(args, adapters: list[str]):
    """peft's Arrow over the same adapter folders: per token, top-2 of the adapters by the alignment of the
    token's hidden state with each adapter's principal direction (training-free)."""
    from peft import ArrowConfig, create_arrow_model
    model = create_arrow_model(fresh_lm(args.model_dir, args.device), [str(args.adapters_dir / a) for a in adapters],
                               ArrowConfig(top_k=2, router_temperature=1.0, rng_seed=0))
    return model.eval()


def peft_arrow(args, adapters: list[str]) -> Callable:
    model = arrow_model(args, adapters)
    return lambda batch: model(input_ids=batch.ids, use_cache=False).logits


# --- main --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    adapters = list(dict.fromkeys(args.adapters))
    routed, tok = load_routed(args.model_dir, args.adapters_dir, adapters, args.device)
    routed.eval()
    pad = tok.vocab.pad_id
    encoded = eval_items(tok, adapters, args.n)
    results: dict = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {}
    rows: dict = results.setdefault("rows", {})
    per_item: dict[str, Hits] = {}

    def record(name: str, hits: Hits, seconds: float, **extra) -> None:
        per_item[name] = hits
        rows[name] = {**summarise(hits, encoded), "seconds": round(seconds, 1), **extra}
        log.info("%s: %s", name, rows[name])
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    def routed_row(name: str, make_router: Callable, on_output: Callable | None = None, **extra) -> None:
        t0 = time.time()
        hits = score(lambda b: routed(b.ids, routers=make_router(b), use_cache=False), encoded, pad, adapters,
                     args.batch_size, args.device, on_output)
        record(name, hits, time.time() - t0, **extra)

    want = set(args.rows)
    if "base" in want:
        routed_row("base", lambda b: None)
    if "single" in want or "oracle_request" in want:
        for a in adapters:
            routed_row(f"single:{a}", lambda b, a=a: LabelRouter([a], torch.where(b.labels >= 0, 0, -1)))
    if "every" in want:
        for a in adapters:
            routed_row(f"every:{a}", lambda b, a=a: SequenceRouter(a))
    if "oracle_request" in want:
        # per request, the one adapter of its true domains that gets the most spans right (whole answer first)
        whole, spans = [], []
        for i, e in enumerate(encoded):
            runs = [(per_item[f"single:{d}"][0][i], per_item[f"single:{d}"][1][i]) for d in dict.fromkeys(e.span_domain)]
            best = max(runs, key=lambda r: (r[0], sum(r[1])))
            whole.append(best[0])
            spans.append(best[1])
        record("oracle_request", (whole, spans), 0.0)
        # not one pass: each span scored under its own domain's adapter on the whole sequence
        spans = [[per_item[f"single:{d}"][1][i][k] for k, d in enumerate(dict.fromkeys(e.span_domain))]
                 if e.kind == "mixed" else per_item[f"single:{e.kind}"][1][i] for i, e in enumerate(encoded)]
        record("oracle_span_rerun", ([all(s) for s in spans], spans), 0.0)
    if "oracle_span" in want:
        routed_row("oracle_span", lambda b: LabelRouter(adapters, b.labels))
    if "ours" in want:
        gates = LearnedGates.load(args.router, device=args.device)
        if gates.adapters != adapters:
            raise SystemExit(f"{args.router} routes over {gates.adapters}, not the evaluated adapters {adapters}")
        for k in (1, 2):
            agreement = GateAgreement(routed.num_blocks, len(adapters) if gates.base_expert else None)
            routed_row(f"ours_top{k}", lambda b, k=k: LearnedRouter(gates, top_k=k, vocab=tok.vocab),
                       lambda batch, out, agreement=agreement: agreement.add(batch, out.decisions))
            rows[f"ours_top{k}"].update(agreement.metrics())
    for kind in ("cat", "ties", "dare_ties"):
        if f"peft_{kind}" in want:
            merges = peft_merges(args, adapters)
            for name, fn in merges.items():
                if name in want:
                    t0 = time.time()
                    record(name, score(fn, encoded, pad, adapters, args.batch_size, args.device), time.time() - t0)
            break
    if "peft_arrow" in want:
        t0 = time.time()
        fn = peft_arrow(args, adapters)
        record("peft_arrow", score(fn, encoded, pad, adapters, args.batch_size, args.device), time.time() - t0)
    if "peft_xlora" in want:
        from molora_xlora import xlora_row
        xlora_row(args, adapters, tok, encoded, pad, record, fresh_lm, score)

    for metric in ("mixed", "mixed_spans"):
        base = rows.get("base", {}).get(metric)
        span = rows.get("oracle_span", {}).get(metric)
        if base is None or span is None or span <= base:
            continue
        for k in (1, 2):
            if f"ours_top{k}" in rows:
                rows[f"ours_top{k}"][f"oracle_recovery_{metric}"] = round(
                    (rows[f"ours_top{k}"][metric] - base) / (span - base), 4)
    import peft
    import transformers
    results["setup"] = {"n_per_domain": args.n, "n_mixed": args.n, "adapters": adapters, "router": str(args.router),
                        "split": "heldout", "seed": "eval", "device": device_name(args.device), "threads": args.threads,
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": peft.__version__, "python": platform.python_version()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results, adapters))
    return results


def table(results: dict, adapters: list[str]) -> str:
    cols = [*adapters, "mixed", "mixed_spans", "all"]
    lines = ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, r in results["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.3f}" if c in r else "–" for c in cols) + " |")
    for k in (1, 2):
        r = results["rows"].get(f"ours_top{k}", {})
        if "agreement" in r:
            lines.append(f"\nours top-{k}: oracle recovery on mixed {r.get('oracle_recovery_mixed')} (whole requests), "
                         f"{r.get('oracle_recovery_mixed_spans')} (spans); routing agreement {r['agreement']:.3f} "
                         f"(per block {r.get('agreement_per_block')}; at span starts {r.get('agreement_span_starts')})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
