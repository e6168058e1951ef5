"""The whole routed linear as one GEMM: the delta's expand runs as the base GEMM's last K steps.

For P projections sharing x (q/k/v, gate/up; P = 1 for one layer) with base weights W_p [width_p, in], the
stacked kernel's shrink (kernels/triton_stacked.py: x read once, every slot's A stacked, each token's weights
and scales folded in) writes the intermediate T [N, P * SR_PAD]; then one launch computes every output tile as

    y_p[rows, cols] = x[rows, :] @ W_p[cols, :]^T  +  T_p[rows, :] @ Bf_p[:, cols]

i.e. one GEMM over K = in + SR_PAD, Bf_p the projection's B stacked as in the stacked kernel. The delta is never
written to memory or read back, and the output is written once: the routed layer costs the shrink launch plus
SR_PAD / in more GEMM work (1.6% at r = 16 on 4 slots, d = 4096) over the base GEMMs, instead of a delta buffer
and a second pass. Top-k costs what k = 1 does (the k choices only change T's coefficients). Triton's GEMM
trails cuBLAS's on one projection and on larger N, so the routed layers take this path for q/k/v up to 256
tokens (kernels/dispatch.py: fuses_base), where one launch for all three GEMMs beats three cuBLAS launches
(H200, d = 4096, N = 256: 1.12x the three base GEMMs with the delta, against 1.25x for the delta then the GEMMs),
and for every group up to WIDE_DECODE_MAX_TOKENS (decode sizes, at the decode tiles below).

  grid (cdiv(N, BLOCK_M) * column tiles,): column tiles run over the projections in turn (each projection's
  columns cut into BLOCK_N tiles; a tile never straddles two projections), and programs go GROUP_M row tiles at
  a time across the columns (the tutorial matmul's ordering), so a W tile is read from HBM once per GROUP_M row
  tiles and from L2 after.
Output: one flat buffer [N * O], projection p's output the contiguous [N, width_p] block at N * bounds[p] (as
the group kernels write their deltas). Bias is not added here (the caller adds it). Shapes alone fix the grid, so
a call can be captured in a CUDA graph and replayed with new slot values.
"""

from __future__ import annotations

import functools

import torch

from molora.kernels.errors import KernelInputError
from molora.kernels.triton_common import (
    HAS_TRITON,
    MAX_PROJECTIONS,
    cdiv,
    dependent_launch,
    dot_config,
    interpreting,
    next_pow2,
    stacked_width,
    tl,
    triton,
)
from molora.kernels.triton_stacked import MAX_WIDTH, stacked_config, stacked_shrink

