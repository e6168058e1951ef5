"""Shape, dtype and device checks shared by every routed-LoRA entry point.

Only metadata is inspected (never tensor values on CUDA), so checking costs no host synchronisation and a
checked call can still be captured in a CUDA graph. Slot values are range-checked on CPU tensors only; on CUDA an
out-of-range slot is treated like -1 by every kernel (no out-of-bounds read), see kernels/dispatch.py.
"""

from __future__ import annotations

import torch

from molora.kernels.errors import KernelInputError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise KernelInputError naming the first problem; `slots` is already [N, k]."""
    for name, t in (("x", x), ("A", A), ("B", B), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise KernelInputError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if x.dim() != 2:
        raise KernelInputError(f"x must be [N, in], got shape {tuple(x.shape)}")
    if A.dim() != 3 or B.dim() != 3:
        raise KernelInputError(f"A must be [S, r, in] and B [S, out, r], got {tuple(A.shape)} and {tuple(B.shape)}")
    n, d_in = x.shape
    s, r, a_in = A.shape
    if a_in != d_in:
        raise KernelInputError(f"A's last dim ({a_in}) must equal x's hidden size ({d_in})")
    if B.shape[0] != s or B.shape[2] != r:
        raise KernelInputError(f"B must be [S={s}, out, r={r}] to match A, got {tuple(B.shape)}")
    if scale.shape != (s,):
        raise KernelInputError(f"scale must be [S={s}], got {tuple(scale.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"slot indices must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 2 or slots.shape[0] != n:
        raise KernelInputError(f"slots must be [N={n}] (or [N, k] for top-k), got {tuple(slots.shape)}")
    if slots.shape[1] < 1:
        raise KernelInputError("top-k needs k >= 1")
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or weights.dtype not in _FLOATS:
            raise KernelInputError("weights must be a floating tensor [N, k]")
        if weights.shape != slots.shape:
            raise KernelInputError(f"weights must match slots' shape {tuple(slots.shape)}, got {tuple(weights.shape)}")
    tensors = [("x", x), ("A", A), ("B", B), ("slots", slots), ("scale", scale)]
    if weights is not None:
        tensors.append(("weights", weights))
    if out is not None:
        if out.shape != (n, B.shape[1]):
            raise KernelInputError(f"out must be [N={n}, out={B.shape[1]}], got {tuple(out.shape)}")
        if out.dtype not in _FLOATS:
            raise KernelInputError(f"out must be a floating tensor, got {out.dtype}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != x.device:
            raise KernelInputError(f"{name} is on {t.device} but x is on {x.device}; move all inputs to one device")
    if x.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= s:
            raise KernelInputError(f"slot indices must lie in [-1, {s - 1}], got values in [{lo}, {hi}]")
