"""Gather (BGMV-style) Triton kernels for few tokens: split-K shrink, then expand, one program per token.

At decode sizes the work is tiny (one adapter's A and B, ~256 KB at d=4096, r=16) and the time is latency, so
the `in` reduction is split over SPLIT_K programs per row instead of walked serially:
  shrink  grid (M rows, SPLIT_K): P[ks, row, p, :] = A[p, s] [:, chunk_ks] @ x[token][chunk_ks]   (float32 partials)
  expand  grid (N, cdiv(out, BLOCK_N)): delta[n, tile] = sum_j weight * scale[p, s] * B[s][tile] @ sum_ks P[ks, row, p]
Rows are the flat (token, choice) pairs n*k + j, so top-k is a loop over the k choices in the expand, with no
sort and no atomics. No routing metadata at all: the grids depend on shapes only (CUDA-graph safe), and a -1
choice costs one scalar load per program.
Projections (P >= 1) that read the same x share the shrink: A is [P, S, r, in] (p = q/k/v or gate/up), B is
[S, O, r] with projection p's output columns bounds[p]:bounds[p+1] of O, scale is [P, S]. One shrink reads x
once for all P, one expand writes all P deltas, each column using its own projection's r partials. A plain
routed_lora call is P = 1.
Measured on the H200 (d=4096, r=16, bf16, graph replay): the first version fused both phases and walked `in`
serially, 28.1 us at N=1; this split-K pair takes 9.4 us (grouped kernel: 19.5 us). See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools

import torch

from molora.kernels.triton_common import (
    HAS_TRITON,
    cdiv,
    delta_target,
    dependent_launch,
    interpreting,
    next_pow2,
    tl,
    triton,
)

if HAS_TRITON:
    @triton.jit
    def _bgmv_shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, M, IN, R, S,
                            sx0, sx1, sap, sa0, sa1, sa2,
                            K: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # the expand may be scheduled now; it waits for this grid's writes (triton_common)
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        ks = tl.program_id(1)
        s = tl.load(slot_ptr + row).to(tl.int32)
        if (s >= 0) & (s < S):  # -1 rows: nothing to do, the expand skips them too
            offs_r = tl.arange(0, BLOCK_R)
            mr = offs_r < R
            offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
            mk = offs_k < IN
            xv = tl.load(x_ptr + (row // K) * sx0 + offs_k * sx1, mask=mk, other=0.0).to(tl.float32)
            for p in tl.static_range(P):  # x read once for every projection
                a = tl.load(a_ptr + p * sap + s * sa0 + offs_r[:, None] * sa1 + offs_k[None, :] * sa2,
                            mask=mr[:, None] & mk[None, :], other=0.0).to(tl.float32)
                tl.store(part_ptr + ((ks * M + row) * P + p) * BLOCK_R + offs_r, tl.sum(a * xv[None, :], axis=1))

    @triton.jit
    def _column_span(offs_o, O1, O2, O3, OUT):
        """(projection, first column, end column) of each output column; boundaries of absent projections
        (P < 4) are passed as OUT, which no valid column reaches."""
        ge1, ge2, ge3 = offs_o >= O1, offs_o >= O2, offs_o >= O3
        po = ge1.to(tl.int32) + ge2.to(tl.int32) + ge3.to(tl.int32)
        lo = tl.where(ge3, O3, tl.where(ge2, O2, tl.where(ge1, O1, 0)))
        hi = tl.where(ge3, OUT, tl.where(ge2, O3, tl.where(ge1, O2, O1)))
        return po, lo, hi

    @triton.jit
    def _bgmv_expand_kernel(b_ptr, slot_ptr, w_ptr, scale_ptr, part_ptr, out_ptr, M, OUT, R, S, O1, O2, O3,
                            sb0, sb1, sb2, ssp, so0, so1,
                            K: tl.constexpr, P: tl.constexpr, HAS_W: tl.constexpr, ACCUMULATE: tl.constexpr,
                            BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_PAD: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # launched before the shrink ends: wait for its partials
            tl.extra.cuda.gdc_wait()
        n = tl.program_id(0).to(tl.int64)
        offs_o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mo = offs_o < OUT
        po, lo, hi = _column_span(offs_o, O1, O2, O3, OUT)
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < R
        offs_s = tl.arange(0, SPLIT_PAD)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(K):
            row = n * K + j
            s = tl.load(slot_ptr + row).to(tl.int32)
            if (s >= 0) & (s < S):
                w = 1.0
                if HAS_W:
                    w = tl.load(w_ptr + row).to(tl.float32)
                b = tl.load(b_ptr + s * sb0 + offs_o[:, None] * sb1 + offs_r[None, :] * sb2,
                            mask=mo[:, None] & mr[None, :], other=0.0).to(tl.float32)
                tt = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
                for p in tl.static_range(P):
                    part = tl.load(part_ptr + ((offs_s[:, None] * M + row) * P + p) * BLOCK_R + offs_r[None, :],
                                   mask=(offs_s < SPLIT_K)[:, None], other=0.0)
                    t = tl.sum(part, axis=0) * (tl.load(scale_ptr + p * ssp + s).to(tl.float32) * w)
                    tt += tl.where((po == p)[:, None], t[None, :], 0.0)
                acc += tl.sum(b * tt, axis=1)
        if BLOCKS:  # projection p's delta is the contiguous [N, width_p] block at N * bounds[p]
            ptrs = out_ptr + (M // K) * lo + n * (hi - lo) + (offs_o - lo)
        else:
            ptrs = out_ptr + n * so0 + offs_o * so1
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mo, other=0.0).to(tl.float32)
        tl.store(ptrs, acc, mask=mo)


@functools.lru_cache(maxsize=1024)  # pure in its int arguments; saves host time per call
def gather_config(n_out: int, d_in: int, rank: int = 16, n: int = 1) -> dict:
    """Tile sizes: BLOCK_K is the split-K chunk of the shrink, BLOCK_N the output columns per expand program.

    H200, 2026-12-01, d=4096, 4 slots, bf16, median us (benchmarks/lora_kernels.py --only sweep; BLOCK_K x BLOCK_N):
      N=1:  r16 64x64 8.1 (256x256 9.8), r32 8.7 (12.3), r64 9.4 (14.7), r128 12.9 (18.1): BLOCK_K 64 and
            BLOCK_N 64 best at every rank (more programs for one token's work)
      N=32: r16 128x256 10.3 (64x256 10.6, 64x64 12.6), r32 256x128 12.2 (64x256 12.3), r64 64x256 15.0
            (64x64 18.5), r128 64x256 24.1 (64x64 29.4): wide BLOCK_N once N * out / BLOCK_N fills the GPU
    so BLOCK_K = 64 and BLOCK_N the power of two in [64, 256] nearest N * out / 512 programs' worth.
    """
    if interpreting():  # tiny tiles so interpreter tests walk every split and mask
        return dict(BLOCK_K=16, BLOCK_N=16, num_warps=1)
    block_n = min(256, max(64, next_pow2(max(1, n * n_out // 512))))
    return dict(BLOCK_K=min(64, max(16, next_pow2(d_in))), BLOCK_N=min(block_n, max(16, next_pow2(n_out))),
                num_warps=4)


def _launch(x, A4, B, slots, weights, scale2, out, accumulate, bounds, blocks, cfg) -> None:
    # host time matters here (eager decode steps): stride tuples read once, no triton.cdiv
    n, d_in = x.shape
    p_count, s_count, r, _ = A4.shape
    d_out = B.shape[1]
    k = slots.shape[1]
    m_rows = n * k
    slots = slots.contiguous()
    w = weights.contiguous() if weights is not None else scale2
    cfg = cfg or gather_config(d_out, d_in, r, n)
    block_r = max(2, next_pow2(r))
    split_k = cdiv(d_in, cfg["BLOCK_K"])
    part = torch.empty(split_k, m_rows, p_count, block_r, dtype=torch.float32, device=x.device)
    sx, sa, sb = x.stride(), A4.stride(), B.stride()
    pdl = dependent_launch(x)
    _bgmv_shrink_kernel[(m_rows, split_k)](
        x, A4, slots, part, m_rows, d_in, r, s_count, sx[0], sx[1], sa[0], sa[1], sa[2], sa[3],
        K=k, P=p_count, BLOCK_R=block_r, BLOCK_K=cfg["BLOCK_K"], PDL=pdl, num_warps=cfg["num_warps"])
    o1, o2, o3 = (tuple(bounds[1:-1]) + (d_out,) * 3)[:3]
    so = out.stride()
    _bgmv_expand_kernel[(n, cdiv(d_out, cfg["BLOCK_N"]))](
        B, slots, w, scale2, part, out, m_rows, d_out, r, s_count, o1, o2, o3, sb[0], sb[1], sb[2],
        scale2.stride(0), so[0] if len(so) == 2 else 0, so[-1],
        K=k, P=p_count, HAS_W=weights is not None, ACCUMULATE=accumulate, BLOCKS=blocks, SPLIT_K=split_k,
        SPLIT_PAD=max(2, next_pow2(split_k)), BLOCK_R=block_r, BLOCK_N=cfg["BLOCK_N"], PDL=pdl,
        num_warps=cfg["num_warps"], launch_pdl=pdl)


def gather_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """delta (x's dtype) for slots [N, k]; with `out` given, out += delta in place and out is returned."""
    d_out = B.shape[1]
    out, accumulate = delta_target(x, d_out, out)
    if x.shape[0] == 0 or d_out == 0:
        return out
    _launch(x, A[None], B, slots, weights, scale[None], out, accumulate, (0, d_out), False, config)
    return out


def gather_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                      weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                      config: dict | None = None) -> torch.Tensor:
    """The P deltas of projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]) as one flat buffer
    [N * O]: projection p's delta is the contiguous [N, width_p] block starting at N * bounds[p]."""
    n = x.shape[0]
    d_out = B.shape[1]
    flat = torch.empty(n * d_out, dtype=x.dtype, device=x.device)
    if n and d_out:
        _launch(x, A, B, slots, weights, scale, flat, False, bounds, True, config)
    return flat
