"""Routed LoRA kernels: per-token adapter selection in one pass (PyTorch reference, torch CPU path, Triton GPU);
and the engine's split-K decode attention (triton_attention.py, imported where it is used)."""

from molora.kernels.dispatch import reads_meta
from molora.kernels.errors import KernelInputError
from molora.kernels.metadata import RoutingMeta, build_routing_meta
from molora.kernels.ops import routed_lora, routed_lora_group, routed_lora_topk
from molora.kernels.reference import (
           routed_lora_group_reference,
           routed_lora_reference,
           routed_lora_topk_reference,
)

__all__ = ["routed_lora", "routed_lora_topk", "routed_lora_group", "routed_lora_reference",
           "routed_lora_topk_reference", "routed_lora_group_reference",
           "build_routing_meta", "RoutingMeta", "KernelInputError", "reads_meta"]
