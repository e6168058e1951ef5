"""The stacked-slots form (kernels/triton_stacked.py) with its two matmuls in cuBLAS, for many rows on the GPU.

For P projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]; a plain call is P = 1):
    h       = x @ [A[p, s] for every p, s]^T      [N, P*S*r]: one F.linear against all of A at once
    h      *= coef                                column (p, s, i) of row n times scale[p, s] * the summed weight
                                                  of token n's choices of slot s (one Triton launch, which also
                                                  writes Bf [S*r, O], row s*r + i = B[s, :, i]: B's copy per call)
    delta_p = h[:, p] @ Bf[:, columns of p]
The cost does not depend on k, and the arithmetic is S/k times what the routed work needs, which is free while
the two GEMMs stay memory-bound: ~4 d S r flop against ~4 d bytes per token (x read, delta written), so up to
S*r ~ 170 columns on an H200 (~790 TFLOP/s dense bf16 at 4.3 TB/s); wider, it still beats the slot-set tiles for
top-k up to 512 columns (measured, GEMM_MAX_WIDTH in dispatch.py). There cuBLAS runs near the memory floor at
large N, where the Triton kernels fall short of it (the grouped kernel's split-K partials and gathered rows, the
stacked kernel's A re-read by every row tile): RESULTS.md, issue 13 seventh pass; kernels/dispatch.py picks it by
shape. No sort and no metadata; every op is captured in a CUDA graph like any other.
"""

from __future__ import annotations

import torch

from molora.kernels.torch_ops import stacked_expand, stacked_expand_group
from molora.kernels.triton_common import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton

if HAS_TRITON:
    from molora.kernels.triton_common import choice_weights  # a triton.jit function: defined only with triton

    @triton.jit
    def _fold_tile(h_ptr, slot_ptr, w_ptr, scale_ptr, tile, N, C, SR, R, ssp, COLUMN_TILES,
                   K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        """h[n, c] *= scale[p, s] * (token n's summed weight on slot s), column c = p * SR + s * R + i, in place."""
        offs_m = ((tile // COLUMN_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_c = (tile % COLUMN_TILES) * BLOCK_C + tl.arange(0, BLOCK_C)
        mm = offs_m < N
        mc = offs_c < C
        c_proj = offs_c // SR
        c_slot = (offs_c % SR) // R
        coef = choice_weights(slot_ptr, w_ptr, offs_m, mm, c_slot, K, HAS_W)
        coef *= tl.load(scale_ptr + c_proj * ssp + c_slot, mask=mc, other=0.0).to(tl.float32)[None, :]
        ptrs = h_ptr + offs_m[:, None] * C + offs_c[None, :]
        m2 = mm[:, None] & mc[None, :]
        h = tl.load(ptrs, mask=m2, other=0.0)
        tl.store(ptrs, (h.to(tl.float32) * coef).to(h.dtype), mask=m2)

    @triton.jit
    def _slot_major_tile(b_ptr, bf_ptr, tile, R, OUT, sb0, sb1, sb2, R_PAD: tl.constexpr, BLOCK_O: tl.constexpr):
        """Bf[s * R + i, o] = B[s, o, i] for one [BLOCK_O, R] tile of B [S, OUT, R]."""
        o_tiles = tl.cdiv(OUT, BLOCK_O)
        s = tile // o_tiles
        offs_o = (tile % o_tiles) * BLOCK_O + tl.arange(0, BLOCK_O)
        offs_r = tl.arange(0, R_PAD)
        m2 = (offs_o < OUT)[:, None] & (offs_r < R)[None, :]
        bt = tl.load(b_ptr + s.to(tl.int64) * sb0 + offs_o[:, None] * sb1 + offs_r[None, :] * sb2, mask=m2)
        tl.store(bf_ptr + (s.to(tl.int64) * R + offs_r[None, :]) * OUT + offs_o[:, None], bt, mask=m2)

    @triton.jit
    def _prepare_kernel(h_ptr, slot_ptr, w_ptr, scale_ptr, b_ptr, bf_ptr, N, C, SR, R, OUT, ssp, sb0, sb1, sb2,
                        FOLD_PROGRAMS, FOLD_COLUMN_TILES,
                        K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                        R_PAD: tl.constexpr, BLOCK_O: tl.constexpr):
        """One launch, two jobs: programs below FOLD_PROGRAMS fold the coefficients into h, the others lay B out
        slot-major, one tile each (a tiled transpose: torch's strided copy of the same 2 MB took 14.5 us on the
        H200)."""
        pid = tl.program_id(0)
        if pid < FOLD_PROGRAMS:
            _fold_tile(h_ptr, slot_ptr, w_ptr, scale_ptr, pid, N, C, SR, R, ssp, FOLD_COLUMN_TILES, K, HAS_W, BLOCK_M,
                       BLOCK_C)
        else:
            _slot_major_tile(b_ptr, bf_ptr, pid - FOLD_PROGRAMS, R, OUT, sb0, sb1, sb2, R_PAD, BLOCK_O)


def _prepare(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
             scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [N, P*S*r] in x's dtype, the shrink against every slot with the coefficients folded in; Bf [S*r, O])
    for A [P, S, r, in], B [S, O, r], scale [P, S]."""
    n, d_in = x.shape
    p_count, s_count, r, _ = A.shape
    d_out = B.shape[1]
    h = torch.nn.functional.linear(x, A.reshape(p_count * s_count * r, d_in))
    bf = torch.empty(s_count * r, d_out, dtype=B.dtype, device=B.device)
    cols = h.shape[1]
    block_m, block_c, block_o = (16, 16, 16) if interpreting() else (32, min(128, next_pow2(cols)), 64)
    column_tiles = cdiv(cols, block_c)
    fold_programs = cdiv(n, block_m) * column_tiles
    _prepare_kernel[(fold_programs + s_count * cdiv(d_out, block_o),)](
        h, slots.contiguous(), weights.contiguous() if weights is not None else scale, scale, B, bf, n, cols,
        s_count * r, r, d_out, scale.stride(0), B.stride(0), B.stride(1), B.stride(2), fold_programs,
        column_tiles, K=slots.shape[1], HAS_W=weights is not None, BLOCK_M=block_m, BLOCK_C=block_c,
        R_PAD=next_pow2(r), BLOCK_O=block_o, num_warps=4)
    return h, bf


def gemm_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
              weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """delta [N, O] in x's dtype for A [S, r, in], slots [N, k]; with `out` given, out += delta in place (in the
    second GEMM when out has x's dtype) and out is returned."""
    n = x.shape[0]
    if n == 0 or B.shape[1] == 0:
        return out if out is not None else x.new_empty(n, B.shape[1])
    h, bf = _prepare(x, A[None], B, slots, weights, scale[None])
    return stacked_expand(h, bf, out)


def gemm_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                    weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """The P deltas [N, width_p] (x's dtype) of projections sharing x: A [P, S, r, in], B [S, O, r], scale [P, S],
    projection p owning output columns bounds[p]:bounds[p+1]. One shrink GEMM for all, one expand GEMM each."""
    n = x.shape[0]
    if n == 0:
        return [x.new_empty(0, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    h, bf = _prepare(x, A, B, slots, weights, scale)
    return stacked_expand_group(h, bf, tuple(bounds))
