"""Evaluate learned MoLoRA routing against the oracle and what a user can already do with `peft` alone.

Same held-out items for every row (models/families/shapes/domains.py, split "heldout"), drawn from --seed:
--n-per-domain per domain (one question each) and --n-mixed mixed requests (two questions of two domains) per seed;
two seeds give different items, the same seed the same ones. Several seeds pool their items (one table with 95%
intervals, and a line per seed). Seed "eval" (the default) is the VALIDATION seed: router variants were chosen on
it, so its report opens with NOT HELD OUT; report on test seeds, choose on "eval" (models/families/shapes/eval_seeds.py
lists every selection seed; one pooled with test seeds is refused). Exact match of greedy decoding, scored from one
teacher-forced forward per batch (models/families/shapes/domain_batches.py: identical to greedy exact match for every
causal routing). Rows:

    base              no adapter
    single:<name>     one adapter on every answer position, the prompt read by the base model (the contract the
                      domain adapters are trained with: scripts/train_domain_adapters.py)
    every:<name>      one adapter on every position, the prompt included (how peft applies an adapter)
    oracle_request    per request, the best of the adapters of its true domains (max over them, per item)
    peft_cat / peft_ties / peft_dare_ties   peft add_weighted_adapter of all domain adapters (weights 1,
                      density 0.5 for ties / dare_ties; dare is seeded), on every position as peft applies them
    peft_arrow        peft create_arrow_model (ArrowConfig top_k = 2): training-free per-token top-k
    <peft row>:answer the same peft model run the fair way: the prompt read by the base model, the adapters on the
                      answer positions only (AnswerOnly: what our adapters were trained for; peft acts on the
                      prompt too, which our adapters never touched, so its own rows score ~0)
    peft_xlora        peft X-LoRA, its classifier trained on the router's data and steps budget (--xlora-steps)
    ours_top1 / ours_top2   learned gates (--router) at k = 1 / 2
    oracle_span       every answer position routed to the true domain of the span it predicts, the prompt to
                      the base model (LabelRouter): the per-span oracle recovery is measured against
    oracle_span_rerun not one pass: each span scored with its own domain's adapter on the whole sequence
    any_pair          an upper reference on mixed requests: solved when SOME ordered pair of adapters (the first
                      span answered by one, the second by the other, the prompt to the base; the same adapter twice
                      included) solves it; E * E passes over the mixed requests
    fair_check        not a row: each adapter alone in peft through AnswerOnly must reproduce single:<name> item for
                      item (it runs the single rows); the report prints the count of identical items

Mixed requests are scored twice: the whole answer (both spans), and per span given the right earlier span
(mixed_spans, teacher forced).

Reports absolute accuracies first (single-domain mean, per domain, mixed requests answered outright, mixed spans;
95% Wilson intervals: molora/models/families/shapes/stats.py), then oracle recovery on mixed requests
(ours - base) / (oracle_span - base) with a paired bootstrap interval over items (fixed seed), beside any_pair;
routing agreement of the gates' top-1 with the span labels per block (and at span starts, where a gate must switch:
train_router.py's span_starts), and the share of prompt positions the gates send to their base expert.

    python scripts/eval_molora.py --seed 1 2 3 --n-per-domain 1000 --n-mixed 1000 --rows base ours oracle_span any_pair
    python scripts/eval_molora.py --rows base ours oracle_span --n 50     # a quick look, on the validation seed
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
from molora.models.families.shapes.errors import ShapesError  # noqa: E402
from molora.models.families.shapes.eval_seeds import VALIDATION_SEED, check_seeds  # noqa: E402
from molora.models.families.shapes.molora_report import report  # noqa: E402
from molora.models.families.shapes.stats import (  # noqa: E402
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    recovery,
    recovery_interval,
    wilson_interval,
)
from molora.routing import LabelRouter, LearnedGates, LearnedRouter, SequenceRouter  # noqa: E402

log = logging.getLogger("eval_molora")
REPO = Path(__file__).resolve().parents[1]
ROWS = ("base", "single", "every", "oracle_request", "peft_cat", "peft_ties", "peft_dare_ties", "peft_arrow", "peft_xlora",
        "ours", "oracle_span", "any_pair", "fair_check")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    p.add_argument("--adapters", nargs="+", default=list(DOMAINS))
    p.add_argument("--router", type=Path, default=REPO / "assets" / "router" / "gates.safetensors")
    p.add_argument("--seed", nargs="+", default=[VALIDATION_SEED],
                   help=f"held-out item seeds; several pool their items (default {VALIDATION_SEED!r}: the validation "
                        "seed, not held out; report on others, e.g. --seed 1 2 3)")
    p.add_argument("--n-per-domain", type=int, default=None, help="held-out items per domain and seed (default 200)")
    p.add_argument("--n-mixed", type=int, default=None, help="mixed requests per seed (default 200)")
    p.add_argument("--n", type=int, default=None, help="both --n-per-domain and --n-mixed")
    p.add_argument("--bootstrap", type=int, default=BOOTSTRAP_RESAMPLES,
                   help=f"resamples of the recovery interval (paired over items, seed {BOOTSTRAP_SEED})")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--xlora-steps", type=int, default=0, help="0: the router's steps (its config.json)")
    p.add_argument("--json", type=Path, default=None, help="write (and merge into) this results file")
    args = p.parse_args(argv)
    args.n_per_domain = args.n_per_domain or args.n or 200
    args.n_mixed = args.n_mixed or args.n or 200
    try:
        args.seed, args.held_out = check_seeds(args.seed)
    except ShapesError as e:
        p.error(str(e))
    return args


def eval_items(tok, adapters: list[str], n: int, seed: int | str = VALIDATION_SEED, n_mixed: int | None = None
               ) -> list[EncodedItem]:
    """The held-out items of one seed: `n` per domain (one question each), then `n_mixed` (default n) mixed."""
    items = [it for d in adapters for it in domain_items(d, n, seed=seed, split="heldout", two_questions=0.0)]
    items += mixed_items(n if n_mixed is None else n_mixed, seed=seed, split="heldout", domains=adapters)
    return [encode_item(tok, it) for it in items]


def seeded_items(tok, adapters: list[str], seeds: list[str], n: int, n_mixed: int
                 ) -> tuple[list[EncodedItem], list[str]]:
    """Every seed's items, pooled, and the seed of each item."""
    encoded: list[EncodedItem] = []
    item_seed: list[str] = []
    for seed in seeds:
        more = eval_items(tok, adapters, n, seed, n_mixed)
        encoded += more
        item_seed += [seed] * len(more)
    return encoded, item_seed


