"""The decode step (issue: overhead, not work): E1, E2 and E4 in ONE run, each forward of the engine side by side.

    python benchmarks/decode_step.py                          # H200: Qwen3-1.7B shape, random bf16 weights
    python benchmarks/decode_step.py --shape tiny --device cpu --new 8     # a dry run on a CPU

Rows (greedy, 32-token prompts, exactly --new tokens per row, tokens/s; batch 1 and 32):
    weight-bandwidth limit          bytes a batch-1 step must read / measured copy bandwidth
    transformers generate, eager    the base model
    transformers generate, static cache + torch.compile   `cache_implementation="static"` (transformers compiles the
                                    decode forward, mode "reduce-overhead"); warmed up on the same shapes first
    engine (transformers forward)   EngineConfig(lean_decoder=False): transformers' module forward, captured
    engine (lean decoder)           the engine's own forward (models/engine/decoder.py), captured; also with
                                    overlap_steps=False (each step's tokens read before the next step is launched)
each engine row without adapters and with 2 rank-16 adapters routed by vocabulary range.  Then, per forward: kernels
and GPU time of one decode step (profiler, widths 1 and 32), the captured step's replay time, and whether the
lean and the transformers forward give the same greedy tokens.  `--learned`: learned top-2 rows (random gates with a
base expert and a routing state, as the shipped router has) against vocabulary routing, in the default engine, and
the GPU time and kernels of each captured step (`--compiled-decision`: the gates' decision compiled by torch.compile,
not the one-launch Triton kernel).  `--picture` (E3): one guided picture of Emu3's size on
`--shape emu3-8b` (random weights of Emu3-8B's language model): 90 x 90 codes and a row marker after each row, 8,190
decode steps of a pair of rows (the picture's row and its CFG twin), routed by vocabulary range, against the time
that reading the weights once a step allows.

    python benchmarks/decode_step.py --learned --new 64
    python benchmarks/decode_step.py --picture --shape emu3-8b [--sdpa-too]
    python benchmarks/decode_step.py --wide-decode-ab      # 17-32 token calls: every group one GEMM, or q/k/v only
    python benchmarks/decode_step.py --elementwise-bound   # the step without its norm / activation kernels
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's molora
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving.py's helpers

from serving import (  # noqa: E402
    GREEDY,
    copy_bandwidth,
    graph_ms,
    hf_generate,
    profile_step,
    prompt_ids,
    replay_ms,
    run_engine,
    sync,
)

import molora.kernels.dispatch as dispatch  # noqa: E402
import molora.kernels.triton_linear as triton_linear  # noqa: E402
import molora.models.engine.decoder as lean_decoder  # noqa: E402
from molora.kernels.graphs import graph_paths  # noqa: E402
from molora.models.engine.core import Done, Engine, EngineConfig  # noqa: E402
from molora.models.engine.generation import GenerationConfig, Request  # noqa: E402
from molora.models.engine.synthetic import SHAPES, plain_model, random_adapters, random_routed_model  # noqa: E402
from molora.routing import LearnedGates, LearnedRouter, VocabRangeRouter, decision  # noqa: E402


def compiled_generate(model, batch: int, new: int, device: str, vocab_size: int) -> float:
    """tokens/s of transformers' generate with a static cache (its decode forward compiled), after two warm-up
    calls on the very same shapes (the first compiles)."""
    ids = torch.randint(5, vocab_size, (batch, 32), device=device)
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=0, cache_implementation="static")
    for _ in range(2):
        model.generate(ids, **args)
    sync(device)
    started = time.perf_counter()
    model.generate(ids, **args)
    sync(device)
    return batch * new / (time.perf_counter() - started)


def engine_rows(routed, vocab, device: str, new: int, lean: bool, overlap: bool, rng: random.Random,
                learned: LearnedRouter | None = None) -> tuple[dict, Engine]:
    """tokens/s of one engine configuration: no adapters and vocabulary routing (or, with `learned`, vocabulary
    routing and learned top-2 rows), batch 1 and 32."""
    engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=64, max_len=32 + new + 8,
                                                                      lean_decoder=lean, overlap_steps=overlap))
    name = ("lean" if lean else "transformers") + ("" if overlap else ", steps not overlapped")
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, **GREEDY)
    routers = [("2 adapters by vocabulary", VocabRangeRouter(vocab, "txt", "img"))]
    routers.insert(0 if learned is None else 1, ("no adapters", None) if learned is None else
                   ("learned top-2 over 2 adapters", learned))
    rows = {}
    for batch in (1, 32):
        requests = {label: [Request(prompt_ids(vocab, 32, rng), router) for _ in range(batch)]
                    for label, router in routers}
        for label in requests:
            run_engine(engine, requests[label], [config] * batch)  # warm-up: captures this width
        # best of 3 runs each, the routers taking turns (A, B, A, B, ...): the GPU's clocks drift within a call, and
        # rows of two routers compared in a ratio should meet the same drift
        runs: dict[str, list[dict]] = {label: [] for label in requests}
        for _ in range(3):
            for label in requests:
                runs[label].append(run_engine(engine, requests[label], [config] * batch))
        for label, done in runs.items():
            best = max(done, key=lambda r: r["tok_s"])
            rows[(label, batch)] = best["tok_s"]
            print(f"engine ({name} forward), {label:26s} batch {batch:2d}: "
                  f"{best['tok_s']:9.1f} tok/s (median gap {statistics.median(best['gaps_ms']):.2f} ms, "
                  f"first token {statistics.median(best['first_ms']):.1f} ms)", flush=True)
    return rows, engine


def set_wide_decode(tiles: int, every_group: int) -> None:
    """Calls of up to `tiles` tokens take the decode tiles (kernels/triton_linear.py WIDE_DECODE_MAX_TOKENS; 16: the
    small tiles above 16 tokens, as before 2026-12-06), and calls of up to `every_group` tokens run every routed
    group as one GEMM (kernels/dispatch.py fuses_base; 16: above 16 tokens only q/k/v, the others cuBLAS onto the
    group call's deltas). Read when a step is captured."""
    triton_linear.WIDE_DECODE_MAX_TOKENS = tiles
    triton_linear.linear_config.cache_clear()
    dispatch.WIDE_DECODE_MAX_TOKENS = every_group


SHIPPED_PIECES = (lean_decoder._add_norm, lean_decoder._gated)


def set_elementwise(shipped: bool) -> None:
    """The lean decoder's residual add + RMSNorm and gated activation as shipped, or (False) as no kernel at all:
    the add_norm returns (x, delta) and the activation its gate, so the GEMMs read unnormalised inputs. Wrong
    numbers, the right shapes: the step's time without these 3 kernels a block bounds what fusing them into the
    GEMMs could save. Read when a decoder first runs (LeanDecoder._fuse), i.e. before an engine captures."""
    if shipped:
        lean_decoder._add_norm, lean_decoder._gated = SHIPPED_PIECES
    else:
        lean_decoder._add_norm = lambda x, delta, weight, eps: (x, delta)
        lean_decoder._gated = lambda gate, up, act: gate


def engine_ab(routed, vocab, device: str, new: int, rng: random.Random, variants: dict[str, Any]) -> dict:
    """Engine variants in one run (`variants`: label -> a function that sets that variant; the first is the shipped
    one, set again at the end, and each ratio is the first's rate over another's): each captured with its variant,
    timed in turns (best of 3, batch 1 and 32, 2 adapters by vocabulary); then each one's captured steps (GPU ms of
    a replay) and the kernels of its width-1 and width-32 steps."""
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, **GREEDY)
    router = VocabRangeRouter(vocab, "txt", "img")
    engines: dict[str, Engine] = {}
    requests = {batch: [Request(prompt_ids(vocab, 32, rng), router) for _ in range(batch)] for batch in (1, 32)}
    first, *others = variants
    try:
        for label, set_variant in variants.items():
            set_variant()
            engines[label] = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=64, max_len=32 + new + 8))
            for batch in (1, 32):
                run_engine(engines[label], requests[batch], [config] * batch)  # warm-up: captures
        result: dict = {}
        for batch in (1, 32):
            runs: dict[str, list[float]] = {label: [] for label in engines}
            for _ in range(3):
                for label, engine in engines.items():
                    variants[label]()
                    runs[label].append(run_engine(engine, requests[batch], [config] * batch)["tok_s"])
            for label in engines:
                result[f"{label}, batch {batch}"] = round(max(runs[label]), 1)
            for other in others:
                ratio = max(runs[first]) / max(runs[other])
                result[f"ratio batch {batch} vs {other}"] = round(ratio, 3)
                print(f"{first} / {other}, batch {batch}: {max(runs[first]):.1f} / {max(runs[other]):.1f} tok/s = "
                      f"{ratio:.3f}", flush=True)
        for label, engine in engines.items() if device == "cuda" else ():
            variants[label]()
            result[f"replay_ms {label}"] = {w: round(ms, 3) for w, ms in replay_ms(engine).items()}
            with graph_paths():
                for width in (1, 32):
                    result[f"profile {label}, width {width}"] = profile_step(engine, width, f"{label}, width {width}")
            print(f"captured step GPU ms ({label}):", result[f"replay_ms {label}"], flush=True)
    finally:
        variants[first]()
        for engine in engines.values():
            engine.close()
    return result


