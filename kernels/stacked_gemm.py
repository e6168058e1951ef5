"""The stacked-slots form (kernels/triton_stacked.py) with its two matmuls in cuBLAS, for many rows on the GPU.

For P projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]; a plain call is P = 1):
    h       = x @ [A[p, s] for every p, s]^T      [N, P*S*r]: one F.linear against all of A at once
    h      *= coef                                one Triton launch: column (p, s, i) of row n times scale[p, s] *
                                                  the summed weight of token n's choices of slot s
    delta_p = h[:, p] @ Bf[:, columns of p]       Bf [S*r, O], row s*r + i = B[s, :, i] (one copy of B per call)
The cost does not depend on k, and the arithmetic is S/k times what the routed work needs, which is free while
the two GEMMs stay memory-bound: ~4 d S r flop against ~4 d bytes per token (x read, delta written), so up to
S*r ~ 170 columns on an H200 (~790 TFLOP/s dense bf16 at 4.3 TB/s). There cuBLAS runs near the memory floor at
large N, where the Triton kernels fall short of it (the grouped kernel's split-K partials and gathered rows, the
stacked kernel's A re-read by every row tile): RESULTS.md, issue 13 seventh pass; kernels/dispatch.py picks it by
shape. No sort and no metadata; every op is captured in a CUDA graph like any other.
"""

from __future__ import annotations

import torch

from molora.kernels.triton_common import HAS_TRITON, cdiv, choice_weights, interpreting, next_pow2, tl, triton

if HAS_TRITON:
    @triton.jit
    def _fold_weights_kernel(h_ptr, slot_ptr, w_ptr, scale_ptr, N, C, SR, R, ssp,
                             K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        """h[n, c] *= scale[p, s] * (token n's summed weight on slot s), column c = p * SR + s * R + i, in place."""
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
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


def _shrunk(x: torch.Tensor, A: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
            scale: torch.Tensor) -> torch.Tensor:
    """h [N, P*S*r] in x's dtype for A [P, S, r, in], scale [P, S]: the shrink against every slot, coefficients
    folded in."""
    n, d_in = x.shape
    p_count, s_count, r, _ = A.shape
    h = torch.nn.functional.linear(x, A.reshape(p_count * s_count * r, d_in))
    cols = h.shape[1]
    block_m, block_c = (16, 16) if interpreting() else (32, min(128, next_pow2(cols)))
    _fold_weights_kernel[(cdiv(n, block_m), cdiv(cols, block_c))](
        h, slots.contiguous(), weights.contiguous() if weights is not None else scale, scale, n, cols,
        s_count * r, r, scale.stride(0), K=slots.shape[1], HAS_W=weights is not None, BLOCK_M=block_m,
        BLOCK_C=block_c, num_warps=4)
    return h


def _slot_major(B: torch.Tensor) -> torch.Tensor:
    """Bf [S*r, O] from B [S, O, r] (a copy: S*r*O elements)."""
    s_count, d_out, r = B.shape
    return B.permute(0, 2, 1).reshape(s_count * r, d_out)


def gemm_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
              weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """delta [N, O] in x's dtype for A [S, r, in], slots [N, k]; with `out` given, out += delta in place (in the
    second GEMM when out has x's dtype) and out is returned."""
    n = x.shape[0]
    if n == 0 or B.shape[1] == 0:
        return out if out is not None else x.new_empty(n, B.shape[1])
    h = _shrunk(x, A[None], slots, weights, scale[None])
    bf = _slot_major(B)
    if out is None:
        return h @ bf
    if out.dtype == h.dtype:
        return out.addmm_(h, bf)
    return out.add_(h @ bf)


def gemm_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                    weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """The P deltas [N, width_p] (x's dtype) of projections sharing x: A [P, S, r, in], B [S, O, r], scale [P, S],
    projection p owning output columns bounds[p]:bounds[p+1]. One shrink GEMM for all, one expand GEMM each."""
    n = x.shape[0]
    if n == 0:
        return [x.new_empty(0, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    h = _shrunk(x, A, slots, weights, scale)
    bf = _slot_major(B)
    width = A.shape[1] * A.shape[2]
    return [h[:, p * width:(p + 1) * width] @ bf[:, lo:hi] for p, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
