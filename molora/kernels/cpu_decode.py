"""The CPU engine's whole decode step in one C call (decode_step.c, built with the bfloat16 GEMM: kernels/cpu_bf16.py).

A decode step of the embedded model is ~6.3M multiply-adds a row but ~575 small torch ops, and on a 2-core CPU the
ops' dispatch, not their arithmetic, was most of the step (benchmarks/RESULTS.md, C1). The C step runs the same
Llama-family forward for one token a row with no per-op cost: the GEMMs are gemm_bf16w.c's (each output one FMA
chain, so a row's numbers never depend on its neighbours), the rest loops over one row at a time.

    weights = StepWeights(dims, eps, scaling, tensors)     # once; the tensors' layout: decode_step.c's header
    decode_step(weights, rows, ids, positions, slots, logits)
    decode_step(weights, rows, ids, positions, slots, logits, LearnedStep(gate_sets, decided_slots, decided_weights))

With a LearnedStep the C step also makes learned (MoLoRA) routing's decision at every block, from the block input,
as LearnedGroup.decide does at one position per row (GateSet), and keeps it for the caller ([W, layers, k]).

The engine's glue (models/engine/cpu_step.py) knows the model and builds the tensor list; this module knows only
tensors: it checks every one against `dims` when the table is made, and each call's indices against the table, so
no call can make the C code read or write outside a tensor.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from molora.kernels.cpu_bf16 import LANES, bf16_weight, library

DIM_NAMES = ("layers", "d", "heads", "kv_heads", "head_dim", "ffn", "vocab", "slots", "rank", "max_len", "qk_norm")
GLOBAL_TENSORS = 5
GROUPS = ("qkv", "o", "gate_up", "down")
LAYER_TENSORS = 4 + 4 * len(GROUPS) + 2


def available() -> bool:
    return library() is not None


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


def expected_shapes(dims: dict[str, int], kv_rows: int) -> list[tuple[tuple[int, ...] | None, torch.dtype]]:
    """(shape, dtype) of each tensor of the table, in order (None shape: an optional tensor, q/k norms)."""
    d, heads, kv_heads, dim = dims["d"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    ffn, vocab, slots, rank = dims["ffn"], dims["vocab"], dims["slots"], dims["rank"]
    f32, bf16 = torch.float32, torch.bfloat16
    q_out, kv_out = heads * dim, kv_heads * dim
    shapes: list[tuple[tuple[int, ...] | None, torch.dtype]] = [
        ((vocab, d), f32), ((d,), f32), ((_padded(vocab) // LANES, d, LANES), bf16),
        ((dims["max_len"], dim), f32), ((dims["max_len"], dim), f32)]
    norm = (dim,) if dims["qk_norm"] else None
    groups = ((3, d, q_out + 2 * kv_out), (1, q_out, d), (2, d, 2 * ffn), (1, ffn, d))
    for _ in range(dims["layers"]):
        shapes += [((d,), f32), ((d,), f32), (norm, f32), (norm, f32)]
        for members, d_in, d_out in groups:
            shapes += [((d_out // LANES, d_in, LANES), bf16), ((members, slots, rank, d_in), f32),
                       ((slots, d_out, rank), f32), ((members, slots), f32)]
        shapes += [((kv_rows, kv_heads, dims["max_len"], dim), f32)] * 2
    return shapes


@dataclass
class StepWeights:
    """The C step's pointer table over `tensors` (held here, so none is freed while the table lives)."""

    dims: dict[str, int]
    eps: float
    scaling: float
    tensors: list[torch.Tensor | None]

    def __post_init__(self) -> None:
        if set(self.dims) != set(DIM_NAMES):
            raise ValueError(f"decode step dims must name {DIM_NAMES}, got {sorted(self.dims)}")
        dims = self.dims
        outputs = (dims["heads"] * dims["head_dim"], (dims["heads"] + 2 * dims["kv_heads"]) * dims["head_dim"],
                   dims["d"], dims["ffn"])
        if dims["heads"] % dims["kv_heads"] or dims["head_dim"] % 2 or dims["rank"] < 1 or \
                any(size % LANES for size in outputs):
            raise ValueError(f"decode step dims {dims}: heads must be a multiple of kv_heads, head_dim even, rank at "
                             f"least 1, and the projections' outputs multiples of {LANES}")
        kv = self.tensors[-1]
        kv_rows = kv.shape[0] if kv is not None and kv.dim() == 4 else -1
        shapes = expected_shapes(dims, kv_rows)
        if len(self.tensors) != len(shapes):
            raise ValueError(f"decode step: {len(self.tensors)} tensors for {len(shapes)} places")
        for index, (tensor, (shape, dtype)) in enumerate(zip(self.tensors, shapes)):
            if shape is None:
                if tensor is not None:
                    raise ValueError(f"decode step tensor {index}: none expected (dims qk_norm=0), got one")
                continue
            _tensor(f"tensor {index}", tensor, dtype, shape)
        self.kv_rows = kv_rows
        self._dims = (ctypes.c_long * len(DIM_NAMES))(*(dims[name] for name in DIM_NAMES))
        self._reals = (ctypes.c_float * 2)(self.eps, self.scaling)
        self._pointers = (ctypes.c_void_p * len(self.tensors))(
            *(0 if t is None else t.data_ptr() for t in self.tensors))