AB_VARIANTS = {
    # 17-32 token calls (a batch-32 step): every routed group one GEMM at the decode tiles, a row tile of 32
    # (shipped); only q/k/v so (o, down, gate/up: cuBLAS onto the group call's deltas); q/k/v at the small tiles
    "wide_decode_ab": {"every group, decode tiles": lambda: set_wide_decode(32, 32),
                       "q/k/v only, decode tiles": lambda: set_wide_decode(32, 16),
                       "q/k/v only, small tiles": lambda: set_wide_decode(16, 16)},
    # the residual add + norm and the activation: shipped, or no kernel (a bound on fusing them into the GEMMs)
    "elementwise_bound": {"shipped": lambda: set_elementwise(True),
                          "no norm / activation kernels": lambda: set_elementwise(False)},
}


def greedy_tokens(engine: Engine, vocab, requests: list[Request], new: int) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, **GREEDY)
    out: list[list[int]] = [[] for _ in requests]
    for index, item in engine.stream(requests, [config] * len(requests)):
        if hasattr(item, "token"):
            out[index].append(item.token)
    return out


def graph_costs(engine: Engine) -> dict[str, dict]:
    """GPU time (20 replays) and kernels (profiler, 3 replays; their count and GPU time by name too) of each captured
    decode step, static and learned, and of each captured prefill (by rows x tokens; replaying one rewrites the
    KV entries and routing states its rows already hold, with the same inputs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def modes(draw: Any) -> str:  # what the step's sampling computes beyond greedy tokens (row_states.Draw)
        return "".join(f", {name}" for name, on in draw._asdict().items() if on)

    graphs = {f"static, width {w}{modes(draw)}": g for (w, draw), (g, _) in engine._graphs.items()}
    graphs |= {f"learned, width {key[0]}{modes(key[1])}, tables {key[2:]}": g
               for key, (g, _, _) in engine._learned_graphs.items()}
    graphs |= {f"prefill, {shape[0]} rows x {shape[1]} tokens": g
               for shape, (g, _, _) in engine._prefill_graphs.items()}
    graphs |= {f"learned prefill, {key[0][0]} rows x {key[0][1]} tokens, tables {key[1:]}": g
               for key, (g, _, _) in engine._learned_prefills.items()}
    costs = {}
    for label, graph in sorted(graphs.items()):
        gpu_ms = graph_ms(graph)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        names = {e.key: e.count / 3 for e in events}
        costs[label] = {"gpu_ms": round(gpu_ms, 3), "kernels": sum(names.values()), "kernel_names": names,
                        "kernel_us": {e.key: round(_device_us(e) / 3, 2) for e in events}}
        kernels = costs[label]["kernels"]
        print(f"captured {label}: {costs[label]['gpu_ms']:.3f} ms GPU, {kernels:.0f} kernels", flush=True)
    return costs


def _device_us(event: Any) -> float:
    """A profiler average's total GPU time in µs (device_time_total; cuda_time_total in older torch)."""
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def picture_model(shape: str, device: str, dtype: torch.dtype, grid: tuple[int, int], codebook: int) -> tuple:
    """Random weights of `shape` whose vocabulary ends in a `codebook`-code picture of `grid` with row markers, and
    two rank-16 adapters (text, image)."""
    routed, vocab = random_routed_model(shape, device=device, dtype=dtype, num_slots=4, r_max=16, image_size=codebook,
                                        grid=grid, row_end=True)
    for adapter in random_adapters(routed, ["txt", "img"], rank=16):
        routed.add_adapter(adapter)
    return routed, vocab


