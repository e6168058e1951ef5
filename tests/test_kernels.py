"""routed_lora / routed_lora_topk: the torch CPU path and the dispatcher against the reference, autograd,
input errors, and no host synchronisation in the metadata builder. (Triton kernels: test_kernels_triton.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import molora.kernels.dispatch as dispatch
from molora.kernels import (
    KernelInputError,
    build_routing_meta,
    routed_lora,
    routed_lora_reference,
    routed_lora_topk,
    routed_lora_topk_reference,
)
from molora.kernels.metadata import build_routing_meta_torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-6}  # the reference itself accumulates fp64 in fp32


def make(n, d_in, d_out, s, r, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g).to(dtype)
    A = (torch.randn(s, r, d_in, generator=g) / d_in ** 0.5).to(dtype)
    B = torch.randn(s, d_out, r, generator=g).to(dtype)
    scale = torch.rand(s, generator=g) + 0.5
    return x, A, B, scale, g


def rel_err(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,d_in,d_out", [(1, 33, 29), (37, 64, 48), (129, 17, 31)])
def test_routed_lora_cpu_matches_reference(dtype, n, d_in, d_out):
    x, A, B, scale, g = make(n, d_in, d_out, 4, 8, dtype)
    slot = torch.randint(-1, 4, (n,), generator=g)
    y = routed_lora(x, A, B, slot, scale)
    assert y.dtype == dtype and y.shape == (n, d_out)
    assert rel_err(y, routed_lora_reference(x, A, B, slot, scale)) <= TOL[dtype]


@pytest.mark.parametrize("pattern", ["none", "one", "every"])
def test_routed_lora_slot_patterns(pattern):
    n, s = 23, 5
    x, A, B, scale, g = make(n, 24, 20, s, 8)
    slot = {"none": torch.full((n,), -1), "one": torch.full((n,), 2),
            "every": torch.arange(n) % s}[pattern].int()
    y = routed_lora(x, A, B, slot, scale)
    if pattern == "none":
        assert torch.equal(y, torch.zeros_like(y))
    assert rel_err(y, routed_lora_reference(x, A, B, slot, scale)) <= TOL[torch.float32] or pattern == "none"


def test_ranks_below_rmax_zero_padded_equal_the_small_rank_adapter():
    x, A, B, scale, g = make(9, 24, 20, 2, 16)
    A[0, 5:] = 0
    B[0, :, 5:] = 0
    slot = torch.zeros(9, dtype=torch.long)
    small = (x @ A[0, :5].t() @ B[0, :, :5].t()) * scale[0]
    assert rel_err(routed_lora(x, A, B, slot, scale), small) <= 1e-5


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_reference_with_repeated_slots(k, dtype):
    n, s = 31, 3
    x, A, B, scale, g = make(n, 40, 24, s, 8, dtype)
    slots = torch.randint(-1, s, (n, k), generator=g)
    slots[:, -1] = slots[:, 0]  # repeated slot within a token
    weights = torch.rand(n, k, generator=g)
    y = routed_lora_topk(x, A, B, slots, weights, scale)
    assert y.dtype == dtype
    assert rel_err(y, routed_lora_topk_reference(x, A, B, slots, weights, scale)) <= TOL[dtype]


def test_out_variant_adds_in_place_and_returns_out():
    x, A, B, scale, g = make(17, 24, 20, 3, 8)
    slot = torch.randint(-1, 3, (17,), generator=g)
    base = torch.randn(17, 20, generator=g)
    out = base.clone()
    res = routed_lora(x, A, B, slot, scale, out=out)
    assert res is out
    assert rel_err(out - base, routed_lora_reference(x, A, B, slot, scale)) <= 1e-5
    slots, w = torch.randint(-1, 3, (17, 2), generator=g), torch.rand(17, 2, generator=g)
    out = base.clone()
    routed_lora_topk(x, A, B, slots, w, scale, out=out)
    assert rel_err(out - base, routed_lora_topk_reference(x, A, B, slots, w, scale)) <= 1e-5


def test_empty_batch():
    x, A, B, scale, _ = make(0, 24, 20, 3, 8)
    assert routed_lora(x, A, B, torch.zeros(0, dtype=torch.long), scale).shape == (0, 20)


def test_gradcheck_topk_float64_x_A_B_weights():
    x, A, B, scale, g = make(7, 6, 5, 3, 4, torch.float64)
    slots = torch.randint(-1, 3, (7, 3), generator=g)
    slots[0] = torch.tensor([1, 1, -1])
    w = torch.rand(7, 3, generator=g, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (x, A, B, w)]
    assert torch.autograd.gradcheck(lambda x, A, B, w: routed_lora_topk(x, A, B, slots, w, scale.double()),
                                    inputs)


def test_gradcheck_routed_lora_float64():
    x, A, B, scale, g = make(8, 6, 5, 3, 4, torch.float64)
    slot = torch.randint(-1, 3, (8,), generator=g)
    inputs = [t.clone().requires_grad_() for t in (x, A, B)]
    assert torch.autograd.gradcheck(lambda x, A, B: routed_lora(x, A, B, slot, scale.double()), inputs)


def test_grad_through_out_variant_matches_reference_autograd():
    x, A, B, scale, g = make(11, 12, 10, 3, 4)
    slots, w = torch.randint(-1, 3, (11, 2), generator=g), torch.rand(11, 2, generator=g)
    ours = [t.clone().requires_grad_() for t in (x, A, B, w)]
    theirs = [t.clone().requires_grad_() for t in (x, A, B, w)]
    base = torch.randn(11, 10, generator=g, requires_grad=True)
    out = base * 1.0  # a non-leaf base output, as in a routed layer
    routed_lora_topk(*ours[:3], slots, ours[3], scale, out=out).square().sum().backward()
    (base.detach() + routed_lora_topk_reference(*theirs[:3], slots, theirs[3], scale)).square().sum().backward()
    for a, b in zip(ours, theirs):
        assert rel_err(a.grad, b.grad) <= 1e-5
    assert rel_err(base.grad, 2 * out.detach()) <= 1e-6


@pytest.mark.parametrize("bad,match", [
    (lambda x, A, B, s, c: (x[0], A, B, s, c), "x must be"),
    (lambda x, A, B, s, c: (x, A[:, :, :-1], B, s, c), "A's last dim"),
    (lambda x, A, B, s, c: (x, A, B[:, :, :-1], s, c), "B must be"),
    (lambda x, A, B, s, c: (x, A, B, s.float(), c), "int32 or int64"),
    (lambda x, A, B, s, c: (x, A, B, s[:-1], c), "slots must be"),
    (lambda x, A, B, s, c: (x, A, B, s + 10, c), r"slot indices must lie in \[-1, 2\]"),
    (lambda x, A, B, s, c: (x, A, B, s, c[:2]), "scale must be"),
    (lambda x, A, B, s, c: (x.int(), A, B, s, c), "floating"),
])
def test_bad_input_gets_a_clear_error(bad, match):
    x, A, B, scale, g = make(5, 8, 6, 3, 4)
    slot = torch.randint(0, 3, (5,), generator=g)
    with pytest.raises(KernelInputError, match=match):
        routed_lora(*bad(x, A, B, slot, scale))


def test_bad_topk_weights_and_meta_are_refused():
    x, A, B, scale, g = make(5, 8, 6, 3, 4)
    slots = torch.randint(0, 3, (5, 2), generator=g)
    with pytest.raises(KernelInputError, match="weights must match"):
        routed_lora_topk(x, A, B, slots, torch.rand(5, 3), scale)
    with pytest.raises(KernelInputError, match="rebuild it"):
        routed_lora_topk(x, A, B, slots, torch.rand(5, 2), scale, meta=build_routing_meta(slots[:, :1], 3))
    with pytest.raises(KernelInputError, match="out must be"):
        routed_lora(x, A, B, slots[:, 0], scale, out=torch.zeros(5, 7))


def test_dispatcher_picks_by_shape_only(monkeypatch):
    x = torch.zeros(3, 4)
    assert dispatch.choose_path(x, 1, False, 4, 16) == "torch"  # CPU, not interpreting
    monkeypatch.setattr(dispatch, "triton_usable", lambda _x: True)

    def pick(n, k=1, meta=False, s=4, r=16):
        return dispatch.choose_path(torch.zeros(n, 4), k, meta, s, r)
    # few rows: gather, while rows * k <= GATHER_MAX_ROWS_STACKED (narrow) or rows * k * r <= GATHER_MAX_ROW_RANK
    # (wide; GATHER_MAX_ROW_RANK_WITH_META when the grouped kernel would get prebuilt metadata, k = 1)
    assert pick(dispatch.GATHER_MAX_ROWS_STACKED) == "gather"
    assert pick(dispatch.GATHER_MAX_ROWS_STACKED // 4, k=2) == "gather"
    assert pick(dispatch.GATHER_MAX_ROWS_STACKED // 4 + 1, k=2) == "stacked"
    assert pick(dispatch.GATHER_MAX_ROW_RANK // 64, r=64) == "gather"
    assert pick(dispatch.GATHER_MAX_ROW_RANK // 64 + 1, r=64) == "stacked"  # (wide tiles, see below)
    assert pick(dispatch.GATHER_MAX_ROW_RANK // 32 + 1, r=32) == "gemm"
    assert pick(dispatch.GATHER_MAX_ROW_RANK_WITH_META // 64, r=64, meta=True) == "gather"
    assert pick(dispatch.GATHER_MAX_ROW_RANK_WITH_META // 64 + 1, r=64, meta=True) == "grouped"
    assert pick(dispatch.GATHER_MAX_ROW_RANK // (64 * 4), k=2, r=64) == "gather"
    assert pick(dispatch.GATHER_MAX_ROW_RANK // (64 * 4) + 1, k=2, r=64) == "stacked"
    # a narrow hot set takes the stacked kernel above the gather rows, for any k
    assert pick(dispatch.GATHER_MAX_ROWS_STACKED + 1) == "stacked"
    assert pick(dispatch.GATHER_MAX_ROWS_STACKED, k=4) == "stacked"
    # ... except k=1 with prebuilt metadata once N * r is large, where the grouped kernel wins
    n_meta = dispatch.STACKED_MAX_ROW_RANK_WITH_META // 16
    assert pick(n_meta, meta=True) == "stacked"
    assert pick(n_meta + 1, meta=True) == "grouped"
    assert pick(n_meta + 1) == "stacked"
    assert pick(n_meta + 1, k=2, meta=True) == "stacked"  # top-k reads no metadata
    # without it, once N * r is larger still: STACKED_MAX_ROW_RANK, or up to STACKED_TILED_MAX_TOKENS on a stack with
    # measured tiles (64 columns: r = 16 on 4 slots, r = 8 on 8)
    assert pick(dispatch.STACKED_TILED_MAX_TOKENS) == "stacked"
    assert pick(dispatch.STACKED_TILED_MAX_TOKENS, s=8, r=8) == "stacked"
    assert pick(dispatch.STACKED_TILED_MAX_TOKENS + 1) == "grouped"  # (and past GEMM_MAX_TOKENS, below)
    assert pick(dispatch.STACKED_MAX_ROW_RANK // 8, r=8) == "stacked"  # 32 columns: no measured tiles
    assert pick(dispatch.STACKED_MAX_ROW_RANK // 8 + 1, r=8) == "gemm"  # (k = 1 without metadata: cuBLAS, below)
    assert pick(dispatch.GEMM_MAX_TOKENS, r=8) == "gemm"
    assert pick(dispatch.GEMM_MAX_TOKENS + 1) == "grouped"
    assert pick(dispatch.GEMM_MAX_TOKENS, r=8, meta=True) == "grouped"
    assert pick(dispatch.STACKED_TILED_MAX_TOKENS, k=2, meta=True) == "stacked"
    assert pick(dispatch.STACKED_TILED_MAX_TOKENS + 1, k=2, meta=True) == "gemm"  # top-k: cuBLAS
    assert pick(2 * n_meta, r=8, meta=True) == "stacked"
    # wide hot sets: grouped for k=1 with metadata; up to STACKED_TOPK_MAX_WIDTH columns top-k (and k=1 without
    # metadata, where the stacked kernel has measured wide tiles) the stacked kernel up to STACKED_TOPK_MAX_TOKENS
    # tokens, then the gemm path (k=1 up to GEMM_MAX_TOKENS); on wider hot sets top-k takes the gemm path up to
    # GEMM_MAX_WIDTH stacked columns, the grouped kernel's slot-set tiles beyond
    assert pick(300, s=4, r=32, meta=True) == "grouped"
    assert pick(300, s=4, r=32) == "gemm"
    assert pick(dispatch.GEMM_MAX_TOKENS + 1, s=4, r=64) == "grouped"
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS, s=4, r=64) == "stacked"  # measured wide tiles, k = 1, no metadata
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS, s=4, r=64, meta=True) == "grouped"
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS, s=4, r=32, meta=True) == "grouped"
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS, k=2, s=4, r=64) == "stacked"
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS + 1, k=2, s=4, r=64) == "gemm"
    assert pick(dispatch.STACKED_TOPK_MAX_TOKENS + 1, k=4, s=4, r=64) == "gemm"
    assert pick(300, k=2, s=8, r=32) == "gemm"
    assert pick(8, k=2, s=4, r=128) == "gemm"
    assert pick(3000, k=2, s=4, r=128) == "gemm"
    assert pick(3000, k=4, s=8, r=64) == "gemm"
    assert pick(300, k=2, s=8, r=128) == "grouped"  # 1024 columns: wider than GEMM_MAX_WIDTH
    assert pick(300, s=8, r=128) == "grouped"
    assert pick(dispatch.GEMM_MAX_TOKENS, s=4, r=128) == "gemm"
    assert pick(dispatch.GEMM_MAX_TOKENS + 1, s=4, r=128) == "grouped"  # k = 1 past GEMM_MAX_TOKENS


def test_group_path_prefers_the_grouped_kernel_with_metadata(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_usable", lambda _x: True)
    x = torch.zeros(200, 4)
    assert dispatch.choose_path(x, 1, True, 4, 8) == "stacked"
    assert dispatch.choose_group_path(x, 1, True, 4, 8, 3) == "grouped"  # q/k/v: x read once, no S-fold shrink
    assert dispatch.choose_group_path(x, 2, True, 4, 8, 3) == "stacked"  # top-k keeps the k-free kernel
    assert dispatch.choose_group_path(x, 1, True, 4, 8, 1) == "stacked"


def test_measured_tiles_are_looked_up_by_shape(monkeypatch):
    """The GPU tile tables (the interpreter has its own tiny tiles): the stacked kernel's by (columns, group or not)
    with a group on a stack without group tiles taking the one-projection ones; the grouped kernel's few-row tiles
    for one projection at k = 1 only, everything else as before."""
    import molora.kernels.triton_grouped as grouped_mod
    import molora.kernels.triton_stacked as stacked_mod
    monkeypatch.setattr(stacked_mod, "interpreting", lambda: False)
    monkeypatch.setattr(grouped_mod, "interpreting", lambda: False)
    stacked_mod.stacked_config.cache_clear()
    grouped_mod.grouped_config.cache_clear()
    try:
        assert stacked_mod.measured_tiles(256, 64) == stacked_mod.STACKED_TILES[(64, False)][1][1]
        assert stacked_mod.measured_tiles(2048, 64, proj=3) == stacked_mod.STACKED_TILES[(64, True)][2][1]
        for proj in (1, 2, 3):  # up to 32 tokens the expand has its own tiles; the shrink's (and warps) stay
            small, wide = stacked_mod.measured_tiles(32, 64, proj), stacked_mod.measured_tiles(256, 64, proj)
            assert small != wide and small[:4] + small[7:] == wide[:4] + wide[7:]
            assert stacked_mod.measured_tiles(1, 64, proj) == small and stacked_mod.measured_tiles(33, 64, proj) == wide
        assert stacked_mod.measured_tiles(256, 256, proj=3) == stacked_mod.STACKED_TILES[(256, False)][1][1]
        assert stacked_mod.measured_tiles(257, 256) is None and stacked_mod.measured_tiles(8, 128) is None
        cfg = stacked_mod.stacked_config(2048, 4096, 4096, 64, 3)
        assert (cfg["EXPAND_M"], cfg["BLOCK_N"], cfg["OUT_SPLIT"], cfg["num_warps"]) == (128, 64, 8, 4)
        few = grouped_mod.grouped_config(32, 4096, 4096, 4, 64)
        assert (few["BLOCK_M"], few["OUT_SPLIT"], few["num_warps"]) == (16, 32, 8)
        assert grouped_mod.grouped_config(32, 4096, 1024, 4, 64)["OUT_SPLIT"] == 1024 // few["BLOCK_N"]
        for cfg in (grouped_mod.grouped_config(32, 4096, 4096, 4, 64, proj=3),  # a group: the 256-row tiles
                    grouped_mod.grouped_config(32, 4096, 4096, 4, 16),  # a rank without few-row tiles
                    grouped_mod.grouped_config(65, 4096, 4096, 4, 64)):
            assert (cfg["BLOCK_M"], cfg["OUT_SPLIT"], cfg["num_warps"]) == (16, 8, 4)
        assert grouped_mod.grouped_config(32, 4096, 1024, 4, 64, proj=3)["OUT_SPLIT"] == 2  # 512-column steps
        sets = grouped_mod.grouped_config(32, 4096, 4096, 15, 64, 1, 2)  # top-2 slot sets: their own table
        assert (sets["BLOCK_M"], sets["OUT_SPLIT"], sets["SPLIT_K"]) == (16, 8, 16)
    finally:
        stacked_mod.stacked_config.cache_clear()
        grouped_mod.grouped_config.cache_clear()


def test_group_path_at_decode_sizes_leaves_the_gather_kernel_as_projections_multiply(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_usable", lambda _x: True)  # CPU tensors: outside the dense eager rule

    def pick(n, r, proj, k=1):
        return dispatch.choose_group_path(torch.zeros(n, 4), k, True, 4, r, proj)
    assert pick(4, 16, 3) == "gather" and pick(16, 16, 1) == "gather"  # rows * r * P <= GROUP_GATHER_MAX_ROW_RANK
    assert pick(16, 16, 3) == "stacked"  # narrow: the stacked kernel (12.2 us vs gather 14.0, grouped 15.5)
    assert pick(1, 64, 3) == "gather" and pick(4, 64, 3) == "grouped"  # wide: the grouped kernel
    assert pick(32, 16, 3) == "grouped"  # N * r > GROUP_STACKED_MAX_ROW_RANK with metadata: grouped, as before
    assert pick(1, 64, 3, k=2) == "gather"  # top-k keeps the single-projection rule (measured there)


def test_metadata_builder_is_sync_free_and_sorted(monkeypatch):
    def forbidden(*_a, **_k):
        raise AssertionError("host synchronisation in the metadata builder")
    slots = torch.randint(-1, 4, (50, 2), generator=torch.Generator().manual_seed(3))
    want_counts = [int((slots == s).sum()) for s in range(4)]
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    meta = build_routing_meta(slots, 4, torch.rand(50, 2))
    assert meta._rows is None and not meta._mixing  # lazy: a forward builds only what its layers read
    meta.rows, meta.offsets, meta.mixing(torch.bfloat16)  # noqa: B018
    monkeypatch.undo()
    flat = slots.reshape(-1)
    assert meta.offsets.tolist()[1:5] == list(torch.tensor(want_counts).cumsum(0))
    assert meta.offsets[-1].item() == flat.numel()
    assert torch.equal(torch.sort(meta.rows.long()).values, torch.arange(flat.numel()))
    keys = torch.where(flat < 0, 4, flat)[meta.rows.long()]
    assert torch.all(keys[1:] >= keys[:-1])
    again = build_routing_meta_torch(slots, 4)
    assert torch.equal(meta.rows, again.rows)


def test_kernels_package_never_imports_models_or_routing():
    for path in (Path(__file__).resolve().parents[1] / "molora" / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("models", "routing", "app") for n in names), path


def test_stacked_kernel_refuses_stacks_wider_than_its_tiles():
    from molora.kernels.triton_stacked import MAX_WIDTH, stacked_lora
    x, A, B, scale, _ = make(2, 8, 8, 4, MAX_WIDTH // 4 + 1)
    with pytest.raises(KernelInputError, match=f"at most {MAX_WIDTH} stacked columns"):
        stacked_lora(x, A, B, torch.zeros(2, 1, dtype=torch.int32), None, scale)
    # S*r = 240 fits, but each slot's 48 rows take 64 columns (r padded to a power of two): 5 * 64 > 256
    x, A, B, scale, _ = make(2, 8, 8, 5, 48)
    with pytest.raises(KernelInputError, match="got S=5, r=48: 512"):
        stacked_lora(x, A, B, torch.zeros(2, 1, dtype=torch.int32), None, scale)



def test_fused_launcher_refuses_more_projections_than_its_kernel_reads():
    pytest.importorskip("triton")
    from molora.kernels.triton_common import MAX_PROJECTIONS
    from molora.kernels.triton_stacked import FusedLaunch
    p_count = MAX_PROJECTIONS + 1
    A, B, scale = torch.zeros(p_count, 2, 4, 8), torch.zeros(2, 4 * p_count, 4), torch.zeros(p_count, 2)
    with pytest.raises(KernelInputError, match=f"at most {MAX_PROJECTIONS} projections"):
        FusedLaunch(A, B, scale, tuple(range(0, 4 * p_count + 1, 4)))


@pytest.mark.skipif(dispatch.interpreting(), reason="the interpreter runs Triton paths on CPU tensors")
@pytest.mark.parametrize("path", ["fused", "stacked", "gather", "grouped"])
def test_explicit_triton_path_on_cpu_tensors_names_the_path_and_the_device(path):
    from molora.kernels import routed_lora_group
    x, A, B, scale, _ = make(3, 16, 8, 2, 4)
    slot = torch.tensor([0, 1, -1])
    with pytest.raises(KernelInputError, match=f"path='{path}'.*x is on cpu"):
        routed_lora(x, A, B, slot, scale, path=path)
    with pytest.raises(KernelInputError, match=f"path='{path}'.*x is on cpu"):
        routed_lora_group(x, A[None], B, slot, None, scale[None], (0, 8), path=path)
    with pytest.raises(ValueError, match="unknown path"):
        routed_lora(x, A, B, slot, scale, path="fast")
    if path == "fused" and dispatch.HAS_TRITON:  # the group's launcher, called directly
        from molora.kernels.triton_stacked import FusedLaunch
        with pytest.raises(KernelInputError, match="path='fused'.*x is on cpu"):
            FusedLaunch(A[None], B, scale[None], (0, 8))(x, slot[:, None], None)

# --- projections sharing x (routed_lora_group) -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(3, 1), (5, 3), (40, 1), (33, 2)])  # the dense form (few rows) and the loop
def test_group_cpu_matches_each_projection_reference(dtype, n, k):
    from molora.kernels import routed_lora_group, routed_lora_group_reference

    g = torch.Generator().manual_seed(n * 10 + k)
    outs = (20, 8, 8)
    bounds = (0, 20, 28, 36)
    x = torch.randn(n, 24, generator=g).to(dtype)
    A = (torch.randn(3, 4, 8, 24, generator=g) / 5).to(dtype)
    B = torch.randn(4, 36, 8, generator=g).to(dtype)
    scale = torch.rand(3, 4, generator=g) + 0.5
    slots = torch.randint(-1, 4, (n, k), generator=g)
    weights = torch.rand(n, k, generator=g) if k > 1 else None
    got = routed_lora_group(x, A, B, slots, weights, scale, bounds)
    want = routed_lora_group_reference(x, A, B, slots, weights, scale, bounds)
    assert [tuple(t.shape) for t in got] == [(n, o) for o in outs]
    for y, ref in zip(got, want):
        assert y.dtype == dtype and rel_err(y, ref) <= TOL[dtype]


def test_group_rejects_bad_bounds_and_scale():
    from molora.kernels import routed_lora_group

    x, A, B, scale, _ = make(4, 16, 12, 3, 4)
    A2, B2, slots = torch.stack([A, A]), torch.cat([B, B], 1), torch.zeros(4, dtype=torch.long)
    with pytest.raises(KernelInputError, match="bounds"):
        routed_lora_group(x, A2, B2, slots, None, torch.stack([scale, scale]), (0, 12, 20))
    with pytest.raises(KernelInputError, match="scale"):
        routed_lora_group(x, A2, B2, slots, None, scale, (0, 12, 24))
    with pytest.raises(KernelInputError, match=r"\[P, S, r, in\]"):
        routed_lora_group(x, A, B, slots, None, scale, (0, 12))


# --- the dense form as the GPU runs it (x's dtype), and eager vs graph-mode dispatch ------------------------------

@pytest.fixture
def native_dense(monkeypatch):
    """Run the dense form in x's dtype, as it runs on CUDA (on the CPU it computes in float32)."""
    import molora.kernels.torch_ops as torch_ops
    monkeypatch.setattr(torch_ops, "dense_dtype", lambda x: x.dtype)


