"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU.

The interpreter tests (test_kernels_triton.py) run the kernels' arithmetic, but the interpreter accepts programs
the GPU compiler refuses: an `if` whose branches give one name tensors of different shapes ran under
TRITON_INTERPRET=1 and failed to compile on the H200 (RESULTS.md, issue 13 seventh pass), which cost a lent-GPU run.
triton.compile lowers a kernel for a named target without a driver (ptxas ships in the triton wheel), so each
kernel is compiled here once, for one typical configuration per code path (constexpr values as the launchers pass
them on the GPU; the two-phase kernels with programmatic dependent launch's waits and triggers, as sm_90 runs them).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import molora.kernels.metadata as metadata  # noqa: E402
import molora.kernels.stacked_gemm as stacked_gemm  # noqa: E402
import molora.kernels.triton_gather as gather  # noqa: E402
import molora.kernels.triton_grouped as grouped  # noqa: E402
import molora.kernels.triton_linear as linear  # noqa: E402
import molora.kernels.triton_stacked as stacked  # noqa: E402
from molora.kernels.triton_common import interpreting, tl  # noqa: E402

BF16 = {"DOT_DTYPE": tl.bfloat16, "PRECISION": "tf32"}
# name: (kernel, constexpr values)
KERNELS = {
    "gather_shrink": (gather._bgmv_shrink_kernel, dict(K=2, P=1, BLOCK_R=16, BLOCK_K=128, PDL=True)),
    "gather_expand": (gather._bgmv_expand_kernel, dict(K=2, P=3, HAS_W=True, ACCUMULATE=False, BLOCKS=True,
                                                       SPLIT_K=4, SPLIT_PAD=4, BLOCK_R=16, BLOCK_N=128, PDL=True)),
    "stacked_shrink": (stacked._stacked_shrink_kernel, dict(K=2, P=1, HAS_W=True, **BF16, SR_PAD=256, R_PAD=64,
                                                            BLOCK_M=16, BLOCK_C=64, BLOCK_K=128, PDL=True)),
    "stacked_expand": (stacked._stacked_expand_kernel, dict(P=1, ACCUMULATE=True, BLOCKS=False, **BF16, SR_PAD=256,
                                                            R_PAD=64, BLOCK_M=16, BLOCK_N=128, PDL=True)),
    "stacked_fused": (stacked._stacked_fused_kernel, dict(K=1, HAS_W=False, ACCUMULATE=True, **BF16, SR_PAD=64,
                                                          R_PAD=16, BLOCK_M=16, BLOCK_K=256, BLOCK_N=64)),
    "grouped_shrink_sets": (grouped._grouped_shrink_kernel, dict(K=2, KS=2, SETS=True, P=1, **BF16, S_PAD=32,
                                                                 BLOCK_M=32, BLOCK_R=64, BLOCK_K=128, PDL=True)),
    "grouped_expand_sets": (grouped._grouped_expand_kernel, dict(K=2, KS=2, SETS=True, P=1, HAS_W=True, MODE=0,
                                                                 BLOCKS=False, **BF16, S_PAD=32, BLOCK_M=32,
                                                                 BLOCK_R=64, BLOCK_N=128, PDL=True)),
    "grouped_expand_atomic": (grouped._grouped_expand_kernel, dict(K=2, KS=1, SETS=False, P=3, HAS_W=True, MODE=2,
                                                                   BLOCKS=True, **BF16, S_PAD=16, BLOCK_M=16,
                                                                   BLOCK_R=16, BLOCK_N=128, PDL=False)),
    "linear_qkv": (linear._stacked_linear_kernel, dict(P=3, **BF16, SR_PAD=64, R_PAD=16, BLOCK_M=64, BLOCK_N=64,
                                                       BLOCK_K=64, GROUP_M=32, EVEN_K=True, PDL=True)),
    "sort_count": (metadata._count_keys_kernel, dict(SETS_K=2, BLOCK=128, S_PAD=32)),
    "sort_place": (metadata._place_rows_kernel, dict(SETS_K=0, BLOCK=128, S_PAD=8, CHUNK_TILE=64)),
    "gemm_prepare": (stacked_gemm._prepare_kernel, dict(K=2, HAS_W=True, BLOCK_M=32, BLOCK_C=128, R_PAD=64,
                                                        BLOCK_O=64)),
}
# pointer arguments by name (everything else not constexpr is an int32 scalar)
POINTERS = {"slot_ptr": "*i32", "rows_ptr": "*i32", "offsets_ptr": "*i32", "counts_ptr": "*i32", "w_ptr": "*fp32",
            "scale_ptr": "*fp32", "part_ptr": "*fp32"}


@pytest.mark.skipif(interpreting(), reason="compiles GPU code: run without TRITON_INTERPRET")
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm90(name):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, constexprs = KERNELS[name]
    names = kernel.arg_names
    assert set(constexprs) <= set(names), set(constexprs) - set(names)
    signature = {}
    for arg in names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = POINTERS.get(arg, "*bf16")
        else:
            signature[arg] = "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
