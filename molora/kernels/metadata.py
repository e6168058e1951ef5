"""Routing metadata, built once per forward and shared by every routed layer with the same routing.

Two things, each computed on the device the first time a layer asks for it (no host synchronisation; a layer
that reads neither costs nothing):
- `rows` / `offsets` (the grouped kernel): for slots [N, k] the M = N*k flat rows are numbered n*k + j. `rows`
  lists them grouped by slot (stable order inside a slot), with every -1 (or out-of-range) row in a final "no
  adapter" segment; `offsets[s]:offsets[s+1]` is slot s's segment and `offsets[S]:offsets[S+1]` the no-adapter
  one. On CUDA two Triton launches do a counting sort (per-chunk counts, then each chunk places its rows): output
  sizes fixed by M and S alone, so the builder can be captured in a CUDA graph.
- `set_rows` / `set_offsets` (the grouped kernel's top-k form, k > 1, S <= SETS_MAX_SLOTS): the N tokens grouped by
  the SET of slots they chose, a bitmask code (bit s set when some choice is slot s; repeats and -1 choices add
  nothing). Segment c - 1 holds the tokens of code c (1 <= c < 2^S), the last segment those with no valid choice.
  A tile of one segment then reads the same k slots for every row: all their A rows as one stacked tile, one
  expand per output tile, each output element written once (no atomics, no float32 buffer). Same counting sort,
  the code computed in the kernel.
- `mixing(dtype)` (the dense torch path, kernels/torch_ops.py): [N, S], the summed weight each token gives each
  slot (one-hot of its slot for static routing, the gate weights for top-k), in the dtype the layer computes in.
Build it with build_routing_meta(slots, S, weights) and pass it as `meta=` to every routed layer of the forward.
Lazy because a forward reads one of the two: decode steps the mixing matrix, prefill the sorted rows.
"""

from __future__ import annotations

import torch

