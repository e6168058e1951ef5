"""Per-call CPU time of the routed-LoRA torch forms, one thread: where the CPU's all-slots form stops paying.

    python -m benchmarks.cpu_ops            # prints a table: us per call, median of 5 rounds

Forms (kernels/torch_ops.py): "stacked" (one shrink GEMM against every slot, coefficients folded in, one expand GEMM:
what the CPU runs below CPU_DENSE_MAX_MACS), "bmm" (the dense form the GPU's eager decode calls run: every slot's
expand as one bmm, then a weighted sum over slots), "loop" (the slot-grouped loop: one matmul pair per slot present,
what the CPU runs above the bound). MACs = N * S * r * (in + out), the all-slots forms' multiply-adds.
Shapes: the embedded model's (hidden 256, MLP 1024; S = 5 adapters of rank 8, top-2 as the learned router routes),
and a 2048-wide model with 8 slots of rank 16.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's molora, as `python benchmarks/x.py`

from molora.kernels.torch_ops import routed_lora_torch, routed_lora_torch_dense, routed_lora_torch_stacked  # noqa: E402

SHAPES = [  # (N, in, out, S, r, k)
    (32, 256, 256, 5, 8, 2), (32, 256, 1024, 5, 8, 2), (256, 256, 256, 5, 8, 2), (256, 256, 1024, 5, 8, 2),
    (1024, 256, 1024, 5, 8, 2), (2048, 256, 1024, 5, 8, 2), (256, 1024, 256, 5, 8, 1), (2048, 1024, 256, 5, 8, 1),
    (16, 2048, 2048, 8, 16, 2), (32, 2048, 2048, 8, 16, 1), (64, 2048, 2048, 8, 16, 1), (128, 2048, 2048, 8, 16, 2),
    (256, 2048, 2048, 8, 16, 2),
]


def per_call_us(fn, rounds: int = 5) -> float:
    fn()
    reps = 3
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; us per call (median of 5 rounds)")
    print(f"{'N':>5} {'in':>5} {'out':>5} {'S':>2} {'r':>3} {'k':>2} {'MACs':>6} {'stacked':>9} {'bmm':>9} {'loop':>9}")
    g = torch.Generator().manual_seed(0)
    for n, d_in, d_out, s, r, k in SHAPES:
        x = torch.randn(n, d_in, generator=g)
        A = torch.randn(s, r, d_in, generator=g) / d_in ** 0.5
        B = torch.randn(s, d_out, r, generator=g)
        scale = torch.rand(s, generator=g) + 0.5
        slots = torch.rand(n, s, generator=g).argsort(1)[:, :k].int()
        weights = torch.rand(n, k, generator=g)
        args = (x, A, B, slots, weights, scale)
        times = [per_call_us(lambda f=f, args=args: f(*args))
                 for f in (routed_lora_torch_stacked, routed_lora_torch_dense, routed_lora_torch)]
        macs = n * s * r * (d_in + d_out)
        print(f"{n:5d} {d_in:5d} {d_out:5d} {s:2d} {r:3d} {k:2d} {macs / 1e6:5.1f}M " + " ".join(f"{t:9.0f}" for t in times))


if __name__ == "__main__":
    main()
