"""How near the weight bandwidth one GEMM a projection can get at decode sizes (issue 32, E2), outside the engine.

A captured chain shaped like a Qwen3-1.7B decode step's GEMMs: 28 blocks x (q/k/v, o, gate/up, down), random bf16
weights, each GEMM after a small copy standing for the norm or activation before it, 2 rank-16 adapters on 4
slots, N = 1 and 2 tokens; replayed 10 times, best of 5, against the bytes at the measured copy bandwidth. Rows:

    shipped tensor-core kernel    stacked_linear_group: the routed layers' decode GEMM, its shrink beside it (PDL)
    cuBLAS base only              F.linear, no delta and no shrink: what the GEMMs alone cost as one launch each
    copies only                   the chain's small copies alone
    CUDA-core variants            the same shrink, then a GEMV on the CUDA cores (weights read 16 bytes a thread,
                                  a float32 [BLOCK_N, BLOCK_K] accumulator summed once; N = 1 and 2), by tiles:
                                  the alternative a decode GEMM could take, measured, not shipped
    persistent chain              N = 1, base only: the whole chain's 112 GEMVs in ONE launch of one program an SM,
                                  each program taking every PROGRAMS-th row tile of each GEMM in turn; "barrier":
                                  a grid-wide barrier after every GEMM (as a real step's next GEMM waits for its
                                  input), "no barrier" the bound without it, "next weights before it" the barrier
                                  with the next GEMV's first weight chunk loaded before the wait. What fewer,
                                  longer launches could give
                                  (a persistent per-block decode kernel), against cuBLAS's GEMVs less the copies

    python benchmarks/decode_gemv_chain.py --json decode_gemv_chain.json          # a CUDA device
    python benchmarks/decode_gemv_chain.py --persistent-only                      # the persistent chain's rows
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's molora
from molora.kernels.graphs import capture_graph  # noqa: E402
from molora.kernels.triton_common import cdiv, dependent_launch, next_pow2, stacked_width, tl, triton  # noqa: E402
from molora.kernels.triton_linear import stacked_linear_group  # noqa: E402
from molora.kernels.triton_stacked import stacked_config, stacked_shrink  # noqa: E402


@triton.jit
def _cc_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, b_ptr, part_ptr, out_ptr,
               N, IN, OUT, R, S, SPLIT_K, O1, O2, O3, T1, T2, T3, sx0, sw0, sb0, sb1, sb2,
               P: tl.constexpr, SR_PAD: tl.constexpr, R_PAD: tl.constexpr, M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    tile_n = tl.program_id(0)
    p = (tile_n >= T1).to(tl.int32) + (tile_n >= T2).to(tl.int32) + (tile_n >= T3).to(tl.int32)
    t_lo = tl.where(p >= 3, T3, tl.where(p >= 2, T2, tl.where(p >= 1, T1, 0)))
    lo = tl.where(p >= 3, O3, tl.where(p >= 2, O2, tl.where(p >= 1, O1, 0)))
    hi = tl.where(p >= 3, OUT, tl.where(p >= 2, O3, tl.where(p >= 1, O2, O1)))
    w_ptr = tl.where(p >= 3, w3_ptr, tl.where(p >= 2, w2_ptr, tl.where(p >= 1, w1_ptr, w0_ptr)))
    offs_n = (tile_n - t_lo) * BLOCK_N + tl.arange(0, BLOCK_N)
    width = hi - lo
    mn = offs_n < width
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * sw0
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None], other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + offs_k).to(tl.float32)
        acc0 += w * x0[None, :]
        if M > 1:
            x1 = tl.load(x_ptr + sx0 + offs_k).to(tl.float32)
            acc1 += w * x1[None, :]
    y0 = tl.sum(acc0, axis=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_c = tl.arange(0, SR_PAD)
    c_slot = offs_c // R_PAD
    c_rank = offs_c % R_PAD
    mc = (c_slot < S) & (c_rank < R)
    bt = tl.load(b_ptr + c_slot.to(tl.int64)[None, :] * sb0 + c_rank[None, :] * sb2
                 + (lo + offs_n).to(tl.int64)[:, None] * sb1, mask=mc[None, :] & mn[:, None], other=0.0).to(tl.float32)
    t0 = tl.zeros([SR_PAD], dtype=tl.float32)
    for ks in range(0, SPLIT_K):
        t0 += tl.load(part_ptr + (ks * N) * (P * SR_PAD) + p * SR_PAD + offs_c)
    t0 = t0.to(x_ptr.dtype.element_ty).to(tl.float32)
    y0 += tl.sum(bt * t0[None, :], axis=1)
    tl.store(out_ptr + lo.to(tl.int64) * N + offs_n, y0, mask=mn)
    if M > 1:
        y1 = tl.sum(acc1, axis=1)
        t1 = tl.zeros([SR_PAD], dtype=tl.float32)
        for ks in range(0, SPLIT_K):
            t1 += tl.load(part_ptr + (ks * N + 1) * (P * SR_PAD) + p * SR_PAD + offs_c)
        t1 = t1.to(x_ptr.dtype.element_ty).to(tl.float32)
        y1 += tl.sum(bt * t1[None, :], axis=1)
        tl.store(out_ptr + lo.to(tl.int64) * N + width + offs_n, y1, mask=mn)


@triton.jit
def _first_chunk(w_table, in_table, out_table, g, pid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GEMV g's weights for this program's first row tile, first BLOCK_K columns (zeros where it has no tile)."""
    w_ptr = tl.multiple_of(tl.load(w_table + g).to(tl.pointer_type(tl.bfloat16)), 16)
    d_in = tl.multiple_of(tl.load(in_table + g), BLOCK_K)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * d_in + offs_k[None, :],
                   mask=(offs_n < tl.load(out_table + g))[:, None], other=0.0)