def picture_run(routed: Any, vocab: Any, shape: str, device: str, dtype: torch.dtype, grid: tuple[int, int],
                split_attention: bool = True, profile_window: tuple[int, int] | None = None) -> dict:
    """E3: seconds of one guided picture (a pair of rows, vocabulary routing, greedy) against the bandwidth time.
    `split_attention=False`: decode steps attend through sdpa over the whole cache (the engine before the split-K
    decode attention kernel).  `profile_window` (first token, steps): then profile that window of the loop (CUDA)."""
    config = routed.model.config
    steps = vocab.image_span_tokens - 1  # <boi> is forced into the prompt (start_image); <eoi> ends the span
    engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=4, max_len=32 + steps + 8))
    engine._setup()
    if engine.decoder is not None:
        engine.decoder.split_attention = split_attention
    rng = random.Random(0)
    prompt = [vocab.bos_id, *(rng.randrange(vocab.text_start, vocab.text_start + vocab.text_size) for _ in range(31))]
    router = VocabRangeRouter(vocab, "txt", "img")
    guided = GenerationConfig(max_new_tokens=steps + 1, max_images=1, start_image=True,
                              **{**GREEDY, "cfg_scale": 3.0})
    warm = GenerationConfig(max_new_tokens=16, max_images=0, **GREEDY)
    run_engine(engine, [Request(prompt, router)] * 2, [warm] * 2)  # captures width 2 (the pair)
    before = engine.steps
    run = run_engine(engine, [Request(prompt, router)], [guided])
    taken = engine.steps - before
    weight_bytes = sum(p.numel() * p.element_size() for p in routed.model.parameters())
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_mean = 2 * layers * 2 * kv_heads * head_dim * dtype.itemsize * (32 + taken / 2)  # the pair's, mean
    bandwidth = copy_bandwidth(device)
    limit_s = taken * weight_bytes / bandwidth
    limit_kv_s = taken * (weight_bytes + kv_bytes_mean) / bandwidth
    out = {"grid": list(grid), "steps": taken, "tokens": run["tokens"], "seconds": float(f"{run['wall_s']:.4g}"),
           "weight_GB": round(weight_bytes / 1e9, 3), "copy_bandwidth_GBs": round(bandwidth / 1e9),
           "limit_s": float(f"{limit_s:.4g}"), "limit_with_kv_s": float(f"{limit_kv_s:.4g}"),
           "E3": round(run["wall_s"] / limit_s, 3), "E3_with_kv": round(run["wall_s"] / limit_kv_s, 3),
           "median_gap_ms": round(statistics.median(run["gaps_ms"]), 3), "split_attention": split_attention}
    attention = "split-K decode attention" if split_attention else "sdpa over the whole cache"
    print(f"E3 {shape} ({attention}): one guided {grid[0]}x{grid[1]} picture, {taken} steps of a pair: {out['seconds']} s; "
          f"weight-bandwidth time {out['limit_s']} s ({out['weight_GB']} GB a step at {out['copy_bandwidth_GBs']} "
          f"GB/s): {out['E3']}x; with the pair's KV cache read too {out['limit_with_kv_s']} s: {out['E3_with_kv']}x",
          flush=True)
    if device == "cuda":
        out["graphs"] = graph_costs(engine)
        if profile_window:
            out["loop"] = loop_profile(engine, Request(prompt, router), guided, *profile_window)
    engine.close()
    return out