if HAS_TRITON:
    @triton.jit
    def _stacked_linear_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, b_ptr, part_ptr, out_ptr,
                               N, IN, OUT, R, S, SPLIT_K, O1, O2, O3, T1, T2, T3, TILES_N,
                               sx0, sx1, sw0, sw1, sb0, sb1, sb2,
                               P: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                               SR_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                               EVEN_K: tl.constexpr, PDL: tl.constexpr):
        """One output tile: projection p's columns (bounds 0, O1, O2, O3, OUT; its first column tile T_p) for a
        row tile; the base GEMM over IN, then the stacked expand of the shrink's partials (summed over SPLIT_K)."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(N, BLOCK_M)
        in_group = GROUP_M * TILES_N
        first_m = (pid // in_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        tile_n = (pid % in_group) // group_m
        p = (tile_n >= T1).to(tl.int32) + (tile_n >= T2).to(tl.int32) + (tile_n >= T3).to(tl.int32)
        t_lo = tl.where(p >= 3, T3, tl.where(p >= 2, T2, tl.where(p >= 1, T1, 0)))
        lo = tl.where(p >= 3, O3, tl.where(p >= 2, O2, tl.where(p >= 1, O1, 0)))
        hi = tl.where(p >= 3, OUT, tl.where(p >= 2, O3, tl.where(p >= 1, O2, O1)))
        w_ptr = tl.where(p >= 3, w3_ptr, tl.where(p >= 2, w2_ptr, tl.where(p >= 1, w1_ptr, w0_ptr)))
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = offs_m < N
        offs_m64 = offs_m.to(tl.int64)
        offs_n = (tile_n - t_lo) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within projection p
        width = hi - lo
        mn = offs_n < width
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = x_ptr + offs_m64[:, None] * sx0
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * sw0
        for k0 in range(0, IN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xt = tl.load(x_rows + offs_k[None, :] * sx1, mask=mm[:, None], other=0.0)
                wt = tl.load(w_cols + offs_k[:, None] * sw1, mask=mn[None, :], other=0.0)
            else:
                mk = offs_k < IN
                xt = tl.load(x_rows + offs_k[None, :] * sx1, mask=mm[:, None] & mk[None, :], other=0.0)
                wt = tl.load(w_cols + offs_k[:, None] * sw1, mask=mk[:, None] & mn[None, :], other=0.0)
            acc += tl.dot(xt.to(DOT_DTYPE), wt.to(DOT_DTYPE), input_precision=PRECISION)
        # the delta: T_p [BLOCK_M, SR_PAD] (the shrink's split-K partials summed) @ Bf_p [SR_PAD, BLOCK_N]
        if PDL:  # launched beside the shrink: the base GEMM above ran meanwhile; wait for its partials now
            tl.extra.cuda.gdc_wait()
        offs_c = tl.arange(0, SR_PAD)
        t = tl.zeros([BLOCK_M, SR_PAD], dtype=tl.float32)
        for ks in range(0, SPLIT_K):
            t += tl.load(part_ptr + (ks * N + offs_m64[:, None]) * (P * SR_PAD) + p * SR_PAD + offs_c[None, :],
                         mask=mm[:, None], other=0.0)
        c_slot = offs_c // R_PAD
        c_rank = offs_c % R_PAD
        mc = (c_slot < S) & (c_rank < R)
        bt = tl.load(b_ptr + c_slot.to(tl.int64)[:, None] * sb0 + c_rank[:, None] * sb2
                     + (lo + offs_n).to(tl.int64)[None, :] * sb1, mask=mc[:, None] & mn[None, :], other=0.0)
        acc += tl.dot(t.to(DOT_DTYPE), bt.to(DOT_DTYPE), input_precision=PRECISION)
        out = out_ptr + lo.to(tl.int64) * N + offs_m64[:, None] * width + offs_n[None, :]
        tl.store(out, acc, mask=mm[:, None] & mn[None, :])


# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the small ones, unless the large ones still
# give WIDE_MIN_PROGRAMS programs or more (then fewer, larger tiles read x and W fewer times). H200, 2026-12-02,
# median us (benchmarks/lora_kernels.py --only linear: BLOCK_M/BLOCK_N/warps/stages swept at BLOCK_K 64, GROUP_M 32):
#   d=4096 q/k/v: N=32 small 50.2 (large 63.6); N=128 small 54.1 (large 66.2: 48 programs); N=256 large 67.0 (96
#   programs; small 91.6); above the dispatcher's 256 tokens, N=2048: 128x256 with 3 stages 340, 4 stages 352
#   (64x128: 489-523); 128x256 with 4 warps: 4-5x slower
#   Qwen3-1.7B q/k/v (2048 -> 2048/1024/1024): N=1 small 24.4 (8 warps 23.4); N=128 25.2; N=256 27.7 (large 39.9:
#   32 programs)
# BLOCK_K 128 ran out of shared memory with the large tiles; GROUP_M 1..32 moved times by <= 2%.
SMALL_TILES = (64, 64, 64, 32, 4, 4)
LARGE_TILES = (128, 256, 64, 32, 8, 4)
WIDE_MIN_PROGRAMS = 64
# Decode steps (up to DECODE_MAX_TOKENS tokens: one row tile of 16) read each weight once, so what counts is how
# many programs stream it: narrow column tiles, long K steps. (BLOCK_N, BLOCK_K, num_warps, num_stages) by the
# number of projections (4 takes 3's). H200, 2026-12-05 (`python benchmarks/lora_kernels.py --only decode`: every
# projection of a Qwen3-1.7B and an Emu3-8B block at N = 1, 2, 16, BLOCK_N 16/32/64 x BLOCK_K 128/256 x 4/8 warps x
# 3/4 stages), median us at N = 1, the small tiles before -> these (cuBLAS alone, no delta):
#   1.7B q/k/v 22.2 -> 15.8 (36.0); gate/up (P = 2, before: cuBLAS onto the group call's deltas) 31.5 -> 26.0 (26.1);
#   o 14.6 -> 12.8 (10.1); down 21.7 -> 20.9 (17.2); 8B q/k/v 39.3 -> 26.2 (36.6), gate/up 77.6 -> 71.6 (71.7),
#   o 23.6 -> 20.6 (19.4), down 47.7 -> 44.7 (42.4); each within 4% of the best tiles of its shape at N = 1, 2, 16
DECODE_MAX_TOKENS = 16
DECODE_TILES = {1: (32, 256, 4, 4), 2: (64, 256, 4, 3), 3: (64, 256, 4, 4)}
# Calls of 17 to WIDE_DECODE_MAX_TOKENS tokens (a batch-32 step) take one row tile of 32 and WIDE_DECODE_TILES. The
# small tiles' K steps of 64 kept too few weight bytes in flight: the 1.7B q/k/v call took 16.4 us in the captured
# width-32 step for 5.6 us of weights. H100, 2026-12-06 (`python benchmarks/lora_kernels.py --only decode
# --decode-n 32 --decode-shapes 1.7B`, the same grid as above), median us at N = 32, the step's call before -> these
# (cuBLAS alone, no delta): q/k/v 19.3 (decode tiles, small tiles 16.4 in the step) -> 18.4 (24.0); gate/up 41.7
# (cuBLAS onto the group call's deltas) -> 33.9 (33.3); o 16.2 -> 15.1 (10.9); down 27.7 -> 25.4 (20.3)
WIDE_DECODE_MAX_TOKENS = 32
WIDE_DECODE_TILES = {1: (16, 256, 4, 4), 2: (64, 128, 8, 3), 3: (32, 256, 8, 4)}


@functools.lru_cache(maxsize=256)
def linear_config(n: int, widths: tuple[int, ...]) -> dict:
    """GEMM tiles for N tokens and the projections' output widths (the shrink takes stacked_config's)."""
    if interpreting():  # tiny tiles so interpreter tests walk row groups, column tiles, K steps and masks
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    if n <= WIDE_DECODE_MAX_TOKENS:
        return decode_config(len(widths), n)
    bm, bn = LARGE_TILES[:2]
    large = cdiv(n, bm) * sum(cdiv(w, bn) for w in widths) >= WIDE_MIN_PROGRAMS
    bm, bn, bk, gm, warps, stages = LARGE_TILES if large else SMALL_TILES
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)


def decode_config(projections: int, n: int = 1) -> dict:
    """The decode tiles of a call of `projections` projections and `n` tokens (up to WIDE_DECODE_MAX_TOKENS: one row
    tile, of 16 up to DECODE_MAX_TOKENS, else of 32)."""
    rows, table = (16, DECODE_TILES) if n <= DECODE_MAX_TOKENS else (32, WIDE_DECODE_TILES)
    bn, bk, warps, stages = table[min(projections, 3)]
    return dict(BLOCK_M=rows, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages)


def _check(x: torch.Tensor, W: tuple[torch.Tensor, ...], A: torch.Tensor, B: torch.Tensor,
           bounds: tuple[int, ...]) -> None:
    if x.dim() != 2 or A.dim() != 4 or B.dim() != 3 or B.shape[1] != bounds[-1] or A.shape[3] != x.shape[1]:
        raise KernelInputError(f"stacked_linear_group takes x [N, in], A [P, S, r, in], B [S, O, r] with O = bounds[-1]; "
                               f"got x {list(x.shape)}, A {list(A.shape)}, B {list(B.shape)}, bounds {bounds}")
    p_count = A.shape[0]
    if not 1 <= p_count <= MAX_PROJECTIONS or len(W) != p_count or len(bounds) != p_count + 1:
        raise KernelInputError(f"stacked_linear_group takes 1..{MAX_PROJECTIONS} projections with one base weight and "
                               f"one bound each; got A for {p_count}, {len(W)} weights, bounds {bounds}")
    if stacked_width(A.shape[1], A.shape[2]) > MAX_WIDTH:
        raise KernelInputError(f"stacked_linear_group takes hot sets of at most {MAX_WIDTH} stacked columns, got "
                               f"S={A.shape[1]}, r={A.shape[2]}")
    for p, (w, lo, hi) in enumerate(zip(W, bounds, bounds[1:])):
        if w.dim() != 2 or tuple(w.shape) != (hi - lo, x.shape[1]) or w.dtype != x.dtype or w.device != x.device:
            raise KernelInputError(f"base weight {p} must be [{hi - lo}, {x.shape[1]}] {x.dtype} on {x.device} (x's "
                                   f"dtype and device, bounds {bounds}); got {list(w.shape)} {w.dtype} on {w.device}")
        if w.stride() != W[0].stride():
            raise KernelInputError(f"base weights must share strides; weight {p} has {w.stride()}, weight 0 "
                                   f"{W[0].stride()}")


def stacked_linear_group(x: torch.Tensor, W: tuple[torch.Tensor, ...], A: torch.Tensor, B: torch.Tensor,
                         slots: torch.Tensor, weights: torch.Tensor | None, scale: torch.Tensor,
                         bounds: tuple[int, ...], config: dict | None = None,
                         shrink_config: dict | None = None) -> torch.Tensor:
    """Base linear plus routed delta of P projections sharing x [N, in]: W (P base weights [width_p, in], x's
    dtype), A [P, S, r, in], B [S, O, r], scale [P, S] (contiguous), slots [N, k] (-1: no adapter), weights [N, k]
    or None. Returns one flat buffer [N * O] in x's dtype, projection p's output the contiguous [N, width_p] block
    at N * bounds[p] (no bias). `config` / `shrink_config` override the GEMM's and the shrink's tiles.

    A launcher, as stacked_lora_group is: it checks the weights and the shapes it lays out, not the routing inputs
    (slots' and weights' shapes, dtypes and devices, scale's shape) that the public ops check
    (kernels/checks.py); its caller (routing/lora.py) passes tensors it built itself."""
    W, bounds = tuple(W), tuple(bounds)
    _check(x, W, A, B, bounds)
    if not HAS_TRITON or not (x.is_cuda or interpreting()):
        raise KernelInputError(f"stacked_linear_group runs a Triton kernel, which needs triton and CUDA tensors (x is "
                               f"on {x.device}); elsewhere compute F.linear per projection plus routed_lora_group, "
                               "as the routed layers do (routing/lora.py)")
    n, d_in = x.shape
    p_count, s_count, r, _ = A.shape
    d_out = B.shape[1]
    flat = torch.empty(n * d_out, dtype=x.dtype, device=x.device)
    if n == 0 or d_out == 0:
        return flat
    widths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    cfg = config or linear_config(n, tuple(widths))
    scfg = shrink_config or stacked_config(n, d_in, max(widths), stacked_width(s_count, r), p_count, False)
    pdl = dependent_launch(x)
    part = stacked_shrink(x, A, slots, weights, scale, scfg, pdl)
    bn = cfg["BLOCK_N"]
    starts = [0]
    for wd in widths:
        starts.append(starts[-1] + cdiv(wd, bn))
    t1, t2, t3 = (starts[1:-1] + [starts[-1]] * 3)[:3]
    o1, o2, o3 = (list(bounds[1:-1]) + [d_out] * 3)[:3]
    w0, w1, w2, w3 = (W + (W[0],) * 3)[:4]
    dot_dtype, precision = dot_config(x.dtype)
    grid = (cdiv(n, cfg["BLOCK_M"]) * starts[-1],)
    _stacked_linear_kernel[grid](
        x, w0, w1, w2, w3, B, part, flat, n, d_in, d_out, r, s_count, part.shape[0], o1, o2, o3, t1, t2, t3,
        starts[-1], x.stride(0), x.stride(1), W[0].stride(0), W[0].stride(1), B.stride(0), B.stride(1),
        B.stride(2), P=p_count, DOT_DTYPE=dot_dtype, PRECISION=precision, SR_PAD=scfg["SR_PAD"],
        R_PAD=next_pow2(r), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        EVEN_K=d_in % cfg["BLOCK_K"] == 0, PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        launch_pdl=pdl)
    return flat
