"""Autograd for routed LoRA: fast forward (whatever the dispatcher picks), torch-path backward.

Gradients flow to x, A, B and the top-k weights (a learned router trains through the weights); scale and slot
ids are treated as constants. The backward reads slot counts on the host (kernels/torch_ops.py), which is fine
for training and never happens on an inference step (no tensor requires grad there, so no Function is used).
"""

from __future__ import annotations

import torch

from molora.kernels.dispatch import routed_lora_forward
from molora.kernels.metadata import RoutingMeta
from molora.kernels.torch_ops import routed_lora_torch_backward


class RoutedLoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                weights: torch.Tensor | None, scale: torch.Tensor, meta: RoutingMeta | None,
                path: str) -> torch.Tensor:
        ctx.save_for_backward(x, A, B, slots, weights, scale)
        return routed_lora_forward(x, A, B, slots, weights, scale, None, meta, path)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, A, B, slots, weights, scale = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2],
                 weights is not None and ctx.needs_input_grad[4])
        dx, dA, dB, dw = routed_lora_torch_backward(grad, x, A, B, slots, weights, scale, needs)
        cast = [None if g is None else g.to(t.dtype) for g, t in ((dx, x), (dA, A), (dB, B), (dw, weights))]
        return cast[0], cast[1], cast[2], None, cast[3], None, None, None


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