def loop_profile(engine: Engine, request: Request, config: GenerationConfig, first: int, steps: int) -> dict:
    """Host time against GPU time of the whole decode loop: the profiler (CPU and CUDA) records `steps` steps of a
    run from its token `first` on (the run is cancelled after them); per step it prints the wall time, the GPU's busy time (every kernel, the
    captured step's and those outside it) and the kernels, then the host ops that take the most time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    started_at = tokens = 0
    stream = engine.stream([request], config)
    for _, item in stream:
        tokens += not isinstance(item, Done)
        if tokens == first:
            sync("cuda")
            prof.start()
            started_at, begun = time.perf_counter(), engine.steps
        if started_at and engine.steps - begun >= steps:
            sync("cuda")
            wall = time.perf_counter() - started_at
            taken = engine.steps - begun
            prof.stop()
            break
    stream.close()  # cancels the rest of the picture
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / taken
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    out = {"steps": taken, "wall_ms": round(wall * 1e3 / taken, 3), "gpu_busy_ms": round(busy_ms, 3),
           "kernels": round(sum(e.count for e in kernels) / taken, 1),
           "host_top": {e.key[:60]: round(e.self_cpu_time_total / 1e3 / taken, 3) for e in host[:12]}}
    print(f"loop profile, {taken} steps (profiler on): {out['wall_ms']} ms a step, GPU busy {out['gpu_busy_ms']} ms "
          f"({out['kernels']} kernels); host ops by self time, ms a step:", flush=True)
    for key, ms in out["host_top"].items():
        print(f"   {ms:8.3f}  {key}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--no-compile", action="store_true", help="skip the static cache + compile baseline")
    parser.add_argument("--json", default=None, help="also write the results here")
    modes = parser.add_mutually_exclusive_group()  # what the run measures (none: E1, E2 and E4)
    modes.add_argument("--picture", action="store_true", help="E3: one guided Emu3-sized picture (see above)")
    parser.add_argument("--grid", type=int, nargs=2, default=[90, 90], help="--picture: rows and columns of codes")
    parser.add_argument("--codebook", type=int, default=32768, help="--picture: codes (the vocabulary's last ids)")
    parser.add_argument("--profile-loop", type=int, nargs=2, default=None, metavar=("FIRST", "STEPS"),
                        help="--picture on CUDA: profile STEPS steps of another picture from its token FIRST")
    parser.add_argument("--sdpa-too", action="store_true",
                        help="--picture: also the same picture with sdpa attention (the engine before split-K)")
    modes.add_argument("--learned", action="store_true",
                        help="only learned top-2 rows (random gates) against vocabulary routing, default engine")
    parser.add_argument("--compiled-decision", action="store_true",
                        help="--learned: torch.compile's decision on CUDA, not the one-launch Triton kernel")
    modes.add_argument("--wide-decode-ab", action="store_true",
                        help="17-32 token calls: every group one GEMM at the decode tiles, or as before (AB_VARIANTS)")
    modes.add_argument("--elementwise-bound", action="store_true",
                        help="the step as shipped vs without its norm / activation kernels (AB_VARIANTS; timing only)")
    args = parser.parse_args()
    device, new = args.device, args.new
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    import transformers
    results: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
                     else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
                     "shape": args.shape, "new": new}
    print(json.dumps(results), flush=True)
    if args.picture:
        grid = tuple(args.grid)
        routed, vocab = picture_model(args.shape, device, dtype, grid, args.codebook)
        results["picture"] = picture_run(routed, vocab, args.shape, device, dtype, grid,
                                         profile_window=args.profile_loop)
        if args.sdpa_too:
            results["picture_sdpa"] = picture_run(routed, vocab, args.shape, device, dtype, grid, split_attention=False)
            print(f"E3 split-K / sdpa seconds: {results['picture']['seconds'] / results['picture_sdpa']['seconds']:.3f}",
                  flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    routed, vocab = random_routed_model(args.shape, device=device, dtype=dtype, num_slots=4, r_max=16)
    for adapter in random_adapters(routed, ["txt", "img"], rank=16):
        routed.add_adapter(adapter)
    model = routed.model
    table: dict = {}

    rng = random.Random(0)
    ab = "wide_decode_ab" if args.wide_decode_ab else "elementwise_bound" if args.elementwise_bound else None
    if ab is not None:
        results[ab] = engine_ab(routed, vocab, device, new, rng, AB_VARIANTS[ab])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    if args.learned:  # learned rows (captured like the others): how far they are from vocabulary routing
        decision.ONE_LAUNCH = not args.compiled_decision
        results["decision"] = "compiled" if args.compiled_decision else "one launch"
        torch.manual_seed(0)
        gates = LearnedGates.for_model(routed, ["txt", "img"], base_expert=True, context_decays=(0.5, 0.9))
        rows, engine = engine_rows(routed, vocab, device, new, True, True, rng, LearnedRouter(gates, top_k=2))
        for batch in (1, 32):
            ratio = rows[("learned top-2 over 2 adapters", batch)] / rows[("2 adapters by vocabulary", batch)]
            print(f"learned top-2 / vocabulary routing, batch {batch}: {ratio:.3f}")
            results[f"learned_ratio_batch_{batch}"] = round(ratio, 3)
        results["rows"] = {f"{label} | {batch}": round(rate, 1) for (label, batch), rate in rows.items()}
        if device == "cuda":
            results["graphs"] = graph_costs(engine)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        engine.close()
        return
    for lean, overlap in ((False, True), (True, False), (True, True)):
        rows, engine = engine_rows(routed, vocab, device, new, lean, overlap, rng)
        name = ("lean" if lean else "transformers") + ("" if overlap else ", steps not overlapped")
        table.update({(f"engine ({name} forward), {k[0]}", k[1]): v for k, v in rows.items()})
        if device == "cuda" and overlap:
            replay = {width: round(ms, 3) for width, ms in replay_ms(engine).items()}
            print(f"captured step GPU ms by width ({name}):", replay, flush=True)
            results[f"replay_ms_{name}"] = replay
            with graph_paths():  # the kernels the captured step replays (the dispatcher's graph-mode paths)
                results[f"profile_{name}"] = {w: profile_step(engine, w, f"{name} forward, width {w}")
                                              for w in (1, 32)}
        engine.close()
        del engine
        gc.collect()

    # the same greedy tokens from both forwards (captured on CUDA), 8 rows routed by vocabulary
    requests = [Request(prompt_ids(vocab, 32, random.Random(i)), VocabRangeRouter(vocab, "txt", "img"))
                for i in range(8)]
    outs = []
    for lean in (False, True):
        engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=16, max_len=32 + 40,
                                                                          lean_decoder=lean))
        outs.append(greedy_tokens(engine, vocab, requests, 32))
        engine.close()
    same = sum(a == b for a, b in zip(*outs))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*outs)]
    print(f"greedy tokens, lean vs transformers forward: {same}/{len(requests)} rows identical "
          f"(first differing step per row: {first_diff})", flush=True)
    results["same_tokens"] = f"{same}/{len(requests)}"

    # transformers' baselines on a plain model of the same shape (no routed layers for torch.compile to trip on)
    torch.manual_seed(0)
    model = plain_model(args.shape, device=device, dtype=dtype)
    for batch in (1, 32):
        table[("transformers generate, eager", batch)] = hf_generate(model, batch, 32, new, device, vocab.vocab_size)
        print(f"transformers generate, eager batch {batch}: {table[('transformers generate, eager', batch)]:.1f}",
              flush=True)
    if not args.no_compile:
        for batch in (1, 32):
            try:
                table[("transformers generate, static cache + compile", batch)] = compiled_generate(
                    model, batch, new, device, vocab.vocab_size)
                print(f"transformers static + compile batch {batch}: "
                      f"{table[('transformers generate, static cache + compile', batch)]:.1f}", flush=True)
            except Exception as err:  # say so in the table
                print(f"static + compile batch {batch} failed: {type(err).__name__}: {err}", flush=True)
    if device == "cuda":
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = copy_bandwidth(device)
        results.update(weight_bytes=weight_bytes, copy_bandwidth_GBs=bandwidth / 1e9)
        table[("weight-bandwidth limit", 1)] = bandwidth / weight_bytes
        print(f"weights {weight_bytes / 1e9:.3f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s, limit "
              f"{bandwidth / weight_bytes:.0f} tok/s at batch 1", flush=True)

    labels = list(dict.fromkeys(k[0] for k in table))
    print("\n| tokens/s | batch 1 | batch 32 |\n|---|---|---|")
    for label in labels:
        cells = [f"{table[(label, b)]:,.1f}" if (label, b) in table else "" for b in (1, 32)]
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    limit = table.get(("weight-bandwidth limit", 1))
    compiled = {b: table.get(("transformers generate, static cache + compile", b)) for b in (1, 32)}
    for name in ("transformers", "lean"):
        routed_row = f"engine ({name} forward), 2 adapters by vocabulary"
        plain_row = f"engine ({name} forward), no adapters"
        e1 = [table[(routed_row, b)] / table[(plain_row, b)] for b in (1, 32)]
        line = f"{name} forward: E1 routed/unrouted {e1[0]:.3f} / {e1[1]:.3f}"
        if limit:
            line += (f"; E2 routed {table[(routed_row, 1)] / limit:.3f} of the limit, unrouted "
                     f"{table[(plain_row, 1)] / limit:.3f}")
        if all(compiled.values()):
            line += (f"; E4 vs static+compile {table[(routed_row, 1)] / compiled[1]:.2f}x (batch 1), "
                     f"{table[(routed_row, 32)] / compiled[32]:.2f}x (batch 32)")
        print(line)
    results["table"] = {f"{k[0]} | {k[1]}": v for k, v in table.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
