"""Serving benchmark (issue: continuous batching, residency, captured decode): E1, E2, K6, S1 in ONE run.

    python benchmarks/serving.py                        # the H200 run: Qwen3-1.7B shape, random bf16 weights
    python benchmarks/serving.py --shape tiny --device cpu --quick     # a dry run of every section on a CPU

Model: Qwen3ForCausalLM of the Qwen3-1.7B shape, random weights, routed rank-16 adapters on all 7 projections,
vocabulary routing by an id range (the last 1/16 of the ids are "image" ids; random prompts hold both kinds).
Every request is greedy with a 32-token prompt and exactly --new tokens (min_new_tokens = max_new_tokens).

    E2  batch-1 tokens/s: our engine (2 adapters routed, decode step captured) vs transformers `generate` of the base
        model and `peft` with one LoRA; bytes a step must read and the bandwidth floor they imply
    E1  routed vs the same engine without adapters, batch 1 and 32 (+ peft one LoRA, peft 2 adapters by
        `adapter_names` at 32)
    K6  decode step latency with a hot set smaller than the pool and a request bringing a new adapter every 8
        steps: captured graph vs eager vs "dynamic" (adapters copied into freshly allocated tensors when needed)
    S1  64 requests with random adapter pairs and lengths through the scheduler vs the same requests one at a time
    check: captured vs eager decode give the same tokens after the churn moved adapters between slots
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from molora.models.engine.core import Done, Engine, EngineConfig  # noqa: E402
from molora.models.engine.generation import GenerationConfig, Request  # noqa: E402
from molora.models.engine.row_states import Draw  # noqa: E402
from molora.models.engine.sampling import SamplingConfig  # noqa: E402
from molora.models.engine.synthetic import SHAPES, plain_model, random_adapters, random_routed_model  # noqa: E402
from molora.routing import VocabRangeRouter  # noqa: E402

GREEDY = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0), cfg_scale=1.0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompt_ids(vocab, length: int, rng: random.Random) -> list[int]:
    return [vocab.bos_id, *(rng.randrange(vocab.text_start, vocab.vocab_size) for _ in range(length - 1))]


def run_engine(engine: Engine, requests: list[Request], configs: list[GenerationConfig]) -> dict:
    """Submit all at once; wall time, tokens, per-request latency (submit -> Done), per-token gaps (a request's
    first token's gap is its time to first token: queueing and prefill, also kept apart as first_ms)."""
    started = time.perf_counter()
    done_at: dict[int, float] = {}
    tokens, gaps, first = 0, [], []
    for index, item in engine.stream(requests, configs):
        if isinstance(item, Done):
            done_at[index] = time.perf_counter() - started
        else:
            tokens += 1
            gaps.append(item.ms)
            if item.index == 0:
                first.append(item.ms)
    wall = time.perf_counter() - started
    lat = sorted(done_at.values())
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "lat_p50_s": statistics.median(lat),
            "lat_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "gaps_ms": gaps, "first_ms": first}


def graph_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """GPU milliseconds of one replay of a captured graph (mean of `replays`, after one warm replay)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def replay_ms(engine: Engine) -> dict[int, float]:
    """GPU milliseconds of each captured decode step (by width), replayed 20 times with nothing else running."""
    return {width: graph_ms(graph) for (width, _), (graph, _) in sorted(engine._graphs.items())}


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    buf = torch.empty(2 * 2 ** 30, dtype=torch.uint8, device=device)
    out = torch.empty_like(buf)
    out.copy_(buf)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        out.copy_(buf)
    sync(device)
    seconds = time.perf_counter() - start
    del buf, out
    return 2 * 2 ** 31 * 10 / seconds


def hf_generate(model, batch: int, prompt_len: int, new: int, device: str, vocab_size: int, **kw) -> float:
    """tokens/s of transformers' generate (greedy, exactly `new` tokens per row)."""
    ids = torch.randint(5, vocab_size, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)
    args = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    model.generate(ids[:, :8], **{**args, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    sync(device)
    started = time.perf_counter()
    model.generate(ids, **args)
    sync(device)
    return batch * new / (time.perf_counter() - started)


def kernel_profile(run, repeats: int, label: str, top: int = 10) -> dict:
    """Kernels of `run()` (called `repeats` times after one warm-up call): count and GPU time per call, and the
    largest by GPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels) / repeats
    count = sum(e.count for e in kernels) / repeats
    print(f"profile {label}: {count:.0f} kernels, {total_us / 1000:.3f} ms of GPU time per call; largest:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"   {e.self_device_time_total / repeats:8.1f} us  x{e.count / repeats:5.0f}  {e.key[:100]}")
    return {"kernels": count, "gpu_ms": total_us / 1000}


def profile_step(engine: Engine, width: int, label: str, top: int = 10) -> dict:
    """Kernels of one eager decode step of `width` rows, its tokens chosen (the same kernels the captured step
    replays): count, GPU time, and the largest by GPU time. Runs on the idle engine's tables (free rows write only
    junk; no row is running, so none moves). Greedy and unguided, as the benchmarks' rows are."""
    greedy = Draw(sampling=False, filters=False, guided=False)
    with torch.no_grad():
        return kernel_profile(lambda: engine._sampled(width, *engine._decode_body(width, []), greedy), 3, label, top)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def k6_run(engine: Engine, vocab, steps: int, pool: list[str], rng: random.Random) -> dict:
    """Two long base-model requests decode `steps` steps; every 8 steps a new 8-token request arrives with the
    next adapter of the pool (the hot set is smaller: most arrivals miss and evict). Gaps of request 0."""
    config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, **GREEDY)
    short = GenerationConfig(max_new_tokens=8, min_new_tokens=8, **GREEDY)
    long_requests = [Request(prompt_ids(vocab, 32, rng), None) for _ in range(2)]
    sink: queue.Queue = queue.Queue()
    stop = threading.Event()
    arrivals = []

    def arrive() -> None:
        last, k = engine.steps, 0
        while not stop.is_set():
            if engine.steps >= last + 8:
                last = engine.steps
                name = pool[k % len(pool)]
                k += 1
                arrivals.append(engine.submit(Request(prompt_ids(vocab, 16, rng), VocabRangeRouter(vocab, name, name)),
                                              short, sink=sink))
            time.sleep(0.0002)

    before = dict(engine.routed.cache.stats())
    engine.step_ms = []
    feeder = threading.Thread(target=arrive, daemon=True)
    stream = engine.stream(long_requests, config)
    feeder.start()
    gaps = []
    for index, item in stream:
        if index == 0 and not isinstance(item, Done):
            gaps.append(item.ms)
    stop.set()
    feeder.join()
    for handle in arrivals:
        handle.cancel()
    after = engine.routed.cache.stats()
    decode = gaps[1:]  # the first gap is the prefill
    step = engine.step_ms
    engine.step_ms = None
    return {"steps": len(decode), "step_p50_ms": statistics.median(step), "step_p99_ms": percentile(step, 0.99),
            "gap_p50_ms": statistics.median(decode), "gap_p99_ms": percentile(decode, 0.99), "gap_max_ms": max(decode),
            "arrivals": len(arrivals), "misses": after["misses"] - before["misses"],
            "evictions": after["evictions"] - before["evictions"]}


def make_dynamic(cache) -> None:
    """The seed paper's "dynamic" baseline: on every swap-in, every layer's adapter tensors are reallocated and the
    adapter copied in from pageable memory (blocking). Addresses change, so nothing can be captured."""
    def copy_in(items):
        for layer in cache.layers.values():
            layer.lora_A = torch.empty_like(layer.lora_A).copy_(layer.lora_A)
            layer.lora_B = torch.empty_like(layer.lora_B).copy_(layer.lora_B)
        for slot, entry in items:
            for name, layer in cache.layers.items():
                layer.lora_A[slot].copy_(entry.A[name].clone())  # pageable source: a blocking copy
                layer.lora_B[slot].copy_(entry.B[name].clone())
                layer.lora_scale[slot] = entry.adapter.scales[name]
        return None
    cache._copy_in = copy_in


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request (E1/E2)")
    parser.add_argument("--quick", action="store_true", help="few steps everywhere (a dry run)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    quick = args.quick
    new = 16 if quick else args.new
    rng = random.Random(0)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
                     else platform.processor() or "cpu", "torch": torch.__version__, "shape": args.shape}
    import transformers
    results["transformers"] = transformers.__version__
    print(json.dumps({k: results[k] for k in ("date", "device", "torch", "transformers", "shape")}), flush=True)

    routed, vocab = random_routed_model(args.shape, device=device, dtype=dtype, num_slots=4, r_max=16)
    pool = [f"pool{i}" for i in range(12)]
    for adapter in random_adapters(routed, ["txt", "img", *pool], rank=16):
        routed.add_adapter(adapter)
    model = routed.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lora_layer = next(iter(routed.cache.layers.values()))
    lora_bytes = sum((lay.in_features + lay.out_features) * 16 * lora_layer.lora_A.element_size()
                     for lay in routed.cache.layers.values())

    # --- E1 / E2: the engine ------------------------------------------------------------------------------
    max_len = 32 + new + 8
    engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=64, max_len=max_len))
    routed_router = VocabRangeRouter(vocab, "txt", "img")
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, **GREEDY)
    table = {}
    for batch in (1, 32):
        for label, router in (("engine, no adapters", None), ("engine, 2 adapters by vocabulary", routed_router)):
            requests = [Request(prompt_ids(vocab, 32, rng), router) for _ in range(batch)]
            run_engine(engine, requests, [config] * batch)  # warm-up: captures this width
            best = max((run_engine(engine, requests, [config] * batch) for _ in range(2)), key=lambda r: r["tok_s"])
            table[(label, batch)] = best["tok_s"]
            step_ms = statistics.median(best["gaps_ms"])
            first = statistics.median(best["gaps_ms"][:batch]) if batch > 1 else best["gaps_ms"][0]
            print(f"{label:42s} batch {batch:2d}: {best['tok_s']:9.1f} tok/s  (median gap {step_ms:.2f} ms, "
                  f"first token {first:.1f} ms)", flush=True)
    # GPU time of one captured step (replayed with nothing else running), for the host-vs-GPU split
    gpu_ms = {}
    if device == "cuda" and engine._graphs:
        gpu_ms = replay_ms(engine)
        print("captured step GPU time by width (ms):", {w: round(v, 3) for w, v in gpu_ms.items()}, flush=True)
        results["profile"] = {w: profile_step(engine, w, f"decode width {w}") for w in (1, 32)}
    results["gpu_step_ms"] = gpu_ms

    # --- baselines: transformers generate (base) and peft -------------------------------------------------------
    if not quick or device == "cpu":
        for batch in (1, 32):
            table[("transformers generate, base", batch)] = hf_generate(model, batch, 32, new, device,
                                                                        vocab.vocab_size)
            print(f"transformers generate, base batch {batch}: {table[('transformers generate, base', batch)]:.1f}",
                  flush=True)
    try:
        import peft
        results["peft"] = peft.__version__
        torch.manual_seed(0)
        plain = plain_model(args.shape, device=device, dtype=dtype)
        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"])
        peft_model = peft.get_peft_model(plain, lora, adapter_name="txt")
        peft_model.add_adapter("img", lora)
        peft_model.eval()
        for batch in (1, 32):
            peft_model.set_adapter("txt")
            table[("peft, one LoRA", batch)] = hf_generate(peft_model, batch, 32, new, device, vocab.vocab_size)
            print(f"peft one LoRA batch {batch}: {table[('peft, one LoRA', batch)]:.1f}", flush=True)
        names = ["txt", "img"] * 16
        table[("peft, 2 adapters by adapter_names", 32)] = hf_generate(peft_model, 32, 32, new, device,
                                                                       vocab.vocab_size, adapter_names=names)
        print(f"peft 2 adapters batch 32: {table[('peft, 2 adapters by adapter_names', 32)]:.1f}", flush=True)
        del peft_model, plain
    except Exception as err:  # peft missing or failing: say so in the table
        print(f"peft baseline failed: {type(err).__name__}: {err}", flush=True)
        results["peft_error"] = f"{type(err).__name__}: {err}"
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    # a batch-1 step reads every weight once, both routed adapters' A and B, and its row's KV columns
    step_bytes = weight_bytes + 2 * lora_bytes + engine.kv.nbytes() // engine.max_rows
    results["bytes_per_step_batch1"] = step_bytes
    results["table"] = {f"{k[0]} | {k[1]}": v for k, v in table.items()}

    # --- memory bandwidth floor ---------------------------------------------------------------------------------
    if device == "cuda":
        bandwidth = copy_bandwidth(device)
        results["copy_bandwidth_GBs"] = bandwidth / 1e9
        floor = bandwidth / step_bytes
        results["floor_tok_s_batch1"] = floor
        print(f"bytes per batch-1 step {step_bytes / 1e9:.3f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
              f"floor {floor:.0f} tok/s", flush=True)

    # --- K6: latency under adapter churn --------------------------------------------------------------------------
    k6 = {}
    steps_graph = 60 if quick else 2000
    steps_eager = 30 if quick else 400
    for mode, steps in (("graph", steps_graph), ("eager", steps_eager), ("dynamic", steps_eager)):
        if mode == "graph" and device != "cuda":
            continue
        k6_engine = Engine(routed, vocab, device=device,
                           config=EngineConfig(max_rows=8, max_len=steps + 48, cuda_graphs=mode == "graph"))
        if mode == "dynamic":
            make_dynamic(routed.cache)
        k6_run(k6_engine, vocab, 24, pool, rng)  # warm-up
        k6[mode] = k6_run(k6_engine, vocab, steps, pool, rng)
        k6_engine.close()
        print(f"K6 {mode:8s}: {json.dumps({k: round(v, 3) for k, v in k6[mode].items()})}", flush=True)
    results["k6"] = k6

    # --- correctness under churn: captured vs eager, after slots moved ------------------------------------------
    if device == "cuda":
        del routed.cache._copy_in  # back to the side-stream copies
        graph_engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=16, max_len=max_len))
        eager_engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=16, max_len=max_len,
                                                                                cuda_graphs=False))
        equal = total = 0
        for round_ in range(4):
            pair = [pool[(2 * round_) % 12], pool[(2 * round_ + 5) % 12]]
            requests = [Request(prompt_ids(vocab, 24, rng), VocabRangeRouter(vocab, *pair)) for _ in range(6)]
            got = {}
            for name, eng in (("graph", graph_engine), ("eager", eager_engine)):
                rows: dict = {}
                for index, item in eng.stream(requests, GenerationConfig(max_new_tokens=48, **GREEDY)):
                    if not isinstance(item, Done):
                        rows.setdefault(index, []).append(item.token)
                got[name] = rows
            equal += sum(got["graph"][i] == got["eager"][i] for i in range(len(requests)))
            total += len(requests)
        results["graph_vs_eager_equal"] = f"{equal}/{total}"
        print(f"captured vs eager after churn: {equal}/{total} requests gave identical tokens "
              f"(evictions so far {routed.cache.stats()['evictions']})", flush=True)

    # --- S1: 64 concurrent requests vs one at a time --------------------------------------------------------------
    n = 16 if quick else 64
    names = ["txt", "img", "pool0", "pool1"]
    requests, configs = [], []
    for _ in range(n):
        requests.append(Request(prompt_ids(vocab, rng.randint(16, 64), rng),
                                VocabRangeRouter(vocab, rng.choice(names), rng.choice(names))))
        k = rng.randint(32, 128) if not quick else rng.randint(4, 16)
        configs.append(GenerationConfig(max_new_tokens=k, min_new_tokens=k, **GREEDY))
    s1_engine = Engine(routed, vocab, device=device, config=EngineConfig(max_rows=64, max_len=64 + 136))
    run_engine(s1_engine, requests[:4], configs[:4])  # warm-up
    together = run_engine(s1_engine, requests, configs)
    started = time.perf_counter()
    alone_lat = []
    for request, cfg in zip(requests, configs):
        t0 = time.perf_counter()
        run_engine(s1_engine, [request], [cfg])
        alone_lat.append(time.perf_counter() - t0)
    alone_wall = time.perf_counter() - started
    tokens = sum(c.max_new_tokens for c in configs)
    seq_lat = [sum(alone_lat[:i + 1]) for i in range(n)]  # one at a time: request i waits for all before it
    results["s1"] = {"requests": n, "tokens": tokens, "concurrent_s": together["wall_s"], "sequential_s": alone_wall,
                     "throughput_ratio": alone_wall / together["wall_s"],
                     "concurrent_lat_p50_s": together["lat_p50_s"], "concurrent_lat_p99_s": together["lat_p99_s"],
                     "sequential_lat_p50_s": statistics.median(seq_lat), "sequential_lat_p99_s": percentile(seq_lat, 0.99),
                     "alone_lat_p50_s": statistics.median(alone_lat)}
    print("S1:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results["s1"].items()}),
          flush=True)

    # --- the table ----------------------------------------------------------------------------------------------------
    print("\n| tokens/s | batch 1 | batch 32 |\n|---|---|---|")
    labels = ["transformers generate, base", "engine, no adapters", "engine, 2 adapters by vocabulary",
              "peft, one LoRA", "peft, 2 adapters by adapter_names"]
    for label in labels:
        cells = [f"{table[(label, b)]:,.1f}" if (label, b) in table else "" for b in (1, 32)]
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    for b in (1, 32):
        base = table.get(("engine, no adapters", b))
        routed_tps = table.get(("engine, 2 adapters by vocabulary", b))
        if base and routed_tps:
            print(f"E1 batch {b}: routed / no adapters = {routed_tps / base:.3f}")
    hf = table.get(("transformers generate, base", 1))
    if hf:
        print(f"E2: engine routed batch 1 / transformers generate base = {table[('engine, 2 adapters by vocabulary', 1)] / hf:.1f}x")
    if "floor_tok_s_batch1" in results:
        print(f"E2: {table[('engine, 2 adapters by vocabulary', 1)] / results['floor_tok_s_batch1']:.1%} of the floor")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
