"""RoutedLoRALinear: an nn.Linear that adds a per-token routed LoRA delta, y = x W^T + b + routed_lora(x, ...).

It *is* an nn.Linear sharing the original weight and bias Parameters (same state-dict keys, so the HF model
still saves and loads as the base model), plus non-persistent buffers holding the hot-set slots
A[S, r_max, in], B[S, out, r_max], scale[S].  They are allocated once here; HotSetCache only ever copies into
them, so their addresses stay fixed (CUDA-graph friendly).  Buffers follow `model.to(device / dtype)`.

The layer builds no routing metadata: it reads the per-call `CallRouting` (routing/context.py) that
RoutedModel.forward set up once for the whole pass.  No routing active -> exactly the base linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reads_meta, routed_lora, routed_lora_topk
from routing.context import current_routing
from routing.errors import RoutingError


class RoutedLoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, num_slots: int, r_max: int, *, name: str = "",
                 block: int | None = None) -> None:
        nn.Module.__init__(self)  # skip nn.Linear.__init__: reuse the base Parameters, allocate nothing new
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.num_slots, self.r_max = num_slots, r_max
        self.name, self.block = name, block
        w = base.weight
        kw = {"dtype": w.dtype, "device": w.device}
        self.register_buffer("lora_A", torch.zeros(num_slots, r_max, self.in_features, **kw), persistent=False)
        self.register_buffer("lora_B", torch.zeros(num_slots, self.out_features, r_max, **kw), persistent=False)
        self.register_buffer("lora_scale", torch.zeros(num_slots, **kw), persistent=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slots={self.num_slots}, r_max={self.r_max}, block={self.block}"

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.lora_scale[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        routing = current_routing()
        if routing is None:
            return y
        slots, weights = routing.for_block(self.block)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != slots.shape[0]:
            raise RoutingError(f"routed layer '{self.name}' got {x2.shape[0]} tokens but the routing covers "
                               f"{slots.shape[0]}; call the model through RoutedModel.forward with the same input_ids")
        # slot-sorted rows, built once per forward and shared by every layer; decode-sized calls take a path
        # that does not read them, so they are not built there
        k = slots.shape[1] if slots.dim() == 2 else 1
        meta = routing.meta(self.block) if reads_meta(x2, k, self.lora_A) else None
        out = y.view(-1, self.out_features)  # the kernels add the delta into the base output in place
        if weights is None:
            routed_lora(x2, self.lora_A, self.lora_B, slots, self.lora_scale, out=out, meta=meta)
        else:
            routed_lora_topk(x2, self.lora_A, self.lora_B, slots, weights, self.lora_scale, out=out, meta=meta)
        return y