DENSE_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}  # x's dtype holds each product


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (16, 2), (5, 4), (0, 1)])
def test_dense_form_in_x_dtype_matches_reference(native_dense, dtype, n, k):
    from molora.kernels.torch_ops import routed_lora_torch_dense

    x, A, B, scale, g = make(n, 40, 24, 4, 8, dtype, seed=n + 10 * k)
    scale = scale.to(dtype)
    slots = torch.randint(-1, 4, (n, k), generator=g)
    weights = torch.rand(n, k, generator=g) if k > 1 else None
    want = routed_lora_topk_reference(x, A, B, slots, weights if k > 1 else torch.ones(n, k), scale).double()
    for meta in (None, build_routing_meta(slots, 4, weights)):
        got = routed_lora_torch_dense(x, A, B, slots, weights, scale, meta)
        assert got.dtype == dtype and got.shape == (n, 24)
        if n:
            assert rel_err(got, want) <= DENSE_TOL[dtype]
        base = torch.randn(n, 24, generator=g).to(dtype)
        out = base.clone()
        assert routed_lora_torch_dense(x, A, B, slots, weights, scale, meta, out) is out  # baddbmm_ into out
        if n:
            assert rel_err(out.double() - base.double(), want) <= 2 * DENSE_TOL[dtype]
    if n:  # a slot beyond S counts as -1 (no adapter), as in the kernels
        beyond = torch.where(slots < 0, 4, slots)
        assert torch.equal(routed_lora_torch_dense(x, A, B, beyond, weights, scale),
                           routed_lora_torch_dense(x, A, B, slots, weights, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (9, 2), (16, 1)])
