"""The per-call routing state, visible to every routed layer of one forward pass.

RoutedModel.forward builds a `CallRouting` once (a `PlacedRouting` for a model spread over devices), sets it in a ContextVar for the duration of the HF model's
forward, and resets it afterwards.  Layers read it with `current_routing()`.  A ContextVar is per thread (and per
asyncio task), so two requests running at once never see each other's routing and there is no global state.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from molora.kernels import build_routing_meta
from molora.routing.decision import static_tables
from molora.routing.errors import RoutingError


@dataclass
class BlockDecision:
    """What a learned gate decided in one block, kept for the aux losses and the routing report."""

    logits: torch.Tensor  # [n, E] float32 gate logits of the gated tokens' rows
    topk: torch.Tensor  # [n, k] expert indices
    mask: torch.Tensor  # [n] bool: positions the gate actually routes (text positions of learned rows)
    base_expert: bool = False  # the last logit column is the base expert (no adapter)


@dataclass
class CallRouting:
    """Routing of one forward pass over N = B*T tokens.

    Static routing (vocabulary range, per sequence) is `slots` [N].  When any row uses a LearnedRouter, each
    block gets its own [N, k] slots and weights, filled by the block's pre-hook (`route_block`) from the block
    input; rows without a learned router keep their static slot in column 0 with weight 1.
    """

    batch: int
    length: int
    slots: torch.Tensor  # [N] long, -1 = base model
    num_slots: int
    slot_of: dict[str, int] = field(default_factory=dict)  # adapter name -> slot pinned for this call
    learned: list[Any] = field(default_factory=list)  # routers.LearnedGroup, one per distinct LearnedRouter
    k: int = 1
    # the CPU's routed base GEMMs take kernels.torch_ops.cpu_linear, whose numbers for a row do not depend on the
    # call's other rows (the serving engine's decode steps with exact rows)
    exact_rows: bool = False
    # rows from here on are padding whose outputs nobody reads (the CPU engine's decode steps; None: none are)
    live_rows: int | None = None
    block_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    decisions: dict[int, list[tuple[Any, BlockDecision]]] = field(default_factory=dict)
    _static_k: tuple[torch.Tensor, torch.Tensor] | None = None
    _meta: dict[int | None, Any] = field(default_factory=dict)
    _slots2d: torch.Tensor | None = None
    # projection group -> its members' outputs computed by the first member called (routing/lora.py)
    shared: dict[Any, SharedOutputs] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.batch * self.length

    def static_topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The static slots as [N, k] slots / weights (slot in column 0, weight 1; -1 / 0 elsewhere)."""
        if self._static_k is None:
            self._static_k = static_tables(self.slots, self.k)
        return self._static_k

    def for_block(self, block: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(slots, weights) for a layer of `block`: ([N], None) when static, ([N, k], [N, k]) when learned."""
        if not self.learned:
            return self.slots, None
        if block is not None and block in self.block_slots:
            return self.block_slots[block]
        return self.static_topk()

    def kernel_slots(self, block: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """for_block(block) with static slots as [N, 1] (the kernels' form), the view made once per forward."""
        slots, weights = self.for_block(block)
        if slots.dim() == 2:
            return slots, weights
        if self._slots2d is None:
            self._slots2d = slots[:, None]
        return self._slots2d, None

    def meta(self, block: int | None) -> Any:
        """Slot-sorted kernel metadata for the layers of `block`, built once per forward."""
        key = block if self.learned and block in self.block_slots else None
        if key not in self._meta:
            slots, weights = self.for_block(block)
            self._meta[key] = build_routing_meta(slots, self.num_slots, weights)
        return self._meta[key]

    def route_block(self, block: int, hidden: torch.Tensor) -> None:
        """Run every learned gate on the block input `hidden` [B, T, d] and store the block's decision."""
        if hidden.shape[0] * hidden.shape[1] != self.num_tokens:
            raise RoutingError(f"block {block} input has shape {tuple(hidden.shape)} but routing was built for "
                               f"{self.batch}x{self.length} tokens")
        # the compiled decision of a decode step makes the static slots itself, in its own kernel (no clone)
        slots = weights = None
        if not all(group.fuses(hidden) for group in self.learned):
            slots, weights = (t.clone().view(self.batch, self.length, self.k) for t in self.static_topk())
        decisions = []
        for group in self.learned:
            slots, weights, decision = group.decide(block, hidden, slots, weights, self.k, self.slots)
            decisions.append((group, decision))
        self.block_slots[block] = (slots.view(-1, self.k), weights.view(-1, self.k))
        self.decisions[block] = decisions


@dataclass
class PlacedRouting(CallRouting):
    """CallRouting of a model spread over devices (accelerate's device_map): built on the input's device as ever,
    and read by each routed layer on the device it computes on.

    Layers pass `route_key` = (block, device) (routing/lora.py).  Slots and weights (static, or a learned block's
    decision) and the kernels' slot-sorted metadata are copied to a device the first time a layer there asks, and
    kept for the rest of the forward: one copy per forward per device (learned routing: per block and device, as its
    decision is per block).  Learned gates run on the routing's device: the block input is brought to it.
    """

    _placed: dict[tuple[Any, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    _placed_meta: dict[tuple[Any, torch.device], Any] = field(default_factory=dict)
    _placed_2d: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def _key(self, block: int | None) -> int | None:
        return block if self.learned and block in self.block_slots else None

    def _on(self, block: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """for_block(block) on `device`, copied once per forward."""
        key = (self._key(block), device)
        got = self._placed.get(key)
        if got is None:
            slots, weights = CallRouting.for_block(self, block)
            if slots.device != device:  # to a GPU: no host sync, the copy is queued like the kernels
                quiet = device.type == "cuda"  # (to the host it must block: the CPU reads it right away)
                slots = slots.to(device, non_blocking=quiet)
                weights = None if weights is None else weights.to(device, non_blocking=quiet)
            got = self._placed[key] = (slots, weights)
        return got

    def for_block(self, key: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(key, tuple):
            return CallRouting.for_block(self, key)
        return self._on(*key)

    def kernel_slots(self, key: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(key, tuple):
            return CallRouting.kernel_slots(self, key)
        slots, weights = self._on(*key)
        if slots.dim() == 2:
            return slots, weights
        device = key[1]
        if device not in self._placed_2d:
            self._placed_2d[device] = slots[:, None]
        return self._placed_2d[device], None

    def meta(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return CallRouting.meta(self, key)
        block, device = key
        mkey = (self._key(block), device)
        if mkey not in self._placed_meta:
            slots, weights = self._on(block, device)
            self._placed_meta[mkey] = build_routing_meta(slots, self.num_slots, weights)
        return self._placed_meta[mkey]

    def route_block(self, block: int, hidden: torch.Tensor) -> None:
        device = self.slots.device
        super().route_block(block, hidden if hidden.device == device else hidden.to(device))


@dataclass
class SharedOutputs:
    """Outputs (base linear + routed delta) a projection group computed in one call for all its members, waiting
    for the members that have not run yet in this forward (routing/lora.py). Holds x, so `x is` identifies the
    input they were computed from."""

    x: torch.Tensor
    outputs: list[torch.Tensor | None]
    left: int

    def take(self, index: int, routing: CallRouting, group: Any) -> torch.Tensor:
        output, self.outputs[index] = self.outputs[index], None
        self.left -= 1
        if self.left == 0:  # every member has its output: drop the entry (and the reference to x)
            del routing.shared[group]
        return output


_ROUTING: ContextVar[CallRouting | None] = ContextVar("molora_routing", default=None)


def current_routing() -> CallRouting | None:
    """The routing of the forward pass running in this thread / task, or None (plain base model)."""
    return _ROUTING.get()


def set_routing(routing: CallRouting | None) -> Any:
    return _ROUTING.set(routing)


def reset_routing(token: Any) -> None:
    _ROUTING.reset(token)
