"""A learned gate's decode-step decision as one Triton launch (issue 32, "learned rows captured too").

routing/decision.py's block_decision, compiled by inductor, is five kernels a block on CUDA (the norm's sums, the
logits, the top-k, the softmax, the slot lookup and select: reductions over different dimensions, which inductor
keeps apart), each a few microseconds on [n, E] tensors: 140 of a Qwen3-1.7B-shaped learned step's 621 kernels.
Here one program per row does all of it: the RMS norm of each part (the block input and each routing state), the
gate logits, k rounds of argmax (equal logits to the lowest expert, as block_decision and the CPU's C step), the
softmax of the k logits, the expert -> slot lookup, a picture's held decision, padding to k_max, and the gated-row
select against the other gate set's decision or the static slot. The numbers round as block_decision's do: each
normalised part to the weight's dtype before the products, the logits to the weight's dtype after them.

A decode step's decision is latency, not bandwidth (a few tens of kilobytes a block), so the program issues its
loads together: BLOCK_P parts of the input and their gate columns as one tile ([BLOCK_E, BLOCK_P, BLOCK_D]), their
norms and products after. (A first version walked the parts one load after another and took as long as the five
kernels; RESULTS.md, E1.) Inputs wider than BLOCK_D take two passes a group of parts: sums of squares, then products.
"""

from __future__ import annotations

import torch

from molora.kernels.triton_common import HAS_TRITON, tl, triton