def batch_rows(encoded: list[EncodedItem], size: int) -> list[list[int]]:
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


Hits = tuple[list[bool | None], list[list[bool]]]  # per item: whole answer right (None: not scored by this row);
#                                                    per span right (given gold earlier spans)


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


def counts(hits: Hits, encoded: list[EncodedItem]) -> dict[str, tuple[int, int]]:
    """(right, scored) per domain, "single_domain" (every single-domain item), "mixed", "mixed_spans" (each span of
    a mixed request one trial) and "all"; items a row does not score (None) are left out."""
    whole, spans = hits
    by: dict[str, list[bool]] = {}
    for h, e in zip(whole, encoded):
        if h is None:
            continue
        for key in dict.fromkeys((e.kind, "mixed" if e.kind == "mixed" else "single_domain", "all")):
            by.setdefault(key, []).append(h)
    mixed = [x for s, h, e in zip(spans, whole, encoded) if e.kind == "mixed" and h is not None for x in s]
    if mixed:
        by["mixed_spans"] = mixed
    return {k: (sum(v), len(v)) for k, v in by.items() if v}


def summarise(hits: Hits, encoded: list[EncodedItem]) -> dict:
    """Accuracy per domain, on mixed requests, mixed spans and all items (counts' proportions)."""
    c = counts(hits, encoded)
    out = {k: round(k_ / n, 4) for k, (k_, n) in c.items() if k not in ("all", "single_domain", "mixed_spans")}
    if None not in hits[0]:  # "all" only for a row that scores every item
        out["all"] = round(c["all"][0] / c["all"][1], 4)
    if "mixed_spans" in c:
        out["mixed_spans"] = round(c["mixed_spans"][0] / c["mixed_spans"][1], 4)
    return out


def intervals(hits: Hits, encoded: list[EncodedItem]) -> dict:
    """Every accuracy of `counts` with its 95% Wilson interval: {metric: [p, lo, hi, right, n]}."""
    return {k: [round(r / n, 4), *(round(x, 4) for x in wilson_interval(r, n)), r, n]
            for k, (r, n) in counts(hits, encoded).items()}


# --- peft baselines ----------------------------------------------------------------------------------------

def fresh_lm(model_dir: Path, device: str):
    from transformers import LlamaForCausalLM

    from molora.models.families.shapes.testing import set_base_model_name
    lm = LlamaForCausalLM.from_pretrained(model_dir / "lm", dtype=torch.float32).to(device)
    set_base_model_name(lm)
    return lm.eval().requires_grad_(False)


