"""Per-token LoRA routing: PEFT adapters, a hot-set slot cache, routed linear layers and routers.

    routed = attach_routed_lora(model, num_slots=4, r_max=16)
    routed.load_adapter("assets/adapters/outline")
    out = routed(input_ids, routers=VocabRangeRouter(vocab, text_adapter="formal", image_adapter="outline"))
"""

from molora.routing.adapters import LoraAdapter, load_peft_adapter, merge_adapters, save_peft_adapter
from molora.routing.cache import AdapterInfo, HotSetCache
from molora.routing.errors import AdapterError, CacheFullError, MoLoRAError, RoutingError, UnknownAdapterError
from molora.routing.lora import RoutedLoRALinear
from molora.routing.modality import ModalityMap, ModalityTable
from molora.routing.model import RoutedModel, RoutedOutput, TokenRouting, attach_routed_lora
from molora.routing.routers import (
    LabelRouter,
    LearnedGates,
    LearnedRouter,
    Router,
    SequenceRouter,
    VocabRangeRouter,
    load_balance_loss,
    router_z_loss,
)

__all__ = [
    "MoLoRAError", "AdapterError", "UnknownAdapterError", "CacheFullError", "RoutingError",
    "LoraAdapter", "load_peft_adapter", "merge_adapters", "save_peft_adapter",
    "attach_routed_lora", "RoutedModel", "RoutedOutput", "HotSetCache", "AdapterInfo", "RoutedLoRALinear",
    "VocabRangeRouter", "SequenceRouter", "LabelRouter", "LearnedRouter", "LearnedGates", "Router", "TokenRouting",
    "load_balance_loss", "router_z_loss", "ModalityMap", "ModalityTable",
]
