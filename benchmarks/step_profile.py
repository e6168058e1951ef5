"""Where a captured decode step's GPU time goes (issue 32, E2's profile): per kernel, and against what the GPU's own
GEMV can do. One CUDA run:

    python benchmarks/step_profile.py [--shape qwen3-1.7b]

1. `F.linear` alone at the step's weight shapes (N = 1, 2, 32), each timed as a graph of 8 calls on 8 copies of the
   weight (so they come from HBM, not L2), us per call and the fraction of 4.1 TB/s it reaches;
2. the engine (random bf16 weights of --shape, 2 rank-16 adapters routed by vocabulary range): tokens/s and the
   median token gap at batch 1 and 32, each captured step's replay time, and its kernels from 5 replays (largest
   first); the decode loop at batch 1 with the profiler on (kernels outside the graph included);
3. the same engine with two dispatcher variants: q/k/v without the fused routed linear
   (kernels/dispatch.py LINEAR_MIN_PROJECTIONS = 99) and with gate/up fused too (= 2).
Needs a CUDA GPU.
"""
import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's molora
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving.py's helpers
from serving import GREEDY, graph_ms, kernel_profile, prompt_ids, run_engine  # noqa: E402

import molora.kernels.dispatch as dispatch  # noqa: E402
from molora.models.engine.core import Engine, EngineConfig  # noqa: E402
from molora.models.engine.generation import GenerationConfig, Request  # noqa: E402
from molora.models.engine.synthetic import SHAPES, random_adapters, random_routed_model  # noqa: E402
from molora.routing import VocabRangeRouter  # noqa: E402

WIDTHS = (1, 32)


def gemv_bench():
    print("== F.linear alone, graph of 8 calls on 8 weight copies (beyond L2), us per call and fraction of 4.1 TB/s")
    for out_f, in_f in ((4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (151936, 2048)):
        ws = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        for n in (1, 2, 32):
            x = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(n, out_f, device="cuda", dtype=torch.bfloat16) for _ in ws]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for w, o in zip(ws, outs):
                    torch.mm(x, w.t(), out=o)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for w, o in zip(ws, outs):
                    torch.mm(x, w.t(), out=o)
            us = graph_ms(g) * 1000 / 8
            floor = out_f * in_f * 2 / 4.1e12 * 1e6
            print(f"   [{out_f:6d} x {in_f:5d}] N={n:2d}: {us:7.2f} us  floor {floor:6.2f}  {floor / us:.2f}")
        del ws


def engine_for(routed, vocab, label, rng, table=False):
    engine = Engine(routed, vocab, device="cuda", config=EngineConfig(max_rows=64, max_len=32 + 64 + 8))
    config = GenerationConfig(max_new_tokens=64, min_new_tokens=64, **GREEDY)
    router = VocabRangeRouter(vocab, "txt", "img")
    for batch in WIDTHS:
        reqs = [Request(prompt_ids(vocab, 32, rng), router) for _ in range(batch)]
        run_engine(engine, reqs, [config] * batch)
        best = max((run_engine(engine, reqs, [config] * batch) for _ in range(3)), key=lambda r: r["tok_s"])
        print(f"{label} batch {batch}: {best['tok_s']:.1f} tok/s median gap {statistics.median(best['gaps_ms']):.3f} ms")
    for (w, _), (g, _) in sorted(engine._graphs.items()):
        print(f"{label} width {w}: replay {graph_ms(g):.3f} ms")
        if table:
            kernel_profile(g.replay, 5, f"{label} width {w}, a replay", top=40)
    if table:  # the loop at batch 1: kernels outside the graph too
        reqs = [Request(prompt_ids(vocab, 32, rng), router)]
        kernel_profile(lambda: run_engine(engine, reqs, [config]), 1, "loop at batch 1, one request of 64 tokens",
                       top=25)
    engine.close()
    gc.collect()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/step_profile.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(torch.__version__, torch.cuda.get_device_name())
    gemv_bench()
    routed, vocab = random_routed_model(args.shape, device="cuda", dtype=torch.bfloat16, num_slots=4, r_max=16)
    for adapter in random_adapters(routed, ["txt", "img"], rank=16):
        routed.add_adapter(adapter)
    rng = random.Random(0)
    engine_for(routed, vocab, "default", rng, table=True)
    for value, label in ((99, "no fused base"), (2, "fused base P>=2")):
        old = dispatch.LINEAR_MIN_PROJECTIONS
        dispatch.LINEAR_MIN_PROJECTIONS = value
        engine_for(routed, vocab, label, rng, table=(value == 99))
        dispatch.LINEAR_MIN_PROJECTIONS = old


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"total {time.time() - started:.0f} s")
