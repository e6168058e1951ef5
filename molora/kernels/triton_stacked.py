"""Stacked-slots Triton kernels: top-k at the cost of k = 1, with no sort, no metadata and no atomics.

Every slot's A is read as one stacked matrix Af[S*r_pad, in] (row c = s*r_pad + i is A[s, i, :], r_pad the
rank padded to a power of two, a constexpr: the compiler then sees each slot's rows as contiguous and loads B's
[S*r_pad, columns] tiles along r, where B [S, out, r] is contiguous) and every slot's B as Bf[S*r_pad, out] (row c
is B[s, :, i]). For slots [N, k] and weights [N, k]:
    coef[n, c] = scale[s] * sum_j weights[n, j] * [slots[n, j] == s]          (s = c // r_pad; -1 matches nothing)
    delta[n]   = sum_c (coef[n, c] * (Af[c] . x[n])) * Bf[c]
so x is read once, the k choices only change the coefficients folded into the [N, S*r] intermediate, and one
expand writes each output element once, straight into `out` (no float32 buffer). The arithmetic is S/k times
what the grouped kernel does, which costs nothing while S*r is small: at d = 4096 on the H200 the two matmuls
stay under the memory time while S*r <~ 100 (4*d*S*r flop vs 4*d bytes per token at ~790 TFLOP/s, ~4.3 TB/s);
kernels/dispatch.py bounds S*r with the width up to which this path was measured faster.
  shrink  grid (cdiv(N, SHRINK_M), S*r_pad / BLOCK_C, SPLIT_K):
          P[ks, rows, cols] = coef[rows, cols] * x[rows, chunk_ks] @ Af[cols, chunk_ks]^T    (float32 partials)
  expand  grid (cdiv(N, EXPAND_M), OUT_SPLIT):
          out[rows, slice] (+)= (sum_ks P[ks, rows, :]) @ Bf[:, slice]
  fused   grid (cdiv(N, BLOCK_M), P * OUT_SPLIT): both phases in one launch, each program a slice of one
          projection's columns, recomputing that projection's (tiny) shrink, for eager decode calls, where the
          caller pays per launch (FusedLaunch: one launch per group call, through the compiled kernel's launcher)
Projections that read the same x (q/k/v, gate/up) share the shrink: with A [P, S, r, in] the shrink's columns
are P blocks of S*r_pad (x read once for all), and one expand launch has P * OUT_SPLIT programs per row tile,
each writing a slice of one projection's delta (stacked_lora_group). A plain call is P = 1.
Grids depend on shapes only, so a call can be captured in a CUDA graph and replayed with new slot values.
"""

from __future__ import annotations

import functools

import torch

from molora.kernels.errors import KernelInputError
from molora.kernels.triton_common import (
    HAS_TRITON,
    MAX_PROJECTIONS,
    cdiv,
    check_triton_device,
    delta_target,
    dependent_launch,
    dot_config,
    interpreting,
    next_pow2,
    stacked_width,
    tl,
    triton,
)

