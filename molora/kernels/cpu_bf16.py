"""The CPU engine's exact-row decode GEMM on a bfloat16 copy of the weights (gemm_bf16w.c, beside this file), and the
build of the engine's C library (that GEMM and the whole decode step on it, decode_step.c: kernels/cpu_decode.py).

A decode step of the embedded model on a 2-core CPU is bound by reading its float32 weights (benchmarks/RESULTS.md,
C1). Its checkpoint is bfloat16, so every weight value is a bfloat16 value: a bfloat16 copy holds the same numbers
in half the bytes, and the kernel widens them in registers and computes in float32. torch has no GEMM of float32
activations against bfloat16 weights on the CPU (oneDNN refuses the mix; F.linear wants one dtype), so the kernel is
ours: ~40 lines of C (AVX-512 intrinsics where the compiler targets AVX-512F, else plain 16-lane loops it vectorises
for the machine: vec16.h), compiled at first use by the machine's C compiler
(`cc -O3 -march=native`, about a second with the decode step) into a temporary directory and called through ctypes
(which releases the GIL).

Where it cannot serve (no compiler, a failed build or check, a weight whose values are not all bfloat16,
an output size not a multiple of 16, more than one torch thread: oneDNN's GEMM uses them all), `bf16_weight` returns
None and the caller keeps oneDNN's float32 GEMM; a failed build logs one line.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gemm_bf16w.c", "decode_step.c"))
HEADER = Path(__file__).with_name("vec16.h")  # 16-lane vectors: AVX-512F where the compiler targets it, else loops
# outputs per block of the copy's layout (one 16-lane float32 vector)
LANES = 16


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (SOURCES), built once per process (a build in a shared cache could meet another CPU:
    -march=native); None where they cannot be built here."""
    # $CC may carry flags ("ccache gcc", "cc -mno-avx512f")
    compiler = shlex.split(os.environ.get("CC", "")) or [found for found in [shutil.which("cc") or shutil.which("gcc")]
                                                         if found]
    missing = [str(source) for source in (*SOURCES, HEADER) if not source.is_file()]
    if not compiler or missing:
        log.info("cpu bfloat16 GEMM: %s; the engine keeps oneDNN's float32 GEMM and torch's decode step",
                 "no C compiler here" if not compiler else f"{missing[0]} is missing")
        return None
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix="molora-gemm-")
        target = os.path.join(folder, "molora_cpu.so")
        subprocess.run([*compiler, "-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-o", target,
                        *(str(source) for source in SOURCES), "-lm"], check=True, capture_output=True, timeout=60)
        built = ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        first = detail.decode(errors="replace").strip().splitlines()[:1] or [str(err)]
        log.info("cpu bfloat16 GEMM: building %s failed (%s); the engine keeps oneDNN's float32 GEMM and torch's "
                 "decode step", " and ".join(source.name for source in SOURCES), first[0][:200])
        return None
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # the loaded library stays mapped
    function = built.molora_gemm_bf16w
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                         ctypes.c_long]
    function.restype = None
    built.molora_gemm_team.argtypes = [ctypes.c_int]
    built.molora_gemm_team.restype = ctypes.c_int
    step = built.molora_decode_step
    step.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + \
        [ctypes.c_void_p] * 3  # (..., k, gate sets, their GateSet array, decided slots, decided weights)
    step.restype = ctypes.c_int
    return built


def available() -> bool:
    return library() is not None


def bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of weight [O, in] (float32, CPU) for gemm_bf16w, in blocks of LANES outputs [O / LANES, in,
    LANES], when it holds the same values and the kernel serves here (see the module doc); else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or \
            weight.shape[0] % LANES or torch.get_num_threads() != 1 or not available():
        return None
    weight = weight.detach()
    copy = weight.to(torch.bfloat16)
    if not torch.equal(copy.float(), weight):
        return None
    return copy.view(weight.shape[0] // LANES, LANES, weight.shape[1]).transpose(1, 2).contiguous()


def gemm_bf16w(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, in] (float32, CPU) @ W [O, in]^T for weight = bf16_weight(W): [N, O] float32, each row's numbers the
    same whatever rows share the call."""
    built = library()
    if built is None:
        raise RuntimeError("the bfloat16 GEMM kernel is not built on this machine (kernels/cpu_bf16.py)")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or weight.dtype != torch.bfloat16 or \
            weight.device.type != "cpu" or weight.dim() != 3 or weight.shape[2] != LANES or \
            not weight.is_contiguous() or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemm_bf16w takes float32 x [N, in] and a bfloat16 weight as bf16_weight makes it "
                         f"[O / {LANES}, in, {LANES}], both on the CPU; got x {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}, weight {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    x = x.contiguous()
    out_features = weight.shape[0] * LANES
    y = x.new_empty(x.shape[0], out_features)  # (on x's device, the CPU, whatever torch's default device is)
    built.molora_gemm_bf16w(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], out_features, x.shape[1])
    return y
