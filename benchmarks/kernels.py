"""Benchmark the routed-LoRA kernels on a CUDA GPU (DESIGN.md §8: K1, K2, K4, K5).

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels.py            # on the GPU; writes kernels.json/.md to $OUT if set
    python3 benchmarks/kernels.py --dry-run                      # CPU smoke run: interpreter, tiny sizes, no timing claims

Every timed function is captured in a CUDA graph and its replays are timed with triton.testing.do_bench
(median; do_bench clears the L2 before each replay, so inputs come from HBM). Correctness against
kernels/reference.py (bf16 and fp16, every path, NaN-poisoned outputs) and a CUDA-graph capture check with slot
values changed after capture run first.

Baselines for K1 (one LoRA pass per adapter, as a one-adapter-per-sequence server runs a batch mixing K adapters):
  seq_contig  the batch is K sequences, one adapter each, each sequence's tokens contiguous: per adapter
              torch.mm(x[rows_a], A_a^T) then torch.mm(., scale_a * B_a^T, out=delta[rows_a])  (2K cuBLAS calls)
  seq_gather  the same token mix interleaved (per-token routing): per adapter index_select its tokens, the two
              mm, index_copy_ back (row indices precomputed on the host, not timed)
  dense_mask  K passes over the whole batch, each result masked to its adapter's tokens and summed
"""

# ruff: noqa: B023  (every closure below is timed inside its own loop iteration, before the variables change)
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP_N = [1, 8, 32, 64, 128, 160, 256, 512, 1024, 2048, 4096, 8192]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run under TRITON_INTERPRET=1, tiny sizes")
    p.add_argument("--no-tune", action="store_true", help="skip the tile-size sweeps")
    return p.parse_args()


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels imports it)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

import kernels.dispatch as dispatch  # noqa: E402
import kernels.triton_gather as gather_mod  # noqa: E402
import kernels.triton_grouped as grouped_mod  # noqa: E402
from kernels import build_routing_meta, routed_lora, routed_lora_topk  # noqa: E402
from kernels.reference import routed_lora_topk_reference  # noqa: E402

DEV = "cpu" if ARGS.dry_run else "cuda"
D = 64 if ARGS.dry_run else 4096          # hidden size in and out
R = 16                                    # rank
S = 4                                     # adapters (hot-set slots)
N_K1 = 40 if ARGS.dry_run else 2048
SWEEP = [1, 8, 40] if ARGS.dry_run else SWEEP_N
RESULTS: dict = {"rows": {}}


# ----------------------------------------------------------------------------------------------- timing
def graphed(fn):
    """Capture fn in a CUDA graph (after warm-up on a side stream) and return its replay; eager on CPU."""
    if DEV == "cpu":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def bench_us(fn) -> float:
    """Median microseconds of one call (graph replay on CUDA)."""
    replay = graphed(fn)
    if DEV == "cpu":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            replay()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    return triton.testing.do_bench(replay, warmup=20, rep=60, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written (best of two ways)."""
    n = (1 << 20) if DEV == "cpu" else (1 << 31)
    src = torch.randn(n // 2, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    if DEV == "cuda":
        us = min(us, triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median") * 1e3)
    return 2 * src.numel() * 2 / (us * 1e-6)


# ----------------------------------------------------------------------------------------------- data
def make_inputs(n: int, k: int = 1, dtype=torch.bfloat16, seed: int = 0, layout: str = "mixed",
                d_in: int = D, d_out: int = D, s: int = S, r: int = R):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, d_in, device=DEV, generator=g).to(dtype)
    A = (torch.randn(s, r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(dtype)
    B = (torch.randn(s, d_out, r, device=DEV, generator=g) / r ** 0.5).to(dtype)
    scale = torch.rand(s, device=DEV, generator=g) + 0.5
    if layout == "contig":
        slots = (torch.arange(n, device=DEV) * s // max(n, 1))[:, None]
    elif k == 1:
        slots = torch.randint(0, s, (n, 1), device=DEV, generator=g)
    else:  # k distinct adapters per token, as a top-k router picks them
        slots = torch.rand(n, s, device=DEV, generator=g).argsort(1)[:, :k]
    weights = torch.softmax(torch.randn(n, k, device=DEV, generator=g), 1)
    return x, A, B, slots.int(), weights, scale


# ----------------------------------------------------------------------------------------------- checks
def poisoned_call(fn):
    """Run fn with every fresh torch.empty buffer filled with NaN, so unwritten outputs show."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = empty
    try:
        return fn()
    finally:
        torch.empty = real


def check_correctness() -> bool:
    print("\n== correctness vs kernels/reference.py (relative to max|ref|) ==")
    tol = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3}
    small = (5, 64, 48, 3, 8)
    cases = [(1, D, D, S, R, 1), (37, 1000, 777, S, R, 1), (300, D, D, S, R, 3), (N_K1, D, D, S, R, 1),
             (N_K1, D, D, S, R, 4), (small[0], small[1], small[2], small[3], small[4], 2), (64, 96, 80, 3, 24, 1)]
    if ARGS.dry_run:
        cases = [(1, 64, 48, 4, 16, 1), (37, 40, 33, 4, 8, 1), (30, 64, 64, 4, 16, 3)]
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for i, (n, di, do, s, r, k) in enumerate(cases):
            x, A, B, slots, w, scale = make_inputs(n, k, dtype, seed=100 + i, d_in=di, d_out=do, s=s, r=r)
            slots[::5, 0] = -1
            weights = w if k > 1 else None
            ref = routed_lora_topk_reference(x, A, B, slots, w if k > 1 else torch.ones_like(w), scale).float()
            den = ref.abs().max().clamp_min(1e-6)
            for path in ("gather", "grouped", "auto"):
                delta = poisoned_call(lambda p=path: dispatch.routed_lora_forward(
                    x, A, B, slots, weights, scale, None, None, p))
                base = torch.randn_like(delta)
                acc = dispatch.routed_lora_forward(x, A, B, slots, weights, scale, base.clone(), None, path)
                err = ((delta.float() - ref).abs().max() / den).item()
                acc_err = ((acc.float() - base.float() - ref).abs().max() / den).item()
                nan = int(torch.isnan(delta).sum())
                good = err <= tol[dtype] and acc_err <= tol[dtype] * 2 and nan == 0
                ok &= good
                print(f"{str(dtype)[6:]:9s} N={n:5d} in={di:5d} out={do:5d} S={s} r={r:2d} k={k} {path:8s} "
                      f"err={err:.2e} out+=err={acc_err:.2e} unwritten={nan} {'ok' if good else 'FAIL'}")
    ok &= check_graph_capture()
    RESULTS["correct"] = ok
    return ok


