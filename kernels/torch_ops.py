"""Vectorised PyTorch path for routed LoRA: the CPU implementation and every device's backward.

Method: flatten the top-k choice into M = N*k rows (token, slot, weight), sort the rows by slot once, and run one
pair of dense matmuls per *slot present* (a Python loop over at most S slots, never over tokens), scattering
results back with index_add_ (which also sums the k rows of one token).
Why this on CPU: matmul cost is what the work needs (no S-fold waste of a masked dense formulation, no
[N, r, in] copy of a gather+bmm formulation, which at N=64, in=4096, r=16 copies 16 MB of A to multiply 512 KB
of x), and a host read of the counts costs nothing on CPU. On CUDA that read synchronises, which is why the CUDA
forward uses the Triton kernels; this module is used there only for backward (training, no graph capture).
Accumulation is float32 (float64 when the inputs are float64, so gradcheck sees exact arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


def routed_lora_torch_dense(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                            weights: torch.Tensor | None, scale: torch.Tensor,
                            meta: RoutingMeta | None = None) -> torch.Tensor:
    """The same delta for a few rows (decode steps on CPU), as dense matmuls against every slot at once.

    delta = sum_s (C[:, s] * (x @ A[s]^T)) @ B[s]^T, where C[n, s] sums weight * scale over the k choices of
    row n that picked slot s. It does S-fold the arithmetic of the grouped loop, which is nothing at decode
    sizes, but needs no sort, no host read and a handful of ops; CPU time there is per-op overhead.
    float32 result.
    """
    acc = accumulate_dtype(x.dtype)
    n = slots.shape[0]
    num_slots, r, _ = A.shape
    selection = meta.selection if meta is not None and meta.selection is not None else None
    if selection is None:  # not built once per forward by the caller: build it here
        selection = selection_matrix(slots, num_slots, weights)
    mix = selection.to(acc) * scale.to(acc)
    shrunk = (x.to(acc) @ A.reshape(num_slots * r, -1).to(acc).t()).view(n, num_slots, r) * mix[:, :, None]
    return torch.bmm(shrunk.transpose(0, 1), B.to(acc).transpose(1, 2)).sum(0)


def routed_lora_torch_group_dense(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                                  weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                                  meta: RoutingMeta | None = None) -> list[torch.Tensor]:
    """routed_lora_torch_dense for P projections sharing x (A [P, S, r, in], B [S, O, r], scale [P, S]): one
    matmul of x against all P*S*r rows of A, then one bmm per projection. float32 results [N, width_p]."""
    acc = accumulate_dtype(x.dtype)
    n = slots.shape[0]
    p_count, num_slots, r, _ = A.shape
    selection = meta.selection if meta is not None and meta.selection is not None else None
    if selection is None:
        selection = selection_matrix(slots, num_slots, weights)
    mix = selection.to(acc)[:, None, :] * scale.to(acc)[None]  # [N, P, S]
    shrunk = (x.to(acc) @ A.reshape(-1, A.shape[-1]).to(acc).t()).view(n, p_count, num_slots, r)
    shrunk = shrunk * mix[..., None]
    return [torch.bmm(shrunk[:, p].transpose(0, 1), B[:, lo:hi].to(acc).transpose(1, 2)).sum(0)
            for p, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


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
