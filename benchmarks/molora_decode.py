"""Greedy decode speed of learned MoLoRA top-2 (and top-1) against peft Arrow and peft X-LoRA, same prompts, same model.

Each row decodes --new-tokens ids after a prefill of the same prompts (mixed held-out requests, cut to the
shortest prompt so a batch needs no padding), batch 1 and batch 32, and reports decode tokens/s (prefill
excluded, median of --runs):

    ours_top2    RoutedModel + LearnedRouter(top_k=2) over the domain adapters, KV cache (DynamicCache)
    ours_top1    the same at top_k=1 (not a default row)
    peft_arrow   peft create_arrow_model (top_k=2), KV cache
    peft_xlora   peft X-LoRA: it refuses use_cache=True, so each step runs the whole sequence (scaling pass +
                 real pass), as its generate does; its classifier is untrained here (speed does not depend on it)
    base         the plain transformers model, KV cache (reference)

Every row runs the same plain loop (HF DynamicCache, one forward per new id), so the rows differ only in how
adapters are applied; on CUDA the clock stops after a device synchronise.

    python benchmarks/molora_decode.py --json benchmarks/molora_decode.json
    python benchmarks/molora_decode.py --device cuda --runs 5 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from eval_molora import arrow_model, fresh_lm  # noqa: E402
from train_router import load_routed  # noqa: E402

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.shapes.domains import mixed_items  # noqa: E402
from molora.routing import LearnedGates, LearnedRouter  # noqa: E402


def prompts(tok, n: int) -> torch.Tensor:
    ids = [[tok.vocab.bos_id, *tok.encode_text(it.prompt)] for it in mixed_items(n, seed="speed", split="heldout")]
    width = min(len(x) for x in ids)
    return torch.tensor([x[:width] for x in ids])


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


@torch.no_grad()
def decode_cached(step, ids: torch.Tensor, new: int) -> float:
    """step(ids, cache) -> (logits, cache); returns decode seconds for `new` greedy ids after the prefill."""
    logits, cache = step(ids, DynamicCache())
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    _sync(nxt)
    t0 = time.perf_counter()
    for _ in range(new):
        logits, cache = step(nxt, cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    _sync(nxt)
    return time.perf_counter() - t0


@torch.no_grad()
def decode_uncached(forward, ids: torch.Tensor, new: int) -> float:
    seq = torch.cat([ids, forward(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    _sync(seq)
    t0 = time.perf_counter()
    for _ in range(new):
        seq = torch.cat([seq, forward(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    _sync(seq)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    p.add_argument("--router", type=Path, default=REPO / "assets" / "router" / "gates.safetensors")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", nargs="+", default=["base", "ours_top2", "peft_arrow", "peft_xlora"],
                   choices=["base", "ours_top1", "ours_top2", "peft_arrow", "peft_xlora"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gates = LearnedGates.load(args.router, device=args.device)
    adapters = gates.adapters
    routed, tok = load_routed(args.model_dir, args.adapters_dir, adapters, args.device)
    routed.eval()
    all_ids = prompts(tok, max(args.batch)).to(args.device)

    def ours(k: int):
        router = LearnedRouter(gates, top_k=k, vocab=tok.vocab)  # one object: it carries the routing state

        def step(ids, cache):
            out = routed(ids, routers=router, past_key_values=cache, use_cache=True)
            return out.logits, out.past_key_values
        return step

    def hf(model):
        def step(ids, cache):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            return out.logits, out.past_key_values
        return step

    rows: dict[str, tuple] = {}
    if "base" in args.rows:
        rows["base"] = ("cached", hf(fresh_lm(args.model_dir, args.device)))
    for k in (1, 2):
        if f"ours_top{k}" in args.rows:
            rows[f"ours_top{k}"] = ("cached", ours(k))
    if "peft_arrow" in args.rows:
        arrow = arrow_model(argparse.Namespace(model_dir=args.model_dir, adapters_dir=args.adapters_dir,
                                               device=args.device), adapters)
        rows["peft_arrow"] = ("cached", hf(arrow))
    if "peft_xlora" in args.rows:
        from peft import XLoraConfig, get_peft_model
        lm = fresh_lm(args.model_dir, args.device)
        lm.config.use_cache = False
        xlora = get_peft_model(lm, XLoraConfig(task_type="CAUSAL_LM", hidden_size=int(lm.config.hidden_size),
                                               xlora_depth=1, layerwise_scalings=True,
                                               adapters={str(i): str(args.adapters_dir / a)
                                                         for i, a in enumerate(adapters)})).eval()
        rows["peft_xlora"] = ("uncached", lambda ids: xlora(input_ids=ids).logits)
    results: dict = {"rows": {}, "setup": {"new_tokens": args.new_tokens, "prompt_len": int(all_ids.shape[1]),
                                           "runs": args.runs, "threads": args.threads,
                                           "device": device_name(args.device), "adapters": adapters,
                                           "base_expert": gates.base_expert,
                                           "torch": torch.__version__, "python": platform.python_version()}}
    for name, (kind, fn) in rows.items():
        for b in args.batch:
            ids = all_ids[:b]
            times = [(decode_cached if kind == "cached" else decode_uncached)(fn, ids, args.new_tokens)
                     for _ in range(args.runs)]
            tps = b * args.new_tokens / statistics.median(times)
            results["rows"].setdefault(name, {})[f"batch{b}_tok_s"] = round(tps, 1)
            print(f"{name:12s} batch {b:3d}: {tps:9.1f} tok/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