def check_graph_capture() -> bool:
    """Capture a routed call (metadata build included), change slot VALUES after capture, replay, compare."""
    if DEV == "cpu":
        return True
    ok = True
    for n, k in ((8, 1), (64, 1), (1000, 1), (64, 2), (1000, 2)):
        x, A, B, slots, w, scale = make_inputs(n, k, seed=7)
        def call():
            return routed_lora_topk(x, A, B, slots, w, scale) if k > 1 else routed_lora(x, A, B, slots[:, 0], scale)
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        slots.copy_(torch.randint(-1, S, slots.shape, device=DEV))
        graph.replay()
        ref = routed_lora_topk_reference(x, A, B, slots, w if k > 1 else torch.ones_like(w), scale).float()
        err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        good = err < 2.5e-2
        ok &= good
        print(f"graph capture N={n} k={k} path={dispatch.choose_path(x, k)}: replay after new slots err={err:.2e} "
              f"{'ok' if good else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------- K1/K2
def baselines(x, A, B, slots, scale):
    """The three per-adapter-pass baselines (see module docstring), each writing a preallocated delta."""
    n = x.shape[0]
    delta = torch.empty(n, B.shape[1], device=DEV, dtype=x.dtype)
    At = [A[a].t() for a in range(S)]
    Bt = [(B[a].float() * scale[a]).to(x.dtype).t() for a in range(S)]
    flat = slots[:, 0].long()
    idx = [torch.nonzero(flat == a).flatten() for a in range(S)]  # setup, not timed
    bounds = [(int(i.min()), int(i.max()) + 1) if i.numel() else (0, 0) for i in idx]
    contiguous = all(hi - lo == i.numel() for (lo, hi), i in zip(bounds, idx))
    masks = [(flat == a).to(x.dtype)[:, None] for a in range(S)]
    tmp = [torch.empty(i.numel(), R, device=DEV, dtype=x.dtype) for i in idx]

    def seq_contig():
        for a, (lo, hi) in enumerate(bounds):
            torch.mm(x[lo:hi], At[a], out=tmp[a])
            torch.mm(tmp[a], Bt[a], out=delta[lo:hi])

    def seq_gather():
        for a in range(S):
            delta.index_copy_(0, idx[a], (x.index_select(0, idx[a]) @ At[a]) @ Bt[a])

    def dense_mask():
        delta.zero_()
        for a in range(S):
            delta.addcmul_(masks[a], (x @ At[a]) @ Bt[a])

    return {"seq_contig": seq_contig if contiguous else None, "seq_gather": seq_gather, "dense_mask": dense_mask}


def run_k1_k2(bw: float) -> None:
    print(f"\n== K1/K2: routed LoRA, N={N_K1}, d={D}, r={R}, {S} adapters, bf16 (median us, graph replay) ==")
    rows = {}
    for layout in ("contig", "mixed"):
        x, A, B, slots, _, scale = make_inputs(N_K1, layout=layout, seed=1)
        slot = slots[:, 0]
        meta = build_routing_meta(slots, S)
        rows[f"routed ({layout})"] = bench_us(lambda x=x, A=A, B=B, slot=slot, scale=scale:
                                              routed_lora(x, A, B, slot, scale))
        rows[f"routed, meta prebuilt ({layout})"] = bench_us(
            lambda x=x, A=A, B=B, slot=slot, scale=scale, meta=meta: routed_lora(x, A, B, slot, scale, meta=meta))
        for name, fn in baselines(x, A, B, slots, scale).items():
            if fn is not None:
                rows[f"{name} ({layout})"] = bench_us(fn)
    W = torch.randn(D, D, device=DEV, dtype=torch.bfloat16)
    xb = torch.randn(N_K1, D, device=DEV, dtype=torch.bfloat16)
    rows["base linear x@W^T (context)"] = bench_us(lambda: xb @ W.t())
    for name, us in rows.items():
        print(f"  {name:40s} {us:9.2f}")
    floor_bytes = (N_K1 * D + S * R * 2 * D + N_K1 * D) * 2
    floor_us = floor_bytes / bw * 1e6
    k1 = {lay: rows[f"{base} ({lay})"] / rows[f"routed ({lay})"]
          for lay, base in (("contig", "seq_contig"), ("mixed", "seq_gather"))}
    k1_dense = rows["dense_mask (mixed)"] / rows["routed (mixed)"]
    k2 = rows["routed (mixed)"] / floor_us
    print(f"  K1 speed-up vs K per-sequence passes: contiguous {k1['contig']:.2f}x, mixed (gathered) "
          f"{k1['mixed']:.2f}x, vs dense masked passes {k1_dense:.2f}x   (target >= 4x)")
    print(f"  K2 memory floor: {floor_bytes / 1e6:.1f} MB at {bw / 1e12:.2f} TB/s measured copy = {floor_us:.2f} us; "
          f"routed/floor = {k2:.2f}x (target <= 2x)")
    RESULTS["k1"] = {"times_us": rows, "speedup_contig": k1["contig"], "speedup_mixed": k1["mixed"],
                     "speedup_dense": k1_dense}
    RESULTS["k2"] = {"bytes": floor_bytes, "copy_bw_Bps": bw, "floor_us": floor_us, "ratio": k2}


# ----------------------------------------------------------------------------------------------- K4 sweep
def run_sweep() -> None:
    print(f"\n== K4: gather vs grouped vs dispatcher across N (d={D}, r={R}, {S} adapters, bf16, median us) ==")
    print(f"  {'N':>6s} {'gather':>9s} {'grouped':>9s} {'grp+meta':>9s} {'auto':>9s} {'auto/best':>9s} "
          f"{'base lin':>9s}  (grouped = meta prebuilt; grp+meta and auto build it in the call)")
    W = torch.randn(D, D, device=DEV, dtype=torch.bfloat16)
    sweep, inputs = [], {}
    for n in SWEEP:  # the two paths first: their crossover sets the dispatcher, which is timed after
        x, A, B, slots, _, scale = inputs[n] = make_inputs(n, seed=n)
        slot = slots[:, 0]
        meta = build_routing_meta(slots, S)
        sweep.append({"N": n,
                      "gather": bench_us(lambda: routed_lora(x, A, B, slot, scale, path="gather")),
                      "grouped": bench_us(lambda: routed_lora(x, A, B, slot, scale, meta=meta, path="grouped")),
                      "grouped_meta": bench_us(lambda: routed_lora(x, A, B, slot, scale, path="grouped")),
                      "base_linear": bench_us(lambda: x @ W.t())})
    crossover = 0
    for row in sweep:  # largest N below which gather never loses to grouped (+ its metadata build)
        if row["gather"] > row["grouped_meta"]:
            break
        crossover = row["N"]
    print(f"  measured crossover: gather wins up to N = {crossover} (was GATHER_MAX_ROWS = "
          f"{dispatch.GATHER_MAX_ROWS}); timing the dispatcher with GATHER_MAX_ROWS = {crossover}")
    RESULTS["crossover_rows"] = crossover
    dispatch.GATHER_MAX_ROWS = crossover
    for row in sweep:
        x, A, B, slots, _, scale = inputs[row["N"]]
        slot = slots[:, 0]
        row["auto"] = bench_us(lambda: routed_lora(x, A, B, slot, scale))
        row["auto_over_best"] = row["auto"] / min(row["gather"], row["grouped_meta"])
        print(f"  {row['N']:6d} {row['gather']:9.2f} {row['grouped']:9.2f} {row['grouped_meta']:9.2f} "
              f"{row['auto']:9.2f} {row['auto_over_best']:9.2f} {row['base_linear']:9.2f}")
    RESULTS["sweep"] = sweep


# ----------------------------------------------------------------------------------------------- K5 top-k
def run_topk() -> None:
    print(f"\n== K5: top-k cost (d={D}, r={R}, {S} adapters, bf16, distinct adapters per token, median us) ==")
    res = {}
    for n in ([8, 40] if ARGS.dry_run else [8, 256, 2048]):
        times = {}
        for k in (1, 2, 4):
            x, A, B, slots, w, scale = make_inputs(n, k, seed=k)
            times[k] = bench_us(lambda x=x, A=A, B=B, slots=slots, w=w, scale=scale:
                                routed_lora_topk(x, A, B, slots, w, scale))
        res[n] = times
        print(f"  N={n:5d} path(k=1)={dispatch.choose_path(x, 1):7s} k=1 {times[1]:8.2f}  k=2 {times[2]:8.2f} "
              f"({times[2] / times[1]:.2f}x, target <= 1.3x)  k=4 {times[4]:8.2f} "
              f"({times[4] / times[1]:.2f}x, target <= 2x)")
    RESULTS["topk"] = res


# ----------------------------------------------------------------------------------------------- tuning
def run_tuning() -> None:
    """Tile-size sweeps that chose the launch configs in triton_gather.py / triton_grouped.py."""
    print("\n== tile sweeps (median us) ==")
    tune = {}
    for n in ([40] if ARGS.dry_run else [2048, 8192]):
        x, A, B, slots, _, scale = make_inputs(n, seed=3)
        meta = build_routing_meta(slots, S)
        line = []
        for bm in (16, 32, 64):
            for split in (1, 2, 4, 8):
                cfg = dict(BLOCK_M=bm, BLOCK_K=64 if ARGS.dry_run else 128, BLOCK_N=16 if ARGS.dry_run else 128,
                           OUT_SPLIT=split, num_warps=4)
                us = bench_us(lambda cfg=cfg: grouped_mod.grouped_lora(x, A, B, slots, None, scale, None, meta, cfg))
                tune[f"grouped N={n} BM={bm} split={split}"] = us
                line.append(f"BM{bm}/s{split}={us:.1f}")
        print(f"  grouped N={n} (default {grouped_mod.grouped_config(n, D, D, S)}):\n    " + " ".join(line))
    for n in ([8] if ARGS.dry_run else [1, 32, 128]):
        x, A, B, slots, _, scale = make_inputs(n, seed=4)
        line = []
        for bn in (128, 256, 512):
            for bk in (64, 128, 256, 512):
                cfg = dict(BLOCK_K=bk, BLOCK_N=bn, num_warps=4)
                us = bench_us(lambda cfg=cfg: gather_mod.gather_lora(x, A, B, slots, None, scale, None, cfg))
                tune[f"gather N={n} BN={bn} BK={bk}"] = us
                line.append(f"BN{bn}/BK{bk}={us:.1f}")
        print(f"  gather N={n} (default {gather_mod.gather_config(D, D)}):\n    " + " ".join(line))
    RESULTS["tuning"] = tune


def write_outputs() -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    lines = ["| N | gather | grouped (meta prebuilt) | grouped + meta | dispatcher | dispatcher / best | base linear |",
             "|---|---|---|---|---|---|---|"]
    for r in RESULTS.get("sweep", []):
        lines.append(f"| {r['N']} | {r['gather']:.2f} | {r['grouped']:.2f} | {r['grouped_meta']:.2f} | "
                     f"{r['auto']:.2f} | {r['auto_over_best']:.2f} | {r['base_linear']:.2f} |")
    Path(out, "kernels.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    env = {"device": torch.cuda.get_device_name() if DEV == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "dry_run": ARGS.dry_run}
    RESULTS["env"] = env
    print("env:", env)
    torch.manual_seed(0)
    ok = check_correctness()
    if not ok:
        print("!! correctness FAILED: timings below are of wrong kernels")
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    run_k1_k2(bw)
    run_sweep()
    run_topk()
    if not ARGS.no_tune:
        run_tuning()
    write_outputs()
    print("\ncorrectness:", "ok" if ok else "FAILED")


if __name__ == "__main__":
    main()
