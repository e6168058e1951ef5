"""Small helpers shared by the Triton launchers: availability, interpreter detection, dot dtype choice."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU-only installs (e.g. a Space without triton) run the torch path only
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def delta_target(x: torch.Tensor, d_out: int, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Where a kernel writes the delta [N, d_out]: into `out` (accumulate: out += delta) or a new tensor in x's
    dtype; and whether it accumulates."""
    if out is not None:
        return out, True
    return torch.empty(x.shape[0], d_out, dtype=x.dtype, device=x.device), False



# Launch through the compiled kernel's own launcher (CompiledKernel.run), skipping JITFunction.run's per-call
# binding, cache-key hashing and hooks: H200, 2026-12-01, the same kernel 34.1 us per launch through
# JITFunction.run vs 12.1 us through its launcher (benchmarks/kernels.py, eager section). Our key holds everything
# Triton specialises a compiled kernel on (argument dtypes, 16-byte pointer alignment, ints equal to 1, divisible by
# 16, 32- or 64-bit; constexpr values; num_warps; device), so a cached kernel only ever runs arguments it was
# compiled for. The first call of each key goes through JITFunction.run (compiling if needed). Profiler launch hooks
# are not called on the fast path. Off under the interpreter; FAST_LAUNCH = False turns it off.
FAST_LAUNCH = True
_LAUNCH_CACHE: dict = {}


def _spec(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        return a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31
    if type(a) is bool or a is None:
        return a
    return type(a)


def launch(fn, grid: tuple[int, ...], *args: object, num_warps: int, **constexprs: object) -> None:
    """fn[grid](*args, **constexprs, num_warps=num_warps), fast after the first call of each specialisation."""
    if not FAST_LAUNCH or interpreting():
        fn[grid](*args, **constexprs, num_warps=num_warps)
        return
    key = (fn, tuple(map(_spec, args)), tuple(constexprs.items()), num_warps, args[0].device.index)
    entry = _LAUNCH_CACHE.get(key)
    if entry is None:
        kernel = fn[grid](*args, **constexprs, num_warps=num_warps)
        names = fn.arg_names[len(args):]  # the constexprs, in the kernel's signature order
        _LAUNCH_CACHE[key] = (kernel, tuple(constexprs[n] for n in names))
        return
    kernel, consts = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, torch.cuda.current_stream().cuda_stream, kernel.function, kernel.packed_metadata,
               None, None, None, *args, *consts)
