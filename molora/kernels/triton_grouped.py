"""Grouped (SGMV-style) Triton kernels: tiles of slot-sorted rows, tensor-core tl.dot shrink and expand.

Rows are the flat (token, choice) pairs sorted by slot (kernels/metadata.py), or for top-k on hot sets of up to
SETS_MAX_SLOTS slots the tokens sorted by the set of slots they chose ("slot-set tiles": a tile's rows share at
most k slots, whose rank rows sit side by side as one stacked tile of KS * r columns, KS = k padded to a power of
two). Each program takes BLOCK_M rows of one segment and finds that segment itself from the offsets (a vector scan,
no host help). Two launches, for P >= 1 projections sharing x (A [P, S, r, in], B [S, O, r], projection p owning
output columns bounds[p]:bounds[p+1]; a plain call is P = 1):
  shrink  grid (tiles, SPLIT_K, P): part[ks, sorted row, p, :] = x[tok, chunk_ks] @ A[p, tile slots][:, chunk_ks]^T
          (float32; the P programs of a tile and chunk run side by side, x from L2 after the first)
  expand  grid (tiles, P * OUT_SPLIT): t = sum_ks part * scale[p, slot] * weight, then t @ B[tile slots]^T for one
          slice of projection p's columns (tl.dot per output tile; a slot-set tile sums its k slots in that dot)
The tile grid is cdiv(M, BLOCK_M) + the number of segments besides the no-adapter one: every segment adds at most
one partial tile, so this bounds the tile count using shapes only; programs past the last tile exit.
Measured on the H200 (2026-12-01, d=4096, 4 slots, bf16, metadata prebuilt, median us): the earlier one-launch
kernel, in which each output slice's program recomputed its tile's shrink (re-reading A[s] from L2, 512 KB per
program at r=64), took r16 N=256 20.2 / N=2048 27.9, r64 25.0 / 34.7, r128 28.6 / 43.4 at its best tiles; these
two phases take 13.6 / 20.9, 16.2 / 26.6, 21.9 / 42.2, so only they are kept.
Modes: 0 store the delta (no-adapter rows get explicit zeros), 1 add into `out` (no-adapter rows skipped:
slot -1 costs nothing), 2 float32 atomic add (top-k on wider hot sets: the k rows of a token live in different
tiles).
"""

from __future__ import annotations

import functools

import torch

from molora.kernels.metadata import RoutingMeta, build_routing_meta, uses_slot_sets
from molora.kernels.triton_common import (
    HAS_TRITON,
    cdiv,
    dependent_launch,
    dot_config,
    interpreting,
    next_pow2,
    tl,
    triton,
)

MODE_STORE, MODE_ADD, MODE_ATOMIC = 0, 1, 2