class AnswerOnly:
    """A peft model run the fair way for our adapters: every LoRA layer's output is its base layer's output except at
    the answer positions, so the prompt is read by the base model and the adapters act on the answer only (what our
    domain adapters were trained for; peft itself applies them to every position). Works for any peft LoRA layer
    whose forward starts from base_layer(x) and adds to it out of place (plain LoRA, merges, Arrow's variant).

        fair = AnswerOnly(peft_model)
        fair.logits(batch)        answer positions (batch.labels >= 0) adapted, the rest the base model's
        fair.everywhere(batch)    as peft does it
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from peft.tuners.lora import LoraLayer
        self.model = model
        self.mask: torch.Tensor | None = None  # [B, T] bool: where the adapters act; None: everywhere
        self._base: dict[int, torch.Tensor] = {}
        layers = [m for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")]
        if not layers:
            raise ValueError("AnswerOnly needs a peft model with LoRA layers")
        for m in layers:
            m.base_layer.register_forward_hook(self._keep_base)
            m.register_forward_hook(self._select)

    def _keep_base(self, module, inputs, out):
        if self.mask is not None:
            self._base[id(module)] = out

    def _select(self, module, inputs, out):
        if self.mask is None:
            return None
        base = self._base.pop(id(module.base_layer))
        return torch.where(self.mask[..., None], out, base)  # where, not base + mask * delta: exact at both

    def logits(self, batch) -> torch.Tensor:
        self.mask = batch.labels >= 0  # positions that predict an answer id or <eos> (single:<name>'s positions)
        try:
            return self.model(input_ids=batch.ids, use_cache=False).logits
        finally:
            self.mask = None
            self._base.clear()

    def everywhere(self, batch) -> torch.Tensor:
        return self.model(input_ids=batch.ids, use_cache=False).logits


def peft_merges(args, adapters: list[str]) -> dict[str, Callable]:
    """One peft model with every domain adapter, and the three weighted merges built from them: each as peft runs it
    (peft_<kind>) and the fair way, on the answer positions only (peft_<kind>:answer)."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(fresh_lm(args.model_dir, args.device), str(args.adapters_dir / adapters[0]),
                                      adapter_name=adapters[0])
    for name in adapters[1:]:
        model.load_adapter(str(args.adapters_dir / name), adapter_name=name)
    fair = AnswerOnly(model)
    torch.manual_seed(0)  # dare drops at random
    out = {}
    for kind in ("cat", "ties", "dare_ties"):
        kw = {} if kind == "cat" else {"density": 0.5}
        model.add_weighted_adapter(adapters, [1.0] * len(adapters), f"merge_{kind}", combination_type=kind, **kw)

        def run(batch, name=f"merge_{kind}", how=fair.everywhere):
            model.set_adapter(name)
            return how(batch)
        out[f"peft_{kind}"] = run
        out[f"peft_{kind}:answer"] = lambda batch, run=run: run(batch, how=fair.logits)
    return out


def arrow_model(args, adapters: list[str]):
    """peft's Arrow over the same adapter folders: per token, top-2 of the adapters by the alignment of the
    token's hidden state with each adapter's principal direction (training-free)."""
    from peft import ArrowConfig, create_arrow_model
    model = create_arrow_model(fresh_lm(args.model_dir, args.device), [str(args.adapters_dir / a) for a in adapters],
                               ArrowConfig(top_k=2, router_temperature=1.0, rng_seed=0))
    return model.eval()


def peft_arrow(args, adapters: list[str]) -> dict[str, Callable]:
    """Arrow as peft runs it (peft_arrow) and the fair way, on the answer positions only (peft_arrow:answer)."""
    fair = AnswerOnly(arrow_model(args, adapters))
    return {"peft_arrow": fair.everywhere, "peft_arrow:answer": fair.logits}


def fair_check(args, adapters: list[str], encoded: list[EncodedItem], pad: int, per_item: dict[str, Hits]) -> dict:
    """The fair way checked: each adapter alone in peft, run through AnswerOnly, must score single:<name>'s items
    exactly (same whole-answer and span hits, item for item); if it does, the :answer rows are peft's models under
    our adapters' contract and nothing else. {name: {"same": items with equal hits, "n": items}}."""
    from peft import PeftModel
    out = {}
    for a in adapters:
        fair = AnswerOnly(PeftModel.from_pretrained(fresh_lm(args.model_dir, args.device), str(args.adapters_dir / a)))
        whole, spans = score(fair.logits, encoded, pad, adapters, args.batch_size, args.device)
        ref = per_item[f"single:{a}"]
        out[a] = {"same": sum(w == rw and s == rs for w, s, rw, rs in zip(whole, spans, *ref)), "n": len(encoded)}
    return out