if HAS_TRITON:
    from molora.kernels.triton_common import choice_weights  # a triton.jit function: defined only with triton

    @triton.jit
    def _shrink_tile(x_ptr, a_ptr, slot_ptr, w_ptr, scale_ptr, offs_m64, mm, offs_c, k_lo, k_hi, R, S,
                     sx0, sx1, sap, sa0, sa1, sa2, ssp,
                     K: tl.constexpr, HAS_W: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                     SR_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """coef * (x[rows, k_lo:k_hi] @ Af[cols, k_lo:k_hi]^T), float32 [BLOCK_M, BLOCK_C]; column c is
        projection c // SR_PAD, slot (c % SR_PAD) // R_PAD, rank row c % R_PAD."""
        cp = offs_c // SR_PAD
        cc = offs_c % SR_PAD
        c_slot = cc // R_PAD
        c_rank = cc % R_PAD
        mc = (c_slot < S) & (c_rank < R)
        a_col = cp.to(tl.int64) * sap + c_slot.to(tl.int64) * sa0 + c_rank * sa1
        acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < k_hi
            xt = tl.load(x_ptr + offs_m64[:, None] * sx0 + offs_k[None, :] * sx1,
                         mask=mm[:, None] & mk[None, :], other=0.0)
            at = tl.load(a_ptr + a_col[None, :] + offs_k[:, None] * sa2, mask=mk[:, None] & mc[None, :], other=0.0)
            acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=PRECISION)
        # fold weight * scale of every choice into its slot's r columns (a token's repeated slot sums its weights)
        coef = choice_weights(slot_ptr, w_ptr, offs_m64, mm, c_slot, K, HAS_W)
        sc = tl.load(scale_ptr + cp * ssp + c_slot, mask=mc, other=0.0).to(tl.float32)
        return acc * coef * sc[None, :]  # padded columns (slot >= S or rank row >= R) are zeros

    @triton.jit
    def _expand_tile(t16, b_ptr, out_ptr, offs_m64, mm, o_lo, o_hi, R, S, sb0, sb1, sb2, so0, so1,
                     ACCUMULATE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                     SR_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
        """out[rows, o_lo:o_hi] (+)= t16 [BLOCK_M, SR_PAD] @ Bf[:, o_lo:o_hi]."""
        offs_c = tl.arange(0, SR_PAD)
        c_slot = offs_c // R_PAD
        c_rank = offs_c % R_PAD
        mc = (c_slot < S) & (c_rank < R)
        b_col = c_slot.to(tl.int64) * sb0 + c_rank * sb2
        for o0 in range(o_lo, o_hi, BLOCK_N):
            offs_o = o0 + tl.arange(0, BLOCK_N)
            mo = offs_o < o_hi
            bt = tl.load(b_ptr + b_col[:, None] + offs_o[None, :] * sb1, mask=mc[:, None] & mo[None, :], other=0.0)
            y = tl.dot(t16, bt.to(DOT_DTYPE), input_precision=PRECISION)
            ptrs = out_ptr + offs_m64[:, None] * so0 + offs_o[None, :] * so1
            m2 = mm[:, None] & mo[None, :]
            if ACCUMULATE:
                y += tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
            tl.store(ptrs, y, mask=m2)

    @triton.jit
    def _program_columns(OUT, O1, O2, O3, OUT_SPLIT, BLOCK_N: tl.constexpr):
        """This program's columns, for grids (row tiles, P * OUT_SPLIT) over P <= 4 projections with bounds
        0, O1, O2, O3, OUT: (projection p, its first column lo, its width, the program's first column o_lo within
        it, columns per program out_per)."""
        p = tl.program_id(1) // OUT_SPLIT
        q = tl.program_id(1) % OUT_SPLIT
        lo = tl.where(p >= 3, O3, tl.where(p >= 2, O2, tl.where(p >= 1, O1, 0)))
        hi = tl.where(p >= 3, OUT, tl.where(p >= 2, O3, tl.where(p >= 1, O2, O1)))
        width = hi - lo
        out_per = tl.cdiv(tl.cdiv(width, OUT_SPLIT), BLOCK_N) * BLOCK_N
        return p, lo, width, q * out_per, out_per

    @triton.jit
    def _stacked_shrink_kernel(x_ptr, a_ptr, slot_ptr, w_ptr, scale_ptr, part_ptr,
                               N, IN, R, S, K_PER,
                               sx0, sx1, sap, sa0, sa1, sa2, ssp,
                               K: tl.constexpr, P: tl.constexpr, HAS_W: tl.constexpr, DOT_DTYPE: tl.constexpr,
                               PRECISION: tl.constexpr, SR_PAD: tl.constexpr, R_PAD: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                               PDL: tl.constexpr):
        if PDL:  # the next phase may be scheduled now; it waits for this grid's writes (triton_common)
            tl.extra.cuda.gdc_launch_dependents()
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = offs_m < N
        offs_m64 = offs_m.to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        k_lo = tl.program_id(2) * K_PER
        acc = _shrink_tile(x_ptr, a_ptr, slot_ptr, w_ptr, scale_ptr, offs_m64, mm, offs_c, k_lo,
                           tl.minimum(k_lo + K_PER, IN), R, S, sx0, sx1, sap, sa0, sa1, sa2, ssp,
                           K, HAS_W, DOT_DTYPE, PRECISION, SR_PAD, R_PAD, BLOCK_M, BLOCK_C, BLOCK_K)
        ptrs = part_ptr + (tl.program_id(2) * N + offs_m64[:, None]) * (P * SR_PAD) + offs_c[None, :]
        tl.store(ptrs, acc, mask=mm[:, None])  # padded columns stored as zeros: the expand reads them unmasked

    @triton.jit
    def _stacked_expand_kernel(b_ptr, part_ptr, out_ptr, N, OUT, R, S, O1, O2, O3, OUT_SPLIT, SPLIT_K,
                               sb0, sb1, sb2, so0, so1,
                               P: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCKS: tl.constexpr,
                               DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SR_PAD: tl.constexpr,
                               R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               PDL: tl.constexpr):
        """Grid (row tiles, P * OUT_SPLIT): each program expands one slice of one projection's columns."""
        if PDL:  # launched before the shrink ends: wait for its partials
            tl.extra.cuda.gdc_wait()
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = offs_m < N
        offs_m64 = offs_m.to(tl.int64)
        p, lo, width, o_lo, out_per = _program_columns(OUT, O1, O2, O3, OUT_SPLIT, BLOCK_N)
        offs_c = p * SR_PAD + tl.arange(0, SR_PAD)
        t = tl.zeros([BLOCK_M, SR_PAD], dtype=tl.float32)
        for ks in range(0, SPLIT_K):
            t += tl.load(part_ptr + (ks * N + offs_m64[:, None]) * (P * SR_PAD) + offs_c[None, :],
                         mask=mm[:, None], other=0.0)
        if BLOCKS:  # projection p's delta is the contiguous [N, width] block at N * lo
            _expand_tile(t.to(DOT_DTYPE), b_ptr + lo.to(tl.int64) * sb1, out_ptr + lo.to(tl.int64) * N,
                         offs_m64, mm, o_lo, tl.minimum(o_lo + out_per, width), R, S, sb0, sb1, sb2, width, 1,
                         ACCUMULATE, DOT_DTYPE, PRECISION, SR_PAD, R_PAD, BLOCK_N)
        else:
            _expand_tile(t.to(DOT_DTYPE), b_ptr, out_ptr, offs_m64, mm, o_lo, tl.minimum(o_lo + out_per, width),
                         R, S, sb0, sb1, sb2, so0, so1, ACCUMULATE, DOT_DTYPE, PRECISION, SR_PAD, R_PAD, BLOCK_N)

    @triton.jit
    def _stacked_fused_kernel(x_ptr, a_ptr, b_ptr, slot_ptr, w_ptr, scale_ptr, out_ptr,
                              N, IN, OUT, R, S, O1, O2, O3, OUT_SPLIT,
                              sx0, sx1, sap, sa0, sa1, sa2, ssp, sb0, sb1, sb2, so0, so1,
                              K: tl.constexpr, HAS_W: tl.constexpr, ACCUMULATE: tl.constexpr,
                              DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SR_PAD: tl.constexpr,
                              R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_N: tl.constexpr):
        """Both phases in one launch for P projections sharing x (decode sizes): grid (row tiles, P * OUT_SPLIT),
        each program a slice of one projection's columns (bounds 0, O1, O2, O3, OUT as in the expand kernel),
        recomputing that projection's shrink for its row tile (x and A_p re-read from L2)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = offs_m < N
        offs_m64 = offs_m.to(tl.int64)
        p, lo, width, o_lo, out_per = _program_columns(OUT, O1, O2, O3, OUT_SPLIT, BLOCK_N)
        if o_lo < width:  # a narrower projection leaves some of its OUT_SPLIT programs without columns
            t = _shrink_tile(x_ptr, a_ptr, slot_ptr, w_ptr, scale_ptr, offs_m64, mm, p * SR_PAD + tl.arange(0, SR_PAD),
                             0, IN, R, S, sx0, sx1, sap, sa0, sa1, sa2, ssp, K, HAS_W, DOT_DTYPE, PRECISION, SR_PAD,
                             R_PAD, BLOCK_M, SR_PAD, BLOCK_K)
            _expand_tile(t.to(DOT_DTYPE), b_ptr + lo.to(tl.int64) * sb1, out_ptr + lo.to(tl.int64) * so1, offs_m64,
                         mm, o_lo, tl.minimum(o_lo + out_per, width), R, S, sb0, sb1, sb2, so0, so1, ACCUMULATE,
                         DOT_DTYPE, PRECISION, SR_PAD, R_PAD, BLOCK_N)


# Widest stack (S*r) the tiles are sized for: at S*r = 512 (r=128) the two-phase top-k expand asked for 272 KB of
# shared memory on the H200 (limit 227 KB), and it was 2-8x slower than the grouped kernel there anyway.
MAX_WIDTH = 256
# Programs per launch that keep all 132 SMs of an H200 busy (2 per SM), the same aim as triton_grouped.py.
TARGET_PROGRAMS = 264
# Measured two-phase tiles, by (stacked columns per projection, a group call of P > 1 projections sharing x):
# ((up to N tokens, (SHRINK_M, BLOCK_C, BLOCK_K, SPLIT_K, EXPAND_M, BLOCK_N, OUT_SPLIT, num_warps)), ...); more
# tokens, and shapes without an entry, take the rule in stacked_config (a group on a wide stack takes the
# one-projection tiles). H200, d=4096, median us, benchmarks/lora_kernels.py (shrink tiles with the expand fixed, then
# expand tiles and warps):
# - 256 columns (r=64 on 4 slots), top-2, 2026-12-02 (--only tune): N=64 15.3 (the rule gave 36.1; SPLIT_K 16
#   instead of 4: 36.4), N=256 18.4 (68.3; SPLIT_K 16: 64-69); at N=2048 and 8192 these tiles took 73 and 304 us
#   against the rule's 59 and 142. Fewer K splits won: each split adds an [N, 256] float32 partial to read back.
# - 64 columns (r=16 on 4 slots), k=1, 2026-12-02 (--only narrow): one projection N=256 13.8 (the rule 16.1),
#   N=2048 24.4 (35.1), N=8192 55.5 (75.5); q/k/v N=256 16.6 (22.8), N=2048 40.5 (68.4). Taller expand tiles won
#   at every size (EXPAND_M 128 above 256 tokens: B's [64, BLOCK_N] tile read once per 128 rows, not per 32).
# - 64 columns, top-2, N <= 32 (a batch-32 decode step's learned rows), expand tiles only: the shrink's tiles and warps
#   stay those of the 256-token entry, so the routed linear of decode steps up to 32 tokens, which takes only the
#   shrink's tiles, is unchanged; other two-phase calls up to 32 tokens take these expand tiles. H100,
#   2026-12-06 (--only topkdecode, Qwen3-1.7B shapes, shrink + expand): o 10.85 -> 10.37, down 12.64 -> 12.00,
#   gate/up (a group) 16.22 -> 11.07: EXPAND_M 16 and more output slices, where the 256-token tiles left a 32-token
#   call 16 expand programs walking 768 columns each. The captured width-32 learned step: the 84 expands 571 -> 400
#   us, the step 3.87 -> 3.70 ms (benchmarks/RESULTS.md, E1). Such steps now run every group as one GEMM
#   (triton_linear.py WIDE_DECODE_TILES); these tiles serve the 17-32 token calls that keep the delta apart (with
#   autograd, float32, or no base weights).
STACKED_TILES: dict[tuple[int, bool], tuple[tuple[int, tuple[int, ...]], ...]] = {
    (256, False): ((64, (16, 64, 128, 4, 16, 128, 32, 4)), (256, (64, 64, 128, 4, 32, 128, 16, 4))),
    (64, False): ((32, (16, 64, 128, 8, 16, 128, 32, 8)), (256, (16, 64, 128, 8, 32, 128, 32, 8)),
                  (2048, (64, 64, 128, 4, 128, 64, 16, 4)), (8192, (64, 64, 128, 2, 128, 64, 4, 4))),
    (64, True): ((32, (64, 64, 128, 8, 16, 128, 64, 8)), (256, (64, 64, 128, 8, 64, 128, 8, 8)),
                 (2048, (64, 64, 128, 2, 128, 64, 8, 4))),
}


def measured_tiles(n: int, columns: int, proj: int = 1) -> tuple[int, ...] | None:
    """STACKED_TILES' entry for N tokens on `columns` stacked columns per projection, or None (the rule)."""
    table = STACKED_TILES.get((columns, proj > 1)) or STACKED_TILES.get((columns, False), ())
    return next((tiles for rows, tiles in table if n <= rows), None)


@functools.lru_cache(maxsize=1024)
def stacked_config(n: int, d_in: int, d_out: int, width: int, proj: int = 1, fused: bool = False) -> dict:
    """Tiles for N tokens, `width` = stacked_width(S, r) columns per projection, `proj` projections sharing x (d_out is
    the widest projection's width; see the module doc for the grids); `fused`: the one-launch schedule.

    SHRINK_M grows with N because every shrink row tile re-reads the whole stacked A (S*r*in*2 bytes, from L2);
    SPLIT_K and OUT_SPLIT then spread each phase over ~TARGET_PROGRAMS programs.
    """
    sr_pad = stacked_width(1, width)
    if interpreting():  # tiny tiles so interpreter tests walk every split, column tile and mask
        return dict(FUSED=fused, SHRINK_M=16, EXPAND_M=16, BLOCK_C=16, BLOCK_K=16, BLOCK_N=16,
                    SPLIT_K=2 if d_in > 16 else 1, OUT_SPLIT=2 if d_out > 16 else 1, num_warps=1, SR_PAD=sr_pad)
    # A [BLOCK_K, S*r] and B [S*r, BLOCK_N] tiles stay <= 32 KB each (x3 pipeline stages in 228 KB of smem)
    tile_cols = 128 if sr_pad <= 128 else 64
    # One launch, OUT_SPLIT slices per projection. H200, 2026-12-01, d=4096, r=16: N=1, one projection, 21.7-25.1 us
    # of GPU time for OUT_SPLIT 64..8; with 32, N <= 16, one projection or q/k/v: 17.4-18.0 us.
    if fused:
        block_n = min(64, tile_cols)
        out_split = 1
        while out_split * 2 * block_n <= d_out and out_split < 32:
            out_split *= 2
        return dict(FUSED=True, SHRINK_M=16, EXPAND_M=16, BLOCK_C=sr_pad, BLOCK_K=max(32, 16384 // sr_pad),
                    BLOCK_N=block_n, SPLIT_K=1, OUT_SPLIT=out_split, num_warps=4, SR_PAD=sr_pad)
    tiles = measured_tiles(n, sr_pad, proj)
    if tiles is not None:
        sm, bc, bk, sk, em, bn, split, warps = tiles
        return dict(FUSED=False, SHRINK_M=sm, EXPAND_M=em, BLOCK_C=bc, BLOCK_K=bk, BLOCK_N=bn,
                    SPLIT_K=max(1, min(sk, d_in // bk)), OUT_SPLIT=max(1, min(split, d_out // bn)), num_warps=warps,
                    SR_PAD=sr_pad)
    # H200, 2026-11-30, r=16 (S*r=64), median us by SHRINK_M/EXPAND_M: N=2048 32/32 32.6, 32/64 33.4, 64/32 34.4,
    # 128/32 43.4; N=8192 32/32 101.6, 32/64 75.7, 64/64 78.5, 128/64 90.4. r=64: N=2048 32/32 76.2 (16 was 85);
    # N=8192 32/64 140.4, 64/64 153.3.
    shrink_m = 16 if n <= 256 else 32
    block_c = min(sr_pad, 128)
    block_k = 128
    tiles = cdiv(n, shrink_m) * (proj * sr_pad // block_c)
    split_k = 1
    while split_k * 2 * block_k * 2 <= d_in and tiles * split_k < TARGET_PROGRAMS:
        split_k *= 2
    expand_m = 16 if n <= 256 else (32 if n <= 2048 else 64)
    block_n = tile_cols
    rows = cdiv(n, expand_m) * proj
    out_split = 1
    while out_split * 2 * block_n <= d_out and rows * out_split < TARGET_PROGRAMS:
        out_split *= 2
    return dict(FUSED=False, SHRINK_M=shrink_m, EXPAND_M=expand_m, BLOCK_C=block_c, BLOCK_K=block_k,
                BLOCK_N=block_n, SPLIT_K=split_k, OUT_SPLIT=out_split, num_warps=4, SR_PAD=sr_pad)


def _check_width(s_count: int, r: int) -> None:
    if stacked_width(s_count, r) > MAX_WIDTH:
        raise KernelInputError(f"the stacked kernel takes hot sets of at most {MAX_WIDTH} stacked columns (S times r "
                               f"padded to a power of two; got S={s_count}, r={r}: "
                               f"{stacked_width(s_count, r)}); use path='grouped' or 'auto' for wider hot sets")


def _fused_args(x, A4, B, scale2, out, bounds, k, has_w, accumulate, cfg) -> tuple[tuple, tuple]:
    """(grid, the one-launch kernel's arguments after its seven pointers and N): fixed for one set of stacked
    adapters, one token count and one routing form, so FusedLaunch works them out once."""
    n, d_in = x.shape
    p_count, s_count, r, _ = A4.shape
    o1, o2, o3 = (tuple(bounds[1:-1]) + (B.shape[1],) * 3)[:3]
    dot_dtype, precision = dot_config(x.dtype)
    grid = (cdiv(n, cfg["SHRINK_M"]), p_count * cfg["OUT_SPLIT"])
    return grid, (d_in, B.shape[1], r, s_count, o1, o2, o3, cfg["OUT_SPLIT"], x.stride(0), x.stride(1),
                  A4.stride(0), A4.stride(1), A4.stride(2), A4.stride(3), scale2.stride(0), B.stride(0), B.stride(1),
                  B.stride(2), out.stride(0), out.stride(1), k, has_w, accumulate, dot_dtype, precision,
                  cfg["SR_PAD"], next_pow2(r), cfg["SHRINK_M"], cfg["BLOCK_K"], cfg["BLOCK_N"])


def _check_pad(A4: torch.Tensor, cfg: dict) -> None:
    if A4.shape[1] * next_pow2(A4.shape[2]) > cfg["SR_PAD"]:
        raise KernelInputError(f"config SR_PAD={cfg['SR_PAD']} holds fewer than the hot set's "
                               f"{A4.shape[1] * next_pow2(A4.shape[2])} stacked columns")


def stacked_shrink(x: torch.Tensor, A4: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                   scale2: torch.Tensor, cfg: dict, pdl: bool) -> torch.Tensor:
    """The shrink phase for P = A4.shape[0] projections sharing x: float32 partials [SPLIT_K, N, P * SR_PAD]
    whose sum over the first axis is the folded intermediate coef * (x Af^T) (see the module doc). `pdl`: the
    next launch, which reads the partials, is a dependent launch (triton_common.dependent_launch)."""
    _check_pad(A4, cfg)
    n, d_in = x.shape
    p_count, s_count, r, _ = A4.shape
    sr_pad = cfg["SR_PAD"]
    w = weights.contiguous() if weights is not None else scale2
    dot_dtype, precision = dot_config(x.dtype)
    k_per = cdiv(cdiv(d_in, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = cdiv(d_in, k_per)
    part = torch.empty(split_k, n, p_count * sr_pad, dtype=torch.float32, device=x.device)
    grid = (cdiv(n, cfg["SHRINK_M"]), p_count * sr_pad // cfg["BLOCK_C"], split_k)
    _stacked_shrink_kernel[grid](
        x, A4, slots.contiguous(), w, scale2, part, n, d_in, r, s_count, k_per, x.stride(0), x.stride(1),
        A4.stride(0), A4.stride(1), A4.stride(2), A4.stride(3), scale2.stride(0), K=slots.shape[1], P=p_count,
        HAS_W=weights is not None, DOT_DTYPE=dot_dtype, PRECISION=precision, SR_PAD=sr_pad, R_PAD=next_pow2(r),
        BLOCK_M=cfg["SHRINK_M"], BLOCK_C=cfg["BLOCK_C"], BLOCK_K=cfg["BLOCK_K"], PDL=pdl, num_warps=cfg["num_warps"])
    return part


def _launch(x, A4, B, slots, weights, scale2, out, accumulate, bounds, blocks, cfg) -> None:
    """Two phases for P = A4.shape[0] projections, or one launch when cfg says FUSED (out [N, O] then, strided)."""
    n = x.shape[0]
    p_count, s_count, r, _ = A4.shape
    d_out = B.shape[1]
    sr_pad = cfg["SR_PAD"]
    r_pad = next_pow2(r)
    if cfg["FUSED"]:
        _check_pad(A4, cfg)
        slots = slots.contiguous()
        w = weights.contiguous() if weights is not None else scale2
        grid, tail = _fused_args(x, A4, B, scale2, out, bounds, slots.shape[1], weights is not None, accumulate, cfg)
        _stacked_fused_kernel[grid](x, A4, B, slots, w, scale2, out, n, *tail, num_warps=cfg["num_warps"])
        return
    pdl = dependent_launch(x)
    part = stacked_shrink(x, A4, slots, weights, scale2, cfg, pdl)
    split_k = part.shape[0]
    dot_dtype, precision = dot_config(x.dtype)
    o1, o2, o3 = (tuple(bounds[1:-1]) + (d_out,) * 3)[:3]
    grid = (cdiv(n, cfg["EXPAND_M"]), p_count * cfg["OUT_SPLIT"])
    _stacked_expand_kernel[grid](
        B, part, out, n, d_out, r, s_count, o1, o2, o3, cfg["OUT_SPLIT"], split_k, B.stride(0), B.stride(1),
        B.stride(2), out.stride(0) if out.dim() == 2 else 0, out.stride(-1), P=p_count, ACCUMULATE=accumulate,
        BLOCKS=blocks, DOT_DTYPE=dot_dtype, PRECISION=precision, SR_PAD=sr_pad, R_PAD=r_pad, BLOCK_M=cfg["EXPAND_M"],
        BLOCK_N=cfg["BLOCK_N"], PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl)


def _config(x, A4, bounds, fused: bool) -> dict:
    return stacked_config(x.shape[0], x.shape[1], max(b - a for a, b in zip(bounds, bounds[1:])),
                          stacked_width(A4.shape[1], A4.shape[2]), A4.shape[0], fused)


def stacked_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                 config: dict | None = None, fused: bool = False) -> torch.Tensor:
    """delta (x's dtype) for slots [N, k]; with `out` given, out += delta in place and out is returned.
    `fused`: the one-launch schedule (eager decode calls), else two phases; `config` overrides the tiles."""
    _check_width(A.shape[0], A.shape[1])
    d_out = B.shape[1]
    out, accumulate = delta_target(x, d_out, out)
    if x.shape[0] == 0 or d_out == 0:
        return out
    A4 = A[None]
    cfg = config or _config(x, A4, (0, d_out), fused)
    _launch(x, A4, B, slots, weights, scale[None], out, accumulate, (0, d_out), False, cfg)
    return out


def stacked_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                       weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                       config: dict | None = None) -> torch.Tensor:
    """The P deltas of projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]) as one flat buffer
    [N * O]: projection p's delta is the contiguous [N, width_p] block starting at N * bounds[p]. One shrink
    (x read once, all P*S*r columns), one expand launch for all projections (two-phase schedule; the one-launch
    schedule for a group is FusedLaunch)."""
    _check_width(A.shape[1], A.shape[2])
    n = x.shape[0]
    d_out = B.shape[1]
    flat = torch.empty(n * d_out, dtype=x.dtype, device=x.device)
    if n and d_out:
        cfg = config or _config(x, A, bounds, False)
        if cfg["FUSED"]:
            raise KernelInputError("stacked_lora_group runs the two-phase schedule; FusedLaunch runs the one-launch one")
        _launch(x, A, B, slots, weights, scale, flat, False, bounds, True, cfg)
    return flat


class FusedLaunch:
    """The one-launch schedule for one set of stacked adapters (A [P, S, r, in], B [S, O, r], scale [P, S],
    projection p owning columns bounds[p]:bounds[p+1], P <= MAX_PROJECTIONS): call(x, slots, weights) -> deltas
    [N, O] in x's dtype (projection p's delta is columns bounds[p]:bounds[p+1]); call(x, slots, weights, out) adds
    them into a contiguous out [N, O] (the projections' base outputs) and returns it. What an eager decode step
    runs: one launch per group call, its host cost cut to what the launch needs.

    The first call for each (N, k, dtypes, accumulate or not) goes through Triton's JITFunction.run (compiling if
    needed), which returns the compiled kernel; later calls call that kernel's own launcher (`CompiledKernel.run`,
    the same call in triton 3.6 and 3.9) with the grid and the arguments after x's worked out once, and device
    pointers as plain ints (the launcher then skips a data_ptr() call and a cuPointerGetAttribute per tensor). H200,
    triton 3.6, three runs: 45.6 / 80.1 / 51.9 us of host time per call through JITFunction.run, 13.8 / 20.4 / 17.3
    direct. A cached
    kernel only runs arguments it was compiled for: the key holds what varies between calls (N, k, x's, the slots',
    the weights' and out's dtypes), everything else is fixed per instance (the adapters' tensors, their strides and
    alignment; out's strides, contiguous [N, O]), and calls whose x, slots, weights or out are not 16-byte aligned
    (Triton specialises pointers on that) take JITFunction.run every time. Profiler launch hooks (triton.knobs) are
    not called on the fast path. Under the interpreter every call goes through JITFunction.run. Owners drop the
    instance when the adapters' tensors are replaced (routing/lora.py: ProjectionGroup)."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, bounds: tuple[int, ...]) -> None:
        if A.shape[0] > MAX_PROJECTIONS:
            raise KernelInputError(f"at most {MAX_PROJECTIONS} projections share one launch, got P={A.shape[0]}")
        _check_width(A.shape[1], A.shape[2])
        self.A, self.B, self.scale, self.bounds = A, B, scale, tuple(bounds)
        self.width = B.shape[1]
        self._aligned = (A.data_ptr() | B.data_ptr() | scale.data_ptr()) % 16 == 0
        self._ptrs = (A.data_ptr(), B.data_ptr())
        self._scale_ptr = scale.data_ptr()
        self._direct: dict[tuple, tuple] = {}

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        x = x.contiguous()
        slots = slots.contiguous()
        if out is None:
            out = x.new_empty(n, self.width)
            key = (n, slots.shape[1], x.dtype, slots.dtype, None if weights is None else weights.dtype, None)
        elif not out.is_contiguous() or out.shape != (n, self.width):
            raise KernelInputError(f"out must be a contiguous [N={n}, O={self.width}], got {tuple(out.shape)} "
                                   f"strides {out.stride()}")
        else:
            key = (n, slots.shape[1], x.dtype, slots.dtype, None if weights is None else weights.dtype, out.dtype)
        if n == 0 or self.width == 0:
            return out
        direct = self._direct.get(key)
        if direct is not None:
            if weights is None:
                wp = self._scale_ptr
            else:
                weights = weights.contiguous()
                wp = weights.data_ptr()
            xp, sp, op = x.data_ptr(), slots.data_ptr(), out.data_ptr()
            if (xp | sp | wp | op) % 16 == 0:
                run, function, packed, g0, g1, tail, stream = direct
                run(g0, g1, 1, stream(x.get_device()), function, packed, None, None, None,
                    xp, *self._ptrs, sp, wp, self._scale_ptr, op, n, *tail)
                return out
        self._launch(x, slots, weights, out, key)
        return out

    def _launch(self, x, slots, weights, out, key) -> None:
        """Through JITFunction.run; keeps the compiled kernel for the direct path when every pointer is aligned."""
        check_triton_device(x, "fused")
        A, B, scale = self.A, self.B, self.scale
        w = weights.contiguous() if weights is not None else scale
        cfg = _config(x, A, self.bounds, True)
        grid, tail = _fused_args(x, A, B, scale, out, self.bounds, slots.shape[1], weights is not None,
                                 key[-1] is not None, cfg)
        kernel = _stacked_fused_kernel[grid](x, A, B, slots, w, scale, out, x.shape[0], *tail,
                                             num_warps=cfg["num_warps"])
        if not interpreting() and self._aligned and \
                (x.data_ptr() | slots.data_ptr() | w.data_ptr() | out.data_ptr()) % 16 == 0:
            # the stream as JITFunction.run reads it (torch's raw stream handle), in triton 3.6 and 3.9 alike
            self._direct[key] = (kernel.run, kernel.function, kernel.packed_metadata, grid[0], grid[1], tail,
                                 triton.runtime.driver.active.get_current_stream)
