"""Routing metadata for the grouped kernel: flat (token, choice) rows sorted by slot, built on the device.

For slots [N, k] the M = N*k flat rows are numbered n*k + j. `rows` lists them grouped by slot (stable order
inside a slot), with every -1 (or out-of-range) row in a final "no adapter" segment; `offsets[s]:offsets[s+1]`
is slot s's segment and `offsets[S]:offsets[S+1]` the no-adapter one.
On CUDA one single-program Triton launch does a counting sort: no .item()/.tolist()/nonzero, output sizes fixed
by M and S alone, so the builder can be captured in a CUDA graph. Build it once per forward and pass it as
`meta=` to every routed layer that shares the routing (it depends only on slots and S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from molora.kernels.triton_common import HAS_TRITON, interpreting, next_pow2, tl, triton


@dataclass(frozen=True)
class RoutingMeta:
    """Slot-sorted rows (int32 [M]) and segment offsets (int32 [S + 2]) for slots of shape [N, k]."""
    rows: torch.Tensor
    offsets: torch.Tensor
    num_slots: int
    n_tokens: int
    k: int
    # CPU builds only: float32 [N, S], the weight each token gives each slot (the dense CPU path's mixing matrix,
    # so each routed layer of a forward skips rebuilding it: 14 small ops per layer down to 6)
    selection: torch.Tensor | None = None


if HAS_TRITON:
    @triton.jit
    def _sort_rows_kernel(slot_ptr, rows_ptr, offsets_ptr, M, S,
                          BLOCK: tl.constexpr, S_PAD: tl.constexpr):
        seg = tl.arange(0, S_PAD)
        counts = tl.zeros([S_PAD], dtype=tl.int32)
        for start in range(0, M, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < M
            key = tl.load(slot_ptr + idx, mask=valid, other=-1).to(tl.int32)
            key = tl.where((key >= 0) & (key < S), key, S)
            key = tl.where(valid, key, S_PAD)  # padding lanes match no segment
            counts += tl.sum((key[:, None] == seg[None, :]).to(tl.int32), axis=0)
        starts = tl.cumsum(counts, axis=0) - counts  # exclusive scan; starts[S + 1] == M
        tl.store(offsets_ptr + seg, starts, mask=seg <= S + 1)
        running = starts
        for start in range(0, M, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < M
            key = tl.load(slot_ptr + idx, mask=valid, other=-1).to(tl.int32)
            key = tl.where((key >= 0) & (key < S), key, S)
            key = tl.where(valid, key, S_PAD)
            onehot = (key[:, None] == seg[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0)  # 1-based rank of each row inside its segment, this chunk
            pos = tl.sum(tl.where(onehot == 1, running[None, :] + rank - 1, 0), axis=1)
            tl.store(rows_ptr + pos, idx, mask=valid)
            running += tl.sum(onehot, axis=0)


def selection_matrix(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, S]: for slots [N, k] (weights [N, k], default 1), the summed weight of each token's choices of
    each slot; -1 and out-of-range slots give nothing."""
    slots2d = (slots if slots.dim() == 2 else slots[:, None]).long()
    valid = (slots2d >= 0) & (slots2d < num_slots)
    safe = torch.where(valid, slots2d, num_slots)  # invalid -> a spare column that is dropped
    w = valid.float() if weights is None else weights.detach().float().reshape(slots2d.shape) * valid
    mix = torch.zeros(slots2d.shape[0], num_slots + 1, dtype=torch.float32, device=slots2d.device)
    return mix.scatter_add_(1, safe, w)[:, :num_slots]


def build_routing_meta_torch(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None
                             ) -> RoutingMeta:
    """Same result with torch ops (the reference for the Triton builder; used on CPU), plus the selection."""
    slots2d = slots.reshape(slots.shape[0], -1)
    flat = slots2d.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_slots), flat, torch.full_like(flat, num_slots))
    rows = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_slots + 2, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return RoutingMeta(rows, offsets.to(torch.int32), num_slots, slots2d.shape[0], slots2d.shape[1],
                       selection_matrix(slots2d, num_slots, weights))


def build_routing_meta(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None) -> RoutingMeta:
    """Slot-sorted rows for slots [N] or [N, k]; one Triton launch on CUDA, no host synchronisation. On the CPU
    also the selection matrix of `weights` (top-k weights [N, k]; None = 1 for every valid choice)."""
    slots2d = slots.reshape(slots.shape[0], -1)
    use_triton = HAS_TRITON and (slots.is_cuda or interpreting())
    if not use_triton:
        return build_routing_meta_torch(slots2d, num_slots, weights)
    flat = slots2d.reshape(-1).contiguous()
    m = flat.numel()
    rows = torch.empty(m, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(num_slots + 2, dtype=torch.int32, device=flat.device)
    if m == 0:
        offsets.zero_()
    else:
        block = 1024 if m > 256 else max(16, next_pow2(m))
        _sort_rows_kernel[(1,)](
            flat, rows, offsets, m, num_slots, BLOCK=block, S_PAD=next_pow2(num_slots + 2), num_warps=4)
    return RoutingMeta(rows, offsets, num_slots, slots2d.shape[0], slots2d.shape[1])