# --- the any-pair reference --------------------------------------------------------------------------------

def pair_labels(batch, encoded: list[EncodedItem], first: int, second: int) -> torch.Tensor:
    """Routing labels: the positions that predict the first span -> adapter `first`, the later spans (and <eos>)
    -> `second`, context -> -1 (the base model)."""
    labels = torch.full_like(batch.labels, -1)
    for b, r in enumerate(batch.rows):
        e = encoded[r]
        which = list(e.span_index) or [0] * len(e.span_domain)
        span = torch.tensor([*which, which[-1]], device=labels.device)  # positions answer_start - 1 .. len - 1
        labels[b, e.answer_start - 1:len(e)] = torch.where(span == 0, first, second)
    return labels


def any_pair(routed, encoded: list[EncodedItem], pad: int, adapters: list[str], size: int, device: str) -> Hits:
    """Per mixed request: some ordered pair (a, b) of adapters, a on the first span and b on the second, answers it
    whole (spans: those of the best pair, whole answer first). One pass per pair over the mixed requests; the other
    items are not scored (None)."""
    mixed = [i for i, e in enumerate(encoded) if e.kind == "mixed"]
    sub = [encoded[i] for i in mixed]
    best: list[tuple[bool, int, list[bool]]] = [(False, -1, [])] * len(sub)
    for a in range(len(adapters)):
        for b in range(len(adapters)):
            whole, spans = score(lambda batch, a=a, b=b: routed(batch.ids, use_cache=False, routers=LabelRouter(
                adapters, pair_labels(batch, sub, a, b))), sub, pad, adapters, size, device)
            best = [max(old, (w, sum(s), s), key=lambda t: t[:2]) for old, w, s in zip(best, whole, spans)]
    whole_all: list[bool | None] = [None] * len(encoded)
    spans_all: list[list[bool]] = [[] for _ in encoded]
    for i, (w, _, s) in zip(mixed, best):
        whole_all[i], spans_all[i] = w, s
    return whole_all, spans_all