def test_dense_group_in_x_dtype_matches_each_projection_and_adds_in_place(native_dense, dtype, n, k):
    from molora.kernels import routed_lora_group_reference
    from molora.kernels.dispatch import routed_lora_group_forward

    g = torch.Generator().manual_seed(n + k)
    bounds = (0, 20, 28, 40)
    x = torch.randn(n, 24, generator=g).to(dtype)
    A = (torch.randn(3, 4, 8, 24, generator=g) / 5).to(dtype)
    B = torch.randn(4, 40, 8, generator=g).to(dtype)
    scale = (torch.rand(3, 4, generator=g) + 0.5).to(dtype)
    slots = torch.randint(-1, 4, (n, k), generator=g)
    weights = torch.rand(n, k, generator=g) if k > 1 else None
    got = routed_lora_group_forward(x, A, B, slots, weights, scale, bounds, build_routing_meta(slots, 4, weights),
                                    "torch")
    want = routed_lora_group_reference(x, A, B, slots, weights, scale, bounds)
    for y, ref, (lo, hi) in zip(got, want, zip(bounds, bounds[1:])):
        assert y.dtype == dtype and y.shape == (n, hi - lo)
        assert rel_err(y, ref.double()) <= DENSE_TOL[dtype]
    # the routed layer runs its base GEMM onto each delta in place: one member's addmm_ leaves the others alone
    others = [t.clone() for t in got[1:]]
    W = torch.randn(20, 24, generator=g).to(dtype)
    got[0].addmm_(x, W.t())
    assert rel_err(got[0], want[0].double() + x.double() @ W.double().t()) <= 2 * DENSE_TOL[dtype]
    assert all(torch.equal(a, b) for a, b in zip(got[1:], others))


