"""One dispatcher for every routed-LoRA call: torch paths on CPU and for eager decode calls, Triton gather, stacked
or grouped kernel on CUDA otherwise.

The choice depends on shapes (rows M = N*k, rank r, stacked width S*r: triton_common.stacked_width, S times r
padded to a power of two) and on one explicit mode, never on slot values:
  fused    on CUDA, decode-sized calls (N <= EAGER_MAX_TOKENS) outside graph mode on narrow hot sets: the stacked
           kernel's one-launch schedule for all P projections of a group call, launched through the compiled
           kernel's own launcher (kernels/triton_stacked.py, FusedLaunch): the least host time (an eager step is
           host-bound)
  torch    the CPU (kernels/torch_ops.py: an all-slots form, stacked above 2 r rows, where dense_fits holds, else
           the slot-grouped loop); and the eager decode calls on wider hot sets: the dense form, four
           C++-dispatched launches
  gather   few rows (rows * r small; for top-k rows * k * r): reads only the chosen slots, split-K latency kernel
  stacked  narrow hot sets (S*r small) above that, any k, up to a size (larger where the stack has measured
           tiles): cost independent of k, no metadata; top-k on hot sets up to S*r = 256 up to 256 tokens; k = 1
           without metadata there too where the stack has measured tiles
  gemm     top-k above those sizes on hot sets up to GEMM_MAX_WIDTH stacked columns, and k = 1 without metadata
           up to GEMM_MAX_TOKENS: the stacked form's two matmuls in cuBLAS (kernels/stacked_gemm.py), cost
           independent of k
  grouped  k = 1 on wide hot sets, and once N*r is large, sooner with prebuilt metadata (two phases, slot-sorted
           tiles); top-k on hot sets wider than GEMM_MAX_WIDTH (tiles of tokens that chose the same set of slots)
Graph mode (kernels/graphs.py: on inside capture_graph, for its warm-up and its capture alike) takes the Triton
paths at every size, the least GPU time, which is all a replayed graph costs; since warm-up and capture see the
same mode, a warm-up compiles exactly what the capture records. A capture made by other means (torch.cuda.graph
after an eager warm-up) is in graph mode too while its stream captures; an eager decode call runs its graph-mode
path once per call shape as well (loads_graph_path), so that such a capture finds that path's kernels loaded.
Projections that share x (routed_lora_group_forward) take the same choice, except at k = 1 (choose_group_path):
the gather kernel only while N*r*P is small, and with prebuilt metadata the grouped kernel replaces the stacked one
once N*r is large; every path then shrinks once for all of them (the fused path: in every program, from L2).
A caller holding the base weights too (routing/lora.py) asks fuses_base whether the whole routed linear of its
projections runs as one GEMM with the delta inside (kernels/triton_linear.py) instead of deltas plus base GEMMs.
On sm_90 and later the two-launch paths chain their launches by programmatic dependent launch (the second phase
scheduled while the first runs; kernels/triton_common.py: dependent_launch), the grouped kernel only at the sizes
where that was measured faster (triton_grouped.PDL_MAX_ROW_RANK).
"""

from __future__ import annotations

import functools
import logging

import torch

from molora.kernels.graphs import call_key, graph_mode, load_graph_path
from molora.kernels.metadata import RoutingMeta
from molora.kernels.torch_ops import (
    routed_lora_torch,
    routed_lora_torch_dense,
    routed_lora_torch_group_dense,
    routed_lora_torch_group_stacked,
    routed_lora_torch_stacked,
)
from molora.kernels.triton_common import (
    HAS_TRITON,
    MAX_PROJECTIONS,
    check_triton_device,
    interpreting,
    stacked_width,
)
from molora.kernels.triton_linear import WIDE_DECODE_MAX_TOKENS

if HAS_TRITON:
    from molora.kernels.stacked_gemm import gemm_lora, gemm_lora_group
    from molora.kernels.triton_gather import gather_lora, gather_lora_group
    from molora.kernels.triton_grouped import grouped_lora, grouped_lora_group
    from molora.kernels.triton_stacked import (
        MAX_WIDTH,
        FusedLaunch,
        measured_tiles,
        stacked_lora,
        stacked_lora_group,
    )

log = logging.getLogger(__name__)