def _index_vector(name: str, tensor: torch.Tensor, width: int) -> None:
    if tensor.dtype != torch.long or tensor.device.type != "cpu" or tensor.dim() != 1 or \
            not tensor.is_contiguous() or tensor.shape[0] < width:
        raise ValueError(f"decode step {name}: expected a contiguous CPU int64 vector of at least {width} entries, got "
                         f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")


def _within(name: str, values: torch.Tensor, low: int, high: int) -> None:
    if values.numel() and not (low <= int(values.min()) and int(values.max()) < high):
        raise ValueError(f"decode step {name} must lie in [{low}, {high}), got {values.tolist()}")


@dataclass
class GateSet:
    """One learned gate set's tables for a C step over W batch rows (decode_step.c's GateSet says what the step does
    with them): its top_k, expert -> slot map `expert_slots` [E] (int64, -1: the base model), one gate weight per
    block (float32 [E, (1 + S) d]), the rows it gates (`gated` [W] bool); with S context `decays`, which rows update
    the routing state (`updates` [W] bool), the states before this step (`state_in` [W, S, d] float32) and where the
    step writes the states after it (`state_out`, same); and `held`: (slots [W, layers, top_k] int64, weights
    float32, use [W] bool), the decisions kept for pictures begun earlier, which the rows marked in `use` take."""

    top_k: int
    expert_slots: torch.Tensor
    weights: Sequence[torch.Tensor]
    gated: torch.Tensor
    decays: Sequence[float] = ()
    updates: torch.Tensor | None = None
    state_in: torch.Tensor | None = None
    state_out: torch.Tensor | None = None
    held: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class LearnedStep:
    """Learned routing for one C step: its gate sets, applied in order (a later one's decision replaces an earlier
    one's on the rows it gates), and where the step writes each row's decision of every block: `slots` / `weights`
    [W, layers, k] (int64 / float32; the rows it computes)."""

    sets: Sequence[GateSet]
    slots: torch.Tensor
    weights: torch.Tensor


class _GateSetC(ctypes.Structure):
    """decode_step.c's GateSet (every pointer as void *: the same layout)."""

    _fields_ = [("experts", ctypes.c_long), ("top_k", ctypes.c_long), ("decays", ctypes.c_long),
                *((name, ctypes.c_void_p) for name in ("expert_slots", "weights", "gated", "updates", "held", "keep",
                                                       "fresh", "state_in", "state_out", "held_slots", "held_weights"))]


def _tensor(name: str, tensor: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """tensor's address, after checking that it is a contiguous CPU tensor of this dtype and shape."""
    if tensor is None or tensor.dtype != dtype or tensor.device.type != "cpu" or tuple(tensor.shape) != shape or \
            not tensor.is_contiguous():
        got = "None" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
        raise ValueError(f"decode step {name}: expected a contiguous CPU {dtype} {shape}, got {got}")
    return tensor.data_ptr()


@functools.lru_cache(maxsize=64)
def _decay_factors(decays: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (keep, fresh) [S] of a routing state's decays: exp(log lambda) with log lambda in float32, and
    1 - lambda, as decision.state_update applies them (made once per decays: ~9 us a step otherwise)."""
    keep = torch.log(torch.tensor(decays, dtype=torch.float32)).exp()
    return keep, torch.tensor([1 - lam for lam in decays], dtype=torch.float32)


def _gate_set(index: int, gates: GateSet, dims: dict[str, int], width: int, k: int) -> tuple[_GateSetC, list]:
    """The C struct of one gate set, after checking every table it points at (and what must stay alive with it)."""
    name = f"learned gate set {index}"
    experts = gates.expert_slots.shape[0] if gates.expert_slots.dim() == 1 else 0
    decays, d, layers = len(gates.decays), dims["d"], dims["layers"]
    if experts < 1 or not 1 <= gates.top_k <= min(experts, k):
        raise ValueError(f"decode step {name}: top_k {gates.top_k} must lie in [1, min(experts, k = {k})] "
                         f"with experts {tuple(gates.expert_slots.shape)}")
    _tensor(f"{name} expert_slots", gates.expert_slots, torch.long, (experts,))
    _within(f"{name} expert_slots", gates.expert_slots, -1, dims["slots"])
    if len(gates.weights) != layers:
        raise ValueError(f"decode step {name}: {len(gates.weights)} gate weights for {layers} blocks")
    weights = (ctypes.c_void_p * layers)(*(_tensor(f"{name} weight {block}", weight, torch.float32,
                                                   (experts, (1 + decays) * d))
                                           for block, weight in enumerate(gates.weights)))
    struct = _GateSetC(experts, gates.top_k, decays, gates.expert_slots.data_ptr(), ctypes.addressof(weights),
                       _tensor(f"{name} gated", gates.gated, torch.bool, (width,)))
    alive: list = [weights]
    if decays:
        keep, fresh = _decay_factors(tuple(gates.decays))
        struct.updates = _tensor(f"{name} updates", gates.updates, torch.bool, (width,))
        struct.state_in = _tensor(f"{name} state_in", gates.state_in, torch.float32, (width, decays, d))
        struct.state_out = _tensor(f"{name} state_out", gates.state_out, torch.float32, (width, decays, d))
        struct.keep, struct.fresh = keep.data_ptr(), fresh.data_ptr()
        alive += [keep, fresh]
    if gates.held is not None:
        slots, held_weights, use = gates.held
        struct.held_slots = _tensor(f"{name} held slots", slots, torch.long, (width, layers, gates.top_k))
        _within(f"{name} held slots", slots, -1, dims["slots"])
        struct.held_weights = _tensor(f"{name} held weights", held_weights, torch.float32, (width, layers, gates.top_k))
        struct.held = _tensor(f"{name} held use", use, torch.bool, (width,))
    return struct, alive


def _learned_args(learned: LearnedStep | None, dims: dict[str, int], width: int) -> tuple[tuple, list]:
    """(k, gate sets, their GateSet array, decided slots, decided weights) for the C call, every table checked, and
    what must stay alive during it."""
    if learned is None:
        return (1, 0, None, None, None), []
    k = learned.slots.shape[-1] if learned.slots.dim() == 3 else 0
    shape = (width, dims["layers"], k)
    if k < 1 or not learned.sets:
        raise ValueError(f"decode step learned: expected one gate set or more and decisions [W, layers, k >= 1], "
                         f"got {len(learned.sets)} sets and {tuple(learned.slots.shape)}")
    outputs = (_tensor("learned slots", learned.slots, torch.long, shape),
               _tensor("learned weights", learned.weights, torch.float32, shape))
    made = [_gate_set(index, gates, dims, width, k) for index, gates in enumerate(learned.sets)]
    structs = (_GateSetC * len(made))(*(struct for struct, _ in made))
    return (k, len(made), ctypes.addressof(structs), *outputs), [structs, made]


# A step splits its rows over threads only in parts of at least this many rows. The embedded model on the 2-core
# VM (2026-12-05, the C step alone, 150 positions, both cores free): 16 rows 6.0 -> 3.7 ms a step in two parts,
# 8 rows 3.2 -> 2.1, 4 rows 1.7 -> 1.1, 2 rows 1.1 -> 0.8. But in the app (benchmarks/app_load.py), where the
# server's and its visitors' threads want the other core too, a visitor alone (two rows with guidance) was served
# in 0.96-1.00 s against 0.70-0.79 in two runs of three when its two rows went in parts; with parts of 4 rows or
# more, eight visitors at once took 3.0 / 3.6 / 3.8 s against 3.9 / 4.2 / 4.1 in one thread (alternating runs)
PART_MIN_ROWS = 4


def decode_step(weights: StepWeights, rows: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, logits: torch.Tensor, learned: LearnedStep | None = None,
                threads: int = 1) -> None:
    """One token for each batch row in `rows` [n] (distinct): row r feeds ids[r] at positions[r] with LoRA slot
    slots[r] (-1: none; or, with `learned`, its gates' top-k of each block), writes its K/V at (cache row r,
    positions[r]) and its logits into logits[r] (float32 [W, vocab]); the other rows of `logits` are left as they
    are. `threads` > 1: the rows go in up to that many parts of PART_MIN_ROWS or more, side by side; a step of too
    few rows for parts (a lone visitor) has each GEMM's output blocks shared with a helper thread instead
    (gemm_bf16w.c molora_gemm_bf16w_team: each thread reads half the weights). The same numbers either way."""
    built = library()
    if built is None:
        raise RuntimeError("the CPU decode step is not built on this machine (kernels/cpu_bf16.py)")
    dims = weights.dims
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or \
            logits.shape[1] != dims["vocab"] or not logits.is_contiguous():
        raise ValueError(f"decode step logits: expected a contiguous CPU float32 [W, {dims['vocab']}], got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    width = logits.shape[0]
    for name, tensor in (("ids", ids), ("positions", positions), ("slots", slots)):
        _index_vector(name, tensor, width)
    if rows.dtype != torch.long or rows.device.type != "cpu" or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"decode step rows: expected a contiguous CPU int64 vector, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    if rows.numel() == 0:
        return
    _within("rows", rows, 0, min(width, weights.kv_rows))
    _within("ids", ids[rows], 0, dims["vocab"])
    _within("positions", positions[rows], 0, dims["max_len"])
    _within("slots", slots[rows], -1, dims["slots"])
    args, _alive = _learned_args(learned, dims, width)  # (the tables it points at live until the call returned)

    def call(part: torch.Tensor) -> int:  # (ctypes lets go of the GIL for the call: parts run side by side)
        return built.molora_decode_step(weights._dims, weights._reals, weights._pointers, part.shape[0],
                                        part.data_ptr(), ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                                        logits.data_ptr(), *args)
    count = min(threads, rows.shape[0] // PART_MIN_ROWS)
    _gemm_team(built, threads > 1)
    if count > 1:
        # each row's numbers come from its own operations whatever the other rows are, and every write of a row
        # (its K/V, logits, decisions, routing state) is its own: the rows can go in parts, one thread each
        if len(set(rows.tolist())) != rows.shape[0]:  # (a set of a few ints: cheaper than a tensor op a step)
            raise ValueError("decode step rows: a row appears twice (each batch row decodes once a step)")
        parts = rows.tensor_split(count)
        others = [_pool(count - 1, os.getpid()).submit(call, part) for part in parts[1:]]
        statuses = [call(parts[0])] + [other.result() for other in others]
        status = max(statuses)
    else:
        status = call(rows)
    if status == 1:
        raise MemoryError(f"the C decode step could not allocate its scratch for {rows.shape[0]} rows")
    if status:
        raise RuntimeError(f"the C decode step returned an unknown status {status}")


_TEAM = {"on": False, "pid": 0}  # what molora_gemm_team was last told, in which process


def _gemm_team(built: ctypes.CDLL, on: bool) -> None:
    """Switch the C library's GEMM helper thread on or off where that changes (a forked child starts off)."""
    if _TEAM["on"] != on or _TEAM["pid"] != os.getpid():
        _TEAM.update(on=bool(built.molora_gemm_team(int(on))), pid=os.getpid())


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """Threads for the parts of a step beyond the caller's own, made once per process (`pid`: a forked child's
    copy of its parent's pool has no threads)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="molora-cpu-step")


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, D] (a model's rotary embedding at positions 0..L-1) as the C step reads them: cos, and sin with
    rotate_half's signs folded in ([-sin[:D/2], sin[D/2:]])."""
    half = sin.shape[-1] // 2
    return cos.float().contiguous(), torch.cat((-sin[..., :half], sin[..., half:]), -1).float().contiguous()


def head_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The output head [vocab, d] as the C step reads it: a bfloat16 copy padded with zero rows to a multiple of
    LANES outputs, in gemm_bf16w's blocks; None unless its values are all bfloat16 (float32 weight on the CPU)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    padded = weight.detach().new_zeros(_padded(weight.shape[0]), weight.shape[1])
    padded[:weight.shape[0]] = weight.detach()
    return bf16_weight(padded)


__all__ = ["StepWeights", "GateSet", "LearnedStep", "decode_step", "available", "rope_tables", "head_copy", "expected_shapes"]
