"""PyTorch paths for routed LoRA: the CPU implementation, the GPU's eager decode path, and every device's backward.

Two forms:
- Grouped loop (routed_lora_torch): flatten the top-k choice into M = N*k rows (token, slot, weight), sort the
  rows by slot once, and run one pair of matmuls per *slot present* (a Python loop over at most S slots, never
  over tokens), scattering results back with index_add_ (which also sums the k rows of one token). Matmul cost is
  what the work needs (no S-fold waste, no [N, r, in] copy of a gather+bmm formulation), and a host read of the
  counts costs nothing on the CPU. On CUDA that read synchronises: there the loop serves only the backward
  (training, no graph capture) and explicit path="torch" calls.
- Dense form (routed_lora_torch_dense, _group_dense): every slot at once in four device ops, for a few rows: the
  CPU's calls of up to 2 r rows, and the GPU's eager decode calls on hot sets wider than the fused kernel's
  (kernels/dispatch.py: narrower ones take one fused Triton launch per group call, through a kept launcher).
- Stacked form (routed_lora_torch_stacked, _group_stacked): one shrink GEMM against every slot, the coefficients
  folded into its [N, S*r] result, one expand GEMM: the CPU's all-slots form above 2 r rows (no [S, N, O]
  intermediate; kernels/stacked_gemm.py is the GPU's version, its fold and B layout in one Triton launch).
Accumulation is float32 (float64 when the inputs are float64, so gradcheck sees exact arithmetic); the dense form
on the GPU computes in x's dtype with cuBLAS's float32 accumulation inside each product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from molora.kernels.cpu_bf16 import bf16_weight, gemm_bf16w
from molora.kernels.metadata import RoutingMeta, build_routing_meta_torch, selection_matrix


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class RowGroups:
    """The rows of each present slot, in slot order: rows[i] is a LongTensor of flat row ids (n*k + j)."""
    slot_ids: list[int]
    rows: list[torch.Tensor]


def group_rows(slots: torch.Tensor, num_slots: int, meta: RoutingMeta | None = None) -> RowGroups:
    """Rows of slots [N, k] grouped by slot, from `meta` (built once per forward) or sorted here; -1 rows dropped.

    One host read of the segment offsets: see module doc."""
    meta = meta or build_routing_meta_torch(slots, num_slots)
    offsets = meta.offsets.tolist()
    rows = meta.rows.long()
    slot_ids = [s for s in range(num_slots) if offsets[s + 1] > offsets[s]]
    return RowGroups(slot_ids, [rows[offsets[s]:offsets[s + 1]] for s in slot_ids])


def _row_coef(slots: torch.Tensor, weights: torch.Tensor | None, scale: torch.Tensor, rows: torch.Tensor,
              s: int, acc: torch.dtype) -> torch.Tensor:
    """weight * scale of each row in `rows` (all of slot s)."""
    coef = scale[s].to(acc).expand(rows.shape[0])
    if weights is not None:
        coef = coef * weights.reshape(-1)[rows].to(acc)
    return coef


def routed_lora_torch(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                      weights: torch.Tensor | None, scale: torch.Tensor,
                      meta: RoutingMeta | None = None) -> torch.Tensor:
    """delta[n] = sum_j weights[n, j] * scale[s] * B[s] @ A[s] @ x[n], s = slots[n, j]; float32 result."""
    acc = accumulate_dtype(x.dtype)
    k = slots.shape[1]
    groups = group_rows(slots, A.shape[0], meta)
    out = torch.zeros(x.shape[0], B.shape[1], dtype=acc, device=x.device)
    for s, rows in zip(groups.slot_ids, groups.rows):
        tok = rows // k
        shrunk = x.index_select(0, tok).to(acc) @ A[s].to(acc).t()
        shrunk = shrunk * _row_coef(slots, weights, scale, rows, s, acc)[:, None]
        out.index_add_(0, tok, shrunk @ B[s].to(acc).t())
    return out


def dense_dtype(x: torch.Tensor) -> torch.dtype:
    """What the dense form computes in: x's dtype on a GPU (cuBLAS accumulates in float32 inside each product),
    float32 on the CPU (float64 for float64), where 16-bit matmuls are slow."""
    return x.dtype if x.is_cuda else accumulate_dtype(x.dtype)


def _all_slots_shrink(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                      weights: torch.Tensor | None, scale: torch.Tensor, meta: RoutingMeta | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both all-slots forms start with, for P projections sharing x (A [P, S, r, in], B [S, O, r], scale
    [P, S]), in dense_dtype(x): (B, coef [N, P, S] = scale[p, s] * token n's summed weight on slot s, h [N, P*S*r] =
    x against every projection's and slot's A at once)."""
    dt = dense_dtype(x)
    if x.dtype != dt or A.dtype != dt or B.dtype != dt or scale.dtype != dt:  # (no .to() calls when all match:
        x, A, B, scale = x.to(dt), A.to(dt), B.to(dt), scale.to(dt)          # this runs on every eager decode call)
    # [N, 1, S] weight of each slot per token: built once per forward in the metadata, or here
    mix = meta.mixing_rows(dt) if meta is not None else selection_matrix(slots, A.shape[1], weights, dt)[:, None]
    return B, torch.mul(mix, scale), torch.nn.functional.linear(x, A.reshape(-1, A.shape[3]))


