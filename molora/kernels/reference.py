"""Plain PyTorch references for the routed LoRA ops: the source of truth every fast path is tested against.

Shapes (DESIGN.md §3):
    x      [N, in]           activations, one row per token
    A      [S, r, in]        stacked LoRA down-projections, one per hot-set slot (zero-padded to r)
    B      [S, out, r]       stacked LoRA up-projections
    slot   [N] int32/int64   adapter slot of each token; -1 means "no adapter"
    slots  [N, k]            top-k slots per token (-1 entries contribute nothing)
    weight [N, k]            mixing weight of each of the k slots
    scale  [S]               lora_alpha / r (or the rsLoRA scale) of each slot
Returns the delta [N, out] in x's dtype, accumulated in float32.
"""

from __future__ import annotations

import torch


def routed_lora_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot: torch.Tensor,
                          scale: torch.Tensor) -> torch.Tensor:
    """delta[n] = scale[s] * B[s] @ (A[s] @ x[n]) with s = slot[n]; zero where s == -1."""
    out = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float32, device=x.device)
    x32 = x.float()
    for s in torch.unique(slot).tolist():
        if s < 0:
            continue
        rows = (slot == s).nonzero(as_tuple=True)[0]
        shrunk = x32[rows] @ A[s].float().t()
        out[rows] = (shrunk @ B[s].float().t()) * scale[s].float()
    return out.to(x.dtype)


def routed_lora_topk_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                               weights: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """delta[n] = sum_j weight[n, j] * scale[s] * B[s] @ (A[s] @ x[n]) with s = slots[n, j]."""
    out = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float32, device=x.device)
    for j in range(slots.shape[1]):
        part = routed_lora_reference(x.float(), A, B, slots[:, j], scale).float()
        out += part * weights[:, j:j + 1].float()
    return out.to(x.dtype)


def routed_lora_group_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                                weights: torch.Tensor | None, scale: torch.Tensor,
                                bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """P projections sharing x: A [P, S, r, in], B [S, O, r] (projection p: columns bounds[p]:bounds[p+1]),
    scale [P, S]; slots [N, k], weights [N, k] or None (1). Each delta is routed_lora_topk_reference of its own
    projection."""
    slots = slots[:, None] if slots.dim() == 1 else slots
    w = weights if weights is not None else torch.ones(slots.shape, device=x.device)
    return [routed_lora_topk_reference(x, A[p], B[:, lo:hi], slots, w, scale[p])
            for p, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """kernels/triton_attention.py's decode_attention in float32: q [n, Hkv, G, D] over the first lengths[n] columns
    of keys / values [n, Hkv, L, D]; returns [n, Hkv, G, D] in q's dtype."""
    columns = torch.arange(keys.shape[2], device=q.device)
    seen = columns[None, :] < lengths[:, None].to(q.device)  # [n, L]
    scores = torch.einsum("njgd,njld->njgl", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.einsum("njgl,njld->njgd", scores.softmax(-1), values.float()).to(q.dtype)