# Thresholds from benchmarks/lora_kernels.py on the H200 (4 slots, d=4096, bf16, CUDA-graph replay, L2 flushed, median
# us; benchmarks/RESULTS.md, "Kernels: fused projections, rank buckets"). 2026-12-01 run, per path, k=1; "meta" =
# the grouped kernel with metadata prebuilt (as a model runs it: built once per forward), "grp+meta" = built in the
# call.
#
# Wide hot sets (S*r > STACKED_MAX_WIDTH): gather while rows * r <= GATHER_MAX_ROW_RANK (the gather kernel's cost
# grows with rows * r), or <= GATHER_MAX_ROW_RANK_WITH_META when the metadata is prebuilt (k = 1; 2026-12-01, before
# the grouped kernel's few-row tiles, whose boundary measurement of 2026-12-02 below set it):
#   r=32:  N=32 gather 12.35, meta 13.22, grp+meta 15.58;  N=128 23.52 vs 13.86 / 16.61
#   r=64:  N=32 gather 15.17, meta 14.27, grp+meta 16.67;  N=128 34.94 vs 15.04 / 17.60
#   r=128: N=1 gather 12.99, meta 16.93;  N=32 24.16 vs 18.82 / 20.93
# Top-k calls take it while rows * k * r <= GATHER_MAX_ROW_RANK (each of a token's k rows costs more as k grows).
# H200, 2026-12-02, r=64, metadata built in the call, median us: k=2 N=8 (2048) gather 13.7; k=4 N=1 (1024) 13.9,
# N=8 (8192) 18.5 against the stacked kernel's 15.3 at N=64.
# H200, 2026-12-02 (--only ranks --sweep-ranks 32,64,128 --sweep-n 8,16,32), gather vs meta at rows * r = 1024:
# r=32 N=32 12.45 vs 12.11, r=64 N=16 13.02 vs 13.22, r=128 N=8 16.42 vs 14.94; at 512: r=64 N=8 11.20 vs 12.90,
# r=32 N=16 11.07 vs 12.22.
GATHER_MAX_ROW_RANK = 2048
GATHER_MAX_ROW_RANK_WITH_META = 512
# Narrow hot sets (S*r <= STACKED_MAX_WIDTH) take the gather kernel while rows * k <= GATHER_MAX_ROWS_STACKED, then
# the stacked kernel. H200, 2026-12-02, r=16, median us, gather vs stacked: k=1 N=32 10.78 vs 11.74, N=64 13.3 vs
# 11.8; k=2 N=8 10.6 vs 11.5, N=64 17.7 vs 12.0; k=4 N=1 11.5 vs 11.2, N=8 13.1 vs 11.6.
GATHER_MAX_ROWS_STACKED = 32
STACKED_MAX_WIDTH = 64
# ... except k=1 with prebuilt metadata once N * r > STACKED_MAX_ROW_RANK_WITH_META, where the two-phase grouped
# kernel wins: r=8 N=256 stacked 12.93 vs meta 14.30, N=2048 26.34 vs 22.14; r=16 N=128 12.83 vs 13.15,
# N=256 15.58 vs 13.34, N=2048 33.50 vs 20.90, N=8192 74.72 vs 48.54
STACKED_MAX_ROW_RANK_WITH_META = 2048
# ... and without it once N * r > STACKED_MAX_ROW_RANK (the grouped kernel then sorts in the call: two parallel
# launches since 2026-12-02). H200, 2026-12-02, k=1, metadata built in the call, median us: r=8 N=2048 stacked
# 26.24 vs grouped 26.88, N=8192 67.07 vs 60.42; r=16 N=256 16.0 vs 18.4, N=1024 24.9 vs 20.8, N=2048 34.4 vs
# 25.6, N=8192 73.6 vs 54.1
STACKED_MAX_ROW_RANK = 8192
# ... or, where the stacked kernel has measured tiles for the stack (STACKED_TILES), up to
# STACKED_TILED_MAX_TOKENS tokens. H200, 2026-12-02, r=16 (64 columns, measured tiles), metadata built in the call,
# median us, stacked vs gemm: k=1 N=1024 19.3 vs 20.1, N=2048 24.4 vs 25.5, N=8192 55.6 vs 53.9; k=2 N=1024 19.2
# vs 19.9, N=2048 24.6 vs 24.8, N=8192 56.3 vs 53.7.
STACKED_TILED_MAX_TOKENS = 2048
# Projections sharing x (P of them): the gather kernel while rows * r * P <= GROUP_GATHER_MAX_ROW_RANK. H200,
# 2026-12-01 (RESULTS.md, issue 13 third pass), q/k/v at d=4096, graph replay, metadata prebuilt, median us:
#   r=16: N=4 gather 11.55, stacked 11.90, grouped 15.23;  N=16 gather 13.98, stacked 12.16, grouped 15.49
#   r=64: N=1 gather 16.70, grouped 16.42;  N=4 19.58 vs 17.09;  N=16 29.63 vs 18.56
GROUP_GATHER_MAX_ROW_RANK = 256
# ... and with prebuilt metadata (k = 1) the stacked kernel only while N * r <= GROUP_STACKED_MAX_ROW_RANK, then the
# grouped one (r=16: N=16 stacked 12.16 vs grouped 15.49; N=256 q/k/v with their GEMMs grouped 75.2 vs stacked 80.5)
GROUP_STACKED_MAX_ROW_RANK = 256
# Top-k (k > 1) above the gather kernel's rows: the stacked form, whose cost does not depend on k (S/k times the
# routed arithmetic): the stacked kernel up to STACKED_TOPK_MAX_TOKENS tokens on hot sets up to STACKED_TOPK_MAX_WIDTH
# stacked columns (narrow ones: by N * r, above), the gemm path (kernels/stacked_gemm.py: cuBLAS) above that and on
# wider hot sets up to GEMM_MAX_WIDTH. k = 1 without prebuilt metadata takes the stacked kernel there too where it has
# measured wide tiles (STACKED_TILES): r=64 N=128 stacked 18.1 vs grouped (sorting in the call) 19.4, N=256 18.3 vs
# 20.8. H200, 2026-12-02, S=4, metadata built in the call, median us; r=64 (256 columns), stacked (wide tiles) vs
# grouped (slot sets) vs gemm, k=2: N=64 15.3 vs 25.8 vs 27.9, N=256 18.4 vs 28.5 vs 30.2; N=2048 grouped 57.7, gemm
# 41.6 (k=4 62.5 vs 42.5), N=8192 91.6 vs 85.2 (k=4 215.1 vs 85.1), gemm then with B copied by torch (14.5 us of it).
# r=128 (512 columns) grouped (slot sets) vs gemm, k=2: N=8 31.0 vs 18.5, N=256 36.7 vs 21.8, N=2048 84.6 vs 40.9,
# N=8192 166.8 vs 113.7 (k=4 at N=8192: the slot-set tiles ran out of shared memory).
STACKED_TOPK_MAX_WIDTH = 256
STACKED_TOPK_MAX_TOKENS = 256
# k = 1 without prebuilt metadata (the grouped kernel would sort in the call) takes the gemm path too above the
# stacked kernel's sizes up to GEMM_MAX_TOKENS tokens. H200, 2026-12-02, S=4, median us, gemm vs grouped (sorting
# in the call): r=16 N=1024 20.2 vs 21.6, N=8192 54.4 vs 54.0; r=64 N=1024 24.2 vs 26.9, N=2048 31.4 vs 31.2,
# N=8192 73.7 vs 61.9; r=128 N=256 21.8 vs 26.0, N=2048 40.7 vs 51.2, N=8192 113.0 vs 87.2. With the metadata
# prebuilt the grouped kernel is faster (r=16 N=2048 20.9, r=64 26.8).
GEMM_MAX_TOKENS = 2048
# The gemm path does S/k times the routed arithmetic: measured up to 512 stacked columns (r=128 on 4 slots, where at
# N=8192 it is already compute-bound: 113 us for k=2 against the grouped kernel's 87 for k=1); wider hot sets take
# the grouped kernel.
GEMM_MAX_WIDTH = 512
# Eager decode calls (CUDA, N <= EAGER_MAX_TOKENS, not in graph mode): an eager step is host-bound, so these take
# the path with the least host time. EAGER_DECODE_PATH "fused": one Triton launch per group call through the
# compiled kernel's launcher (FusedLaunch) on hot sets up to EAGER_FUSED_MAX_WIDTH = S*r, the dense torch form
# (four C++-dispatched launches per group call) on wider ones; "torch": the dense form everywhere. Host time added
# per routed linear, decode step of 8 Qwen3-1.7B-shaped blocks, r=16, 4 slots, H200 (benchmarks/RESULTS.md,
# "Kernels: a group call computes its members' outputs (issue 13, fifth pass)", the group call running its
# members' GEMMs): fused 17.07 us at N=1 and 16.91 at N=8, dense 62.13 and 58.05, PEFT-like unmerged LoRA 50.86
# and 51.41 (fourth pass, each layer its own GEMM: fused 43.3 / 45.5 and 18.9 / 40.5 over two runs).
# Graph mode takes the Triton kernels with the least GPU time instead (the one-launch kernel: 17.4-18.0 us of GPU
# time at r=16 N<=16, one projection or q/k/v, vs gather 8.5-14.7).
EAGER_MAX_TOKENS = 16
EAGER_DECODE_PATH = "fused"
# The one-launch kernel re-reads a projection's stacked A [S*r, in] in every program: at S*r = 64 (r=16, 4 slots)
# its GPU time is 17.4-18.0 us (d=4096), at S*r = 256 (r=64) 46-48 us; host time measured at S*r = 64 only, so
# wider hot sets take the dense form.
EAGER_FUSED_MAX_WIDTH = 64