def learned_decision(hidden: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor,
                     expert_slots: torch.Tensor, gated: torch.Tensor, old_slots: torch.Tensor | None,
                     old_weights: torch.Tensor | None, static: torch.Tensor, held_slots: torch.Tensor | None,
                     held_weights: torch.Tensor | None, held_use: torch.Tensor | None, k: int, k_max: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """routing.decision.block_decision's arguments and results: (slots [n, k_max] long, weights [n, k_max] float32,
    logits [n, E] float32, top-k experts [n, k] long) for n rows of block inputs `hidden` [n, d] and routing states
    `state` [n, S, d] (or None: the gate reads the block input alone, not normalised)."""
    n, d = hidden.shape
    experts = weight.shape[0]
    parts = 0 if state is None else state.shape[1]
    hidden, weight = _rows(hidden), _rows(weight)
    state = hidden if state is None else state.contiguous()
    slots = torch.empty(n, k_max, dtype=torch.long, device=hidden.device)
    weights = torch.empty(n, k_max, dtype=torch.float32, device=hidden.device)
    logits = torch.empty(n, experts, dtype=torch.float32, device=hidden.device)
    top = torch.empty(n, k, dtype=torch.long, device=hidden.device)
    has_old, has_held = old_slots is not None, held_slots is not None
    old_slots, old_weights = (_rows(old_slots), _rows(old_weights)) if has_old else (slots, weights)
    if has_held:
        held_slots, held_weights, held_use = _rows(held_slots), _rows(held_weights), held_use.reshape(-1)
    else:
        held_slots, held_weights, held_use = top, weights, gated
    block_e = max(2, triton.next_power_of_2(experts))
    block_d = min(triton.next_power_of_2(d), max(16, _TILE // block_e))
    block_p = max(1, min(triton.next_power_of_2(parts + 1), _TILE // (block_e * block_d)))
    tile = block_e * block_p * block_d
    _decision_kernel[(n,)](
        hidden, state, weight, expert_slots, gated, old_slots, old_weights, static, held_slots, held_weights,
        held_use, slots, weights, logits, top,
        d, experts, hidden.stride(0), weight.stride(0), old_slots.stride(0), old_weights.stride(0),
        held_slots.stride(0), held_weights.stride(0),
        PARTS=parts, K=k, K_MAX=k_max, BLOCK_K=max(2, triton.next_power_of_2(k_max)), BLOCK_E=block_e,
        BLOCK_P=block_p, BLOCK_D=block_d, ONE_TILE=block_d >= d, HAS_OLD=has_old, HAS_HELD=has_held, W_DTYPE=_TL_DTYPES[weight.dtype],
        num_warps=4 if tile <= 4096 else 8 if tile <= 16384 else 16)
    return slots, weights, logits, top


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does this kernel take the call (Triton present, CUDA tensors, a weight dtype it rounds to)?"""
    return HAS_TRITON and hidden.is_cuda and weight.dtype in _TL_DTYPES


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dimension (the kernel takes a row stride only)."""
    return t if t.stride(-1) == 1 else t.contiguous()


# Most gate weights one program holds at once (register pressure at 16 warps: 64 numbers a thread)
_TILE = 32768

if HAS_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _decision_kernel(h_ptr, state_ptr, w_ptr, expert_slots_ptr, gated_ptr, old_s_ptr, old_w_ptr, static_ptr,
                         held_s_ptr, held_w_ptr, held_use_ptr, out_s_ptr, out_w_ptr, logits_ptr, top_ptr,
                         D, E, stride_h, stride_w, stride_old_s, stride_old_w, stride_held_s, stride_held_w,
                         PARTS: tl.constexpr, K: tl.constexpr, K_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
                         HAS_OLD: tl.constexpr,
                         HAS_HELD: tl.constexpr, W_DTYPE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        cols = tl.arange(0, BLOCK_D)
        dots = tl.zeros([BLOCK_E], dtype=tl.float32)
        for p0 in tl.static_range(0, PARTS + 1, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_ok = p <= PARTS
            # part 0 is the block input, part p > 0 the routing state p - 1 (masks keep each load to its own)
            h_ptrs = h_ptr + row * stride_h + p[:, None] * 0
            s_ptrs = state_ptr + (row * PARTS + p[:, None] - 1) * D
            w_ptrs = w_ptr + e[:, None, None] * stride_w + p[None, :, None] * D
            w_ok = e_ok[:, None, None] & p_ok[None, :, None]
            if ONE_TILE:  # the input's width fits BLOCK_D: every load issued before any is waited on
                ok = cols[None, :] < D
                x = (tl.load(h_ptrs + cols[None, :], mask=ok & (p[:, None] == 0), other=0.0).to(tl.float32)
                     + tl.load(s_ptrs + cols[None, :], mask=ok & (p[:, None] > 0) & p_ok[:, None],
                               other=0.0).to(tl.float32))
                w = tl.load(w_ptrs + cols[None, None, :], mask=w_ok & ok[None], other=0.0).to(tl.float32)
                if PARTS > 0:  # each part's RMS norm (block_decision: parts * rsqrt(mean(parts ** 2) + 1e-6))
                    x = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) / D + 1e-6))[:, None]
                x = x.to(W_DTYPE).to(tl.float32)
                dots += tl.sum(tl.sum(w * x[None], 2), 1)
            else:
                rstd = tl.full([BLOCK_P], 1.0, dtype=tl.float32)
                if PARTS > 0:
                    squares = tl.zeros([BLOCK_P], dtype=tl.float32)
                    for c in range(0, D, BLOCK_D):
                        ok = c + cols[None, :] < D
                        x = (tl.load(h_ptrs + c + cols[None, :], mask=ok & (p[:, None] == 0), other=0.0)
                             .to(tl.float32)
                             + tl.load(s_ptrs + c + cols[None, :], mask=ok & (p[:, None] > 0) & p_ok[:, None],
                                       other=0.0).to(tl.float32))
                        squares += tl.sum(x * x, 1)
                    rstd = 1.0 / tl.sqrt(squares / D + 1e-6)
                for c in range(0, D, BLOCK_D):
                    ok = c + cols[None, :] < D
                    x = (tl.load(h_ptrs + c + cols[None, :], mask=ok & (p[:, None] == 0), other=0.0).to(tl.float32)
                         + tl.load(s_ptrs + c + cols[None, :], mask=ok & (p[:, None] > 0) & p_ok[:, None],
                                   other=0.0).to(tl.float32))
                    w = tl.load(w_ptrs + c + cols[None, None, :], mask=w_ok & ok[None], other=0.0).to(tl.float32)
                    x = (x * rstd[:, None]).to(W_DTYPE).to(tl.float32)
                    dots += tl.sum(tl.sum(w * x[None], 2), 1)
        logits = dots.to(W_DTYPE).to(tl.float32)
        tl.store(logits_ptr + row * E + e, logits, mask=e_ok)
        # top-k: k rounds of argmax, equal logits to the lowest expert
        j = tl.arange(0, BLOCK_K)
        rest = tl.where(e_ok, logits, float("-inf"))
        values = tl.zeros([BLOCK_K], dtype=tl.float32)
        top = tl.zeros([BLOCK_K], dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.argmax(rest, 0, tie_break_left=True)
            values = tl.where(j == i, tl.max(rest, 0), values)
            top = tl.where(j == i, best, top)
            rest = tl.where(e == best, float("-inf"), rest)
        chosen = j < K
        tl.store(top_ptr + row * K + j, top.to(tl.int64), mask=chosen)
        mix = tl.where(chosen, tl.exp(values - tl.max(tl.where(chosen, values, float("-inf")), 0)), 0.0)
        mix = mix / tl.sum(mix, 0)
        slots = tl.load(expert_slots_ptr + top, mask=chosen, other=-1)
        if HAS_HELD:  # a picture's kept decision
            use = tl.load(held_use_ptr + row)
            slots = tl.where(use, tl.load(held_s_ptr + row * stride_held_s + j, mask=chosen, other=-1), slots)
            mix = tl.where(use, tl.load(held_w_ptr + row * stride_held_w + j, mask=chosen, other=0.0), mix)
        slots = tl.where(chosen, slots, -1)
        mix = tl.where(chosen, mix, 0.0)
        if HAS_OLD:  # another gate set's decision this block
            old_slots = tl.load(old_s_ptr + row * stride_old_s + j, mask=j < K_MAX, other=-1)
            old_mix = tl.load(old_w_ptr + row * stride_old_w + j, mask=j < K_MAX, other=0.0)
        else:  # the static slot in column 0 with weight 1
            static = tl.load(static_ptr + row).to(tl.int64)
            old_slots = tl.where(j == 0, static, -1)
            old_mix = tl.where((j == 0) & (static >= 0), 1.0, 0.0)
        gated = tl.load(gated_ptr + row)
        tl.store(out_s_ptr + row * K_MAX + j, tl.where(gated, slots.to(tl.int64), old_slots.to(tl.int64)),
                 mask=j < K_MAX)
        tl.store(out_w_ptr + row * K_MAX + j, tl.where(gated, mix, old_mix.to(tl.float32)), mask=j < K_MAX)
else:
    _TL_DTYPES = {}