if HAS_TRITON:
    from molora.kernels.triton_common import choice_weights  # a triton.jit function: defined only with triton

    @triton.jit
    def _segment_tile(pid, offsets_ptr, S, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """(found, slot, first sorted row, segment end) of row tile `pid`: a vector scan of the S + 2 offsets."""
        seg = tl.arange(0, S_PAD)
        in_range = seg <= S
        starts = tl.load(offsets_ptr + seg, mask=in_range, other=0)
        ends = tl.load(offsets_ptr + seg + 1, mask=in_range, other=0)
        ntiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(ntiles, axis=0)
        tile_start = tile_end - ntiles
        hit = (tile_start <= pid) & (pid < tile_end)
        found = tl.sum(hit.to(tl.int32), axis=0) > 0
        s = tl.sum(tl.where(hit, seg, 0), axis=0)
        seg_end = tl.sum(tl.where(hit, ends, 0), axis=0)
        row0 = tl.sum(tl.where(hit, starts + (pid - tile_start) * BLOCK_M, 0), axis=0)
        return found, s, row0, seg_end

    @triton.jit
    def _store_rows(out_ptr, y, tok, offs_o, m2, so0, so1, MODE: tl.constexpr):
        ptrs = out_ptr + tok[:, None] * so0 + offs_o[None, :] * so1
        if MODE == 2:
            tl.atomic_add(ptrs, y, mask=m2)
        else:
            if MODE == 1:
                y += tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
            tl.store(ptrs, y, mask=m2)

    @triton.jit
    def _tile_columns(key, S, SETS: tl.constexpr, KS: tl.constexpr, BLOCK_R: tl.constexpr):
        """(slot, rank row) of each of a tile's KS * BLOCK_R stacked columns (slot S: none). A plain tile
        (KS = 1) belongs to slot `key`; a slot-set tile's column block c to the c-th lowest bit of code key + 1."""
        q = tl.arange(0, KS * BLOCK_R)
        slot_q = tl.zeros([KS * BLOCK_R], dtype=tl.int32) + key
        if SETS:
            code = key + 1
            block = q // BLOCK_R
            slot_q = tl.zeros([KS * BLOCK_R], dtype=tl.int32) + S
            seen = 0
            for s in range(0, S):
                bit = (code >> s) & 1
                slot_q = tl.where((block == seen) & (bit == 1), s, slot_q)
                seen += bit
            slot_q = tl.max_constancy(slot_q, BLOCK_R)  # one slot per aligned block of BLOCK_R columns
        return slot_q, q % BLOCK_R

    @triton.jit
    def _tile_tokens(rows_ptr, offs_m, mrow, K: tl.constexpr, SETS: tl.constexpr):
        """(sorted entries, their tokens): set tiles sort tokens, plain tiles flat rows n*k + j."""
        rows = tl.load(rows_ptr + offs_m, mask=mrow, other=0)
        if SETS:
            tok = rows.to(tl.int64)
        else:
            tok = (rows // K).to(tl.int64)
        return rows, tok

    @triton.jit
    def _grouped_shrink_kernel(x_ptr, a_ptr, rows_ptr, offsets_ptr, part_ptr, M, IN, R, S, NKEYS, K_PER,
                               sx0, sx1, sap, sa0, sa1, sa2,
                               K: tl.constexpr, KS: tl.constexpr, SETS: tl.constexpr, P: tl.constexpr,
                               DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, S_PAD: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                               PDL: tl.constexpr):
        """Two phases, first: part[ks, sorted row, p, :] = x[tok, chunk_ks] @ A[p, tile slots][:, chunk_ks]^T
        (float32; the tile's KS slots' rank rows side by side), p = program_id(2)."""
        if PDL:  # the expand may be scheduled now; it waits for this grid's writes (triton_common)
            tl.extra.cuda.gdc_launch_dependents()
        found, key, row0, seg_end = _segment_tile(tl.program_id(0), offsets_ptr, NKEYS, S_PAD, BLOCK_M)
        if found & (key < NKEYS):
            offs_m = row0 + tl.arange(0, BLOCK_M)
            mrow = offs_m < seg_end
            rows, tok = _tile_tokens(rows_ptr, offs_m, mrow, K, SETS)
            slot_q, rank_q = _tile_columns(key, S, SETS, KS, BLOCK_R)
            mq = (slot_q < S) & (rank_q < R)
            a_col = slot_q.to(tl.int64) * sa0 + rank_q * sa1
            q = tl.arange(0, KS * BLOCK_R)
            k_lo = tl.program_id(1) * K_PER
            k_hi = tl.minimum(k_lo + K_PER, IN)
            p = tl.program_id(2)
            acc = tl.zeros([BLOCK_M, KS * BLOCK_R], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mk = offs_k < k_hi
                xt = tl.load(x_ptr + tok[:, None] * sx0 + offs_k[None, :] * sx1,
                             mask=mrow[:, None] & mk[None, :], other=0.0)
                at = tl.load(a_ptr + p * sap + a_col[None, :] + offs_k[:, None] * sa2,
                             mask=mk[:, None] & mq[None, :], other=0.0)
                acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=PRECISION)
            ptrs = part_ptr + ((tl.program_id(1) * M + offs_m[:, None].to(tl.int64)) * P + p) * (KS * BLOCK_R) \
                + q[None, :]
            tl.store(ptrs, acc, mask=mrow[:, None])

    @triton.jit
    def _grouped_expand_kernel(b_ptr, rows_ptr, offsets_ptr, slot_ptr, w_ptr, scale_ptr, part_ptr, out_ptr,
                               M, OUT, R, S, NKEYS, O1, O2, O3, OUT_SPLIT, SPLIT_K,
                               sb0, sb1, sb2, ssp, so0, so1,
                               K: tl.constexpr, KS: tl.constexpr, SETS: tl.constexpr, P: tl.constexpr,
                               HAS_W: tl.constexpr, MODE: tl.constexpr, BLOCKS: tl.constexpr,
                               DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, S_PAD: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                               PDL: tl.constexpr):
        """Two phases, second: grid (row tiles, P * OUT_SPLIT); one slice of one projection's columns."""
        if PDL:  # launched before the shrink ends: wait for its partials
            tl.extra.cuda.gdc_wait()
        found, key, row0, seg_end = _segment_tile(tl.program_id(0), offsets_ptr, NKEYS, S_PAD, BLOCK_M)
        active = found
        if MODE != 0:
            active = active & (key < NKEYS)
        if active:
            p = tl.program_id(1) // OUT_SPLIT
            lo = tl.where(p >= 3, O3, tl.where(p >= 2, O2, tl.where(p >= 1, O1, 0)))
            hi = tl.where(p >= 3, OUT, tl.where(p >= 2, O3, tl.where(p >= 1, O2, O1)))
            width = hi - lo
            out_per = tl.cdiv(tl.cdiv(width, OUT_SPLIT), BLOCK_N) * BLOCK_N
            o_lo = (tl.program_id(1) % OUT_SPLIT) * out_per
            o_hi = tl.minimum(o_lo + out_per, width)
            offs_m = row0 + tl.arange(0, BLOCK_M)
            mrow = offs_m < seg_end
            rows, tok = _tile_tokens(rows_ptr, offs_m, mrow, K, SETS)
            if BLOCKS:  # projection p's delta is the contiguous [N, width] block at N * lo
                n_tokens = M
                if not SETS:
                    n_tokens = M // K
                base = out_ptr + lo.to(tl.int64) * n_tokens
                s0 = width
                s1 = 1
            else:
                base = out_ptr
                s0 = so0
                s1 = so1
            if key < NKEYS:
                slot_q, rank_q = _tile_columns(key, S, SETS, KS, BLOCK_R)
                mq = (slot_q < S) & (rank_q < R)
                q = tl.arange(0, KS * BLOCK_R)
                t = tl.zeros([BLOCK_M, KS * BLOCK_R], dtype=tl.float32)
                for ks in range(0, SPLIT_K):
                    t += tl.load(part_ptr + ((ks * M + offs_m[:, None].to(tl.int64)) * P + p) * (KS * BLOCK_R)
                                 + q[None, :], mask=mrow[:, None], other=0.0)
                coef = tl.load(scale_ptr + p * ssp + slot_q, mask=mq, other=0.0).to(tl.float32)[None, :]
                if SETS:  # each column block's weight: the token's summed weight on that block's slot
                    coef = coef * choice_weights(slot_ptr, w_ptr, tok, mrow, slot_q, K, HAS_W)
                elif HAS_W:
                    coef = coef * tl.load(w_ptr + rows, mask=mrow, other=0.0).to(tl.float32)[:, None]
                t16 = (t * coef).to(DOT_DTYPE)
                b_col = slot_q.to(tl.int64) * sb0 + rank_q * sb2
                for o0 in range(o_lo, o_hi, BLOCK_N):
                    offs_o = o0 + tl.arange(0, BLOCK_N)
                    mo = offs_o < o_hi
                    bt = tl.load(b_ptr + b_col[:, None] + (lo + offs_o[None, :]) * sb1,
                                 mask=mq[:, None] & mo[None, :], other=0.0)
                    y = tl.dot(t16, bt.to(DOT_DTYPE), input_precision=PRECISION)
                    _store_rows(base, y, tok, offs_o, mrow[:, None] & mo[None, :], s0, s1, MODE)
            else:  # MODE 0 only: the no-adapter rows' delta is an explicit zero
                for o0 in range(o_lo, o_hi, BLOCK_N):
                    offs_o = o0 + tl.arange(0, BLOCK_N)
                    m2 = mrow[:, None] & (offs_o < o_hi)[None, :]
                    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    tl.store(base + tok[:, None] * s0 + offs_o[None, :] * s1, zero, mask=m2)


# (BLOCK_M, OUT_SPLIT) by (padded rank, row bucket), row bucket = the smallest of 256, 1024, 4096, 16384 holding the
# rows. H200, 2026-12-01, d=4096, 4 slots, bf16, metadata prebuilt, median us (benchmarks/lora_kernels.py --only sweep,
# BLOCK_M/OUT_SPLIT): N=256 r16 16/8 13.6 (32/8 13.55, 16/1 23.4), r32 16/8 14.4, r64 16/8 16.2 (64/8 20.5),
# r128 32/8 21.9 (16/8 22.0); N=2048 r16 32/8 20.9 (16/4 21.0, 64/1 34.0), r32 16/4 22.8, r64 32/8 26.6 (16/4
# 27.2), r128 64/2 42.2 (32/4 42.8, 16/8 51.1). Buckets not measured take the rule in grouped_config.
GROUPED_TILES: dict[tuple[int, int], tuple[int, int]] = {
    (16, 256): (16, 8), (32, 256): (16, 8), (64, 256): (16, 8), (128, 256): (32, 8),
    (16, 4096): (32, 8), (32, 4096): (16, 4), (64, 4096): (32, 8), (128, 4096): (64, 2),
}
# One projection, k = 1, up to FEW_ROWS rows: (BLOCK_M, OUT_SPLIT, num_warps) by padded rank, OUT_SPLIT capped at
# one BLOCK_N slice per program (more, thinner column slices: the rows alone give too few programs). H200,
# 2026-12-02, N=32, d=4096, metadata prebuilt, median us (--only sweep32, BLOCK_M/OUT_SPLIT/SPLIT_K/num_warps):
# r32 16/32/16/8 11.7 (GROUPED_TILES' 16/8/16/4 12.8; the gather kernel 11.9), r64 16/32/16/8 12.6 (14.1;
# 16/32/16/4 13.2), r128 16/32/16/8 14.9 (18.7; 16/16/16/8 15.1). Groups and slot-set tiles were not measured here.
FEW_ROWS = 64
FEW_ROW_TILES: dict[int, tuple[int, int, int]] = {32: (16, 32, 8), 64: (16, 32, 8), 128: (16, 32, 8)}
# Slot-set tiles (top-k), (BLOCK_M, OUT_SPLIT, SPLIT_K, num_warps) by (stacked columns, row bucket). H200,
# 2026-12-02, r=64 k=2 (128 columns), metadata prebuilt, median us (kernels.py --only setsweep, BLOCK_M/OUT_SPLIT/
# num_warps, SPLIT_K as the sweep's default config had it: 16, 16, 8, 2): N=64
# 32/8/4 20.6 (16/8/4 21.2); N=256 16/8/4 22.4 (32/8/4 25.6); N=2048 32/4/4 40.1 (64/2/4 52.6); N=8192 64/2/8 85.4
# (64/2/4 95.8). Other column counts take the k = 1 table as a rank of that many columns would.
GROUPED_SET_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (128, 256): (16, 8, 16, 4), (128, 4096): (32, 4, 8, 4), (128, 16384): (64, 2, 2, 8),
}
ROW_BUCKETS = (256, 1024, 4096, 16384)
# The grouped kernel chains its phases by programmatic dependent launch (triton_common) only while rows * r <=
# PDL_MAX_ROW_RANK. H200, 2026-12-02, 4 slots, d=4096, k=1, metadata prebuilt, median us off / on (kernels.py --only
# pdl, each twice, interleaved, rounds within 0.5%): rows * r <= 8192 gained 2-6% (r32 N32 12.66 / 11.92, N256
# 14.74 / 14.02; r64 N32 12.99 / 12.28, N128 15.35 / 15.01; r128 N32 15.28 / 14.74), above it lost up to 18% (r64
# N256 16.62 / 16.96; r128 N128 20.53 / 22.46, N256 22.18 / 27.22; r32 N2048 25.36 / 25.73) or gained <= 1.3% (r64
# N2048 26.78 / 26.43, r128 N2048 45.28 / 44.82): the expand's programs, scheduled early, sit beside a longer shrink.
PDL_MAX_ROW_RANK = 8192


def row_bucket(m_rows: int) -> int:
    return next((b for b in ROW_BUCKETS if m_rows <= b), ROW_BUCKETS[-1])


@functools.lru_cache(maxsize=1024)  # pure in its int arguments; saves host time per call
def grouped_config(m_rows: int, d_in: int, d_out: int, num_slots: int, rank: int = 16, proj: int = 1,
                   slots_per_tile: int = 1) -> dict:
    """Tile sizes and splits (m_rows: sorted entries, tokens for slot-set tiles; d_out: one projection's width;
    num_slots: segments besides the no-adapter one; proj: projections sharing x; slots_per_tile: KS).

    Rule where GROUPED_TILES has no measurement: BLOCK_M grows with the row count (16 below 1024, 32 below 4096,
    else 64; 32 on tiles of 512 columns or more: at 64 the slot-set expand asked for 264 KB of shared memory on the
    H200, r=128 k=4 N=8192) and OUT_SPLIT spreads a row tile's columns over ~2 programs per SM of an H200 (132 SMs), in
    512-column steps. SPLIT_K splits the shrink over `in` the same way (chunks of at least 2 * BLOCK_K). A tile's
    stacked columns (slots_per_tile * padded rank) pick the GROUPED_TILES row as a rank would, and from 256 columns
    on halve BLOCK_K and BLOCK_N (the A and B tiles stay within the H200's shared memory). One projection with few
    rows takes FEW_ROW_TILES where measured.
    """
    if interpreting():  # tiny tiles so interpreter tests walk every split and mask
        return dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, OUT_SPLIT=2 if d_out > 16 else 1, num_warps=1,
                    SPLIT_K=2 if d_in > 16 else 1)
    columns = slots_per_tile * max(16, next_pow2(rank))
    block_m = 16 if m_rows < 1024 else (32 if m_rows < 4096 or columns >= 512 else 64)
    block_n = min(128 if columns < 256 else 64, max(16, next_pow2(d_out)))
    max_split = max(1, d_out // 512)
    tuned = GROUPED_TILES.get((columns, row_bucket(m_rows)))
    set_tiles = GROUPED_SET_TILES.get((columns, row_bucket(m_rows))) if slots_per_tile > 1 else None
    few = FEW_ROW_TILES.get(columns) if m_rows <= FEW_ROWS and proj == 1 and slots_per_tile == 1 else None
    if set_tiles is not None:
        block_m, split, split_k, warps = set_tiles
        return dict(BLOCK_M=block_m, BLOCK_K=128, BLOCK_N=128, OUT_SPLIT=min(split, max_split), num_warps=warps,
                    SPLIT_K=split_k)
    warps = 4
    if few is not None:
        block_m, _, warps = few
    elif tuned is not None:
        block_m = tuned[0]
    tiles = cdiv(m_rows, block_m) + num_slots
    split = 1
    while split * 2 <= max_split and tiles * proj * split < 264:
        split *= 2
    if few is not None:
        split = min(few[1], max(1, d_out // block_n))
    elif tuned is not None:
        split = min(tuned[1], max_split)
    block_k = min(128 if columns < 256 else 64, max(16, next_pow2(d_in)))
    split_k = 1
    while split_k * 2 * block_k * 2 <= d_in and tiles * split_k < 264:
        split_k *= 2
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, OUT_SPLIT=split, num_warps=warps, SPLIT_K=split_k)


def _launch(x, A4, B, slots, weights, scale2, meta, target, mode, bounds, blocks, cfg) -> None:
    n, d_in = x.shape
    p_count, s_count, r, _ = A4.shape
    d_out = B.shape[1]
    k = slots.shape[1]
    sets = uses_slot_sets(k, s_count)
    if sets:
        rows, offsets, m_rows, ks, nkeys = meta.set_rows, meta.set_offsets, n, next_pow2(k), (1 << s_count) - 1
    else:
        rows, offsets, m_rows, ks, nkeys = meta.rows, meta.offsets, n * k, 1, s_count
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    cfg = cfg or grouped_config(m_rows, d_in, widest, nkeys, r, p_count, ks)
    dot_dtype, precision = dot_config(x.dtype)
    w = weights.contiguous() if weights is not None else scale2
    tiles = cdiv(m_rows, cfg["BLOCK_M"]) + nkeys
    block_r = max(16, next_pow2(r))
    s_pad = next_pow2(nkeys + 2)
    k_per = cdiv(cdiv(d_in, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = cdiv(d_in, k_per)
    part = torch.empty(split_k, m_rows, p_count, ks * block_r, dtype=torch.float32, device=x.device)
    pdl = m_rows * r <= PDL_MAX_ROW_RANK and dependent_launch(x)
    _grouped_shrink_kernel[(tiles, split_k, p_count)](
        x, A4, rows, offsets, part, m_rows, d_in, r, s_count, nkeys, k_per, x.stride(0), x.stride(1),
        A4.stride(0), A4.stride(1), A4.stride(2), A4.stride(3), K=k, KS=ks, SETS=sets, P=p_count,
        DOT_DTYPE=dot_dtype, PRECISION=precision, S_PAD=s_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_R=block_r,
        BLOCK_K=cfg["BLOCK_K"], PDL=pdl, num_warps=cfg["num_warps"])
    o1, o2, o3 = (tuple(bounds[1:-1]) + (d_out,) * 3)[:3]
    _grouped_expand_kernel[(tiles, p_count * cfg["OUT_SPLIT"])](
        B, rows, offsets, slots.contiguous(), w, scale2, part, target, m_rows, d_out, r, s_count, nkeys, o1, o2, o3,
        cfg["OUT_SPLIT"], split_k, B.stride(0), B.stride(1), B.stride(2), scale2.stride(0),
        target.stride(0) if target.dim() == 2 else 0, target.stride(-1),
        K=k, KS=ks, SETS=sets, P=p_count, HAS_W=weights is not None, MODE=mode, BLOCKS=blocks, DOT_DTYPE=dot_dtype,
        PRECISION=precision, S_PAD=s_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_R=block_r, BLOCK_N=cfg["BLOCK_N"],
        PDL=pdl, num_warps=cfg["num_warps"], launch_pdl=pdl)


def grouped_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                 meta: RoutingMeta | None = None, config: dict | None = None) -> torch.Tensor:
    """delta (x's dtype) for slots [N, k]; with `out` given, out += delta in place and out is returned."""
    n = x.shape[0]
    s_count = A.shape[0]
    d_out = B.shape[1]
    k = slots.shape[1]
    if meta is None:
        meta = build_routing_meta(slots, s_count)
    accumulate = out is not None
    if n == 0 or d_out == 0:
        return out if accumulate else torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    if k == 1 or uses_slot_sets(k, s_count):
        mode = MODE_ADD if accumulate else MODE_STORE
        target = out if accumulate else torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    else:
        mode = MODE_ATOMIC
        direct = accumulate and out.dtype == torch.float32
        target = out if direct else torch.zeros(n, d_out, dtype=torch.float32, device=x.device)
    _launch(x, A[None], B, slots, weights, scale[None], meta, target, mode, (0, d_out), False, config)
    if mode != MODE_ATOMIC or target is out:
        return target
    if accumulate:
        return out.add_(target)
    return target.to(x.dtype)


def grouped_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                       weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                       meta: RoutingMeta | None = None, config: dict | None = None) -> torch.Tensor:
    """The P deltas of projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]) as one flat buffer
    [N * O], projection p's delta the contiguous [N, width_p] block at N * bounds[p]: one two-phase shrink (x
    read once from HBM for every projection) and one expand launch."""
    n = x.shape[0]
    d_out = B.shape[1]
    k = slots.shape[1]
    if meta is None:
        meta = build_routing_meta(slots, A.shape[1])
    if n == 0 or d_out == 0:
        return torch.empty(n * d_out, dtype=x.dtype, device=x.device)
    if k == 1 or uses_slot_sets(k, A.shape[1]):
        flat = torch.empty(n * d_out, dtype=x.dtype, device=x.device)
        _launch(x, A, B, slots, weights, scale, meta, flat, MODE_STORE, bounds, True, config)
        return flat
    flat = torch.zeros(n * d_out, dtype=torch.float32, device=x.device)
    _launch(x, A, B, slots, weights, scale, meta, flat, MODE_ATOMIC, bounds, True, config)
    return flat.to(x.dtype)
