"""Triton kernels vs the PyTorch reference under the CPU interpreter (TRITON_INTERPRET=1).

triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when kernels/ is first imported, and other test
files in the same pytest process import kernels/ without it. So the checks run in ONE child process started
with the variable set (this file executed as a script), which prints one JSON line per case; the pytest side
asserts each case separately. Sizes are tiny on purpose: the interpreter runs every program in Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Largest error allowed per dtype, as max|kernel - reference| / max|reference| and as relative Frobenius norm.
# The reference rounds once (float32 accumulate -> dtype); the grouped kernel also rounds the rank-r
# intermediate to the dot dtype (as on the GPU), hence a few ulps of the 16-bit formats.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2.5e-2}

# name: (N, in, out, S, r, k, slot pattern, dtype)
CASES = {
    "odd_sizes_fp32": (37, 33, 29, 4, 8, 1, "random", "float32"),
    "odd_sizes_fp16": (23, 33, 29, 4, 8, 1, "random", "float16"),
    "odd_sizes_bf16": (23, 33, 29, 4, 8, 1, "random", "bfloat16"),
    "one_token": (1, 40, 24, 3, 16, 1, "random_valid", "float32"),
    "one_token_topk": (1, 40, 24, 3, 16, 2, "random_valid", "float16"),
    "all_minus_one": (11, 24, 20, 3, 8, 1, "none", "float32"),
    "all_minus_one_topk": (11, 24, 20, 3, 8, 3, "none", "float32"),
    "all_one_slot": (19, 24, 20, 3, 8, 1, "one", "bfloat16"),
    "every_slot_used": (21, 24, 20, 7, 8, 1, "every", "float32"),
    "ranks_below_rmax": (17, 24, 20, 4, 16, 1, "random", "float32"),
    "rank_above_16": (9, 24, 20, 2, 24, 1, "random", "float32"),
    "topk2_repeats": (13, 24, 20, 3, 8, 2, "repeats", "float32"),
    "topk3_repeats_fp16": (13, 24, 20, 3, 8, 3, "repeats", "float16"),
    "topk4_repeats_bf16": (13, 24, 20, 3, 8, 4, "repeats", "bfloat16"),
    "topk4_random": (10, 24, 20, 4, 8, 4, "random", "float32"),
    # stacked width S*r = 40 -> 64 padded columns: several column tiles, padded columns, k = 2 and 4
    "wide_stack_topk2_fp16": (29, 40, 36, 5, 8, 2, "random", "float16"),
    "wide_stack_topk4_fp32": (18, 33, 50, 5, 8, 4, "random", "float32"),
    "rank_32_fp16": (9, 24, 20, 3, 32, 1, "random", "float16"),
    # top-k on the grouped kernel: slot-set tiles up to SETS_MAX_SLOTS = 6 slots (the cases above), float32 atomics
    # over flat rows beyond (8 slots here); r = 32 with k = 3: 4 padded column blocks of 32 per set tile
    "topk2_eight_slots": (23, 24, 20, 8, 8, 2, "random", "float32"),
    "topk3_rank_32_fp16": (21, 24, 20, 6, 32, 3, "random", "float16"),
}
PATHS = ("gather", "stacked", "grouped", "gemm")

# Projections sharing x (routed_lora_group): name: (N, in, outs, S, r, k, slot pattern, dtype). Widths that are not
# multiples of the tiles, a projection narrower than a tile, P = 1..4, top-k with repeats, all -1.
GROUP_CASES = {
    "group_qkv_fp32": (21, 33, (29, 12, 12), 4, 8, 1, "random", "float32"),
    "group_gate_up_fp16": (18, 40, (36, 36), 3, 8, 2, "repeats", "float16"),
    "group_one_token_bf16": (1, 24, (20, 8, 8), 3, 16, 1, "random_valid", "bfloat16"),
    "group_four_fp32": (9, 24, (20, 5, 17, 3), 2, 8, 3, "random", "float32"),
    "group_single_fp16": (13, 24, (20,), 3, 8, 1, "random", "float16"),
    "group_all_minus_one": (11, 24, (20, 10), 3, 8, 2, "none", "float32"),
    "group_rank_24_fp32": (7, 24, (20, 20, 12), 2, 24, 1, "random", "float32"),
}

# The whole routed linear as one GEMM (kernels/triton_linear.py) on the group cases, plus an input width the
# K tiles divide (its unmasked K loop) with several row groups, and decode steps at the GPU's decode tiles
# (DECODE_TILES: one row tile of 16, K steps of 256; "decode_wide_*" above 16 tokens: WIDE_DECODE_TILES, a row
# tile of 32; "decode_*" cases run with them instead of the interpreter's tiny tiles): one projection over a
# partial column tile, two and three over a partial K step and a full one.
LINEAR_CASES = {**GROUP_CASES, "linear_even_k_fp16": (70, 32, (48, 16, 16), 4, 16, 2, "random", "float16"),
                "decode_one_fp16": (1, 512, (80,), 4, 16, 1, "random_valid", "float16"),
                "decode_two_fp32": (3, 300, (48, 100), 4, 16, 2, "random", "float32"),
                "decode_three_fp16": (16, 256, (64, 32, 32), 4, 16, 1, "random", "float16"),
                "decode_wide_one_fp16": (29, 300, (72,), 4, 16, 2, "random_valid", "float16"),
                "decode_wide_two_fp32": (19, 300, (48, 100), 4, 16, 1, "random", "float32"),
                "decode_wide_three_fp16": (27, 256, (64, 32, 32), 4, 16, 1, "random", "float16")}

# Training on the GPU runs the Triton forward and the torch-path backward (kernels/autograd.py); float64 always
# takes the torch path, so these fp32 cases are what covers that mix. Reference: kernels/reference.py under torch
# autograd on float32 copies. Both sides accumulate in fp32 in a different order -> a few ulps; 1e-4 relative.
GRAD_TOL = 1e-4
# name: (N, in, out, S, r, k)
GRAD_CASES = {"grad_k1": (19, 33, 29, 4, 8, 1), "grad_topk3": (13, 27, 21, 3, 8, 3)}

# path="auto" under the interpreter: (N, k, pass a prebuilt meta, S, r, path the dispatcher must pick). Hidden
# sizes are tiny so the rows above kernels/dispatch.py's thresholds stay cheap for the interpreter; S*r = 384
# is above every stacked width (the gemm path without metadata), S*r = 640 above the gemm path's (the grouped kernel).
AUTO_CASES = {"auto_one_token": (1, 1, False, 3, 4, "gather"), "auto_one_token_topk": (1, 3, False, 3, 4, "gather"),
              "auto_above_gather_stacked": (200, 1, False, 3, 4, "stacked"),
              "auto_above_gather_stacked_topk": (100, 3, True, 3, 4, "stacked"),
              "auto_stacked_meta_few_tokens": (100, 1, True, 3, 4, "stacked"),
              "auto_stacked_meta_large_n": (600, 1, True, 3, 4, "grouped"),
              "auto_narrow_topk_large_n": (4200, 2, False, 3, 4, "gemm"),
              "auto_wide_few_rows": (30, 1, False, 3, 64, "gather"),
              "auto_wide_few_rows_meta": (30, 1, True, 3, 64, "grouped"),
              "auto_wide_topk_stacked": (100, 2, False, 3, 32, "stacked"),
              "auto_wide_topk_gemm": (300, 2, False, 5, 32, "gemm"),
              "auto_wide_above_gather_max": (600, 1, False, 3, 128, "gemm"),
              "auto_wide_above_gather_max_topk": (200, 3, False, 3, 128, "gemm"),
              "auto_widest_above_gather_max": (600, 1, False, 5, 128, "grouped"),
              "auto_widest_above_gather_max_topk": (200, 3, False, 5, 128, "grouped"),
              "auto_wide_meta": (300, 1, True, 3, 128, "grouped")}


def _slots(torch, pattern: str, n: int, s: int, k: int, gen):
    if pattern == "random":
        return torch.randint(-1, s, (n, k), generator=gen)
    if pattern == "random_valid":
        return torch.randint(0, s, (n, k), generator=gen)
    if pattern == "none":
        return torch.full((n, k), -1)
    if pattern == "one":
        return torch.full((n, k), s - 1)
    if pattern == "every":
        return (torch.arange(n * k) % s).view(n, k)
    if pattern == "repeats":  # every row repeats its first slot at least once, plus some -1
        first = torch.randint(0, s, (n, 1), generator=gen)
        rest = torch.randint(-1, s, (n, k - 1), generator=gen)
        rest[: n // 2, 0] = first[: n // 2, 0]
        return torch.cat([first, rest], 1)
    raise ValueError(pattern)


def _run_case(name: str, path: str, seed: int) -> dict:
    import torch

    import molora.kernels.triton_gather as gather_mod
    import molora.kernels.triton_grouped as grouped_mod
    from molora.kernels.dispatch import routed_lora_forward
    from molora.kernels.reference import routed_lora_topk_reference

    n, d_in, d_out, s, r, k, pattern, dtype_name = CASES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen).to(dtype)
    A = torch.randn(s, r, d_in, generator=gen) / d_in ** 0.5
    B = torch.randn(s, d_out, r, generator=gen)
    if name == "ranks_below_rmax":  # slot i has rank r - 4*i, zero-padded to r like the hot-set cache does
        for i in range(s):
            A[i, r - 4 * i:] = 0
            B[i, :, r - 4 * i:] = 0
    A, B = A.to(dtype), B.to(dtype)
    scale = torch.rand(s, generator=gen) + 0.5
    slots = _slots(torch, pattern, n, s, k, gen)
    weights = torch.rand(n, k, generator=gen) if k > 1 else None
    ref = routed_lora_topk_reference(x, A, B, slots, weights if k > 1 else torch.ones(n, 1), scale).float()

    # Poison every fresh output buffer, so an element the kernel never writes shows up as NaN.
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    # No host synchronisation on the hot path: these must never be called by metadata or launchers.
    def forbidden(*_a, **_k):
        raise AssertionError("host synchronisation on the hot path")

    saved = {m: getattr(torch.Tensor, m) for m in ("item", "tolist", "nonzero")}
    gather_mod.torch.empty = grouped_mod.torch.empty = poisoned_empty
    for m in saved:
        setattr(torch.Tensor, m, forbidden)
    try:
        delta = routed_lora_forward(x, A, B, slots, weights, scale, None, None, path)
    finally:
        torch.empty = real_empty
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)
    base = torch.randn(n, d_out, generator=gen).to(dtype)
    acc = routed_lora_forward(x, A, B, slots, weights, scale, base.clone(), None, path)

    def errors(y: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
        den_max = max(want.abs().max().item(), 1e-6) if want.numel() else 1.0
        den_norm = max(want.norm().item(), 1e-6)
        return (y - want).abs().max().item() / den_max, (y - want).norm().item() / den_norm

    max_err, norm_err = errors(delta.float(), ref)
    acc_max_err, _ = errors(acc.float() - base.float(), ref)
    return {"dtype_ok": delta.dtype == dtype and acc.dtype == dtype, "shape_ok": tuple(delta.shape) == (n, d_out),
            "unwritten": int(torch.isnan(delta).sum()), "max_err": max_err, "norm_err": norm_err,
            "acc_max_err": acc_max_err, "exact_zero": bool((delta[(slots < 0).all(1)] == 0).all()),
            "tol": TOLERANCE[dtype_name]}


def _group_case_inputs(torch, case: tuple, seed: int) -> tuple:
    """x, A [P, S, r, in], B [S, O, r], scale [P, S], slots, weights, bounds and the generator for a group case."""
    n, d_in, outs, s, r, k, pattern, dtype_name = case
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    for o in outs:
        bounds.append(bounds[-1] + o)
    x = torch.randn(n, d_in, generator=gen).to(dtype)
    A = (torch.randn(len(outs), s, r, d_in, generator=gen) / d_in ** 0.5).to(dtype)
    B = torch.randn(s, bounds[-1], r, generator=gen).to(dtype)
    scale = torch.rand(len(outs), s, generator=gen) + 0.5
    slots = _slots(torch, pattern, n, s, k, gen)
    weights = torch.rand(n, k, generator=gen) if k > 1 else None
    return x, A, B, scale, slots, weights, bounds, gen


def _run_group_case(name: str, path: str, seed: int) -> dict:
    import torch

    import molora.kernels.triton_gather as gather_mod
    import molora.kernels.triton_stacked as stacked_mod
    from molora.kernels import routed_lora_group
    from molora.kernels.reference import routed_lora_group_reference

    n, _, outs, _, _, _, _, dtype_name = GROUP_CASES[name]
    dtype = getattr(torch, dtype_name)
    x, A, B, scale, slots, weights, bounds, _ = _group_case_inputs(torch, GROUP_CASES[name], seed)
    refs = [t.float() for t in routed_lora_group_reference(x, A, B, slots, weights, scale, tuple(bounds))]
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    gather_mod.torch.empty = stacked_mod.torch.empty = poisoned_empty
    try:
        got = routed_lora_group(x, A, B, slots, weights, scale, tuple(bounds), path=path)
    finally:
        torch.empty = real_empty
    errs = [(g.float() - w).abs().max().item() / max(w.abs().max().item(), 1e-6) for g, w in zip(got, refs)]
    none = (slots < 0).all(1)
    return {"shapes_ok": [tuple(g.shape) for g in got] == [(n, o) for o in outs],
            "dtype_ok": all(g.dtype == dtype and g.is_contiguous() for g in got),
            "unwritten": sum(int(torch.isnan(g).sum()) for g in got), "max_err": max(errs),
            "exact_zero": all(bool((g[none] == 0).all()) for g in got), "tol": TOLERANCE[dtype_name]}


def _run_linear_case(name: str, seed: int) -> dict:
    """stacked_linear_group: each projection's output vs x W_p^T + its reference delta, the flat output poisoned."""
    import torch

    import molora.kernels.triton_linear as linear_mod
    from molora.kernels.reference import routed_lora_group_reference

    n, d_in, outs, _, _, _, _, dtype_name = LINEAR_CASES[name]
    dtype = getattr(torch, dtype_name)
    x, A, B, scale, slots, weights, bounds, gen = _group_case_inputs(torch, LINEAR_CASES[name], seed)
    W = [(torch.randn(o, d_in, generator=gen) / d_in ** 0.5).to(dtype) for o in outs]
    refs = routed_lora_group_reference(x, A, B, slots, weights, scale, tuple(bounds))
    real_empty = torch.empty
    torch.empty = lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))  # (every float buffer is written)
    config = linear_mod.decode_config(len(outs), n) if name.startswith("decode_") else None
    try:
        flat = linear_mod.stacked_linear_group(x, W, A, B, slots, weights, scale, tuple(bounds), config)
    finally:
        torch.empty = real_empty
    got = [flat[n * lo:n * hi].view(n, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    wants = [x.float() @ w.float().t() + d.float() for w, d in zip(W, refs)]
    return {"flat_ok": flat.shape == (n * bounds[-1],) and flat.dtype == dtype,
            "unwritten": int(torch.isnan(flat).sum()), "max_err": max(_rel_err(g.float(), w) for g, w in zip(got, wants)),
            "tol": TOLERANCE[dtype_name]}


def _run_strided_scale_checks() -> dict:
    """Public ops with a scale that is a strided view (every path): the kernels read scale with unit stride, so the
    ops hand them a contiguous copy; error per path against the reference."""
    import torch

    from molora.kernels import routed_lora, routed_lora_group
    from molora.kernels.reference import routed_lora_group_reference, routed_lora_reference

    gen = torch.Generator().manual_seed(11)
    n, d_in, s, r = 21, 24, 3, 8
    x = torch.randn(n, d_in, generator=gen)
    A = torch.randn(2, s, r, d_in, generator=gen) / d_in ** 0.5
    B = torch.randn(s, 30, r, generator=gen)
    slots = torch.randint(-1, s, (n,), generator=gen)
    scale = (torch.rand(s, 2, generator=gen) + 0.5).t()  # [2, S] with strides (1, 2)
    want = routed_lora_reference(x, A[0], B[:, :20], slots, scale[0])
    wants = routed_lora_group_reference(x, A, B, slots, None, scale, (0, 20, 30))
    res = {}
    for path in PATHS:
        res[path] = _rel_err(routed_lora(x, A[0], B[:, :20], slots, scale[0], path=path), want)
        got = routed_lora_group(x, A, B, slots, None, scale, (0, 20, 30), path=path)
        res[f"group-{path}"] = max(_rel_err(g, w) for g, w in zip(got, wants))
    return res


def _rel_err(got, want) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)


def _spy_paths():
    """Record which Triton launcher the dispatcher really calls (kernels/dispatch.py's module-level names)."""
    import molora.kernels.dispatch as dispatch
    calls: list[str] = []
    real = {name: getattr(dispatch, f"{name}_lora") for name in ("gather", "stacked", "grouped", "gemm")}

    def wrap(name):
        def launcher(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return launcher

    for name in real:
        setattr(dispatch, f"{name}_lora", wrap(name))

    def restore():
        for name, fn in real.items():
            setattr(dispatch, f"{name}_lora", fn)
    return calls, restore


def _run_grad_case(name: str, path: str, seed: int) -> dict:
    """Forward and gradients of x, A, B (and the top-k weights) through the public ops vs reference autograd."""
    import torch

    from molora.kernels import routed_lora, routed_lora_topk
    from molora.kernels.reference import routed_lora_reference, routed_lora_topk_reference

    n, d_in, d_out, s, r, k = GRAD_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    A = torch.randn(s, r, d_in, generator=gen) / d_in ** 0.5
    B = torch.randn(s, d_out, r, generator=gen)
    scale = torch.rand(s, generator=gen) + 0.5
    if k == 1:
        slots = torch.randint(-1, s, (n, 1), generator=gen)
        slots[0, 0], slots[1, 0] = -1, s - 1
    else:
        slots = _slots(torch, "repeats", n, s, k, gen)
        slots[0] = torch.tensor([1, 1, -1])      # a repeated slot and a -1 in the same row, for sure
        slots[1] = torch.tensor([-1, -1, -1])
    weights = torch.rand(n, k, generator=gen)
    g = torch.randn(n, d_out, generator=gen)

    leaves = {"x": x, "A": A, "B": B} | ({"weights": weights} if k > 1 else {})
    ours = {key: t.clone().requires_grad_() for key, t in leaves.items()}
    refs = {key: t.clone().requires_grad_() for key, t in leaves.items()}
    calls, restore = _spy_paths()
    try:
        if k == 1:
            y = routed_lora(ours["x"], ours["A"], ours["B"], slots[:, 0], scale, path=path)
        else:
            y = routed_lora_topk(ours["x"], ours["A"], ours["B"], slots, ours["weights"], scale, path=path)
    finally:
        restore()
    (y * g).sum().backward()
    if k == 1:
        want = routed_lora_reference(refs["x"], refs["A"], refs["B"], slots[:, 0], scale)
    else:
        want = routed_lora_topk_reference(refs["x"], refs["A"], refs["B"], slots, refs["weights"], scale)
    (want * g).sum().backward()
    errs = {"fwd": _rel_err(y.detach(), want.detach())}
    for key in leaves:
        got, ref_grad = ours[key].grad, refs[key].grad
        if got is None or got.dtype != torch.float32 or got.shape != ref_grad.shape:
            return {"error": f"grad of {key}: {None if got is None else (got.dtype, tuple(got.shape))}"}
        errs[key] = _rel_err(got, ref_grad)
    return {"calls": calls, "errs": errs, "grad_fn": type(y.grad_fn).__name__, "tol": GRAD_TOL}


def _run_auto_case(name: str, seed: int) -> dict:
    """path="auto" with the interpreter on: which launcher the dispatcher picks by rows, and the result."""
    import torch

    from molora.kernels import build_routing_meta, routed_lora, routed_lora_topk
    from molora.kernels.dispatch import choose_path
    from molora.kernels.reference import routed_lora_topk_reference

    n, k, with_meta, s, r, _ = AUTO_CASES[name]
    d_in, d_out = 12, 10
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    A = torch.randn(s, r, d_in, generator=gen) / d_in ** 0.5
    B = torch.randn(s, d_out, r, generator=gen)
    scale = torch.rand(s, generator=gen) + 0.5
    slots = torch.randint(-1, s, (n, k), generator=gen)
    weights = torch.rand(n, k, generator=gen)
    meta = build_routing_meta(slots, s) if with_meta else None
    calls, restore = _spy_paths()
    try:
        if k == 1:
            y = routed_lora(x, A, B, slots[:, 0], scale, meta=meta)
        else:
            y = routed_lora_topk(x, A, B, slots, weights, scale, meta=meta)
    finally:
        restore()
    want = routed_lora_topk_reference(x, A, B, slots, weights if k > 1 else torch.ones(n, 1), scale)
    return {"chosen": choose_path(x, k, with_meta, s, r), "calls": calls, "err": _rel_err(y, want),
            "dtype_ok": y.dtype == torch.float32, "tol": TOLERANCE["float32"]}


def _run_meta_checks() -> dict:
    import torch

    from molora.kernels.metadata import build_routing_meta, build_routing_meta_torch
    gen = torch.Generator().manual_seed(7)
    results = {}
    for n, k, s in ((1, 1, 4), (37, 1, 4), (300, 3, 5), (1500, 1, 3), (64, 2, 1), (1100, 2, 6), (40, 4, 4)):
        slots = torch.randint(-1, s, (n, k), generator=gen)
        if n == 300:
            slots[0, 0] = s + 3  # out of range: goes with the no-adapter rows, like -1
        got, want = build_routing_meta(slots, s), build_routing_meta_torch(slots, s)
        same = torch.equal(got.rows, want.rows) and torch.equal(got.offsets, want.offsets)
        if k > 1:  # tokens by slot set: the kernel's order is the torch sort's, and each segment holds its set
            same = same and torch.equal(got.set_rows, want.set_rows) and torch.equal(got.set_offsets, want.set_offsets)
            off = got.set_offsets.tolist()
            for code in range(1, 1 << s):
                for tok in got.set_rows[off[code - 1]:off[code]].tolist():
                    valid = {v for v in slots[tok].tolist() if 0 <= v < s}
                    same = same and sum(1 << v for v in valid) == code
            none = got.set_rows[off[-2]:off[-1]].tolist()
            same = same and all(not any(0 <= v < s for v in slots[t].tolist()) for t in none)
        results[f"{n}x{k}_S{s}"] = bool(same)
    return results


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    for i, name in enumerate(CASES):
        for path in PATHS:
            try:
                res = _run_case(name, path, seed=1000 + i)
            except Exception as exc:  # report, so the parent names the failing case
                res = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({"case": f"{name}-{path}", **res}), flush=True)
    for i, name in enumerate(GROUP_CASES):
        for path in PATHS:
            try:
                res = _run_group_case(name, path, seed=4000 + i)
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({"case": f"{name}-{path}", **res}), flush=True)
    for i, name in enumerate(LINEAR_CASES):
        try:
            res = _run_linear_case(name, seed=5000 + i)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"case": f"{name}-linear", **res}), flush=True)
    print(json.dumps({"case": "metadata", **_run_meta_checks()}), flush=True)
    print(json.dumps({"case": "strided_scale", **_run_strided_scale_checks()}), flush=True)
    for i, name in enumerate(GRAD_CASES):
        for path in PATHS:
            try:
                res = _run_grad_case(name, path, seed=2000 + i)
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({"case": f"{name}-{path}", **res}), flush=True)
    for i, name in enumerate(AUTO_CASES):
        try:
            res = _run_auto_case(name, seed=3000 + i)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"case": name, **res}), flush=True)


