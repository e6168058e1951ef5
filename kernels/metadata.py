"""Routing metadata, built once per forward and shared by every routed layer with the same routing.

Two things, each computed on the device the first time a layer asks for it (no host synchronisation; a layer
that reads neither costs nothing):
- `rows` / `offsets` (the grouped kernel): for slots [N, k] the M = N*k flat rows are numbered n*k + j. `rows`
  lists them grouped by slot (stable order inside a slot), with every -1 (or out-of-range) row in a final "no
  adapter" segment; `offsets[s]:offsets[s+1]` is slot s's segment and `offsets[S]:offsets[S+1]` the no-adapter
  one. On CUDA one single-program Triton launch does a counting sort: output sizes fixed by M and S alone, so the
  builder can be captured in a CUDA graph.
- `mixing(dtype)` (the dense torch path, kernels/torch_ops.py): [N, S], the summed weight each token gives each
  slot (one-hot of its slot for static routing, the gate weights for top-k), in the dtype the layer computes in.
Build it with build_routing_meta(slots, S, weights) and pass it as `meta=` to every routed layer of the forward.
Lazy because a forward reads one of the two: decode steps the mixing matrix, prefill the sorted rows.
"""

from __future__ import annotations

import torch

from molora.kernels.triton_common import HAS_TRITON, interpreting, next_pow2, tl, triton


class RoutingMeta:
    """Per-forward routing metadata for slots [N, k] (k = 1 for static routing) over `num_slots` slots."""

    def __init__(self, slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None, *,
                 sort: str = "auto") -> None:
        self.slots = slots if slots.dim() == 2 else slots.reshape(slots.shape[0], 1)
        self.weights = weights
        self.num_slots = num_slots
        self.n_tokens, self.k = self.slots.shape
        self._sort = sort  # "auto": Triton on CUDA (or under the interpreter), torch otherwise; "torch": torch
        self._rows: torch.Tensor | None = None
        self._offsets: torch.Tensor | None = None
        self._mixing: dict[torch.dtype, torch.Tensor] = {}

    @property
    def rows(self) -> torch.Tensor:
        """int32 [M]: flat row ids n*k + j grouped by slot, the no-adapter rows last."""
        if self._rows is None:
            self._rows, self._offsets = _sorted_rows(self.slots, self.num_slots, self._sort)
        return self._rows

    @property
    def offsets(self) -> torch.Tensor:
        """int32 [S + 2]: slot s's rows are rows[offsets[s]:offsets[s + 1]]; the no-adapter rows come last."""
        if self._offsets is None:
            self._rows, self._offsets = _sorted_rows(self.slots, self.num_slots, self._sort)
        return self._offsets

    @property
    def selection(self) -> torch.Tensor:
        """float32 [N, S]: the summed weight of each token's choices of each slot."""
        return self.mixing(torch.float32)

    def mixing(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, S] in `dtype`: the summed weight of each token's choices of each slot, made once per dtype."""
        return self.mixing_rows(dtype)[:, 0]

    def mixing_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """mixing(dtype) as [N, 1, S] (the dense form's layout), made once per dtype."""
        got = self._mixing.get(dtype)
        if got is None:
            got = self._mixing[dtype] = selection_matrix(self.slots, self.num_slots, self.weights, dtype)[:, None]
        return got


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


def selection_matrix(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, S] in `dtype`: for slots [N, k] (weights [N, k], default 1), the summed weight of each token's choices
    of each slot; -1 and out-of-range slots match no column. Three device ops for static routing (arange, ==,
    cast), five for top-k; no host read."""
    slots2d = slots if slots.dim() == 2 else slots[:, None]
    onehot = slots2d[:, :, None] == torch.arange(num_slots, device=slots2d.device, dtype=slots2d.dtype)
    if weights is None:
        return onehot[:, 0].to(dtype) if slots2d.shape[1] == 1 else onehot.sum(1).to(dtype)
    return (onehot * weights.detach().reshape(slots2d.shape)[:, :, None].to(dtype)).sum(1)


def _sort_rows_torch(slots2d: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = slots2d.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_slots), flat, torch.full_like(flat, num_slots))
    rows = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_slots + 2, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return rows, offsets.to(torch.int32)


def _sorted_rows(slots2d: torch.Tensor, num_slots: int, sort: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, offsets) for slots [N, k]: one Triton launch on CUDA (or under the interpreter), torch ops else."""
    if sort != "auto" or not (HAS_TRITON and (slots2d.is_cuda or interpreting())):
        return _sort_rows_torch(slots2d, num_slots)
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
    return rows, offsets


def build_routing_meta_torch(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None
                             ) -> RoutingMeta:
    """Same result with torch ops only, sorted right away (the reference for the Triton builder)."""
    meta = RoutingMeta(slots, num_slots, weights, sort="torch")
    meta.rows  # noqa: B018  (sort now)
    return meta


def build_routing_meta(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None) -> RoutingMeta:
    """Metadata for slots [N] or [N, k] (top-k weights [N, k]; None = 1 for every valid choice). Nothing is
    computed until a layer reads it: the sorted rows (one Triton launch on CUDA) or the mixing matrix."""
    return RoutingMeta(slots, num_slots, weights)