# The CPU takes the stacked all-slots form (kernels/torch_ops.py: one shrink GEMM against every slot, one expand
# GEMM) whenever the rank columns it computes for nothing per token, (S - k) * r, stay within
# CPU_STACKED_WASTE_PER_CHOICE * k (the slot-grouped loop gathers and scatters each choice's row, which costs about
# that many rank columns), and otherwise while N * S * r * (in + out), summed over the call's projections, stays
# under CPU_DENSE_MAX_MACS (fixed costs); the slot-grouped loop above. One thread, the 2-core dev machine,
# 2026-12-02, us per call, stacked / dense bmm / loop (`python -m benchmarks.cpu_ops`): S=5 r=8 k=2 256->1024 N=32
# 396 / 460 / 1824, N=256 1476 / 2888 / 2987, N=2048 10754 / 42313 / 15968; k=1 1024->256 N=256 1243 / 1574 / 1805,
# N=2048 8868 / 14558 / 7585; S=8 r=16 2048->2048 k=1 N=32 2256 / 2233 / 2713, N=64 3145 / 4375 / 2726; k=2 N=16
# 2443 / 1585 / 2705, N=128 5050 / 6780 / 4533. The embedded model's decode at batch 32, top-2 (RESULTS.md, issue 13
# seventh pass): 493-513 tok/s with the dense bmm form, 556-608 with the stacked one.
CPU_STACKED_WASTE_PER_CHOICE = 32
CPU_DENSE_MAX_MACS = 24_000_000