@pytest.fixture(scope="module")
def interp_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("case", [f"{c}-{p}" for c in CASES for p in PATHS])
def test_triton_kernel_matches_reference(interp_results: dict, case: str) -> None:
    res = interp_results[case]
    assert "error" not in res, res.get("error")
    assert res["shape_ok"] and res["dtype_ok"], res
    assert res["unwritten"] == 0, f"{res['unwritten']} output elements never written"
    assert res["exact_zero"], "tokens with only slot -1 must get an exact zero delta"
    assert res["max_err"] <= res["tol"] and res["norm_err"] <= res["tol"], res
    assert res["acc_max_err"] <= res["tol"], f"out= accumulate variant: {res}"


@pytest.mark.parametrize("case", [f"{c}-{p}" for c in GROUP_CASES for p in PATHS])
def test_triton_projection_group_matches_reference(interp_results: dict, case: str) -> None:
    """One shared shrink and one expand for P projections (gather, stacked) or one projection at a time (grouped)
    give each projection's own reference delta, every element written, -1 rows exactly zero."""
    res = interp_results[case]
    assert "error" not in res, res.get("error")
    assert res["shapes_ok"] and res["dtype_ok"], res
    assert res["unwritten"] == 0, f"{res['unwritten']} output elements never written"
    assert res["exact_zero"], "tokens with only slot -1 must get an exact zero delta"
    assert res["max_err"] <= res["tol"], res


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_triton_routed_linear_matches_base_plus_reference(interp_results: dict, case: str) -> None:
    """Base GEMMs with the delta's expand as their last K steps: every projection's x W_p^T + delta, every output
    element written (the projections' column tiles, row groups, masked and unmasked K loops)."""
    res = interp_results[f"{case}-linear"]
    assert "error" not in res, res.get("error")
    assert res["flat_ok"], res
    assert res["unwritten"] == 0, f"{res['unwritten']} output elements never written"
    assert res["max_err"] <= res["tol"], res