@triton.jit
def _persistent_chain_kernel(w_table, x_table, y_table, in_table, out_table, n_gemms, counter_ptr, stall_ptr,
                             PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BARRIER: tl.constexpr, PREFETCH: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """y_g = W_g @ x_g for the n_gemms GEMVs of the tables (device pointers and sizes; d_in a multiple of BLOCK_K),
    one launch of PROGRAMS programs, all resident (one an SM). With BARRIER, every program arrives on a global
    counter after each GEMM and spins until all have (release / acquire at GPU scope); a spin that reaches
    SPIN_LIMIT gives up and counts itself in stall_ptr, so a grid that is not all resident ends instead of hanging.
    PREFETCH: the loads of the next GEMV's first weight chunk are issued before the barrier (weights never wait for
    the previous GEMV), so their HBM latency overlaps the wait."""
    pid = tl.program_id(0)
    w_next = _first_chunk(w_table, in_table, out_table, 0, pid, BLOCK_N, BLOCK_K)
    for g in range(0, n_gemms):
        w_ptr = tl.multiple_of(tl.load(w_table + g).to(tl.pointer_type(tl.bfloat16)), 16)
        x_ptr = tl.multiple_of(tl.load(x_table + g).to(tl.pointer_type(tl.bfloat16)), 16)
        y_ptr = tl.multiple_of(tl.load(y_table + g).to(tl.pointer_type(tl.bfloat16)), 16)
        d_in = tl.multiple_of(tl.load(in_table + g), BLOCK_K)  # (the hints let the weights load 16 bytes a thread)
        d_out = tl.load(out_table + g)
        w_first = w_next
        for t in range(pid, tl.cdiv(d_out, BLOCK_N), PROGRAMS):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            mn = offs_n < d_out
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, d_in, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                if PREFETCH and t == pid and k0 == 0:
                    w = w_first
                else:
                    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * d_in + offs_k[None, :], mask=mn[:, None],
                                other=0.0)
                acc += w.to(tl.float32) * tl.load(x_ptr + offs_k).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(tl.bfloat16), mask=mn)
        if PREFETCH:
            w_next = _first_chunk(w_table, in_table, out_table, tl.minimum(g + 1, n_gemms - 1), pid, BLOCK_N,
                                  BLOCK_K)
        if BARRIER:
            tl.debug_barrier()  # every thread's stores issued before the release
            tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins = 0
            while (seen < (g + 1) * PROGRAMS) & (spins < SPIN_LIMIT):
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
                spins += 1
            if spins >= SPIN_LIMIT:
                tl.atomic_add(stall_ptr, 1)
            tl.debug_barrier()


