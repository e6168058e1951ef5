"""Decode attention (one new token per row) over a static KV cache: split-K ("flash-decoding"), GQA without copies.

A decode step's query is one token per row, so attention is a read of the row's keys and values: memory, not
math. torch's scaled_dot_product_attention runs it as one program per (row, KV head) walking every column of the
static cache under an additive mask: on an Emu3-8B shape (8 KV heads, a guided pair of rows, 8,300 columns) that
is 16 programs on a 132-SM GPU, each reading 4 MB of K/V serially, and most of the step's time. Here

    split   grid (rows x KV heads, splits): program (n, j, s) reads columns [s*chunk, (s+1)*chunk) of row n's KV
            head j, only those below the row's length (a column the row has not written is never read), for
            the G query heads of that KV head at once (one [G, BLOCK_N] score tile per block: GQA without
            repeat_kv), and writes its normalised partial output and log-sum-exp (float32)
    combine grid (rows x KV heads): merges the splits' partials by their log-sum-exps into the output

The row's length comes from a device tensor, so the launches depend on shapes only (CUDA-graph safe) and a
captured step reads as much KV as the rows hold, not the cache's whole length.
"""

from __future__ import annotations

import functools

import torch

from molora.kernels.errors import KernelInputError
from molora.kernels.triton_common import HAS_TRITON, cdiv, dot_config, interpreting, next_pow2, tl, triton

BLOCK_N = 64  # columns per inner step of a split
PROGRAMS_PER_SM = 2  # splits are sized so the grid covers the GPU about twice


if HAS_TRITON:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, po_ptr, plse_ptr, KVH, G, D, L, CHUNK, scale,
                      sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, S,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        row = pid // KVH
        head = pid % KVH
        start = split * CHUNK
        length = tl.minimum(tl.maximum(tl.load(len_ptr + row).to(tl.int32), 1), L)  # clamped: never out of bounds
        end = tl.minimum(start + CHUNK, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gm = g < G
        dm = d < D
        q = tl.load(q_ptr + row * sq0 + head * sq1 + g[:, None] * sq2 + d[None, :] * sq3,
                    mask=gm[:, None] & dm[None, :], other=0.0)
        q = (q.to(tl.float32) * scale).to(DOT)
        m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        k_row = k_ptr + row * sk0 + head * sk1
        v_row = v_ptr + row * sv0 + head * sv1
        for c in range(start, end, BLOCK_N):
            cols = c + tl.arange(0, BLOCK_N)
            cm = cols < end
            kv_mask = cm[:, None] & dm[None, :]
            k = tl.load(k_row + cols[:, None] * sk2 + d[None, :] * sk3, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION)
            scores = tl.where(cm[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_row + cols[:, None] * sv2 + d[None, :] * sv3, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
            m = m_new
        # a split past the row's length read nothing: output 0, log-sum-exp -inf (it weighs nothing in the merge)
        filled = total > 0
        out = acc / tl.where(filled, total, 1.0)[:, None]
        lse = tl.where(filled, m + tl.log(tl.where(filled, total, 1.0)), float("-inf"))
        base = (pid * S + split) * BLOCK_G
        tl.store(plse_ptr + base + g, lse)
        tl.store(po_ptr + (base + g[:, None]) * BLOCK_D + d[None, :], out)

    @triton.jit
    def _combine_kernel(po_ptr, plse_ptr, o_ptr, KVH, G, D, S, so0, so1, so2, so3,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        row = pid // KVH
        head = pid % KVH
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        base = pid * S * BLOCK_G
        # split 0 always holds the row's first column (every row has length >= 1): m starts finite
        m = tl.load(plse_ptr + base + g)
        acc = tl.load(po_ptr + (base + g[:, None]) * BLOCK_D + d[None, :])
        total = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
        for s in range(1, S):
            at = base + s * BLOCK_G
            lse = tl.load(plse_ptr + at + g)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha[:, None] + w[:, None] * tl.load(po_ptr + (at + g[:, None]) * BLOCK_D + d[None, :])
            total = total * alpha + w
            m = m_new
        out = acc / total[:, None]
        tl.store(o_ptr + row * so0 + head * so1 + g[:, None] * so2 + d[None, :] * so3, out.to(o_ptr.dtype.element_ty),
                 mask=(g[:, None] < G) & (d[None, :] < D))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention_runs_on(x: torch.Tensor) -> bool:
    """Whether decode_attention can run on tensors like x (triton present; CUDA, or the CPU interpreter)."""
    return HAS_TRITON and (x.is_cuda or interpreting())


def split_chunk(rows_heads: int, columns: int, programs: int) -> int:
    """Columns per split: enough splits that rows_heads x splits covers `programs`, each a multiple of BLOCK_N."""
    splits = max(1, cdiv(programs, rows_heads))
    return max(BLOCK_N, cdiv(cdiv(columns, splits), BLOCK_N) * BLOCK_N)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float, chunk: int | None = None) -> torch.Tensor:
    """Attention of one query token per row over the first `lengths[n]` columns of its cache row.

    q [n, Hkv, G, D] (query head h = j*G + g reads KV head j), keys / values [n, Hkv, L, D] (any strides: views of
    a static cache), lengths [n] integer on q's device (clamped to 1..L: a padding row reads column 0, never out of
    bounds).  Returns [n, Hkv, G, D] in q's dtype.
    `chunk`: columns per split (default: sized to fill the GPU twice over).
    """
    if not decode_attention_runs_on(q):
        raise KernelInputError(f"decode_attention runs Triton kernels: it needs triton and CUDA tensors (or "
                               f"TRITON_INTERPRET=1), got {q.device}")
    n, kv_heads, groups, head_dim = q.shape
    if keys.shape[:2] != (n, kv_heads) or keys.shape[3] != head_dim or values.shape != keys.shape:
        raise KernelInputError(f"decode_attention: q {tuple(q.shape)} needs keys and values [n={n}, {kv_heads}, L, "
                               f"{head_dim}], got {tuple(keys.shape)} and {tuple(values.shape)}")
    if lengths.shape != (n,) or lengths.dtype.is_floating_point or lengths.device != q.device:
        raise KernelInputError(f"decode_attention: lengths must be [{n}] integers on {q.device}, got "
                               f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}")
    columns = keys.shape[2]
    programs = PROGRAMS_PER_SM * (_sm_count(q.get_device()) if q.is_cuda else 2)
    chunk = chunk or split_chunk(n * kv_heads, columns, programs)
    splits = cdiv(columns, chunk)
    block_g, block_d = max(16, next_pow2(groups)), max(16, next_pow2(head_dim))
    partial_out = torch.empty(n * kv_heads, splits, block_g, block_d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(n * kv_heads, splits, block_g, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dot, precision = dot_config(q.dtype)
    _split_kernel[(n * kv_heads, splits)](
        q, keys, values, lengths, partial_out, partial_lse, kv_heads, groups, head_dim, columns, chunk, float(scale),
        *q.stride(), *keys.stride(), *values.stride(), splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=BLOCK_N, DOT=dot, PRECISION=precision)
    _combine_kernel[(n * kv_heads,)](partial_out, partial_lse, out, kv_heads, groups, head_dim, splits, *out.stride(),
                                     BLOCK_G=block_g, BLOCK_D=block_d)
    return out