def test_mixing_matrix_is_each_tokens_weight_per_slot():
    slots = torch.tensor([[0, 2], [-1, 1], [3, 3], [5, -1]])  # 5 is beyond S = 4: no adapter
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.5, 0.25], [1.0, 1.0]])
    meta = build_routing_meta(slots, 4, weights)
    want = torch.tensor([[0.25, 0, 0.75, 0], [0, 0.5, 0, 0], [0, 0, 0, 0.75], [0, 0, 0, 0]])
    assert torch.equal(meta.mixing(torch.float32), want)
    assert meta.mixing(torch.bfloat16).dtype == torch.bfloat16 and torch.equal(meta.mixing(torch.float32), meta.selection)
    one = build_routing_meta(torch.tensor([2, -1, 0]), 3).mixing(torch.float16)
    assert torch.equal(one, torch.tensor([[0, 0, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.float16))


def test_routed_linear_takes_q_k_v_between_decode_and_prefill_sizes_on_narrow_hot_sets(monkeypatch):
    """fuses_base: three or more projections, up to 256 tokens (eager decode calls keep the one-launch delta kernel,
    graph mode takes the one GEMM from one token, and at decode sizes for any number of projections), stacked
    width <= STACKED_MAX_WIDTH, 16-bit activations on CUDA."""
    from types import SimpleNamespace

    from molora.kernels.graphs import graph_paths

    monkeypatch.setattr(dispatch, "HAS_TRITON", True)

    def cuda_x(n, dtype=torch.bfloat16):
        return SimpleNamespace(shape=(n, 64), is_cuda=True, dtype=dtype)
    eager, hi = dispatch.EAGER_MAX_TOKENS, dispatch.LINEAR_MAX_TOKENS
    assert dispatch.fuses_base(cuda_x(eager + 1), 4, 16, 3) and dispatch.fuses_base(cuda_x(hi), 4, 16, 3)
    assert dispatch.fuses_base(cuda_x(hi, torch.float16), 4, 8, 4)
    assert not dispatch.fuses_base(cuda_x(hi + 1), 4, 16, 3)  # cuBLAS's GEMMs pull ahead
    assert not dispatch.fuses_base(cuda_x(64), 4, 16, 2)  # gate/up: not measured
    assert not dispatch.fuses_base(cuda_x(64), 4, 32, 3)  # 128 stacked columns: wider than measured
    assert not dispatch.fuses_base(cuda_x(64, torch.float32), 4, 16, 3)
    assert not dispatch.fuses_base(SimpleNamespace(shape=(64, 64), is_cuda=False, dtype=torch.bfloat16), 4, 16, 3)
    assert not dispatch.fuses_base(cuda_x(1), 4, 16, 3) and not dispatch.fuses_base(cuda_x(eager), 4, 16, 3)
    wide = dispatch.WIDE_DECODE_MAX_TOKENS  # eager calls above the eager decode path's sizes: every group too
    assert all(dispatch.fuses_base(cuda_x(n), 4, 16, p) for n in (eager + 1, wide) for p in (1, 2))
    assert not dispatch.fuses_base(cuda_x(wide + 1), 4, 16, 1)
    with graph_paths():
        assert dispatch.fuses_base(cuda_x(1), 4, 16, 3) and dispatch.fuses_base(cuda_x(eager), 4, 16, 3)
        assert not dispatch.fuses_base(cuda_x(hi + 1), 4, 16, 3)
        decode = dispatch.WIDE_DECODE_MAX_TOKENS  # a decode step: o, down and gate/up too, with the decode tiles
        assert all(dispatch.fuses_base(cuda_x(n), 4, 16, p) for n in (1, 17, decode) for p in (1, 2))
        assert not dispatch.fuses_base(cuda_x(decode + 1), 4, 16, 2) and not dispatch.fuses_base(cuda_x(1), 4, 32, 1)


def test_routed_linear_refuses_bad_inputs_by_name():
    from molora.kernels.triton_linear import stacked_linear_group

    x = torch.randn(5, 8, dtype=torch.float16)
    A, B = torch.zeros(2, 4, 4, 8, dtype=torch.float16), torch.zeros(4, 12, 4, dtype=torch.float16)
    slots, scale = torch.zeros(5, 1, dtype=torch.long), torch.ones(2, 4)
    W = [torch.zeros(6, 8, dtype=torch.float16), torch.zeros(6, 8, dtype=torch.float16)]

    def call(W=W, A=A, B=B, bounds=(0, 6, 12)):
        return stacked_linear_group(x, W, A, B, slots, None, scale, bounds)
    with pytest.raises(KernelInputError, match=r"base weight 1 must be \[6, 8\]"):
        call(W=[W[0], torch.zeros(6, 7, dtype=torch.float16)])
    with pytest.raises(KernelInputError, match="base weight 0 must be .*float16"):
        call(W=[W[0].float(), W[1]])
    with pytest.raises(KernelInputError, match="share strides"):
        call(W=[W[0], torch.zeros(8, 6, dtype=torch.float16).t()])
    with pytest.raises(KernelInputError, match="one base weight and one bound each"):
        call(W=W[:1])
    with pytest.raises(KernelInputError, match="O = bounds"):
        call(bounds=(0, 6, 11))
    with pytest.raises(KernelInputError, match="at most 256 stacked columns"):
        call(A=torch.zeros(2, 4, 128, 8, dtype=torch.float16), B=torch.zeros(4, 12, 128, dtype=torch.float16))
    if not torch.cuda.is_available():  # valid shapes reach the device check
        with pytest.raises(KernelInputError, match="CUDA"):
            call()


def test_eager_decode_calls_take_one_fused_launch_and_graph_mode_the_triton_kernels(monkeypatch):
    from types import SimpleNamespace

    from molora.kernels.graphs import graph_mode, graph_paths

    monkeypatch.setattr(dispatch, "HAS_TRITON", True)

    def cuda_x(n):  # what the dispatcher reads of x: its shape, device and dtype
        return SimpleNamespace(shape=(n, 64), is_cuda=True, dtype=torch.bfloat16)
    n_max = dispatch.EAGER_MAX_TOKENS
    assert dispatch.choose_path(cuda_x(1), 1, False, 4, 16) == "fused"
    assert dispatch.choose_path(cuda_x(n_max), 4, True, 4, 16) == "fused"  # by tokens, any k
    assert dispatch.choose_group_path(cuda_x(n_max), 1, True, 4, 16, 3) == "fused"  # one launch for the group
    assert dispatch.choose_path(cuda_x(1), 1, False, 4, 32) == "torch"  # wider than measured: the dense form
    assert dispatch.choose_group_path(cuda_x(1), 2, True, 4, 128, 3) == "torch"
    assert dispatch.choose_path(cuda_x(n_max + 1), 1, False, 4, 16) == "gather"
    assert not dispatch.reads_meta(cuda_x(1), 1, torch.zeros(3, 4, 16, 8))  # the fused kernel reads no metadata
    assert dispatch.reads_meta(cuda_x(1), 1, torch.zeros(3, 4, 32, 8))  # the dense form reads the mixing matrix
    assert not graph_mode()
    with graph_paths():  # capture_graph's warm-up and capture: the kernels with the least GPU time
        assert graph_mode()
        assert dispatch.choose_path(cuda_x(1), 1, False, 4, 16) == "gather"
        assert dispatch.choose_group_path(cuda_x(1), 1, True, 4, 16, 3) == "gather"
        assert dispatch.choose_group_path(cuda_x(n_max), 1, True, 4, 64, 3) == "grouped"
        assert not dispatch.reads_meta(cuda_x(1), 1, torch.zeros(3, 4, 16, 8))
    assert not graph_mode()
    # CPU: the stacked form whenever its waste per token (S - k) * r <= CPU_STACKED_WASTE_PER_CHOICE * k, else by its
    # multiply-adds N * S * r * (P * in + O)
    A, B = torch.zeros(8, 16, 256), torch.zeros(8, 256, 16)  # (8 - 1) * 16 = 112 > 32: by multiply-adds
    n_max = dispatch.CPU_DENSE_MAX_MACS // (8 * 16 * 512)

    def fits(n, A, B, k=1):
        return dispatch.dense_fits(torch.zeros(n, 256), A, B, k)
    assert fits(n_max, A, B) and not fits(n_max + 1, A, B)
    A3 = torch.zeros(3, 8, 16, 256)  # q/k/v sharing x: three projections' A, one B of all their columns
    B3 = torch.zeros(8, 768, 16)
    n3 = dispatch.CPU_DENSE_MAX_MACS // (8 * 16 * (3 * 256 + 768))
    assert fits(n3, A3, B3) and not fits(n3 + 1, A3, B3)
    A5, B5 = torch.zeros(5, 8, 256), torch.zeros(5, 256, 8)  # the embedded model's top-2: (5 - 2) * 8 = 24 <= 64
    assert fits(100_000, A5, B5, k=2) and fits(100_000, A5, B5, k=1)  # k = 1: 32 <= 32 ...
    assert not fits(100_000, torch.zeros(6, 8, 256), torch.zeros(6, 256, 8), k=1)  # ... 6 slots: 40 > 32
    monkeypatch.setattr(dispatch, "EAGER_DECODE_PATH", "torch")  # the alternative: the dense form everywhere
    assert dispatch.choose_group_path(cuda_x(1), 1, True, 4, 16, 3) == "torch"


def _fused_interpreter_checks() -> list[str]:
    """The one-launch schedule (FusedLaunch, stacked_lora(fused=True), routed_lora_group_forward(path="fused"))
    against kernels/reference.py under the interpreter: random inputs, P = 1..3 projections of uneven widths,
    k = 1, 2, 4 (repeated slots, -1), one and two row tiles, outputs poisoned with NaN before each call.
    Returns the failures (run by test_fused_one_launch_matches_reference_under_the_interpreter)."""
    from molora.kernels import routed_lora_group_reference
    from molora.kernels.dispatch import routed_lora_group_forward
    from molora.kernels.triton_stacked import FusedLaunch, stacked_lora

    real_new_empty = torch.Tensor.new_empty

    def poisoned_new_empty(self, *args, **kwargs):  # FusedLaunch's output (the interpreter allocates with it too)
        t = real_new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.Tensor.new_empty = poisoned_new_empty
    fails = []
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}
    try:
        for dtype in (torch.float32, torch.float16):
            for i, (n, k, bounds, s, r, d_in) in enumerate([
                    (1, 1, (0, 40), 4, 8, 40), (5, 2, (0, 40, 52, 64), 3, 8, 40), (16, 4, (0, 24, 56), 4, 4, 33),
                    (17, 1, (0, 20, 36, 52), 2, 16, 24), (3, 2, (0, 9, 18), 3, 5, 16)]):
                g = torch.Generator().manual_seed(100 + i)
                p_count, d_out = len(bounds) - 1, bounds[-1]
                x = torch.randn(n, d_in, generator=g).to(dtype)
                A = (torch.randn(p_count, s, r, d_in, generator=g) / d_in ** 0.5).to(dtype)
                B = torch.randn(s, d_out, r, generator=g).to(dtype)
                scale = (torch.rand(p_count, s, generator=g) + 0.5).to(dtype)
                slots = torch.randint(-1, s, (n, k), generator=g)
                if k > 1:
                    slots[::2, -1] = slots[::2, 0]  # a repeated slot sums its weights
                weights = torch.rand(n, k, generator=g) if k > 1 else None
                want = routed_lora_group_reference(x, A, B, slots, weights, scale, bounds)
                launch = FusedLaunch(A, B, scale, bounds)
                got = [launch(x, slots, weights) for _ in range(2)]  # a second call as an eager step makes it
                got.append(torch.cat(routed_lora_group_forward(x, A, B, slots, weights, scale, bounds, None, "fused"),
                                     1))
                for j, y in enumerate(got):
                    err = rel_err(y, torch.cat(want, 1))
                    if not (y.dtype == dtype and y.shape == (n, d_out) and err <= tol[dtype]):
                        fails.append(f"{dtype} case {i} call {j}: err {err:.2e} shape {tuple(y.shape)}")
                base = torch.randn(n, bounds[1], generator=g).to(dtype)  # one projection, added into out in place
                out = stacked_lora(x, A[0], B[:, :bounds[1]], slots, weights, scale[0], base.clone(), fused=True)
                err = rel_err(out.double() - base.double(), want[0])
                if err > 2 * tol[dtype]:
                    fails.append(f"{dtype} case {i} out+=: err {err:.2e}")
    finally:
        torch.Tensor.new_empty = real_new_empty
    return fails


def test_fused_one_launch_matches_reference_under_the_interpreter():
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    code = ("import json, tests.test_kernels as t; print('FAILS=' + json.dumps(t._fused_interpreter_checks()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fails = json.loads(proc.stdout.split("FAILS=")[-1])
    assert fails == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 2), (16, 1), (16, 4)])