# The whole routed linear of P projections sharing x as one GEMM (kernels/triton_linear.py: the stacked shrink,
# then every projection's base GEMM with the delta's expand as its last K steps) against the group call plus each
# base GEMM onto its delta (cuBLAS), from LINEAR_MIN_PROJECTIONS projections and up to LINEAR_MAX_TOKENS tokens on
# narrow hot sets (stacked width <= STACKED_MAX_WIDTH); eager decode calls keep the fused path (host time), graph
# mode takes this one down to one token. H200, 2026-12-02, r=16, 4 slots, k=1, graph replay, median us (RESULTS.md,
# issue 13 ninth pass), three base GEMMs / group call / one GEMM:
#   d=4096 q/k/v: N=1 50.3 / 59.1 / 50.4, N=16 50.8 / 63.4 / 49.9, N=128 48.7 / 61.6 / 54.0, N=256 59.9 / 74.3 /
#   66.9; N=512 78.9 / 99.9 / 115.0 and N=2048 272 / 309 / 337 (Triton's GEMM falls behind cuBLAS's as N grows)
#   Qwen3-1.7B q/k/v (2048 -> 2048/1024/1024): N=1 36.3 / 42.9 / 23.5, N=128 23.7 / 34.8 / 24.7, N=256 25.0 /
#   36.9 / 27.6
#   gate/up (2048 -> 6144 each, P=2): N=32 27.1 / 37.8 / 33.1, N=64 26.9 / 38.1 / 40.1, N=256 30.9 / 43.4 / 43.1:
#   no steady gain, so two projections keep the group call; one projection at d=4096, N=256: 24.4 / 35.9 / 42.6
# Decode-sized calls (N <= triton_linear.WIDE_DECODE_MAX_TOKENS; outside graph mode from 17, as eager calls up to
# EAGER_MAX_TOKENS take the fused path, above) take it for every projection count: with the
# decode tiles it beat cuBLAS onto the group call's deltas for one projection (o, down) and two (gate/up) at every
# Qwen3-1.7B and Emu3-8B shape, N = 1, 2, 16 (H200, 2026-12-05; triton_linear.py, DECODE_TILES): 0.71-0.96x the time;
# and at the 1.7B shape, N = 32 (H100, 2026-12-06; WIDE_DECODE_TILES): 0.81-0.93x.
LINEAR_MIN_PROJECTIONS = 3
LINEAR_MIN_TOKENS = 1
LINEAR_MAX_TOKENS = 256

