"""Grouped (SGMV-style) Triton kernel: tiles of slot-sorted rows, tensor-core tl.dot shrink and expand.

Rows are the flat (token, choice) pairs sorted by slot (kernels/metadata.py). Each program takes BLOCK_M rows of
one slot's segment, finds that segment itself from the S + 2 offsets (a vector scan, no host help), and computes
  t = (x[tokens] @ A[s]^T) * scale[s] * weight          [BLOCK_M, r]   (tl.dot over `in`)
  y = t @ B[s]^T                                         [BLOCK_M, out] (tl.dot per output tile)
The grid is (cdiv(M, BLOCK_M) + S, OUT_SPLIT): every segment adds at most one partial tile, so this bounds the
tile count using shapes only; programs past the last tile exit. OUT_SPLIT programs share one row tile and each
expands a slice of `out` (recomputing the shrink from L2) so that small N still fills the GPU.
Modes: 0 store the delta (no-adapter rows get explicit zeros), 1 add into `out` (no-adapter rows skipped:
slot -1 costs nothing), 2 float32 atomic add (top-k: the k rows of a token live in different tiles).
"""

from __future__ import annotations

import functools

import torch

from kernels.metadata import RoutingMeta, build_routing_meta
from kernels.triton_common import HAS_TRITON, dot_config, interpreting, next_pow2, tl, triton

MODE_STORE, MODE_ADD, MODE_ATOMIC = 0, 1, 2

