"""Gather (BGMV-style) Triton kernel: one program per (token, output tile), for few tokens.

Each program reads its token's k slot ids, and for each valid slot computes the rank-r shrink t = A[s] @ x[n]
with a plain multiply-reduce (no tensor cores: one token is one row), then accumulates the expand
weight * scale[s] * B[s][tile] @ t. Top-k needs no sort and no atomics here: the k choices are a loop.
The shrink is recomputed by each output tile of a token; A[s] then comes from L2, which is cheap while N is
small, and is why the dispatcher switches to the grouped kernel for more tokens.
No metadata, so nothing to synchronise: the grid is (N, cdiv(out, BLOCK_N)), shapes only.
"""

from __future__ import annotations

import torch

from kernels.triton_common import HAS_TRITON, interpreting, next_pow2, tl, triton

if HAS_TRITON:
    @triton.jit
    def _gather_kernel(x_ptr, a_ptr, b_ptr, slot_ptr, w_ptr, scale_ptr, out_ptr,
                       IN, OUT, R, S,
                       sx0, sx1, sa0, sa1, sa2, sb0, sb1, sb2, so0, so1,
                       K: tl.constexpr, HAS_W: tl.constexpr, ACCUMULATE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        offs_o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mo = offs_o < OUT
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < R
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(K):
            s = tl.load(slot_ptr + n * K + j).to(tl.int32)
            if (s >= 0) & (s < S):  # -1 (and out-of-range) choices cost one scalar load
                t = tl.zeros([BLOCK_R], dtype=tl.float32)
                for k0 in range(0, IN, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mk = offs_k < IN
                    xv = tl.load(x_ptr + n * sx0 + offs_k * sx1, mask=mk, other=0.0).to(tl.float32)
                    a = tl.load(a_ptr + s * sa0 + offs_r[:, None] * sa1 + offs_k[None, :] * sa2,
                                mask=mr[:, None] & mk[None, :], other=0.0).to(tl.float32)
                    t += tl.sum(a * xv[None, :], axis=1)
                coef = tl.load(scale_ptr + s).to(tl.float32)
                if HAS_W:
                    coef = coef * tl.load(w_ptr + n * K + j).to(tl.float32)
                b = tl.load(b_ptr + s * sb0 + offs_o[:, None] * sb1 + offs_r[None, :] * sb2,
                            mask=mo[:, None] & mr[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(b * (t * coef)[None, :], axis=1)
        ptrs = out_ptr + n * so0 + offs_o * so1
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mo, other=0.0).to(tl.float32)
        tl.store(ptrs, acc, mask=mo)


def gather_config(n_out: int, d_in: int) -> dict:
    """Tile sizes. GPU: BLOCK_N=256 output columns per program, 256-wide shrink chunks (see benchmarks)."""
    if interpreting():  # tiny tiles so interpreter tests walk every loop and mask
        return dict(BLOCK_K=16, BLOCK_N=16, num_warps=1)
    return dict(BLOCK_K=min(256, next_pow2(d_in)), BLOCK_N=min(256, max(16, next_pow2(n_out))), num_warps=4)


def gather_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """delta (x's dtype) for slots [N, k]; with `out` given, out += delta in place and out is returned."""
    n, d_in = x.shape
    s_count, r, _ = A.shape
    d_out = B.shape[1]
    accumulate = out is not None
    if out is None:
        out = torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    if n == 0 or d_out == 0:
        return out
    k = slots.shape[1]
    slots = slots.contiguous()
    w = weights.contiguous() if weights is not None else scale
    cfg = config or gather_config(d_out, d_in)
    grid = (n, triton.cdiv(d_out, cfg["BLOCK_N"]))
    _gather_kernel[grid](x, A, B, slots, w, scale, out, d_in, d_out, r, s_count,
                         x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2),
                         B.stride(0), B.stride(1), B.stride(2), out.stride(0), out.stride(1),
                         K=k, HAS_W=weights is not None, ACCUMULATE=accumulate,
                         BLOCK_R=max(2, next_pow2(r)), BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
                         num_warps=cfg["num_warps"])
    return out
