"""Public routed-LoRA ops (CONTRACTS.md): routed_lora, routed_lora_topk and routed_lora_group.

    delta[n] = sum_j weights[n, j] * scale[s] * B[s] @ A[s] @ x[n],   s = slots[n, j]  (routed_lora: k = 1, w = 1)

Returned in x's dtype, accumulated in float32. Slot -1 means no adapter (zero delta, and no work on the
accumulate path). With `out=` the delta is added into `out` in place (out += delta) and `out` is returned, so a
routed layer can add straight into its base output. `meta=` takes a RoutingMeta from build_routing_meta(slots, S),
built once per forward and shared by every layer with the same routing (only the grouped kernel reads it).
routed_lora_group computes the deltas of several projections that read the same x (q/k/v, gate/up) with one
shrink and one expand for all of them; routed layers then run their base GEMMs onto those deltas (addmm_,
beta = 1), so a delta costs no extra pass over the output (on eager decode calls they instead add the deltas into
their GEMMs' outputs: routing/lora.py with kernels/triton_stacked.py's FusedLaunch).
"""

from __future__ import annotations

import torch

from molora.kernels.autograd import RoutedLoRAFunction, needs_autograd
from molora.kernels.checks import check_inputs
from molora.kernels.dispatch import routed_lora_forward, routed_lora_group_forward
from molora.kernels.errors import KernelInputError
from molora.kernels.metadata import RoutingMeta
from molora.kernels.triton_common import MAX_PROJECTIONS


def _check_meta(meta: RoutingMeta | None, slots: torch.Tensor, num_slots: int) -> None:
    if meta is not None and (meta.n_tokens, meta.k, meta.num_slots) != (slots.shape[0], slots.shape[1], num_slots):
        raise KernelInputError(
            f"meta was built for N={meta.n_tokens}, k={meta.k}, S={meta.num_slots} but the call has "
            f"N={slots.shape[0]}, k={slots.shape[1]}, S={num_slots}; rebuild it with build_routing_meta")


def _run(x, A, B, slots, weights, scale, out, meta, path):
    check_inputs(x, A, B, slots, weights, scale, out)
    _check_meta(meta, slots, A.shape[0])
    scale = scale.contiguous()  # (the kernels read scale with unit stride; a no-op for the routed layers' buffers)
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


def routed_lora_group(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                      weights: torch.Tensor | None, scale: torch.Tensor, bounds: tuple[int, ...], *,
                      meta: RoutingMeta | None = None, path: str = "auto") -> list[torch.Tensor]:
    """Deltas of P projections that read the same x [N, in]: A [P, S, r, in], B [S, O, r] where projection p owns
    output columns bounds[p]:bounds[p+1] (bounds[0] = 0, bounds[P] = O), scale [P, S], slots [N] or [N, k],
    weights [N, k] or None (weight 1). Returns P tensors [N, width_p] in x's dtype."""
    if not isinstance(A, torch.Tensor) or A.dim() != 4:
        raise KernelInputError(f"A must be [P, S, r, in], got {getattr(A, 'shape', type(A))}")
    p_count = A.shape[0]
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) != p_count + 1 or bounds[0] != 0 or bounds[-1] != B.shape[1] or \
            any(b > c for b, c in zip(bounds, bounds[1:])):
        raise KernelInputError(f"bounds must rise from 0 to O={B.shape[1]} in P+1={p_count + 1} steps, got {bounds}")
    if p_count > MAX_PROJECTIONS:
        raise KernelInputError(f"at most {MAX_PROJECTIONS} projections share one call, got P={p_count}")
    if not isinstance(scale, torch.Tensor) or scale.shape != A.shape[:2]:
        raise KernelInputError(f"scale must be [P, S]={tuple(A.shape[:2])}, got {getattr(scale, 'shape', None)}")
    slots2 = slots[:, None] if isinstance(slots, torch.Tensor) and slots.dim() == 1 else slots
    for p in range(p_count):
        check_inputs(x, A[p], B[:, bounds[p]:bounds[p + 1]], slots2, weights, scale[p], None)
    _check_meta(meta, slots2, A.shape[1])
    scale = scale.contiguous()  # (the kernels read each row of scale with unit stride)
    if needs_autograd(x, A, B, weights):
        return [RoutedLoRAFunction.apply(x, A[p], B[:, lo:hi], slots2, weights, scale[p], meta, path)
                for p, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    return routed_lora_group_forward(x, A, B, slots2, weights, scale, bounds, meta, path)
