"""The learned-routing report of scripts/eval_molora.py (issue 29): what it prints, from its results dict.

Absolute accuracies first (single-domain mean, per domain, mixed requests answered outright, mixed spans; 95% Wilson
intervals from results["ci95"]), then recovery of the per-span oracle with its paired bootstrap interval, the
oracle said in one line, beside the any-pair reference; with several seeds, each seed's mixed accuracy and
recovery. A selection seed's report opens with NOT HELD OUT (eval_seeds.selection_warning).

    report(results, adapters) -> str
"""

from __future__ import annotations

from .eval_seeds import selection_warning
from .stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, recovery

ORACLE_LINE = ("per-span oracle (oracle_span): every answer position routed to the adapter of the true domain of the "
               "span it predicts, the prompt read by the base model, in one pass")
PAIR_LINE = ("any adapter pair (any_pair): a mixed request counts when some ordered pair of adapters (one adapter "
             "twice included), the first span answered by one and the second by the other, answers it whole (an "
             "upper reference for per-span routing over these adapters)")


def row_order(name: str) -> tuple[int, str]:
    """base, single adapters, peft rows (each as peft runs it, then the fair way), X-LoRA, ours, the oracles."""
    for rank, prefix in enumerate(("base", "single:", "every:", "peft_cat", "peft_ties", "peft_dare_ties", "peft_arrow",
                                   "peft_xlora", "ours_top1", "ours_top2", "oracle_request", "oracle_span_rerun",
                                   "oracle_span", "any_pair")):
        if name.startswith(prefix):
            return rank, name
    return 99, name


def cell(r: dict, metric: str, ci95: dict | None = None) -> str:
    """"p (lo–hi)" from the row's Wilson intervals `ci95` ({metric: [p, lo, hi, ...]}), or the bare value."""
    ci = (ci95 or {}).get(metric)
    if ci is None:
        return f"{r[metric]:.3f}" if r.get(metric) is not None else "–"
    return f"{ci[0]:.3f} ({ci[1]:.3f}–{ci[2]:.3f})"


def report(results: dict, adapters: list[str]) -> str:
    """Absolute accuracies first (with 95% Wilson intervals), then recovery of the per-span oracle with its interval
    beside the any-pair reference, then routing agreement; with several seeds, each seed's mixed accuracy."""
    setup, rows = results["setup"], results["rows"]
    seeds = setup.get("seeds", [setup.get("seed")])

    def wilson(name: str) -> dict | None:
        return results.get("ci95", {}).get(name)
    out = [] if setup.get("held_out", True) else [selection_warning(seeds), ""]
    out.append(f"Seeds {' '.join(map(str, seeds))}: {setup.get('n_per_domain')} items per domain + "
               f"{setup.get('n_mixed')} mixed requests per seed, held-out split; greedy exact match; "
               "95% Wilson intervals in brackets (mixed spans: each span one trial)")
    cols = ["single_domain", *adapters, "mixed", "mixed_spans"]
    names = sorted(rows, key=row_order)
    out += ["", "Absolute accuracy", "| row | single-domain mean | " + " | ".join(adapters)
            + " | mixed (both spans exact) | mixed spans |", "|---|" + "---|" * len(cols)]
    out += [f"| {n} | " + " | ".join(cell(rows[n], c, wilson(n)) for c in cols) + " |" for n in names]
    out += ["", f"Recovery of the per-span oracle on mixed requests: (row - base) / (oracle_span - base); 95% paired "
            f"bootstrap over requests ({setup.get('bootstrap', BOOTSTRAP_RESAMPLES)} resamples, seed {BOOTSTRAP_SEED})",
            f"  oracle = {ORACLE_LINE}", f"  {PAIR_LINE}", "",
            "| row | recovery, whole requests | recovery, spans |", "|---|---|---|"]
    for n in names:
        r = rows[n]
        if "oracle_recovery_mixed" not in r or n == "any_pair":
            continue
        parts = []
        for metric in ("mixed", "mixed_spans"):
            v, ci = r.get(f"oracle_recovery_{metric}"), r.get(f"oracle_recovery_{metric}_ci95")
            parts.append("–" if v is None else f"{v:.3f}" + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""))
        out.append(f"| {n} | " + " | ".join(parts) + " |")
    if "oracle_span" in rows:
        out += ["", "| reference | mixed (both spans exact) | recovery, whole requests |", "|---|---|---|",
                f"| oracle_span | {cell(rows['oracle_span'], 'mixed', wilson('oracle_span'))} | 1 (by definition) |"]
        if "any_pair" in rows:
            r = rows["any_pair"]
            ci = r.get("oracle_recovery_mixed_ci95")
            rec = r.get("oracle_recovery_mixed")
            out.append(f"| any_pair | {cell(r, 'mixed', wilson('any_pair'))} | " + ("–" if rec is None else f"{rec:.3f}")
                       + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else "") + " |")
    for n in names:
        v = rows[n].get("mixed_vs_oracle")
        if v:
            out.append(f"{n} solves {v['share_of_oracle_solved']:.3f} of the mixed requests the oracle solves; "
                       f"{v['share_oracle_fails']:.3f} of the ones it solves the oracle fails")
    if results.get("fair_check"):
        out.append("\nfair-baseline hook (AnswerOnly) check, each adapter alone in peft vs single:<name>, items with "
                   "identical hits: " + ", ".join(f"{a} {c['same']}/{c['n']}" for a, c in results["fair_check"].items()))
    for k in (1, 2):
        r = rows.get(f"ours_top{k}", {})
        if "agreement" in r:
            out.append(f"\nours top-{k}: routing agreement {r['agreement']:.3f} (per block {r.get('agreement_per_block')};"
                       f" at span starts {r.get('agreement_span_starts')})")
    if len(seeds) > 1 and results.get("by_seed"):
        out += ["", "Mixed requests answered outright, per seed", "| row | " + " | ".join(map(str, seeds)) + " | pooled |",
                "|---|" + "---|" * (len(seeds) + 1)]
        for n in names:
            per = [results["by_seed"].get(s, {}).get(n, {}).get("mixed") for s in seeds]
            out.append(f"| {n} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in per)
                       + f" | {cell(rows[n], 'mixed', wilson(n))} |")
        recovered = [n for n in names if "oracle_recovery_mixed" in rows[n] and n.startswith(("ours", "any_pair"))]
        if recovered:
            out += ["", "Recovery of the per-span oracle on mixed requests, per seed",
                    "| row | " + " | ".join(map(str, seeds)) + " | pooled |", "|---|" + "---|" * (len(seeds) + 1)]
            for n in recovered:
                per = []
                for s in seeds:
                    got = results["by_seed"].get(s, {})
                    v = recovery(*(got.get(x, {}).get("mixed", float("nan")) for x in (n, "base", "oracle_span")))
                    per.append("–" if v is None or v != v else f"{v:.3f}")
                out.append(f"| {n} | " + " | ".join(per) + f" | {rows[n]['oracle_recovery_mixed']:.3f} |")
    return "\n".join(out)


__all__ = ["ORACLE_LINE", "PAIR_LINE", "report"]
