"""One dispatcher for every routed-LoRA call: torch path on CPU, Triton gather, stacked or grouped kernel on CUDA.

The choice depends only on shapes (rows M = N*k, stacked width S*r), never on slot values, so it is the same on
every replay of a captured CUDA graph:
  gather   rows <= GATHER_MAX_ROWS_STACKED (or the limits below when the stacked path does not apply)
  stacked  S*r <= STACKED_MAX_WIDTH: cost independent of k, no metadata (kernels/triton_stacked.py)
  grouped  otherwise (wide hot sets: S*r above the width where stacking all slots stops being free)
"""

from __future__ import annotations

import logging

import torch

from kernels.metadata import RoutingMeta
from kernels.torch_ops import routed_lora_torch, routed_lora_torch_dense
from kernels.triton_common import HAS_TRITON, interpreting

if HAS_TRITON:
    from kernels.triton_gather import gather_lora
    from kernels.triton_grouped import grouped_lora
    from kernels.triton_stacked import stacked_lora

log = logging.getLogger(__name__)

# Rows (N*k) up to which the gather kernel beats the grouped one; chosen from benchmarks/kernels.py on the H200
# 2026-11-30 (4 slots, d=4096, r=16, bf16, CUDA-graph replay, L2 flushed, median us):
#   N      gather   grouped+meta built in the call   grouped, meta prebuilt
#   256    17.57    23.17                            20.42
#   512    27.01    28.26                            22.30
#   1024   45.54    31.81                            25.31
# so gather up to 512 rows for a self-contained call, up to 256 when the caller passes a prebuilt `meta`.
GATHER_MAX_ROWS = 512
GATHER_MAX_ROWS_WITH_META = 256

# Rows up to which the CPU uses the dense all-slots form instead of the slot-grouped loop (decode steps: 2-8 rows;
# 30-39 us vs 57-62 us per layer at hidden 256, measured on the 2-core dev machine, 2026-11-30).
CPU_DENSE_MAX_ROWS = 16

# Stacked path (kernels/triton_stacked.py): used while S*r <= STACKED_MAX_WIDTH, and above GATHER_MAX_ROWS_STACKED
# rows, below which the gather kernel (reads only the chosen slots) is faster. Provisional values, replaced by the
# H200 measurements of benchmarks/kernels.py (see the numbers beside them once measured).
STACKED_MAX_WIDTH = 256
GATHER_MAX_ROWS_STACKED = 64

PATHS = ("auto", "torch", "gather", "stacked", "grouped")


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); float64 always takes the torch path."""
    return HAS_TRITON and (x.is_cuda or interpreting()) and x.dtype != torch.float64


def choose_path(x: torch.Tensor, k: int, has_meta: bool = False, width: int | None = None) -> str:
    """Path for x [N, in] with k choices per token; `width` = S*r of the stacked adapters (None: not known, the
    stacked path is not considered)."""
    if not triton_usable(x):
        return "torch"
    rows = x.shape[0] * k
    if width is not None and width <= STACKED_MAX_WIDTH:
        return "gather" if rows <= GATHER_MAX_ROWS_STACKED else "stacked"
    limit = GATHER_MAX_ROWS_WITH_META if has_meta else GATHER_MAX_ROWS
    return "gather" if rows <= limit else "grouped"


def reads_meta(x: torch.Tensor, k: int, A: torch.Tensor | None = None) -> bool:
    """Would the automatic path for this call read a prebuilt RoutingMeta? (Only the grouped kernel and the CPU
    grouped loop do, so a caller building metadata once per forward skips it otherwise.) Pass the stacked A
    [S, r, in] so the stacked path is known; without it the answer assumes it is not taken."""
    rows = x.shape[0] * k
    if triton_usable(x):
        width = None if A is None else A.shape[0] * A.shape[1]
        return choose_path(x, k, True, width) == "grouped"
    return rows > CPU_DENSE_MAX_ROWS


def routed_lora_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                        meta: RoutingMeta | None = None, path: str = "auto") -> torch.Tensor:
    """No-autograd forward for slots [N, k]: the delta in x's dtype, or `out` after out += delta."""
    if path == "auto":
        path = choose_path(x, slots.shape[1], meta is not None, A.shape[0] * A.shape[1])
    if path == "torch":
        if x.shape[0] * slots.shape[1] <= CPU_DENSE_MAX_ROWS:
            delta = routed_lora_torch_dense(x, A, B, slots, weights, scale)
        else:
            delta = routed_lora_torch(x, A, B, slots, weights, scale, meta)
        if out is not None:
            return out.add_(delta)
        return delta.to(x.dtype)
    if path == "gather":
        return gather_lora(x, A, B, slots, weights, scale, out)
    if path == "stacked":
        return stacked_lora(x, A, B, slots, weights, scale, out)
    if path == "grouped":
        return grouped_lora(x, A, B, slots, weights, scale, out, meta)
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