from molora.kernels.triton_common import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton


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
        self._sets: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mixing: dict[torch.dtype, torch.Tensor] = {}
        self._columns: dict[tuple[torch.dtype, int | None], list[tuple[int, torch.Tensor | None]]] = {}

    @property
    def rows(self) -> torch.Tensor:
        """int32 [M]: flat row ids n*k + j grouped by slot, the no-adapter rows last."""
        if self._rows is None:
            self._rows, self._offsets = _sorted_keys(self.slots, self.num_slots, self._sort, sets=False)
        return self._rows

    @property
    def offsets(self) -> torch.Tensor:
        """int32 [S + 2]: slot s's rows are rows[offsets[s]:offsets[s + 1]]; the no-adapter rows come last."""
        if self._offsets is None:
            self._rows, self._offsets = _sorted_keys(self.slots, self.num_slots, self._sort, sets=False)
        return self._offsets

    @property
    def set_rows(self) -> torch.Tensor:
        """int32 [N]: token ids grouped by the set of slots each chose (see the module doc)."""
        return self._slot_sets()[0]

    @property
    def set_offsets(self) -> torch.Tensor:
        """int32 [2^S + 1]: the tokens whose slot-set code is c are set_rows[set_offsets[c - 1]:set_offsets[c]];
        the tokens with no valid choice come last."""
        return self._slot_sets()[1]

    def _slot_sets(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.num_slots > SETS_MAX_SLOTS:
            raise ValueError(f"slot sets are built for hot sets of at most {SETS_MAX_SLOTS} slots, not {self.num_slots}")
        if self._sets is None:
            self._sets = _sorted_keys(self.slots, self.num_slots, self._sort, sets=True)
        return self._sets

    @property
    def selection(self) -> torch.Tensor:
        """float32 [N, S]: the summed weight of each token's choices of each slot."""
        return self.mixing(torch.float32)

    def mixing(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, S] in `dtype`: the summed weight of each token's choices of each slot, made once per dtype."""
        return self.mixing_rows(dtype)[:, 0]

    def slot_columns(self, dtype: torch.dtype, live: int | None = None) -> list[tuple[int, torch.Tensor | None]]:
        """The CPU's per-slot form (kernels/torch_ops.py routed_linear_torch_slots): (slot, its weight on each token
        [N, 1] in `dtype`) for each slot some token chose with a nonzero weight, in slot order; the weights are None
        where each of the first `live` tokens (all: None) gives the slot weight 1, so nothing needs weighting
        (tokens from `live` on are padding whose outputs nobody reads). One host read, made once per forward."""
        key = (dtype, live)
        got = self._columns.get(key)
        if got is None:
            mixing = self.mixing(dtype)  # [N, S]
            present, whole = torch.stack((mixing.ne(0).any(0), mixing[:live].eq(1).all(0))).tolist()
            columns = mixing.t()[:, :, None]
            got = self._columns[key] = [(s, None if whole[s] else columns[s])
                                        for s in range(self.num_slots) if present[s]]
        return got

    def mixing_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """mixing(dtype) as [N, 1, S] (the dense form's layout), made once per dtype."""
        got = self._mixing.get(dtype)
        if got is None:
            got = self._mixing[dtype] = selection_matrix(self.slots, self.num_slots, self.weights, dtype)[:, None]
        return got


# Widest hot set the slot-set sort serves: 2^S - 1 set codes are its segments (the counting sort's one-hot is
# [BLOCK, next_pow2(2^S + 1)] wide).
SETS_MAX_SLOTS = 6
# Rows per program of the sort: each program counts, then places, one chunk (two launches, every chunk in
# parallel). The single-program sort it replaced cost the grouped kernel ~12 us at 2048 flat rows and ~42 us at 8192
# on the H200 (k = 1, r = 64, metadata built in the call minus prebuilt, 2026-12-01), and with slot sets at S = 4 (a
# 4x wider one-hot) the whole call took 131 us at N = 2048, k = 2, against 39 for k = 1 (2026-12-02); the two
# launches cost 4-5 us (RESULTS.md, issue 13 sixth pass).
SORT_CHUNK = 128


def uses_slot_sets(k: int, num_slots: int) -> bool:
    """Top-k calls on hot sets of at most SETS_MAX_SLOTS slots sort tokens by slot set: one tile's rows share
    their k slots, so every output element is written once. Wider hot sets sort the N*k flat rows by slot and add
    each row's delta with float32 atomics (kernels/triton_grouped.py, MODE_ATOMIC)."""
    return k > 1 and num_slots <= SETS_MAX_SLOTS


if HAS_TRITON:
    @triton.jit
    def _sort_key(slot_ptr, idx, valid, S, SETS_K: tl.constexpr):
        """Segment key of rows idx: its slot (SETS_K = 0; S for none) or, for SETS_K = k, the bitmask of token
        idx's k slots minus one (2^S - 1 for none)."""
        if SETS_K == 0:
            key = tl.load(slot_ptr + idx, mask=valid, other=-1).to(tl.int32)
            key = tl.where((key >= 0) & (key < S), key, S)
        else:
            code = tl.zeros(idx.shape, dtype=tl.int32)
            for j in tl.static_range(SETS_K):
                s = tl.load(slot_ptr + idx * SETS_K + j, mask=valid, other=-1).to(tl.int32)
                code = code | tl.where((s >= 0) & (s < S), 1 << tl.maximum(s, 0), 0)
            key = tl.where(code == 0, (1 << S) - 1, code - 1)
        return key

    @triton.jit
    def _chunk_onehot(slot_ptr, M, S, SETS_K: tl.constexpr, BLOCK: tl.constexpr, S_PAD: tl.constexpr):
        """(row ids, valid, int32 one-hot [BLOCK, S_PAD] of their segment keys) of this program's chunk."""
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < M
        key = _sort_key(slot_ptr, idx, valid, S, SETS_K)
        key = tl.where(valid, key, S_PAD)  # padding lanes match no segment
        return idx, valid, (key[:, None] == tl.arange(0, S_PAD)[None, :]).to(tl.int32)

    @triton.jit
    def _count_keys_kernel(slot_ptr, counts_ptr, M, S, SETS_K: tl.constexpr, BLOCK: tl.constexpr,
                           S_PAD: tl.constexpr):
        """counts[chunk, key]: rows of each key in this program's chunk of BLOCK rows."""
        _, _, onehot = _chunk_onehot(slot_ptr, M, S, SETS_K, BLOCK, S_PAD)
        tl.store(counts_ptr + tl.program_id(0) * S_PAD + tl.arange(0, S_PAD), tl.sum(onehot, axis=0))

    @triton.jit
    def _place_rows_kernel(slot_ptr, counts_ptr, rows_ptr, offsets_ptr, M, S, NKEYS, CHUNKS,
                           SETS_K: tl.constexpr, BLOCK: tl.constexpr, S_PAD: tl.constexpr, CHUNK_TILE: tl.constexpr):
        """Each program places its chunk's rows: after every row of a smaller key, then after its key's rows in
        earlier chunks, then in chunk order (stable). Program 0 also writes the offsets."""
        seg = tl.arange(0, S_PAD)
        total = tl.zeros([S_PAD], dtype=tl.int32)
        before = tl.zeros([S_PAD], dtype=tl.int32)
        for c0 in range(0, CHUNKS, CHUNK_TILE):
            chunk = c0 + tl.arange(0, CHUNK_TILE)
            counts = tl.load(counts_ptr + chunk[:, None] * S_PAD + seg[None, :], mask=(chunk < CHUNKS)[:, None],
                             other=0)
            total += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((chunk < tl.program_id(0))[:, None], counts, 0), axis=0)
        starts = tl.cumsum(total, axis=0) - total  # exclusive scan; starts[NKEYS + 1] == M
        if tl.program_id(0) == 0:
            tl.store(offsets_ptr + seg, starts, mask=seg <= NKEYS + 1)
        idx, valid, onehot = _chunk_onehot(slot_ptr, M, S, SETS_K, BLOCK, S_PAD)
        rank = tl.cumsum(onehot, axis=0)  # 1-based rank of each row inside its key, this chunk
        pos = tl.sum(tl.where(onehot == 1, (starts + before)[None, :] + rank - 1, 0), axis=1)
        tl.store(rows_ptr + pos, idx, mask=valid)


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