def persistent_rows(layers: list, floor_us: float, results: dict, configs: list, g) -> None:
    """The persistent chain at N = 1 (base weights only), with and without its barriers, by tiles, into results."""
    grps = [grp for layer in layers for grp in layer]
    xs = {w: torch.randn(w, device="cuda", dtype=torch.bfloat16, generator=g) for w in {grp["d_in"] for grp in grps}}
    ws = [grp["base"] for grp in grps]
    ys = [torch.empty(w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]

    def table(values):
        return torch.tensor(values, device="cuda", dtype=torch.int64)
    tables = (table([w.data_ptr() for w in ws]), table([xs[grp["d_in"]].data_ptr() for grp in grps]),
              table([y.data_ptr() for y in ys]), table([w.shape[1] for w in ws]), table([w.shape[0] for w in ws]))
    refs = [torch.nn.functional.linear(xs[grp["d_in"]][None], w)[0] for grp, w in zip(grps, ws)]
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    stall = torch.zeros(1, device="cuda", dtype=torch.int32)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    cublas = results["N=1 cuBLAS base only (no delta, no shrink)"] - results["N=1 copies only"]
    print(f"N=1 cuBLAS's GEMVs less the copies: {cublas:.0f} us ({floor_us / cublas:.2f} of copy bandwidth)",
          flush=True)
    for barrier, prefetch in ((False, False), (True, False), (True, True)):
        mode = ("barrier" if barrier else "no barrier") + (", next weights before it" if prefetch else "")
        scored = []
        for bn, bk, warps in configs:
            label = f"persistent chain, {mode}, bn={bn} bk={bk} w={warps}"

            def launch(tiles=(bn, bk, warps), barrier=barrier, prefetch=prefetch):
                counter.zero_()
                _persistent_chain_kernel[(programs,)](*tables, len(ws), counter, stall, PROGRAMS=programs,
                                                      BLOCK_N=tiles[0], BLOCK_K=tiles[1], BARRIER=barrier,
                                                      PREFETCH=prefetch, SPIN_LIMIT=1 << 18, num_warps=tiles[2])
            try:
                stall.zero_()
                launch()
                torch.cuda.synchronize()
                err = max(((y.float() - r.float()).abs().max() / r.float().abs().max()).item()
                          for y, r in zip(ys, refs))
                graph, _ = capture_graph(launch)
                us = replay_us(graph)
            except Exception as exc:  # (a tile the compiler refuses)
                print(label, "failed:", type(exc).__name__, str(exc)[:200], flush=True)
                continue
            stalls = int(stall.item())
            results[f"N=1 {label}"] = round(us, 1)
            results[f"N=1 {label} rel_err"] = err
            results[f"N=1 {label} stalls"] = stalls
            verdict = "WRONG" if err > 2e-2 else ("STALLED (not all resident)" if stalls else "ok")
            print(f"N=1 {label}: {us:.0f} us a chain ({floor_us / us:.2f} of copy bandwidth; {cublas / us:.2f}x "
                  f"cuBLAS's GEMVs) {verdict}", flush=True)
            if verdict == "ok":
                scored.append((us, label))
        if scored:
            print(f"N=1 best persistent chain, {mode}: {min(scored)}", flush=True)


def cc_linear(x, W, A, B, slots, scale, bounds, bn, bk, warps, stages):
    n, d_in = x.shape
    p_count, s_count, r, _ = A.shape
    d_out = B.shape[1]
    widths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    flat = torch.empty(n * d_out, dtype=x.dtype, device=x.device)
    scfg = stacked_config(n, d_in, max(widths), stacked_width(s_count, r), p_count, False)
    pdl = dependent_launch(x)
    part = stacked_shrink(x, A, slots, None, scale, scfg, pdl)
    starts = [0]
    for wd in widths:
        starts.append(starts[-1] + cdiv(wd, bn))
    t1, t2, t3 = (starts[1:-1] + [starts[-1]] * 3)[:3]
    o1, o2, o3 = (list(bounds[1:-1]) + [d_out] * 3)[:3]
    w0, w1, w2, w3 = (tuple(W) + (W[0],) * 3)[:4]
    _cc_kernel[(starts[-1],)](x, w0, w1, w2, w3, B, part, flat, n, d_in, d_out, r, s_count, part.shape[0],
                              o1, o2, o3, t1, t2, t3, x.stride(0), W[0].stride(0), B.stride(0), B.stride(1),
                              B.stride(2), P=p_count, SR_PAD=scfg["SR_PAD"], R_PAD=next_pow2(r), M=n,
                              BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return flat


def layer_set(d, mlp, q, kv, g):
    def group(widths, d_in):
        base = torch.randn(sum(widths), d_in, device="cuda", dtype=torch.bfloat16, generator=g) / d_in ** 0.5
        W, lo = [], 0
        for w in widths:
            W.append(base[lo:lo + w])
            lo += w
        A = torch.randn(len(widths), 4, 16, d_in, device="cuda", dtype=torch.bfloat16, generator=g) / d_in ** 0.5
        B = torch.randn(4, sum(widths), 16, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        scale = torch.ones(len(widths), 4, device="cuda")
        bounds = [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        return dict(W=W, base=base, A=A, B=B, scale=scale, bounds=tuple(bounds), d_in=d_in)
    return [group([q, kv, kv], d), group([q], q), group([mlp, mlp], d), group([d], mlp)]


def replay_us(graph) -> float:
    """Microseconds of one replay of `graph`: 10 replays timed by CUDA events, the best of 5."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 100)
    return min(times)


def width_rows(n: int, layers: list, floor_us: float, results: dict, configs: list, g) -> list:
    """Every row at N = n tokens into `results`; the CUDA-core tiles of `configs`; returns the best three tiles."""
    d, mlp = layers[0][0]["d_in"], layers[0][3]["d_in"]
    xs = {w: torch.randn(n, w, device="cuda", dtype=torch.bfloat16, generator=g) for w in (d, mlp)}
    staged = {w: torch.empty_like(x) for w, x in xs.items()}
    slots = torch.randint(-1, 4, (n, 1), device="cuda", generator=g)

    def chain(run):
        outs = []
        for layer in layers:
            for grp in layer:
                x = staged[grp["d_in"]]
                x.copy_(xs[grp["d_in"]])  # stands for the norm / activation before each GEMM
                outs.append(run(x, grp))
        return outs

    def timed(run, label):
        graph, outs = capture_graph(lambda: chain(run))
        us = replay_us(graph)
        print(f"N={n} {label}: {us:.0f} us a chain ({floor_us / us:.2f} of copy bandwidth)", flush=True)
        results[f"N={n} {label}"] = round(us, 1)
        return outs

    ref = timed(lambda x, grp: stacked_linear_group(x, grp["W"], grp["A"], grp["B"], slots, None, grp["scale"],
                                                    grp["bounds"]), "shipped tensor-core kernel")
    timed(lambda x, grp: torch.nn.functional.linear(x, grp["base"]), "cuBLAS base only (no delta, no shrink)")
    copies, _ = capture_graph(lambda: chain(lambda x, grp: None))  # the chain's non-GEMV share
    results[f"N={n} copies only"] = round(replay_us(copies), 1)
    print(f"N={n} copies only: {results[f'N={n} copies only']:.0f} us", flush=True)
    scored = []
    for bn, bk, warps, stages in configs:
        label = f"CUDA-core bn={bn} bk={bk} w={warps} st={stages}"

        def variant(x, grp, tiles=(bn, bk, warps, stages)):
            return cc_linear(x, grp["W"], grp["A"], grp["B"], slots, grp["scale"], grp["bounds"], *tiles)
        try:
            outs = timed(variant, label)
        except Exception as err:  # (a tile the compiler refuses)
            print(label, "failed:", type(err).__name__, str(err)[:200], flush=True)
            continue
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(outs, ref))
        results[f"N={n} {label} rel_err"] = err
        if err > 2e-2:
            print(f"   rel err {err:.3g}: WRONG", flush=True)
        else:
            scored.append((results[f"N={n} {label}"], (bn, bk, warps, stages)))
    if scored:
        print(f"N={n} best CUDA-core: {min(scored)}", flush=True)
    return [tiles for _, tiles in sorted(scored)[:3]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--persistent-only", action="store_true",
                        help="N = 1's shipped, cuBLAS and copies rows, then the persistent chain (no CUDA-core tiles)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemv_chain.py times CUDA kernels: it needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    d, mlp, q, kv, blocks = 2048, 6144, 2048, 1024, 28
    layers = [layer_set(d, mlp, q, kv, g) for _ in range(blocks)]
    weight_bytes = sum(grp["base"].numel() * 2 for layer in layers for grp in layer)
    results = {"device": torch.cuda.get_device_name(), "weight_bytes": weight_bytes}
    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    out.copy_(buf)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        out.copy_(buf)
    torch.cuda.synchronize()
    bw = 2 * (2 << 30) * 10 / (time.perf_counter() - t)
    del buf, out
    results["copy_GBs"] = bw / 1e9
    floor_us = weight_bytes / bw * 1e6
    print(f"{torch.cuda.get_device_name()}: weights {weight_bytes / 1e9:.3f} GB, copy {bw / 1e9:.0f} GB/s, "
          f"floor {floor_us:.0f} us a chain", flush=True)
    if args.persistent_only:
        width_rows(1, layers, floor_us, results, [], g)
    else:
        cc_tiles = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (1, 3)))
        best = width_rows(1, layers, floor_us, results, cc_tiles, g)
        width_rows(2, layers, floor_us, results, best, g)  # the three best tiles of N = 1
    persistent_rows(layers, floor_us, results, list(itertools.product((8, 16, 32), (512, 1024), (4, 8))), g)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