# --- main --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    adapters = list(dict.fromkeys(args.adapters))
    routed, tok = load_routed(args.model_dir, args.adapters_dir, adapters, args.device)
    routed.eval()
    pad = tok.vocab.pad_id
    encoded, item_seed = seeded_items(tok, adapters, args.seed, args.n_per_domain, args.n_mixed)
    setup = {"seeds": args.seed, "held_out": args.held_out, "n_per_domain": args.n_per_domain,
             "n_mixed": args.n_mixed, "adapters": adapters, "router": str(args.router), "split": "heldout",
             "bootstrap": args.bootstrap}
    results: dict = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {}
    old = results.get("setup", {})
    if results.get("rows") and any(old.get(k) != v for k, v in setup.items()):
        raise SystemExit(f"{args.json} holds rows of other items or models ({ {k: old.get(k) for k in setup} }); "
                         "pass another --json")
    rows: dict = results.setdefault("rows", {})
    by_seed: dict = results.setdefault("by_seed", {})
    ci95: dict = results.setdefault("ci95", {})  # per row: {metric: [p, lo, hi, right, n]} (95% Wilson)
    per_item: dict[str, Hits] = {}

    def record(name: str, hits: Hits, seconds: float, **extra) -> None:
        per_item[name] = hits
        rows[name] = {**summarise(hits, encoded), "seconds": round(seconds, 1), **extra}
        ci95[name] = intervals(hits, encoded)
        if len(args.seed) > 1:
            for seed in args.seed:
                keep = [i for i, s in enumerate(item_seed) if s == seed]
                by_seed.setdefault(seed, {})[name] = summarise(
                    ([hits[0][i] for i in keep], [hits[1][i] for i in keep]), [encoded[i] for i in keep])
        log.info("%s: %s", name, rows[name])
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    def routed_row(name: str, make_router: Callable, on_output: Callable | None = None, **extra) -> None:
        t0 = time.time()
        hits = score(lambda b: routed(b.ids, routers=make_router(b), use_cache=False), encoded, pad, adapters,
                     args.batch_size, args.device, on_output)
        record(name, hits, time.time() - t0, **extra)

    def peft_rows(fns: dict[str, Callable]) -> None:
        for name, fn in fns.items():
            t0 = time.time()
            record(name, score(fn, encoded, pad, adapters, args.batch_size, args.device), time.time() - t0)

    want = set(args.rows)
    if "fair_check" in want:
        want.add("single")
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
    if "any_pair" in want:
        t0 = time.time()
        record("any_pair", any_pair(routed, encoded, pad, adapters, args.batch_size, args.device), time.time() - t0)
    if "ours" in want:
        gates = LearnedGates.load(args.router, device=args.device)
        if gates.adapters != adapters:
            raise SystemExit(f"{args.router} routes over {gates.adapters}, not the evaluated adapters {adapters}")
        for k in (1, 2):
            agreement = GateAgreement(routed.num_blocks, len(adapters) if gates.base_expert else None)
            routed_row(f"ours_top{k}", lambda b, k=k: LearnedRouter(gates, top_k=k, vocab=tok.vocab),
                       lambda batch, out, agreement=agreement: agreement.add(batch, out.decisions))
            rows[f"ours_top{k}"].update(agreement.metrics())
    merges = [f"peft_{kind}" for kind in ("cat", "ties", "dare_ties") if f"peft_{kind}" in want]
    if merges:
        peft_rows({name: fn for name, fn in peft_merges(args, adapters).items() if name.split(":")[0] in merges})
    if "peft_arrow" in want:
        peft_rows(peft_arrow(args, adapters))
    if "fair_check" in want:
        results["fair_check"] = fair_check(args, adapters, encoded, pad, per_item)
        log.info("fair_check: %s", results["fair_check"])
    if "peft_xlora" in want:
        from molora_xlora import xlora_row
        xlora_row(args, adapters, tok, encoded, pad, record, fresh_lm, score)

    add_recovery(rows, per_item, encoded, args.bootstrap)
    import peft
    import transformers
    results["setup"] = {**setup, "seed": args.seed[0] if len(args.seed) == 1 else args.seed,
                        "device": device_name(args.device), "threads": args.threads,
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": peft.__version__, "python": platform.python_version()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(report(results, adapters))
    return results


def mixed_hits(hits: Hits, encoded: list[EncodedItem], metric: str) -> list[float]:
    """Per mixed request: 1/0 whole answer right (metric "mixed"), or the share of its spans right ("mixed_spans")."""
    whole, spans = hits
    return [float(w) if metric == "mixed" else sum(s) / len(s)
            for w, s, e in zip(whole, spans, encoded) if e.kind == "mixed"]


def add_recovery(rows: dict, per_item: dict[str, Hits], encoded: list[EncodedItem], resamples: int) -> None:
    """oracle_recovery_<metric> and its 95% paired bootstrap interval for every row scored in this run beside base
    and oracle_span (rows merged from an earlier run get the point value only)."""
    for metric in ("mixed", "mixed_spans"):
        base, span = rows.get("base", {}).get(metric), rows.get("oracle_span", {}).get(metric)
        if base is None or span is None or span <= base:
            continue
        paired = "base" in per_item and "oracle_span" in per_item
        for name, r in rows.items():
            if name in ("base", "oracle_span") or r.get(metric) is None:
                continue
            r[f"oracle_recovery_{metric}"] = round(recovery(r[metric], base, span), 4)
            if paired and name in per_item:
                ci = recovery_interval(*(mixed_hits(per_item[x], encoded, metric) for x in (name, "base", "oracle_span")),
                                       resamples=resamples)
                r[f"oracle_recovery_{metric}_ci95"] = None if ci is None else [round(x, 4) for x in ci]
    if "oracle_span" not in per_item:
        return
    oracle = mixed_hits(per_item["oracle_span"], encoded, "mixed")
    for name, hits in per_item.items():
        if name.startswith("ours") or name == "any_pair":  # which requests: those the oracle solves, or others
            mine = mixed_hits(hits, encoded, "mixed")
            both = sum(m and o for m, o in zip(mine, oracle))
            rows[name]["mixed_vs_oracle"] = {
                "share_of_oracle_solved": round(both / max(1, sum(oracle)), 4),
                "share_oracle_fails": round((sum(mine) - both) / max(1, sum(mine)), 4)}


# --- the report (molora/models/families/shapes/molora_report.py) ---------------------------------------

def table(results: dict, adapters: list[str]) -> str:
    """Accuracies only, one row per line (scripts/scale_vs_specialise.py's table)."""
    cols = [*adapters, "mixed", "mixed_spans", "all"]
    lines = ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, r in results["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.3f}" if r.get(c) is not None else "–" for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