PATHS = ("auto", "torch", "fused", "gather", "stacked", "grouped", "gemm")


def dense_fits(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, k: int) -> bool:
    """Does the torch path take an all-slots form for x [N, in], k choices per token, adapters A [S, r, in] (or
    [P, S, r, in] for P projections sharing x) and B [S, O, r]? On CUDA the dense form by tokens (its cost there is
    per launch); on the CPU the stacked form by its waste per token or its multiply-adds (see above)."""
    if x.is_cuda:
        return x.shape[0] <= EAGER_MAX_TOKENS
    num_slots, rank = B.shape[0], B.shape[2]
    if (num_slots - k) * rank <= CPU_STACKED_WASTE_PER_CHOICE * k:
        return True
    projections = A.shape[0] if A.dim() == 4 else 1
    return x.shape[0] * num_slots * rank * (projections * x.shape[1] + B.shape[1]) <= CPU_DENSE_MAX_MACS


def stacked_over_dense(x: torch.Tensor, B: torch.Tensor) -> bool:
    """Which all-slots torch form: the stacked one (CPU, N > 2 r) or the dense bmm one. The stacked form copies B
    [S, O, r] to slot-major (S*r*O elements, a transposing copy), the dense form writes and reads an [S, N, O]
    intermediate, so on the CPU the stacked form wins once N outgrows r (measured: CPU_DENSE_MAX_MACS's comment).
    CUDA's eager decode calls (N <= 16) keep the dense form, whose four launches were measured for host time."""
    return not x.is_cuda and x.shape[0] > 2 * B.shape[2]


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); float64 always takes the torch path."""
    return HAS_TRITON and (x.is_cuda or interpreting()) and x.dtype != torch.float64


def eager_decode(x: torch.Tensor) -> bool:
    """A decode-sized call (N <= EAGER_MAX_TOKENS) on CUDA outside graph mode: it takes the least host time."""
    return x.is_cuda and x.shape[0] <= EAGER_MAX_TOKENS and not graph_mode()


def loads_graph_path(x: torch.Tensor, path: str) -> bool:
    """Does this call, on path `path`, take an eager decode path where graph mode would take a Triton kernel? Then
    its caller runs the graph-mode path once per call shape too (graphs.load_graph_path), so that a graph captured
    after an eager warm-up by other means than capture_graph finds its kernels loaded."""
    return (path == "fused" or path == "torch") and eager_decode(x) and triton_usable(x)


def choose_path(x: torch.Tensor, k: int, has_meta: bool, num_slots: int, rank: int) -> str:
    """Path for x [N, in] with k choices per token over `num_slots` adapters of rank (r_max) `rank`.

    Shapes and graph mode only: never slot values, so a captured call replays the same path."""
    if not triton_usable(x):
        return "torch"
    n = x.shape[0]
    if eager_decode(x):  # eager decode call: least host time
        fits = stacked_width(num_slots, rank) <= EAGER_FUSED_MAX_WIDTH
        return "fused" if EAGER_DECODE_PATH == "fused" and fits else "torch"
    rows = n * k
    width = stacked_width(num_slots, rank)
    if width <= STACKED_MAX_WIDTH:  # narrow
        if rows * k <= GATHER_MAX_ROWS_STACKED:
            return "gather"
        if has_meta and k == 1:
            if n * rank <= STACKED_MAX_ROW_RANK_WITH_META:
                return "stacked"
        elif n * rank <= STACKED_MAX_ROW_RANK or \
                (n <= STACKED_TILED_MAX_TOKENS and measured_tiles(n, width) is not None):
            return "stacked"
        return "gemm" if k > 1 or (not has_meta and n <= GEMM_MAX_TOKENS) else "grouped"
    if rows * k * rank <= (GATHER_MAX_ROW_RANK_WITH_META if has_meta and k == 1 else GATHER_MAX_ROW_RANK):
        return "gather"
    if width <= STACKED_TOPK_MAX_WIDTH and n <= STACKED_TOPK_MAX_TOKENS and \
            (k > 1 or (not has_meta and measured_tiles(n, width) is not None)):
        return "stacked"
    if width <= GEMM_MAX_WIDTH and (k > 1 or (not has_meta and n <= GEMM_MAX_TOKENS)):
        return "gemm"
    return "grouped"


def choose_group_path(x: torch.Tensor, k: int, has_meta: bool, num_slots: int, rank: int, proj: int) -> str:
    """Path for `proj` projections sharing x: as choose_path, except
    - k = 1: the gather kernel only while N * r * P <= GROUP_GATHER_MAX_ROW_RANK (its work grows with P), then the
      stacked kernel on narrow hot sets and the grouped one on wide;
    - with prebuilt metadata and k = 1 the grouped kernel replaces the stacked one once N * r >
      GROUP_STACKED_MAX_ROW_RANK (the stacked shrink does S times the arithmetic, times P here). H200,
      2026-12-01, q/k/v at d=4096, r=16, delta + three base GEMMs, median us: N=256 grouped 75.2 vs stacked 80.5,
      N=2048 309.7 vs 365.5, N=8192 1284 vs 1354; but N=16 (delta alone) stacked 12.16 vs grouped 15.49.
    Shapes and graph mode only."""
    path = choose_path(x, k, has_meta, num_slots, rank)
    if proj == 1 or path == "torch" or path == "fused":
        return path
    if path == "gather" and k == 1 and x.shape[0] * rank * proj > GROUP_GATHER_MAX_ROW_RANK:  # measured for k = 1
        path = "stacked" if stacked_width(num_slots, rank) <= STACKED_MAX_WIDTH else "grouped"
    if k == 1 and has_meta and path == "stacked" and x.shape[0] * rank > GROUP_STACKED_MAX_ROW_RANK:
        return "grouped"
    return path


def fuses_base(x: torch.Tensor, num_slots: int, rank: int, proj: int) -> bool:
    """Does the routed linear of `proj` projections sharing x [N, in] (16-bit, the base weights' dtype) run as one
    GEMM with the delta inside (kernels/triton_linear.py)? Shapes and graph mode only; any k (the k choices only
    change the shrink's coefficients). The kernel has no backward: callers use it without autograd."""
    n = x.shape[0]
    least = 1 if n <= WIDE_DECODE_MAX_TOKENS else LINEAR_MIN_PROJECTIONS
    return (HAS_TRITON and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and least <= proj <= MAX_PROJECTIONS and LINEAR_MIN_TOKENS <= n <= LINEAR_MAX_TOKENS
            and stacked_width(num_slots, rank) <= STACKED_MAX_WIDTH
            and not eager_decode(x))


def reads_meta(x: torch.Tensor, k: int, A: torch.Tensor) -> bool:
    """Would the automatic path for this call (adapters A [S, r, in], or [P, S, r, in] for P projections sharing
    x) read a prebuilt RoutingMeta? On CUDA the grouped kernel (sorted rows) and the dense form (mixing matrix) do,
    so a caller building metadata once per forward skips it otherwise; on the CPU both forms do."""
    if triton_usable(x):
        proj, s, r = (A.shape[0], A.shape[1], A.shape[2]) if A.dim() == 4 else (1, A.shape[0], A.shape[1])
        return choose_group_path(x, k, True, s, r, proj) in ("grouped", "torch")
    return True  # the CPU's grouped loop reads the sorted rows, its dense form the mixing matrix


def routed_lora_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor | None = None,
                        meta: RoutingMeta | None = None, path: str = "auto") -> torch.Tensor:
    """No-autograd forward for slots [N, k]: the delta in x's dtype, or `out` after out += delta."""
    if path == "auto":
        path = choose_path(x, slots.shape[1], meta is not None, A.shape[0], A.shape[1])
        if loads_graph_path(x, path):
            load_graph_path(call_key(x, "lora", A, B, slots, weights, scale, out, meta is None),
                            lambda: routed_lora_forward(x, A, B, slots, weights, scale,
                                                        None if out is None else out.clone(), meta))
    elif path != "torch":
        _check_path(x, path)
    if path == "torch":
        if dense_fits(x, A, B, slots.shape[1]):
            all_slots = routed_lora_torch_stacked if stacked_over_dense(x, B) else routed_lora_torch_dense
            delta = all_slots(x, A, B, slots, weights, scale, meta, out)
            return delta if out is not None else delta.to(x.dtype)
        delta = routed_lora_torch(x, A, B, slots, weights, scale, meta)
        if out is not None:
            return out.add_(delta)
        return delta.to(x.dtype)
    if path == "gather":
        return gather_lora(x, A, B, slots, weights, scale, out)
    if path == "gemm":
        return gemm_lora(x, A, B, slots, weights, scale, out)
    if path == "stacked" or path == "fused":
        return stacked_lora(x, A, B, slots, weights, scale, out, fused=path == "fused")
    return grouped_lora(x, A, B, slots, weights, scale, out, meta)  # (_check_path refused unknown paths)


def routed_lora_group_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                              weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...],
                              meta: RoutingMeta | None = None, path: str = "auto") -> list[torch.Tensor]:
    """No-autograd forward of P projections sharing x: A [P, S, r, in], B [S, O, r] (projection p's output columns
    bounds[p]:bounds[p+1]), scale [P, S], slots [N, k]. Returns P fresh deltas [N, width_p] in x's dtype.
    Every Triton path shrinks once for all projections (x read once) and expands all of them in one launch; the
    CPU's grouped loop runs one projection at a time. The fused path here makes a FusedLaunch per call (through
    JITFunction.run); a caller calling often keeps one (routing/lora.py: ProjectionGroup)."""
    k = slots.shape[1]
    if path == "auto":
        path = choose_group_path(x, k, meta is not None, A.shape[1], A.shape[2], A.shape[0])
        if loads_graph_path(x, path):
            load_graph_path(call_key(x, "group", A, B, slots, weights, scale, tuple(bounds), meta is None),
                            lambda: routed_lora_group_forward(x, A, B, slots, weights, scale, bounds, meta))
    elif path != "torch":
        _check_path(x, path)
    if path == "fused":
        delta = FusedLaunch(A, B, scale, bounds)(x, slots, weights)
        return [delta] if A.shape[0] == 1 else list(delta.split(_widths(tuple(bounds)), 1))
    if path == "torch" and dense_fits(x, A, B, k):
        all_slots = routed_lora_torch_group_stacked if stacked_over_dense(x, B) else routed_lora_torch_group_dense
        deltas = all_slots(x, A, B, slots, weights, scale, bounds, meta)
        return deltas if deltas[0].dtype == x.dtype else [d.to(x.dtype) for d in deltas]
    bounds = tuple(bounds)
    if path == "gemm":
        return gemm_lora_group(x, A, B, slots, weights, scale, bounds)
    if path == "gather" or path == "grouped" or (path == "stacked" and stacked_width(A.shape[1], A.shape[2]) <= MAX_WIDTH):
        if path == "gather":
            flat = gather_lora_group(x, A, B, slots, weights, scale, bounds)
        elif path == "grouped":
            flat = grouped_lora_group(x, A, B, slots, weights, scale, bounds, meta)
        else:
            flat = stacked_lora_group(x, A, B, slots, weights, scale, bounds)
        return flat_blocks(flat, x.shape[0], bounds)
    spans = list(zip(bounds, bounds[1:]))
    return [routed_lora_forward(x, A[p], B[:, lo:hi], slots, weights, scale[p], None, meta, path)
            for p, (lo, hi) in enumerate(spans)]


def flat_blocks(flat: torch.Tensor, n: int, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """The P outputs a group kernel wrote into one flat buffer: projection p's the contiguous [N, width_p] block at
    N * bounds[p]."""
    if len(bounds) == 2:
        return [flat.view(n, bounds[1])]
    widths = _widths(bounds)
    return [block.view(n, wd) for block, wd in zip(flat.split([n * wd for wd in widths]), widths)]


def _check_path(x: torch.Tensor, path: str) -> None:
    """An explicit path other than "torch": a known one, on tensors Triton can run."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
    check_triton_device(x, path)


@functools.lru_cache(maxsize=256)
def _widths(bounds: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in zip(bounds, bounds[1:]))