def test_cuda_eager_fused_path_and_captured_triton_path_match_reference(dtype, n, k):
    from molora.kernels import routed_lora_group, routed_lora_group_reference
    from molora.kernels.graphs import capture_graph

    x, A, B, scale, g = make(n, 256, 192, 4, 16, dtype, seed=n * k)
    x, A, B, scale = x.cuda(), A.cuda(), B.cuda(), scale.cuda()
    slots = torch.randint(-1, 4, (n, k), generator=g).cuda()
    weights = torch.rand(n, k, generator=g).cuda()
    assert dispatch.choose_path(x, k, True, 4, 16) == "fused"  # eager: one launch
    want = routed_lora_topk_reference(x, A, B, slots, weights, scale).double()
    eager = routed_lora_topk(x, A, B, slots, weights, scale, meta=build_routing_meta(slots, 4, weights))
    assert eager.dtype == dtype and rel_err(eager, want) <= 2.5e-2
    dense = dispatch.routed_lora_forward(x, A, B, slots, weights, scale, None, build_routing_meta(slots, 4, weights),
                                         "torch")
    assert rel_err(dense, want) <= 2.5e-2
    graph, captured = capture_graph(lambda: routed_lora_topk(x, A, B, slots, weights, scale))  # Triton inside
    slots.copy_(torch.randint(-1, 4, (n, k), generator=g).cuda())  # replays read the new values
    graph.replay()
    want = routed_lora_topk_reference(x, A, B, slots, weights, scale).double()
    assert rel_err(captured, want) <= 2.5e-2
    A3, B3, s3 = torch.stack([A, A.flip(0), A]), torch.cat([B, B[:, :64]], 1), torch.stack([scale] * 3)
    bounds = (0, 192, 224, 256)
    got = routed_lora_group(x, A3, B3, slots, weights, s3, bounds)
    for y, ref in zip(got, routed_lora_group_reference(x, A3, B3, slots, weights, s3, bounds)):
        assert rel_err(y, ref.double()) <= 2.5e-2
    # the group's launcher: the first call compiles, later calls take the compiled kernel's launcher directly (with
    # new slot values each time); an x that is not 16-byte aligned takes JITFunction.run again
    from molora.kernels.triton_stacked import FusedLaunch
    launch = FusedLaunch(A3, B3, s3, bounds)
    odd = torch.empty(n * 256 + 1, dtype=dtype, device="cuda")[1:].view(n, 256)
    for x_in in (x, x, x, odd.copy_(x)):
        slots.copy_(torch.randint(-1, 4, (n, k), generator=g).cuda())
        want = torch.cat(routed_lora_group_reference(x, A3, B3, slots, weights, s3, bounds), 1)
        assert rel_err(launch(x_in, slots, weights), want.double()) <= 2.5e-2
    assert launch._direct  # the direct path was set up


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,r", [(1, 16), (8, 16), (1, 64), (16, 128)])
def test_cuda_a_plain_capture_after_eager_calls_records_the_graph_path(n, r, monkeypatch):
    """What an independent harness does (issue 32, K4): eager calls on a side stream, then torch.cuda.graph. The
    eager calls take the eager decode path; the capture records the path capture_graph would (the least GPU time),
    whose Triton kernel the first eager call loaded; replays with new slot values match the reference."""
    from molora.kernels.graphs import graph_paths

    x, A, B, scale, g = make(n, 512, 384, 4, r, torch.bfloat16, seed=n + r)
    x, A, B, scale = x.cuda(), A.cuda(), B.cuda(), scale.cuda()
    slots = torch.randint(0, 4, (n,), generator=g).cuda()
    with graph_paths():
        graph_path = dispatch.choose_path(x, 1, False, 4, r)
    taken, choose = [], dispatch.choose_path
    monkeypatch.setattr(dispatch, "choose_path", lambda *a: taken.append(choose(*a)) or taken[-1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            routed_lora(x, A, B, slots, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = routed_lora(x, A, B, slots, scale)
    assert taken[0] in ("fused", "torch") and taken[-1] == graph_path and graph_path not in ("fused", "torch")
    slots.copy_(torch.randint(0, 4, (n,), generator=g).cuda())
    graph.replay()
    want = routed_lora_reference(x.float(), A.float(), B.float(), slots, scale)
    assert rel_err(captured, want) <= 2.5e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k,r", [(300, 2, 64), (2100, 4, 16), (40, 1, 16)])
def test_cuda_gemm_path_captured_matches_reference(n, k, r):
    """The cuBLAS form of the stacked kernel: captured in a graph, slot values changed after capture, out= variant,
    projection groups."""
    from molora.kernels import routed_lora_group, routed_lora_group_reference
    from molora.kernels.graphs import capture_graph

    x, A, B, scale, g = make(n, 512, 384, 4, r, torch.bfloat16, seed=n + k)
    x, A, B, scale = x.cuda(), A.cuda(), B.cuda(), scale.cuda()
    slots = torch.randint(-1, 4, (n, k), generator=g).cuda()
    weights = torch.rand(n, k, generator=g).cuda()
    graph, captured = capture_graph(lambda: routed_lora_topk(x, A, B, slots, weights, scale, path="gemm"))
    slots.copy_(torch.randint(-1, 4, (n, k), generator=g).cuda())
    graph.replay()
    want = routed_lora_topk_reference(x, A, B, slots, weights, scale).double()
    assert rel_err(captured, want) <= 2.5e-2
    base = torch.randn(n, 384, dtype=torch.bfloat16, device="cuda")
    got = routed_lora_topk(x, A, B, slots, weights, scale, out=base.clone(), path="gemm")
    assert rel_err(got.double() - base.double(), want) <= 2.5e-2
    A3, B3, s3 = torch.stack([A, A.flip(0), A]), torch.cat([B, B[:, :64]], 1), torch.stack([scale, scale * 2, scale])
    bounds = (0, 384, 416, 448)
    for y, ref in zip(routed_lora_group(x, A3, B3, slots, weights, s3, bounds, path="gemm"),
                      routed_lora_group_reference(x, A3, B3, slots, weights, s3, bounds)):
        assert y.shape == ref.shape and rel_err(y, ref.double()) <= 2.5e-2


def test_dependent_launch_is_off_on_the_cpu_and_switchable():
    from molora.kernels.triton_common import dependent_launch, set_dependent_launch

    x = torch.zeros(2, 8)
    assert not dependent_launch(x)  # CPU tensors (and the interpreter) launch the phases plainly
    set_dependent_launch(False)
    try:
        assert not dependent_launch(x)
    finally:
        set_dependent_launch(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path,n,r,group", [("gather", 8, 16, False), ("stacked", 300, 16, False),
                                            ("grouped", 64, 32, False), ("grouped", 64, 16, True),
                                            ("linear", 200, 16, True)])
def test_cuda_dependent_launch_gives_the_plain_launches_results_in_captured_graphs(path, n, r, group):
    """Each two-phase path captured with programmatic dependent launch on and off: the same bits on every replay
    (slot values changed between replays where the path reads no metadata), and the reference's values. A second
    phase reading its partials before the first phase wrote them would differ."""
    from molora.kernels import routed_lora_group, routed_lora_group_reference
    from molora.kernels.graphs import capture_graph
    from molora.kernels.triton_common import dependent_launch, set_dependent_launch
    from molora.kernels.triton_linear import stacked_linear_group

    x, A, B, scale, g = make(n, 512, 384, 4, r, torch.bfloat16, seed=n + r)
    x, A, B, scale = x.cuda(), A.cuda(), B.cuda(), scale.cuda()
    slots = torch.randint(-1, 4, (n, 1), generator=g).cuda()
    meta = build_routing_meta(slots, 4)
    A3, B3, s3 = torch.stack([A, A.flip(0), A]), torch.cat([B, B[:, :64]], 1), torch.stack([scale, scale * 2, scale])
    bounds = (0, 384, 416, 448)
    W = [torch.randn(hi - lo, 512, dtype=torch.bfloat16, device="cuda") / 512 ** 0.5
         for lo, hi in zip(bounds, bounds[1:])]

    def call():
        if path == "linear":
            return stacked_linear_group(x, W, A3, B3, slots, None, s3, bounds)
        if group:
            return torch.cat(routed_lora_group(x, A3, B3, slots, None, s3, bounds, meta=meta, path=path), 1)
        return routed_lora(x, A, B, slots[:, 0], scale, meta=meta, path=path)

    def want():
        if path == "linear":
            deltas = routed_lora_group_reference(x, A3, B3, slots, None, s3, bounds)
            return torch.cat([(x.double() @ w.double().t()).flatten() + d.double().flatten()
                              for w, d in zip(W, deltas)])
        if group:
            return torch.cat(routed_lora_group_reference(x, A3, B3, slots, None, s3, bounds), 1).double()
        return routed_lora_reference(x, A, B, slots[:, 0], scale).double()

    captures = {}
    try:
        for mode in (False, True):
            set_dependent_launch(mode)
            captures[mode] = capture_graph(call)
    finally:
        set_dependent_launch(True)
    assert dependent_launch(x) == (torch.cuda.get_device_capability()[0] >= 9)
    for _ in range(4):
        if path != "grouped":  # (the grouped graphs read the metadata built for the slots they were captured with)
            slots.copy_(torch.randint(-1, 4, (n, 1), generator=g).cuda())
        outs = []
        for graph, out in captures.values():
            graph.replay()
            outs.append(out.clone())
        assert torch.equal(outs[0], outs[1])
        assert rel_err(outs[1], want()) <= 2.5e-2


@pytest.mark.parametrize("n,k", [(40, 2), (33, 1), (0, 1)])
def test_cpu_stacked_form_matches_reference_adds_in_place_and_serves_groups(n, k):
    """The CPU's all-slots form above 2 r rows: one shrink GEMM against every slot, one expand GEMM."""
    from molora.kernels import routed_lora_group_reference
    from molora.kernels.torch_ops import routed_lora_torch_group_stacked, routed_lora_torch_stacked

    x, A, B, scale, g = make(n, 40, 24, 4, 8, seed=n + k)
    slots = torch.randint(-1, 5, (n, k), generator=g)  # 4 (beyond S) counts as no adapter
    weights = torch.rand(n, k, generator=g) if k > 1 else None
    want = routed_lora_topk_reference(x, A, B, torch.where(slots >= 4, -1, slots),
                                      weights if k > 1 else torch.ones(n, k), scale)
    assert dispatch.stacked_over_dense(x, B) == (n > 16)
    for meta in (None, build_routing_meta(slots, 4, weights)):
        got = routed_lora_torch_stacked(x, A, B, slots, weights, scale, meta)
        assert got.shape == (n, 24) and (n == 0 or rel_err(got, want) <= TOL[torch.float32])
        base = torch.randn(n, 24, generator=g)
        out = base.clone()
        assert routed_lora_torch_stacked(x, A, B, slots, weights, scale, meta, out) is out
        assert n == 0 or rel_err(out - base, want) <= TOL[torch.float32]
    A3, B3, s3 = torch.stack([A, A.flip(0), A]), torch.cat([B, B[:, :8]], 1), torch.stack([scale, scale * 2, scale])
    bounds = (0, 24, 28, 32)
    valid = torch.where(slots >= 4, -1, slots)
    for y, ref in zip(routed_lora_torch_group_stacked(x, A3, B3, slots, weights, s3, bounds),
                      routed_lora_group_reference(x, A3, B3, valid, weights, s3, bounds)):
        assert y.shape == ref.shape and (n == 0 or rel_err(y, ref) <= TOL[torch.float32])


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("form", ["mkl", "packed"])
def test_cpu_linear_gives_a_row_the_same_numbers_whatever_rows_share_its_call(form):
    from molora.kernels.torch_ops import cpu_linear, pack_exact_rows

    g = torch.Generator().manual_seed(0)
    for d_out, d_in in [(768, 256), (256, 1024), (1080, 256)]:
        weight = torch.randn(d_out, d_in, generator=g) * 0.05
        packed = None
        if form == "packed":
            packed = pack_exact_rows(weight)
            if packed is None:
                pytest.skip("oneDNN's linear is not exact per row on this machine (the MKL form serves)")
        x = torch.randn(24, d_in, generator=g)
        widest = cpu_linear(x, weight, packed)
        assert widest.is_contiguous()
        torch.testing.assert_close(widest, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 4, 5, 8, 13, 16):
            assert torch.equal(cpu_linear(x[:rows], weight, packed), widest[:rows])
        shuffled = torch.randperm(24, generator=g)  # a row's place in its call does not matter either
        assert torch.equal(cpu_linear(x[shuffled], weight, packed), widest[shuffled])


def test_the_cpu_per_slot_form_weights_a_slot_only_where_a_live_row_needs_it():
    """RoutingMeta.slot_columns: a slot every live row gives weight 1 needs no weighting (None); rows past `live`
    are padding and do not count. The live rows' outputs are the same numbers either way."""
    from molora.kernels.metadata import RoutingMeta
    from molora.kernels.torch_ops import routed_linear_torch_slots

    g = torch.Generator().manual_seed(1)
    meta = RoutingMeta(torch.tensor([2, 2, -1, 0]), 3)
    every = meta.slot_columns(torch.float32)
    assert [s for s, _ in every] == [0, 2] and all(column is not None for _, column in every)
    assert torch.equal(dict(every)[2].view(-1), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    live2 = meta.slot_columns(torch.float32, 2)
    assert [s for s, _ in live2] == [0, 2] and dict(live2)[2] is None and dict(live2)[0] is not None
    assert meta.slot_columns(torch.float32, 2) is live2  # made once a forward
    # learned weights (not 1) are always applied
    learned = RoutingMeta(torch.tensor([[1, 2], [1, 2]]), 3, torch.tensor([[0.75, 0.25], [0.75, 0.25]]))
    assert all(column is not None for _, column in learned.slot_columns(torch.float32, 2))

    d_in, r, widths = 8, 3, (6, 4)
    weight = torch.randn(sum(widths), d_in, generator=g)
    slot_form = [(torch.randn(d_in, 2 * r, generator=g), *(torch.randn(r, w, generator=g) for w in widths))
                 for _ in range(3)]
    x = torch.randn(4, d_in, generator=g)
    weighted = routed_linear_torch_slots(x, weight, slot_form, every, widths)
    skipped = routed_linear_torch_slots(x, weight, slot_form, live2, widths)
    for y, z in zip(weighted, skipped):
        assert torch.equal(y[:2], z[:2])
    shrink, *b_t = slot_form[2]  # row 0 against the reference: base + its one slot's delta
    h = x[:1] @ shrink
    want = torch.cat([x[:1] @ weight[:6].t() + h[:, :r] @ b_t[0], x[:1] @ weight[6:].t() + h[:, r:] @ b_t[1]], 1)
    torch.testing.assert_close(torch.cat([y[:1] for y in skipped], 1), want, rtol=1e-5, atol=1e-5)


def test_the_cpu_slot_form_follows_the_hot_set_writing_a_slot():
    """ProjectionGroup.slot_form (the CPU's per-slot shrink with the scales folded in) is a copy: a slot written
    in place (an adapter loaded, a slot cleared, a scale changed) makes it again, in and outside inference mode."""
    from molora.routing.lora import RoutedLoRALinear, group_projections

    torch.manual_seed(0)
    parent = torch.nn.Module()
    parent.q_proj, parent.k_proj = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 8, bias=False)
    layers = [RoutedLoRALinear(getattr(parent, n), num_slots=3, r_max=4, name=f"b.{n}") for n in ("q_proj", "k_proj")]
    (group,) = group_projections(layers)

    def expected(s):
        return torch.cat([layer.lora_scale[s] * layer.lora_A[s].t() for layer in layers], 1)

    with torch.no_grad():
        for layer in layers:
            layer.lora_A.normal_()
            layer.lora_B.normal_()
            layer.lora_scale.fill_(0.5)
    group.stacked()
    assert torch.equal(group.slot_form()[1][0], expected(1))
    with torch.inference_mode():
        layers[1].lora_A[1].normal_()
        layers[0].lora_scale[1] = 2.0
        assert torch.equal(group.slot_form()[1][0], expected(1))
    layers[0].clear_slot(2)
    assert torch.equal(group.slot_form()[2][0], expected(2))
    assert torch.equal(group.slot_form()[2][1], layers[0].lora_B[2].t())  # B: views of the slots


@pytest.mark.usefixtures("one_torch_thread")
def test_a_routed_model_packs_its_groups_within_the_byte_budget():
    from molora.models.engine.synthetic import random_routed_model

    routed, _ = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=2, image_size=64)
    groups = routed.projection_groups()
    assert routed.pack_exact_rows(0) == (0, len(groups), 0)
    assert all(group.exact_rows_weight() is None for group in groups)
    smallest = min(group.weight.nbytes for group in groups)
    packed, total, spent = routed.pack_exact_rows(smallest)
    if packed == 0:
        pytest.skip("oneDNN's linear is not exact per row on this machine")
    assert packed == 1 and total == len(groups) and spent == smallest
    packed, _, spent = routed.pack_exact_rows(2 ** 40)
    assert packed == len(groups) and spent == sum(group.weight.nbytes for group in groups)


def test_pack_exact_rows_refuses_what_it_cannot_pack():
    from molora.kernels.torch_ops import pack_exact_rows

    assert pack_exact_rows(torch.randn(8, 4, dtype=torch.float64)) is None
    assert pack_exact_rows(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    assert pack_exact_rows(torch.randn(2, 8, 4)) is None


@pytest.mark.usefixtures("one_torch_thread")
def test_a_packed_group_packs_again_when_its_weight_changes():
    """The packed copy follows the weights: written in place (load_state_dict copies into them) or replaced."""
    from molora.routing.lora import RoutedLoRALinear

    layer = RoutedLoRALinear(torch.nn.Linear(32, 48, bias=False), num_slots=2, r_max=4)
    group = layer.group
    assert group.exact_rows_weight() is None  # nothing packed until asked
    if not group.pack_exact_rows():
        pytest.skip("oneDNN's linear is not exact per row on this machine")
    x = torch.randn(4, 32)
    first = group.exact_rows_weight()
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, first, None, "none", [], ""),
                               x @ layer.weight.t())
    with torch.no_grad():
        layer.weight.mul_(2.0)
    again = group.exact_rows_weight()
    assert again is not first
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, again, None, "none", [], ""),
                               x @ layer.weight.t())
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(torch.randn(48, 32))
    group._stack()  # (what stacked() does when it finds the Parameter replaced)
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, group.exact_rows_weight(), None, "none", [],
                                                                  ""), x @ layer.weight.t())