def _dense_parts(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor | None, scale: torch.Tensor, meta: RoutingMeta | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(coef [N*P, 1, S], y^T [N*P, S, O]) for P projections sharing x (A [P, S, r, in], B [S, O, r],
    scale [P, S]): delta = bmm(coef, y^T), row n*P + p holding projection p's delta on every column of O.
    Few Python-level calls: on the H200's host each view costs ~1.6 us and each launch 9-16 us (RESULTS.md)."""
    n = x.shape[0]
    p_count, num_slots, r, _ = A.shape
    B, coef, h = _all_slots_shrink(x, A, B, slots, weights, scale, meta)
    # rows (n, p) of h against every slot's B: [S, N*P, O] (P-fold the arithmetic, nothing at decode sizes)
    rows = n * p_count
    y = torch.bmm(h.as_strided((num_slots, rows, r), (r, num_slots * r, 1)), B.transpose(1, 2))
    return (coef if p_count == 1 else coef.view(rows, 1, num_slots)), y.transpose(0, 1)


@functools.lru_cache(maxsize=256)
def _column_pieces(bounds: tuple[int, ...], width: int) -> tuple[int, ...]:
    """Split sizes of a row [P * width] (projection p's result on every column, for each p) that put projection
    p's own columns bounds[p]:bounds[p+1] at the odd positions."""
    sizes, at = [], 0
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        sizes += [p * width + lo - at, hi - lo]
        at = p * width + hi
    sizes.append(len(bounds[1:]) * width - at)
    return tuple(sizes)


def routed_lora_torch_dense(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                            weights: torch.Tensor | None, scale: torch.Tensor,
                            meta: RoutingMeta | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same delta for a few rows (decode steps), as dense matmuls against every slot at once:

        delta[n] = sum_s C[n, s] * B[s] @ (A[s] @ x[n]),   C[n, s] = scale[s] * (summed weight of row n's choices of s)

    Four device ops whatever S and k (x @ all of A; every slot's expand in one bmm; C from the per-forward mixing
    matrix and the scales; the C-weighted sum over slots as one more bmm), no sort and no host read, so it can be
    captured. It does S-fold the arithmetic of a routed kernel, which is nothing at decode sizes, where the time is
    per-op overhead: on the GPU these are C++-dispatched cuBLAS launches, cheaper on the host than a launch through
    Triton's JITFunction.run (benchmarks/RESULTS.md, issue 13 third pass; the fused path's kept launcher is cheaper
    still, fourth pass). Result in dense_dtype(x); with `out` (same dtype) the last product accumulates into it
    (out += delta) and `out` is returned.
    """
    coef, yt = _dense_parts(x, A[None], B, slots, weights, scale[None], meta)
    if out is not None and out.dtype == yt.dtype:
        out.unsqueeze(1).baddbmm_(coef, yt)
        return out
    delta = torch.bmm(coef, yt).view(x.shape[0], B.shape[1])
    return delta if out is None else out.add_(delta)


def routed_lora_torch_group_dense(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                                  weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                                  meta: RoutingMeta | None = None) -> list[torch.Tensor]:
    """routed_lora_torch_dense for P projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]): still four
    device ops for all of them. Results [N, width_p] in dense_dtype(x) (views of one [N, P, O] buffer)."""
    n, p_count, width = x.shape[0], A.shape[0], B.shape[1]
    coef, yt = _dense_parts(x, A, B, slots, weights, scale, meta)
    delta = torch.bmm(coef, yt).view(n, p_count * width)  # row n: projection p's result on every column, for each p
    if p_count == 1:
        return [delta]
    return list(delta.split(_column_pieces(tuple(bounds), width), 1)[1::2])  # one call for every projection


def _stacked_parts(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                   weights: torch.Tensor | None, scale: torch.Tensor, meta: RoutingMeta | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [N, P*S*r], Bf [S*r, O]) in dense_dtype(x) for P projections sharing x (A [P, S, r, in], B [S, O, r],
    scale [P, S]): h = x @ [every projection's and slot's A]^T with column (p, s, i) of row n times scale[p, s] * the
    summed weight of token n's choices of s; Bf row s*r + i = B[s, :, i]. The stacked form (kernels/stacked_gemm.py,
    whose GPU version folds and lays out B in one Triton launch)."""
    n = x.shape[0]
    p_count, num_slots, r, _ = A.shape
    B, coef, h = _all_slots_shrink(x, A, B, slots, weights, scale, meta)
    h.view(n, p_count, num_slots, r).mul_(coef[..., None])
    return h, B.permute(0, 2, 1).reshape(num_slots * r, B.shape[1])


