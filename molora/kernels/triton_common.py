"""Small helpers shared by the Triton launchers: availability, interpreter detection, dot dtype choice."""

from __future__ import annotations

import functools
import os

import torch

from molora.kernels.errors import KernelInputError

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU-only installs (e.g. a Space without triton) run the torch path only
    triton = None
    tl = None
    HAS_TRITON = False


# Read once, as triton reads it when kernels are decorated (at import): an os.environ lookup per routed call cost
# ~2 us of host time on the decode path.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


# The Triton expand kernels read a group's column boundaries as three scalars (O1, O2, O3): at most four projections
# share one call.
MAX_PROJECTIONS = 4


# Programmatic dependent launch (Hopper and later; kernels/*: the two-phase launchers). The second phase of a call
# is launched with launch_pdl and waits on griddepcontrol.wait before it reads the first phase's partials; the first
# phase lets it be scheduled (griddepcontrol.launch_dependents) as soon as all its own programs have started, so the
# second launch's latency and set-up overlap the first's tail (and the routed linear's base GEMM runs beside the
# shrink). Benchmarks switch it off to measure what it saves (set_dependent_launch). Triton before 3.3 has no
# griddepcontrol ops (tl.extra.cuda.gdc_wait): the launchers then run the phases as plain launches.
_DEPENDENT_LAUNCH = True


def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


_HAS_GDC = HAS_TRITON and _triton_has_gdc()


def set_dependent_launch(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for the launches that follow (on by default)."""
    global _DEPENDENT_LAUNCH
    _DEPENDENT_LAUNCH = bool(enabled)


@functools.lru_cache(maxsize=16)
def _sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def dependent_launch(x: torch.Tensor) -> bool:
    """Whether the two-phase launchers chain their phases by programmatic dependent launch for tensors like x: on a
    CUDA device of compute capability 9.0 or later, with a triton that has the ops, not under the interpreter,
    unless switched off."""
    return _DEPENDENT_LAUNCH and _HAS_GDC and not _INTERPRETING and x.is_cuda and _sm90_or_later(x.get_device())


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return _INTERPRETING


def check_triton_device(x: torch.Tensor, path: str) -> None:
    """Refuse a Triton path that cannot run x (no triton; CPU tensors outside the interpreter) with an error naming
    the path and the device, instead of Triton's own ("0 active drivers")."""
    if not HAS_TRITON:
        raise KernelInputError(f"path={path!r} runs Triton kernels but triton is not installed; use path='auto' or "
                               "'torch'")
    if not (x.is_cuda or _INTERPRETING):
        raise KernelInputError(f"path={path!r} runs Triton kernels, which need CUDA tensors, but x is on {x.device}; "
                               "use path='auto' or 'torch' there, or set TRITON_INTERPRET=1 before importing molora "
                               "to run them in Triton's CPU interpreter")


def dot_config(dtype: torch.dtype) -> tuple[object, str]:
    """(operand dtype for tl.dot, input_precision) for activations of `dtype`.

    GPU: bf16/fp16 stay 16-bit (tensor-core dots); fp32 uses "ieee" so fp32 callers get fp32 accuracy.
    Interpreter: bf16 operands are cast to fp32 first, because under TRITON_INTERPRET=1 tl.dot on bf16 returns
    garbage (DESIGN.md §3, measured with triton 3.9: relative error ~6e9); the GPU build never takes that branch.
    """
    if dtype == torch.float16:
        return tl.float16, "tf32"
    if dtype == torch.bfloat16 and not interpreting():
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


if HAS_TRITON:
    @triton.jit
    def choice_weights(slot_ptr, w_ptr, tok, mrow, col_slot, K: tl.constexpr, HAS_W: tl.constexpr):
        """float32 [rows, columns]: each row's summed weight on each column's slot, for tokens `tok` [rows]
        (mask `mrow`) with slots [N, K] and weights [N, K] (1 without HAS_W) and the slot of each column
        `col_slot` [columns]. A repeated slot sums its weights; -1 (and any slot no column holds) adds nothing."""
        coef = tl.zeros([tok.shape[0], col_slot.shape[0]], dtype=tl.float32)
        for j in tl.static_range(K):
            s = tl.load(slot_ptr + tok * K + j, mask=mrow, other=-1).to(tl.int32)
            if HAS_W:
                w = tl.load(w_ptr + tok * K + j, mask=mrow, other=0.0).to(tl.float32)
            else:
                w = tl.full([tok.shape[0]], 1.0, dtype=tl.float32)
            coef += tl.where(s[:, None] == col_slot[None, :], w[:, None], 0.0)
        return coef


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) (triton.cdiv is a constexpr function in newer triton: ~4 us per call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def stacked_width(num_slots: int, rank: int) -> int:
    """Columns the stacked kernels (kernels/triton_stacked.py) lay a hot set out in: each slot's rank rows padded to
    a power of two, so a slot's rows sit at constexpr offsets the compiler sees as contiguous, and the whole padded
    to a power of two (at least 16, tl.dot's smallest tile). Equal to S*r for power-of-two S and r."""
    return max(16, next_pow2(num_slots * next_pow2(rank)))


def delta_target(x: torch.Tensor, d_out: int, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Where a kernel writes the delta [N, d_out]: into `out` (accumulate: out += delta) or a new tensor in x's
    dtype; and whether it accumulates."""
    if out is not None:
        return out, True
    return torch.empty(x.shape[0], d_out, dtype=x.dtype, device=x.device), False


