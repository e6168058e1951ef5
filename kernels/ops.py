"""Public routed-LoRA ops (CONTRACTS.md): routed_lora and routed_lora_topk.

    delta[n] = sum_j weights[n, j] * scale[s] * B[s] @ A[s] @ x[n],   s = slots[n, j]  (routed_lora: k = 1, w = 1)

Returned in x's dtype, accumulated in float32. Slot -1 means no adapter (zero delta, and no work on the
accumulate path). With `out=` the delta is added into `out` in place (out += delta) and `out` is returned, so a
routed layer can add straight into its base output. `meta=` takes a RoutingMeta from build_routing_meta(slots, S),
built once per forward and shared by every layer with the same routing (only the grouped kernel reads it).
"""

from __future__ import annotations

import torch

from kernels.autograd import RoutedLoRAFunction, needs_autograd
from kernels.checks import check_inputs
from kernels.dispatch import routed_lora_forward
from kernels.errors import KernelInputError
from kernels.metadata import RoutingMeta


def _check_meta(meta: RoutingMeta | None, slots: torch.Tensor, num_slots: int) -> None:
    if meta is not None and (meta.n_tokens, meta.k, meta.num_slots) != (slots.shape[0], slots.shape[1], num_slots):
        raise KernelInputError(
            f"meta was built for N={meta.n_tokens}, k={meta.k}, S={meta.num_slots} but the call has "
            f"N={slots.shape[0]}, k={slots.shape[1]}, S={num_slots}; rebuild it with build_routing_meta")


def _run(x, A, B, slots, weights, scale, out, meta, path):
    check_inputs(x, A, B, slots, weights, scale, out)
    _check_meta(meta, slots, A.shape[0])
    if needs_autograd(x, A, B, weights):
        delta = RoutedLoRAFunction.apply(x, A, B, slots, weights, scale, meta, path)
        return delta if out is None else out.add_(delta)
    return routed_lora_forward(x, A, B, slots, weights, scale, out, meta, path)


def routed_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor,
                *, out: torch.Tensor | None = None, meta: RoutingMeta | None = None,
                path: str = "auto") -> torch.Tensor:
    """Per-token LoRA delta: x [N, in], A [S, r, in], B [S, out, r], slot [N] int (-1 = none), scale [S]."""
    if not isinstance(slot, torch.Tensor) or slot.dim() != 1:
        raise KernelInputError(f"slot must be a 1-D integer tensor [N], got {getattr(slot, 'shape', type(slot))}")
    return _run(x, A, B, slot[:, None], None, scale, out, meta, path)


def routed_lora_topk(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                     weights: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None,
                     meta: RoutingMeta | None = None, path: str = "auto") -> torch.Tensor:
    """Top-k mixture of LoRA deltas: slots [N, k] int (-1 entries ignored), weights [N, k] (differentiable)."""
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2:
        raise KernelInputError(f"slots must be a 2-D integer tensor [N, k], got {getattr(slots, 'shape', type(slots))}")
    if weights is None:
        raise KernelInputError("routed_lora_topk needs weights [N, k]; use routed_lora for one slot per token")
    return _run(x, A, B, slots, weights, scale, out, meta, path)