def stacked_expand(h: torch.Tensor, bf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """h [N, S*r] @ Bf [S*r, O]; with `out`, out += that in place (in the GEMM when the dtypes match)."""
    if out is None:
        return h @ bf
    if out.dtype == h.dtype:
        return out.addmm_(h, bf)
    return out.add_(h @ bf)


def stacked_expand_group(h: torch.Tensor, bf: torch.Tensor, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """The P deltas of projections sharing x: projection p's h columns [N, S*r] @ its output columns of Bf."""
    width = bf.shape[0]
    return [h[:, p * width:(p + 1) * width] @ bf[:, lo:hi] for p, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def routed_lora_torch_stacked(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                              weights: torch.Tensor | None, scale: torch.Tensor,
                              meta: RoutingMeta | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same delta as one shrink GEMM against every slot, the coefficients folded into its [N, S*r] result,
    and one expand GEMM: S/k times the routed arithmetic (the dense form's), but no [S, N, O] intermediate. The
    CPU's form above 2 r rows where dense_fits holds (kernels/dispatch.py). Result in dense_dtype(x); with `out`
    (out += delta) `out` is returned."""
    h, bf = _stacked_parts(x, A[None], B, slots, weights, scale[None], meta)
    return stacked_expand(h, bf, out)


def routed_lora_torch_group_stacked(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                                    weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                                    meta: RoutingMeta | None = None) -> list[torch.Tensor]:
    """routed_lora_torch_stacked for P projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]): one
    shrink GEMM for all of them, one expand GEMM each; results [N, width_p] in dense_dtype(x)."""
    h, bf = _stacked_parts(x, A, B, slots, weights, scale, meta)
    return stacked_expand_group(h, bf, tuple(bounds))


# The CPU engine's decode GEMMs (cpu_linear): weight @ x^T per chunk of CPU_GEMM_CHUNK rows, the last one padded to a
# multiple of CPU_GEMM_BLOCK rows. MKL (torch 2.13, one thread, 2-core EPYC VM, 2026-12-04), the embedded model's 25
# GEMMs of a decode step, ms: 4 rows 4.48 as F.linear -> 2.72 this way, 8 rows 5.05 -> 4.27, 16 rows 6.00 -> 8.09
# (two chunks). Its kernel for fewer than 12 rows in this orientation works on blocks of 4 rows, each row on its own,
# so a row's numbers are the same in every call (F.linear's are the same at 4 rows and more, not at 1-3).
CPU_GEMM_CHUNK = 8
CPU_GEMM_BLOCK = 4


# Faster still where it is exact: oneDNN's linear on weights packed once into its blocked layout (a second copy of
# the weights, kept by the projection group). Same VM and shapes, ms: 4 rows 1.89 packed (2.84 as above), 16 rows
# 3.41 (6.86 as two chunks above); inside a decode step, where the weights come from memory, 2.65 against 2.96 at
# 4 rows. A row's numbers did not depend on the other rows at any width from 1 to 40 there; pack_exact_rows checks
# that on each weight before it is used (another CPU or oneDNN build may block rows otherwise: then the MKL form).
# Fastest where the weights' values are bfloat16 (the embedded model's): our kernel on a bfloat16 copy, half the
# bytes (kernels/cpu_bf16.py). The embedded model's 24 routed GEMM shapes, 6 layers, hot, us: 4 rows 549 against
# 886 packed, 16 rows 1,969 against 2,200; C1's request 2.42 -> 1.69 s in one run (RESULTS.md C1).
PACK_CHECK_WIDTHS = (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 32, 64)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype == torch.bfloat16:  # bf16_weight's copy
        return gemm_bf16w(x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _rows_exact(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Does `packed` give a row the same numbers whatever rows share its call (random rows: every width in
    PACK_CHECK_WIDTHS, at two offsets, against each row alone), and the right ones (close to F.linear)?"""
    x = torch.randn(PACK_CHECK_WIDTHS[-1] + 1, weight.shape[1], generator=torch.Generator().manual_seed(0))
    alone = torch.cat([_packed_linear(row, packed) for row in x.split(1)])
    exact = all(torch.equal(_packed_linear(x[at:at + n], packed), alone[at:at + n])
                for n in PACK_CHECK_WIDTHS for at in (0, 1))
    return exact and torch.allclose(alone, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)


def pack_exact_rows(weight: torch.Tensor, bf16: bool = True) -> torch.Tensor | None:
    """weight [O, in] (float32, CPU) in a form cpu_linear computes faster with, if that form gives a row the same
    numbers whatever rows share its call here, and the right ones (_rows_exact): a bfloat16 copy for our kernel where
    the weight's values are bfloat16 and it serves here (kernels/cpu_bf16.py; `bf16=False`: not tried), else
    oneDNN's packed layout; else None. Either is a copy: the caller packs again when the weight changes."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    weight = weight.detach()
    copy = bf16_weight(weight) if bf16 else None
    if copy is not None and _rows_exact(weight, copy):
        return copy
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return packed if _rows_exact(weight, packed) else None
    except RuntimeError:  # no oneDNN kernel for this build or machine
        return None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ weight [O, in]^T as a contiguous [N, O] whose rows do not depend on the other rows of x (float32
    on the CPU: through `packed` = pack_exact_rows(weight) when given (our bfloat16 kernel or oneDNN's), else
    weight @ x^T per chunk of CPU_GEMM_CHUNK rows, see above; elsewhere F.linear)."""
    n = x.shape[0]
    if packed is not None and n:
        return _packed_linear(x, packed)
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or n == 0:
        return torch.nn.functional.linear(x, weight)
    pad = -n % CPU_GEMM_BLOCK
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    if n + pad <= CPU_GEMM_CHUNK:
        y = torch.mm(weight, x.t()).t()
    else:
        y = torch.cat([torch.mm(weight, chunk.t()).t() for chunk in x.split(CPU_GEMM_CHUNK)])
    return y[:n].contiguous()


def routed_linear_torch_slots(x: torch.Tensor, weight: torch.Tensor, slot_form: list[tuple[torch.Tensor, ...]],
                              columns: list[tuple[int, torch.Tensor | None]], widths: tuple[int, ...],
                              exact_rows: bool = False, packed: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Every output (base linear + routed delta) of P projections sharing x [N, in], reading only the adapters of
    the slots present: weight [O, in] = the members' base weights stacked (one GEMM for all of them);
    slot_form[s] = (every member's scale[p, s] * A[p, s]^T side by side [in, P*r], then B[s, member p's columns]^T
    [r, width_p] for each p: ProjectionGroup.slot_form); columns: (slot, each token's summed weight on it [N, 1],
    or None when every token that counts gives it weight 1) for the slots some token chose
    (RoutingMeta.slot_columns); exact_rows: the base GEMM by cpu_linear (a row's numbers do not depend on the
    other rows; `packed`: the weight as pack_exact_rows made it), else F.linear.

    Per present slot: one shrink GEMM of every row for all members (a row that did not choose s gets weight 0: it
    adds exact zeros, so a row's numbers do not depend on its neighbours' slots), weighted in place, and one expand
    per member onto its output columns (2026-12-05: one shrink GEMM with the scales folded in, where it was a
    broadcast matmul per slot then the scales: C1's request alone 2.96 -> 2.74 s, eight at once 4.55 -> 4.34 s,
    alternating in one process). The all-slots forms read every slot's A and B, S times what a decode step needs:
    on a 2-core CPU whose steps are bound by memory traffic, the embedded model's routed linears (7 slots of rank 16)
    took 14.4 ms a decode step at 4 rows that way against 6.2 for the base GEMMs alone. Returns views [N, width_p]
    of one [N, O] buffer."""
    base = cpu_linear(x, weight, packed) if exact_rows else torch.nn.functional.linear(x, weight)
    count = len(widths)
    outs = base.split_with_sizes(widths, 1) if count > 1 else (base,)
    for s, column in columns:
        shrink, *b_t = slot_form[s]
        h = torch.mm(x, shrink)  # [N, P*r]
        if column is not None:
            h.mul_(column)
        parts = h.split_with_sizes((shrink.shape[1] // count,) * count, 1) if count > 1 else (h,)
        for y, h_p, b_p in zip(outs, parts, b_t):
            y.addmm_(h_p, b_p)
    return list(outs)


def routed_lora_torch_backward(grad: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                               slots: torch.Tensor, weights: torch.Tensor | None, scale: torch.Tensor,
                               needs: tuple[bool, bool, bool, bool]
                               ) -> tuple[torch.Tensor | None, ...]:
    """Gradients (dx, dA, dB, dweights) of routed_lora_torch for upstream grad [N, out]; None where not needed.

    Per row (n, j) with slot s, u = weight * scale[s], t = A[s] x[n], h = B[s]^T g[n]:
        dweight = scale[s] * <h, t>,  dx[n] += u A[s]^T h,  dA[s] += u h x[n]^T,  dB[s] += u g[n] t^T.
    """
    need_x, need_a, need_b, need_w = needs
    acc = accumulate_dtype(x.dtype)
    k = slots.shape[1]
    g = grad.to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    dA = torch.zeros(A.shape, dtype=acc, device=A.device) if need_a else None
    dB = torch.zeros(B.shape, dtype=acc, device=B.device) if need_b else None
    dw = torch.zeros(slots.numel(), dtype=acc, device=x.device) if need_w else None
    groups = group_rows(slots, A.shape[0])
    for s, rows in zip(groups.slot_ids, groups.rows):
        tok = rows // k
        a_s, b_s = A[s].to(acc), B[s].to(acc)
        xs = x.index_select(0, tok).to(acc)
        gs = g.index_select(0, tok)
        u = _row_coef(slots, weights, scale, rows, s, acc)[:, None]
        h = gs @ b_s                                   # [m, r]
        t = xs @ a_s.t() if (need_w or need_b) else None
        if need_w:
            dw.index_add_(0, rows, (h * t).sum(1) * scale[s].to(acc))
        hu = h * u
        if need_x:
            dx.index_add_(0, tok, hu @ a_s)
        if need_a:
            dA[s] += hu.t() @ xs
        if need_b:
            dB[s] += gs.t() @ (t * u)
    return (dx, dA, dB, dw.view(slots.shape) if need_w else None)