def test_public_ops_read_a_strided_scale_right_on_every_path(interp_results: dict) -> None:
    res = {k: v for k, v in interp_results["strided_scale"].items() if k != "case"}
    assert res and all(err <= TOLERANCE["float32"] for err in res.values()), res


def test_triton_metadata_builder_matches_torch_sort(interp_results: dict) -> None:
    res = interp_results["metadata"]
    bad = [k for k, ok in res.items() if k != "case" and not ok]
    assert not bad, f"slot-sorted rows/offsets differ from torch's stable sort for {bad}"


@pytest.mark.parametrize("case", [f"{c}-{p}" for c in GRAD_CASES for p in PATHS])
def test_triton_forward_with_torch_backward_matches_reference_autograd(interp_results: dict, case: str) -> None:
    res = interp_results[case]
    assert "error" not in res, res.get("error")
    path = case.rsplit("-", 1)[1]
    assert res["calls"] == [path], f"forward should run the Triton {path} kernel once, ran {res['calls']}"
    assert res["grad_fn"].startswith("RoutedLoRAFunction"), res["grad_fn"]
    bad = {key: err for key, err in res["errs"].items() if not err <= res["tol"]}
    assert not bad, f"relative max error above {res['tol']}: {bad}"


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_path_under_interpreter(interp_results: dict, case: str) -> None:
    res = interp_results[case]
    assert "error" not in res, res.get("error")
    want = AUTO_CASES[case][-1]
    assert res["chosen"] == want and res["calls"] == [want], f"expected {want}: {res}"
    assert res["dtype_ok"] and res["err"] <= res["tol"], res


def test_auto_cases_straddle_the_dispatcher_thresholds(monkeypatch) -> None:
    """Keeps AUTO_CASES meaningful if the thresholds in kernels/dispatch.py move."""
    import torch

    import molora.kernels.dispatch as dispatch
    monkeypatch.setattr(dispatch, "triton_usable", lambda _x: True)
    for n, k, with_meta, s, r, want in AUTO_CASES.values():
        assert dispatch.choose_path(torch.zeros(n, 1), k, with_meta, s, r) == want, (n, k, with_meta, s, r, want)


if __name__ == "__main__":
    main()