if HAS_TRITON:
    @triton.jit
    def _grouped_kernel(x_ptr, a_ptr, b_ptr, rows_ptr, offsets_ptr, w_ptr, scale_ptr, out_ptr,
                        IN, OUT, R, S, OUT_PER,
                        sx0, sx1, sa0, sa1, sa2, sb0, sb1, sb2, so0, so1,
                        K: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, S_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        # --- which segment (slot) and which tile of it is this program's? ---
        seg = tl.arange(0, S_PAD)
        in_range = seg <= S
        starts = tl.load(offsets_ptr + seg, mask=in_range, other=0)
        ends = tl.load(offsets_ptr + seg + 1, mask=in_range, other=0)
        ntiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(ntiles, axis=0)
        tile_start = tile_end - ntiles
        hit = (tile_start <= pid) & (pid < tile_end)
        found = tl.sum(hit.to(tl.int32), axis=0)
        s = tl.sum(tl.where(hit, seg, 0), axis=0)
        seg_end = tl.sum(tl.where(hit, ends, 0), axis=0)
        row0 = tl.sum(tl.where(hit, starts + (pid - tile_start) * BLOCK_M, 0), axis=0)
        active = found > 0
        if MODE != 0:  # accumulating: no-adapter rows are skipped entirely
            active = active & (s < S)
        if active:
            offs_m = row0 + tl.arange(0, BLOCK_M)
            mrow = offs_m < seg_end
            rows = tl.load(rows_ptr + offs_m, mask=mrow, other=0)
            tok = (rows // K).to(tl.int64)
            o_lo = tl.program_id(1) * OUT_PER
            o_hi = tl.minimum(o_lo + OUT_PER, OUT)
            offs_r = tl.arange(0, BLOCK_R)
            mr = offs_r < R
            if s < S:
                acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for k0 in range(0, IN, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mk = offs_k < IN
                    xt = tl.load(x_ptr + tok[:, None] * sx0 + offs_k[None, :] * sx1,
                                 mask=mrow[:, None] & mk[None, :], other=0.0)
                    at = tl.load(a_ptr + s * sa0 + offs_r[None, :] * sa1 + offs_k[:, None] * sa2,
                                 mask=mk[:, None] & mr[None, :], other=0.0)
                    acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=PRECISION)
                coef = tl.load(scale_ptr + s).to(tl.float32)
                if HAS_W:
                    w = tl.load(w_ptr + rows, mask=mrow, other=0.0).to(tl.float32)
                    acc = acc * (w * coef)[:, None]
                else:
                    acc = acc * coef
                t = acc.to(DOT_DTYPE)
                for o0 in range(o_lo, o_hi, BLOCK_N):
                    offs_o = o0 + tl.arange(0, BLOCK_N)
                    mo = offs_o < o_hi
                    bt = tl.load(b_ptr + s * sb0 + offs_o[None, :] * sb1 + offs_r[:, None] * sb2,
                                 mask=mr[:, None] & mo[None, :], other=0.0)
                    y = tl.dot(t, bt.to(DOT_DTYPE), input_precision=PRECISION)
                    ptrs = out_ptr + tok[:, None] * so0 + offs_o[None, :] * so1
                    m2 = mrow[:, None] & mo[None, :]
                    if MODE == 2:
                        tl.atomic_add(ptrs, y, mask=m2)
                    else:
                        if MODE == 1:
                            y += tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
                        tl.store(ptrs, y, mask=m2)
            else:  # MODE 0 only: the no-adapter rows' delta is an explicit zero
                for o0 in range(o_lo, o_hi, BLOCK_N):
                    offs_o = o0 + tl.arange(0, BLOCK_N)
                    m2 = mrow[:, None] & (offs_o < o_hi)[None, :]
                    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    tl.store(out_ptr + tok[:, None] * so0 + offs_o[None, :] * so1, zero, mask=m2)


# Measured overrides (BLOCK_M, OUT_SPLIT, num_warps) by (padded rank, row bucket), row bucket = the smallest of
# 256, 1024, 4096, 16384 that holds the rows; chosen on the H200 (benchmarks/kernels.py --only sweep, numbers in
# benchmarks/RESULTS.md). Shapes not listed take the rule in grouped_config.
GROUPED_TILES: dict[tuple[int, int], tuple[int, int, int]] = {}
ROW_BUCKETS = (256, 1024, 4096, 16384)


def row_bucket(m_rows: int) -> int:
    return next((b for b in ROW_BUCKETS if m_rows <= b), ROW_BUCKETS[-1])


@functools.lru_cache(maxsize=1024)  # pure in its int arguments; saves host time per call
def grouped_config(m_rows: int, d_in: int, d_out: int, num_slots: int, rank: int = 16) -> dict:
    """Tile sizes and output split.

    GPU: BLOCK_M grows with the row count (16 rows below 1024, 32 below 4096, else 64) and OUT_SPLIT spreads a
    row tile's output columns over enough programs for ~2 per SM of an H200 (132 SMs), in 512-column steps;
    GROUPED_TILES overrides both where a measurement chose otherwise.
    """
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, OUT_SPLIT=2 if d_out > 16 else 1, num_warps=1)
    block_m = 16 if m_rows < 1024 else (32 if m_rows < 4096 else 64)
    tiles = triton.cdiv(m_rows, block_m) + num_slots
    max_split = max(1, d_out // 512)
    split = 1
    while split * 2 <= max_split and tiles * split < 264:
        split *= 2
    warps = 4
    tuned = GROUPED_TILES.get((max(16, next_pow2(rank)), row_bucket(m_rows)))
    if tuned is not None:
        block_m, split, warps = tuned[0], min(tuned[1], max_split), tuned[2]
    return dict(BLOCK_M=block_m, BLOCK_K=min(128, max(16, next_pow2(d_in))),
                BLOCK_N=min(128, max(16, next_pow2(d_out))), OUT_SPLIT=split, num_warps=warps)


def grouped_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                 meta: RoutingMeta | None = None, config: dict | None = None) -> torch.Tensor:
    """delta (x's dtype) for slots [N, k]; with `out` given, out += delta in place and out is returned."""
    n, d_in = x.shape
    s_count, r, _ = A.shape
    d_out = B.shape[1]
    k = slots.shape[1]
    if meta is None:
        meta = build_routing_meta(slots, s_count)
    accumulate = out is not None
    if n == 0 or d_out == 0:
        return out if accumulate else torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    if k == 1:
        mode = MODE_ADD if accumulate else MODE_STORE
        target = out if accumulate else torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    else:
        mode = MODE_ATOMIC
        direct = accumulate and out.dtype == torch.float32
        target = out if direct else torch.zeros(n, d_out, dtype=torch.float32, device=x.device)
    m_rows = n * k
    cfg = config or grouped_config(m_rows, d_in, d_out, s_count, r)
    out_per = triton.cdiv(triton.cdiv(d_out, cfg["OUT_SPLIT"]), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    grid = (triton.cdiv(m_rows, cfg["BLOCK_M"]) + s_count, triton.cdiv(d_out, out_per))
    dot_dtype, precision = dot_config(x.dtype)
    w = weights.contiguous() if weights is not None else scale
    _grouped_kernel[grid](x, A, B, meta.rows, meta.offsets, w, scale, target,
                          d_in, d_out, r, s_count, out_per,
                          x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2),
                          B.stride(0), B.stride(1), B.stride(2), target.stride(0), target.stride(1),
                          K=k, HAS_W=weights is not None, MODE=mode, DOT_DTYPE=dot_dtype, PRECISION=precision,
                          S_PAD=next_pow2(s_count + 2), BLOCK_M=cfg["BLOCK_M"], BLOCK_R=max(16, next_pow2(r)),
                          BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    if k == 1 or target is out:
        return target
    if accumulate:
        return out.add_(target)
    return target.to(x.dtype)