def _sort_keys_torch(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, offsets) of a stable counting sort of keys [M] in [0, num_keys] (num_keys: no adapter)."""
    rows = torch.argsort(keys, stable=True).to(torch.int32)
    counts = torch.zeros(num_keys + 1, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    offsets = torch.zeros(num_keys + 2, dtype=torch.int64, device=keys.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return rows, offsets.to(torch.int32)


def slot_set_codes(slots2d: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int64 [N]: each token's bitmask of valid slots chosen (the torch form of the sort kernel's set keys)."""
    chosen = selection_matrix(slots2d, num_slots) > 0
    return (chosen.long() << torch.arange(num_slots, device=slots2d.device)).sum(1)


def _sorted_keys(slots2d: torch.Tensor, num_slots: int, sort: str, sets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, offsets) for slots [N, k]: flat rows by slot, or (sets) tokens by slot-set code; two Triton launches
    on CUDA (or under the interpreter), torch ops else."""
    num_keys = (1 << num_slots) - 1 if sets else num_slots
    if sort != "auto" or not (HAS_TRITON and (slots2d.is_cuda or interpreting())):
        if sets:
            keys = slot_set_codes(slots2d, num_slots) - 1
            keys = torch.where(keys < 0, num_keys, keys)
        else:
            flat = slots2d.reshape(-1).long()
            keys = torch.where((flat >= 0) & (flat < num_slots), flat, torch.full_like(flat, num_slots))
        return _sort_keys_torch(keys, num_keys)
    src = slots2d.contiguous()
    m = src.shape[0] if sets else src.numel()
    rows = torch.empty(m, dtype=torch.int32, device=src.device)
    offsets = torch.empty(num_keys + 2, dtype=torch.int32, device=src.device)
    if m == 0:
        offsets.zero_()
    else:
        s_pad = next_pow2(num_keys + 2)
        block = min(SORT_CHUNK, max(16, next_pow2(m)))
        chunks = cdiv(m, block)
        counts = torch.empty(chunks, s_pad, dtype=torch.int32, device=src.device)
        sets_k = src.shape[1] if sets else 0
        _count_keys_kernel[(chunks,)](src, counts, m, num_slots, SETS_K=sets_k, BLOCK=block, S_PAD=s_pad,
                                      num_warps=4)
        _place_rows_kernel[(chunks,)](src, counts, rows, offsets, m, num_slots, num_keys, chunks, SETS_K=sets_k,
                                      BLOCK=block, S_PAD=s_pad, CHUNK_TILE=64, num_warps=4)
    return rows, offsets


def build_routing_meta_torch(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None
                             ) -> RoutingMeta:
    """Same result with torch ops only, sorted right away (the reference for the Triton builder)."""
    meta = RoutingMeta(slots, num_slots, weights, sort="torch")
    meta.rows  # noqa: B018  (sort now)
    if meta.k > 1 and num_slots <= SETS_MAX_SLOTS:
        meta.set_rows  # noqa: B018
    return meta


def build_routing_meta(slots: torch.Tensor, num_slots: int, weights: torch.Tensor | None = None) -> RoutingMeta:
    """Metadata for slots [N] or [N, k] (top-k weights [N, k]; None = 1 for every valid choice). Nothing is
    computed until a layer reads it: the sorted rows (two Triton launches on CUDA) or the mixing matrix."""
    return RoutingMeta(slots, num_slots, weights)
