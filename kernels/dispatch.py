"""One dispatcher for every routed-LoRA call: torch path on CPU, Triton gather or grouped kernel on CUDA.

The choice depends only on shapes (rows M = N*k), never on slot values, so it is the same on every replay of a
captured CUDA graph.
"""

from __future__ import annotations

import logging

import torch

from kernels.metadata import RoutingMeta
from kernels.torch_ops import routed_lora_torch, routed_lora_torch_dense
from kernels.triton_common import HAS_TRITON, interpreting

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

PATHS = ("auto", "torch", "gather", "grouped")


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); float64 always takes the torch path."""
    return HAS_TRITON and (x.is_cuda or interpreting()) and x.dtype != torch.float64


def choose_path(x: torch.Tensor, k: int, has_meta: bool = False) -> str:
    if not triton_usable(x):
        return "torch"
    limit = GATHER_MAX_ROWS_WITH_META if has_meta else GATHER_MAX_ROWS
    return "gather" if x.shape[0] * k <= limit else "grouped"


def reads_meta(x: torch.Tensor, k: int) -> bool:
    """Would the automatic path for this call read a prebuilt RoutingMeta? (The gather kernel and the CPU dense
    form never do, so a caller building metadata once per forward skips it for decode-sized calls.)"""
    rows = x.shape[0] * k
    if triton_usable(x):
        return rows > GATHER_MAX_ROWS_WITH_META
    return rows > CPU_DENSE_MAX_ROWS


def routed_lora_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                        meta: RoutingMeta | None = None, path: str = "auto") -> torch.Tensor:
    """No-autograd forward for slots [N, k]: the delta in x's dtype, or `out` after out += delta."""
    if path == "auto":
        path = choose_path(x, slots.shape[1], meta is not None)
    if path == "torch":
        if x.shape[0] * slots.shape[1] <= CPU_DENSE_MAX_ROWS:
            delta = routed_lora_torch_dense(x, A, B, slots, weights, scale)
        else:
            delta = routed_lora_torch(x, A, B, slots, weights, scale, meta)
        if out is not None:
            return out.add_(delta)
        return delta.to(x.dtype)
    if path == "gather":
        from kernels.triton_gather import gather_lora
        return gather_lora(x, A, B, slots, weights, scale, out)
    if path == "grouped":
        from kernels.triton_grouped import grouped_lora
        return grouped_lora(x, A, B, slots, weights, scale, out, meta)
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
