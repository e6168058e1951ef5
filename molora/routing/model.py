"""attach_routed_lora and RoutedModel: per-token LoRA routing around any transformers causal LM.

attach_routed_lora replaces the target nn.Linear modules by RoutedLoRALinear (sharing their weights), puts a
HotSetCache over them, and registers a forward pre-hook on every transformer block so learned gates can route on
the block input.  RoutedModel.forward then, per call:

    1. collects the adapters the routers name and pins them in the hot set (acquire),
    2. builds the routing of every token ONCE (CallRouting: slots [N], or per-block top-k for learned rows),
    3. runs ONE forward of the HF model with that routing set in a ContextVar (per thread / task),
    4. resets the context and unpins (release), even when the forward raises.

Models spread over devices (accelerate's device_map, dispatched BEFORE attaching): each wrapped layer's slots are
allocated on the device that layer computes on (its accelerate hook's execution device, else its weight's
device), the layer keeps its accelerate hook, and every forward's routing is a PlacedRouting, which copies what
the layers read to their devices once per forward per device.  Found once, at attach time (`RoutedModel.placement`);
a model on one device keeps the plain path.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from molora.routing.adapters import LoraAdapter, check_base_model, load_peft_adapter, save_peft_adapter
from molora.routing.cache import AdapterInfo, HotSetCache
from molora.routing.context import (
    BlockDecision,
    CallRouting,
    PlacedRouting,
    current_routing,
    reset_routing,
    set_routing,
)
from molora.routing.decision import top_k_first
from molora.routing.errors import AdapterError, RoutingError
from molora.routing.lora import PlacedRoutedLoRALinear, ProjectionGroup, RoutedLoRALinear, group_projections
from molora.routing.routers import LearnedGroup, LearnedRouter, Router, load_balance_loss, router_z_loss

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TokenRouting:
    """Which adapter each position used.  slots [B, T] (static) or [B, T, k] with weights (learned: the top-k
    of the routing weight averaged over blocks).  slot_names maps the slots of this call to adapter names."""

    slots: torch.Tensor
    weights: torch.Tensor | None
    slot_names: dict[int, str]

    def adapter_names(self, b: int) -> list[str | None]:
        """The adapter used at each position of sequence `b` (top-1 for learned routing); None = base model."""
        row = self.slots[b]
        if row.dim() == 2:
            row = row[:, 0]
        return [self.slot_names.get(s) for s in row.tolist()]


@dataclass
class RoutedOutput:
    logits: torch.Tensor
    past_key_values: Any
    routing: TokenRouting
    loss: torch.Tensor | None = None  # the HF model's loss when `labels` were passed
    load_balance_loss: torch.Tensor | None = None  # learned routing only: mean over blocks (and routers)
    z_loss: torch.Tensor | None = None
    decisions: dict[int, list[BlockDecision]] | None = None  # learned routing only: per block gate decisions


def _past_key_values(out: Any) -> Any:
    """The KV cache of an HF output: `cache` in transformers >= 5.2x, `past_key_values` before."""
    names = {f.name for f in dataclasses.fields(out)} if dataclasses.is_dataclass(out) else set()
    if "cache" in names:
        return out.cache
    return getattr(out, "past_key_values", None)


def _cached_length(cache: Any) -> int:
    """Positions an HF KV cache already holds (0 for none or an empty one)."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2]) if len(cache) else 0  # legacy tuple of (key, value) per layer


def _carry_routing_states(plan: CallRouting | None, continuing: bool) -> None:
    """Gates with context decays read a causal state of every earlier position. A forward that extends a KV cache
    (token-by-token decode with transformers' cache) continues each row from the state its router kept after the
    previous forward; a forward over a fresh sequence starts from zeros. (The serving engine keeps states per
    cache row itself and calls `run`.)"""
    for group in plan.learned if plan is not None else ():
        if not group.gates.context_decays:
            continue
        state = group.router.carried_states.get(id(group.gates)) if continuing else None
        rows = group.gated.shape[0]
        if continuing and (state is None or state.shape[0] != rows):
            raise RoutingError("this forward extends a KV cache, but its learned router carries no routing state "
                               f"for {rows} rows: pass the same LearnedRouter object to every step of a sequence")
        group.state_in = state


def _keep_routing_states(plan: CallRouting | None) -> None:
    for group in plan.learned if plan is not None else ():
        if group.gates.context_decays and group.state_out is not None:
            group.router.carried_states[id(group.gates)] = group.state_out


# --- attaching ---------------------------------------------------------------------------------------------

@dataclass
class Placement:
    """Where a routed model computes, found once when attaching.

    input_device   where input ids go and routing is built (the input embedding's execution device)
    block_devices  the execution device of each transformer block (its KV cache belongs there)
    spread         the routed layers compute on more than one device, or on another than the input's: layers read
                   routing copied to their device (PlacedRouting)
    offloaded      accelerate streams some weights in from the CPU or disk at each forward (weights on "meta"
                   between calls)
    hooked         accelerate hooks are attached (a dispatched model: do not move it with .to())
    """

    input_device: torch.device
    block_devices: list[torch.device]
    spread: bool
    offloaded: bool
    hooked: bool

    @property
    def devices(self) -> list[torch.device]:
        """Every device the model computes on, the input's first."""
        return list(dict.fromkeys([self.input_device, *self.block_devices]))

    @property
    def one_device(self) -> bool:
        """The whole model lives and computes on one device (nothing offloaded): what CUDA-graph capture needs."""
        return not self.spread and not self.offloaded and len(self.devices) == 1


def _normal(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _hook_device(module: nn.Module) -> torch.device | None:
    """The execution device of an accelerate hook on `module` (a SequentialHook's first that has one), or None."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    for h in hooks:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return _normal(device)
    return None


def execution_device(model: nn.Module, name: str, default: torch.device | None = None) -> torch.device:
    """Where submodule `name` of `model` computes: the execution device of the nearest accelerate hook on it or an
    ancestor (accelerate keeps offloaded weights on "meta" and brings them to that device per call), else the
    device of its first parameter or buffer that is not on "meta", else "meta" when it has tensors (all there), else
    `default` (a module without tensors)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        device = _hook_device(model.get_submodule(".".join(parts[:i])) if i else model)
        if device is not None:
            return device
    module = model.get_submodule(name) if name else model
    tensors = itertools.chain(module.parameters(), module.buffers())
    first = next(tensors, None)
    real = first if first is None or first.device.type != "meta" else next(
        (t for t in tensors if t.device.type != "meta"), None)
    if real is not None:
        return _normal(real.device)
    if first is not None or default is None:
        return torch.device("meta")  # every weight on "meta" and no hook that brings them in
    return default


def input_device(model: nn.Module, default: torch.device | None = None) -> torch.device:
    """Where a (possibly dispatched) model takes its input ids: its input embedding's execution device. A model
    without an input embedding (`get_input_embeddings` missing, or raising NotImplementedError as transformers'
    base class does) takes them on the whole model's device."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embed = None
    name = next((n for n, m in model.named_modules() if m is embed), "") if embed is not None else ""
    return execution_device(model, name, default)


def find_placement(model: nn.Module, layer_names: Sequence[str], block_path: str | None, num_blocks: int
                   ) -> Placement:
    """The Placement of `model` (layer_names: the linears to route; block_path: the blocks' ModuleList)."""
    layer_devices = {execution_device(model, n) for n in layer_names}
    first = next(iter(layer_devices))
    inputs = input_device(model, first)
    prefix = f"{block_path}." if block_path else ""
    blocks = [execution_device(model, f"{prefix}{i}", inputs) for i in range(num_blocks)] \
        if block_path is not None else []
    hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
    offloaded = any(p.device.type == "meta" for p in model.parameters()) and hooked
    spread = layer_devices != {inputs}
    return Placement(inputs, blocks, spread, offloaded, hooked)


def _keep_hook(base: nn.Module, layer: nn.Module) -> None:
    """Give the routed layer the accelerate hook of the linear it replaces (it moves inputs to the execution
    device and, when offloaded, brings the weight in for the call and drops it after)."""
    hook = getattr(base, "_hf_hook", None)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(layer, hook)


def _is_target(name: str, targets: str | Sequence[str]) -> bool:
    """PEFT's convention: a string is a regex over the full module name, a list matches name suffixes."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _find_blocks(model: nn.Module, names: list[str]) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList holding the transformer blocks: the one containing the most routed layers."""
    best, best_count = None, 0
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            prefix = f"{path}." if path else ""
            count = sum(1 for n in names if n.startswith(prefix))
            if count > best_count:
                best, best_count = (path, module), count
    return best


def _block_pre_hook(index: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        routing = current_routing()
        if routing is None or not routing.learned:
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None:
            raise RoutingError(f"block {index} was called without hidden_states; learned routing cannot see its input")
        routing.route_block(index, hidden)
        return None
    return hook


def attach_routed_lora(model: nn.Module, target_modules: str | Sequence[str] = DEFAULT_TARGETS,
                       num_slots: int = 4, r_max: int = 16) -> RoutedModel:
    """Wrap the target nn.Linear modules of a transformers causal LM (in place) and return a RoutedModel.

    A model dispatched over devices by accelerate (`from_pretrained(..., device_map=...)`) is attached after the
    dispatch: each layer's slots go to the device it computes on (see the module docstring)."""
    if not isinstance(num_slots, int) or num_slots < 1 or not isinstance(r_max, int) or r_max < 1:
        raise RoutingError(f"num_slots and r_max must be positive ints, got {num_slots!r}, {r_max!r}")
    if any(isinstance(m, RoutedLoRALinear) for m in model.modules()):
        raise RoutingError("this model already has routed LoRA layers; attach_routed_lora once per model")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _is_target(n, target_modules)]
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise RoutingError(f"no nn.Linear matches target_modules={target_modules!r}; this model's linear layers "
                           f"are named {linear}")
    found = _find_blocks(model, names)
    blocks: list[nn.Module] = []
    block_path = None
    if found is not None:
        block_path, module_list = found
        blocks = list(module_list)
    placement = find_placement(model, names, block_path, len(blocks))
    layers: dict[str, RoutedLoRALinear] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = None
        if block_path is not None:
            prefix = f"{block_path}." if block_path else ""
            if name.startswith(prefix):
                block = int(name[len(prefix):].split(".", 1)[0])
        base = getattr(parent, child)
        device = execution_device(model, name) if placement.hooked or placement.spread else None
        cls = PlacedRoutedLoRALinear if placement.spread and device is not None and device.type == "cuda" \
            else RoutedLoRALinear
        layer = cls(base, num_slots, r_max, name=name, block=block, device=device)
        if placement.spread:
            layer.route_key = (block, layer.lora_A.device)
        _keep_hook(base, layer)
        setattr(parent, child, layer)
        layers[name] = layer
    group_projections(layers.values())  # q/k/v and gate/up share one routed-LoRA call (routing/lora.py)
    for index, block_module in enumerate(blocks):
        block_module.register_forward_pre_hook(_block_pre_hook(index), with_kwargs=True)
    log.info("routed LoRA on %d linear layers in %d blocks: %d slots, r_max %d", len(layers), len(blocks),
             num_slots, r_max)
    if placement.hooked or placement.spread:
        log.info("routed model placed over %s (input on %s%s)", [str(d) for d in placement.devices],
                 placement.input_device, ", weights offloaded" if placement.offloaded else "")
    return RoutedModel(model, HotSetCache(layers, num_slots, r_max), num_blocks=len(blocks),
                       placement=placement if placement.hooked or placement.spread else None)


# --- the routed model ----------------------------------------------------------------------------------------

class RoutedModel(nn.Module):
    """A transformers causal LM with routed LoRA layers, a hot-set cache and per-call routers."""

    def __init__(self, model: nn.Module, cache: HotSetCache, num_blocks: int,
                 placement: Placement | None = None) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.num_blocks = num_blocks
        # None: one device, wherever the model is moved; else a dispatched model's devices (fixed)
        self.placement = placement
        self._routing_cls = PlacedRouting if placement is not None and placement.spread else CallRouting
        # transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated, to be removed
        # in 5.40); callers pass past_key_values=, which forward renames where the model wants `cache`
        self._takes_cache = "cache" in inspect.signature(model.forward).parameters

    # --- facts about the model -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where input ids go: the model's device (a dispatched model: its input embedding's execution device)."""
        if self.placement is not None:
            return self.placement.input_device
        return next(self.model.parameters()).device

    def projection_groups(self) -> list[ProjectionGroup]:
        """The routed layers' projection groups (routing/lora.py), each once, in layer order."""
        return list({id(layer.group): layer.group for layer in self.cache.layers.values()}.values())

    def pack_exact_rows(self, max_bytes: int) -> tuple[int, int, int]:
        """Pack the routed layers' base weights for the CPU's exact-row decode GEMMs (ProjectionGroup.pack_exact_rows),
        group by group while the copies, counted at the weights' size, stay within `max_bytes`; returns (groups
        packed, groups, bytes counted)."""
        groups = self.projection_groups()
        packed = spent = 0
        for group in groups:
            weight = group.weight
            if weight is not None and spent + weight.nbytes <= max_bytes and group.pack_exact_rows():
                packed, spent = packed + 1, spent + weight.nbytes
        return packed, len(groups), spent

    def make_routing(self, *args: Any, **kwargs: Any) -> CallRouting:
        """CallRouting(*args, **kwargs), or a PlacedRouting when the model is spread over devices (what every plan
        for this model must be: its layers ask for their routing on their own device)."""
        return self._routing_cls(*args, **kwargs)

    @property
    def hidden_size(self) -> int:
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(text.hidden_size)

    @property
    def name_or_path(self) -> str | None:
        return getattr(self.model, "name_or_path", None) or getattr(self.model.config, "_name_or_path", None) or None

    # --- adapters --------------------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return self.cache.names

    def add_adapter(self, adapter: LoraAdapter, *, force: bool = False, info: AdapterInfo | None = None) -> None:
        """Add a LoraAdapter to the pool (registered with `info`: modality, description, folder) after checking it
        fits this model (nothing changes if it does not)."""
        check_base_model(adapter.base_model_name_or_path, self.name_or_path, name=adapter.name, force=force)
        self.check_fits(adapter.name, {m: (a.shape, b.shape) for m, (a, b) in adapter.weights.items()})
        self.cache.add(adapter, info)

    def check_fits(self, name: str, shapes: dict[str, tuple[Any, Any]]) -> None:
        """{module: (A shape, B shape)} of adapter `name` fit this model's routed layers (AdapterError if not)."""
        modules = dict(self.model.named_modules())
        for module in shapes:
            if module not in self.cache.layers:
                if module in modules:
                    kind = type(modules[module]).__name__
                    raise AdapterError(f"adapter '{name}' targets '{module}' ({kind}), which is not routed; "
                                       "attach_routed_lora(..., target_modules=...) must include it")
                raise AdapterError(f"adapter '{name}' targets module '{module}', which this model does not "
                                   "have; the adapter was made for another architecture")
        self.cache.check_shapes(name, shapes)

    def load_adapter(self, path: str | Path, name: str | None = None, *, force: bool = False,
                     info: AdapterInfo | None = None) -> str:
        """Load a PEFT LoRA folder and add it; returns its name (the folder name unless `name` is given).
        `info`: what the registry keeps beside it (default: modality "any", this folder)."""
        # shapes that do not fit this model are refused from the file's header, before its tensors are read
        adapter = load_peft_adapter(path, name=name, base_model_name_or_path=self.name_or_path, force=force,
                                    fits=self.check_fits)
        info = AdapterInfo(adapter.name, Path(path)) if info is None else info
        self.add_adapter(adapter, force=True, info=info)  # base model already checked (or forced) by the loader
        return adapter.name

    def remove_adapter(self, name: str) -> None:
        self.cache.remove(name)

    def adapter(self, name: str) -> LoraAdapter:
        return self.cache.adapter(name)

    def save_adapter(self, name: str, path: str | Path) -> None:
        """Write a loaded adapter as a PEFT folder (peft.PeftModel.from_pretrained loads it)."""
        adapter = self.cache.adapter(name)
        if not adapter.base_model_name_or_path and self.name_or_path:
            adapter = LoraAdapter(adapter.name, adapter.weights, adapter.scales,
                                  {**adapter.config, "base_model_name_or_path": self.name_or_path})
        save_peft_adapter(adapter, path)

    # --- forward ----------------------------------------------------------------------------------------------
    def _per_row(self, routers: Any, batch: int) -> list[Any] | Any:
        if routers is None or isinstance(routers, Router):
            return routers
        if isinstance(routers, (list, tuple)):
            if len(routers) != batch:
                raise RoutingError(f"got {len(routers)} routers for a batch of {batch} sequences; pass one router "
                                   "(or None) per row, or a single router for the whole batch")
            for r in routers:
                if r is not None and not isinstance(r, Router):
                    raise RoutingError(f"{r!r} is not a router (VocabRangeRouter, SequenceRouter, LearnedRouter)")
            return list(routers)
        raise RoutingError(f"routers must be None, a router, or a list of routers (one per row); got {routers!r}")

    def _plan(self, input_ids: torch.Tensor, routers: Any, slot_of: dict[str, int]) -> CallRouting:
        batch, length = input_ids.shape
        device = input_ids.device
        groups: list[LearnedGroup] = []
        if not isinstance(routers, list):
            slots = routers.route(input_ids, slot_of).long()
            if isinstance(routers, LearnedRouter):
                groups += LearnedGroup.for_router(routers, None, input_ids, slot_of, device)
        else:
            slots = torch.full((batch, length), -1, dtype=torch.long, device=device)
            by_router: dict[int, tuple[Any, list[int]]] = {}
            for row, router in enumerate(routers):
                if router is not None:
                    by_router.setdefault(id(router), (router, []))[1].append(row)
            for router, rows in by_router.values():
                index = torch.tensor(rows, dtype=torch.long, device=device)
                ids = input_ids[index]
                slots[index] = router.route(ids, slot_of).long()
                if isinstance(router, LearnedRouter):
                    groups += LearnedGroup.for_router(router, index, ids, slot_of, device)
        k = max((g.top_k for g in groups), default=1)
        return self.make_routing(batch, length, slots.reshape(-1), self.cache.num_slots, slot_of=dict(slot_of),
                                 learned=groups, k=k)

    @contextmanager
    def routing_scope(self, input_ids: torch.Tensor, routers: Any = None) -> Iterator[CallRouting | None]:
        """Pin the routers' adapters, build the routing of `input_ids` once, and make it the routing of every
        routed layer called in this thread inside the `with` block; unpin and reset on exit (even on errors).

        RoutedModel.forward is this around one HF forward.  An engine replaying a captured CUDA graph can hold
        one scope over several calls and write new slots into `scope.slots` in place (`scope.slot_of` maps
        adapter names to the pinned slots).  Yields None when no adapter is routed (plain base model).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise RoutingError("input_ids must be a [batch, seq] tensor of token ids")
        per_row = self._per_row(routers, input_ids.shape[0])
        rows = [] if per_row is None else (per_row if isinstance(per_row, list) else [per_row])
        names = list(dict.fromkeys(n for r in rows if r is not None for n in r.adapters()))
        slots = self.cache.acquire(names) if names else []
        try:
            slot_of = dict(zip(names, slots))
            plan = None if per_row is None or not names else self._plan(input_ids, per_row, slot_of)
            token = set_routing(plan)
            try:
                yield plan
            finally:
                reset_routing(token)
        finally:
            if names:
                self.cache.release(names)

    def forward(self, input_ids: torch.Tensor, routers: Any = None, *, aux_losses: bool | None = None,
                **hf_kwargs: Any) -> RoutedOutput:
        """One forward of the HF model with every token routed; see the module docstring for the steps.
        aux_losses: compute learned routing's load-balance and z-losses (default: when autograd is on, i.e. in
        training; an inference forward never pays for them)."""
        if "inputs_embeds" in hf_kwargs:
            raise RoutingError("routing works from token ids; pass input_ids, not inputs_embeds")
        with self.routing_scope(input_ids, routers) as plan:
            cache = hf_kwargs.get("past_key_values", hf_kwargs.get("cache"))
            _carry_routing_states(plan, continuing=_cached_length(cache) > 0)
            out = self.run(input_ids, plan, aux_losses=aux_losses, **hf_kwargs)
            _keep_routing_states(plan)
            return out

    def run(self, input_ids: torch.Tensor, plan: CallRouting | None, *, aux_losses: bool | None = None,
            forward: Callable[..., Any] | None = None, **hf_kwargs: Any) -> RoutedOutput:
        """One HF forward under a routing the caller built and whose adapters the caller holds (the serving
        engine pins adapters per request, not per forward, and writes its routing tables in place).  `forward`:
        another forward of the same model and its routed layers to run instead of the model's own (the engine's
        LeanDecoder), called with input_ids and `hf_kwargs` as they are."""
        if forward is not None:
            token = set_routing(plan)
            try:
                out = forward(input_ids=input_ids, **hf_kwargs)
            finally:
                reset_routing(token)
            return self._output(out, input_ids, plan, torch.is_grad_enabled() if aux_losses is None else aux_losses)
        if self._takes_cache and "past_key_values" in hf_kwargs:
            hf_kwargs["cache"] = hf_kwargs.pop("past_key_values")
        if plan is not None and self._routing_cls is PlacedRouting and not isinstance(plan, PlacedRouting):
            raise RoutingError("this model is spread over devices: build its routing with RoutedModel.make_routing "
                               "(a PlacedRouting), so each layer reads it on its own device")
        token = set_routing(plan)
        try:
            out = self.model(input_ids=input_ids, **hf_kwargs)
        finally:
            reset_routing(token)
        return self._output(out, input_ids, plan, torch.is_grad_enabled() if aux_losses is None else aux_losses)

    def token_routing(self, plan: CallRouting | None, input_ids: torch.Tensor) -> TokenRouting:
        """What a forward of input_ids [B, T] under `plan` routed each token to (RoutedOutput.routing): the static
        slots, or, for learned routing, the top-k of the routing weight averaged over blocks. Public for forwards
        run outside `run` (the serving engine's C decode step)."""
        batch, length = input_ids.shape
        slot_names = {} if plan is None else {s: n for n, s in plan.slot_of.items()}
        if plan is None:
            return TokenRouting(torch.full((batch, length), -1, dtype=torch.long, device=input_ids.device), None,
                                slot_names)
        if not plan.learned or not plan.block_slots:
            return TokenRouting(plan.slots.view(batch, length), None, slot_names)
        with torch.no_grad():  # all blocks at once (a handful of kernels, not four a block: decode steps read it)
            slots = torch.stack([s for s, _ in plan.block_slots.values()], 1)  # [N, blocks, k]; -1 = no adapter
            weights = torch.stack([w for _, w in plan.block_slots.values()], 1).float()
            chose = slots[..., None] == torch.arange(self.cache.num_slots, device=slots.device)  # [N, blocks, k, S]
            mass = (chose * weights[..., None]).sum((1, 2)) / len(plan.block_slots)
            top_w, top_s = top_k_first(mass, plan.k)  # equal masses (two blocks each way) by lowest slot
            top_s = torch.where(top_w > 0, top_s, torch.full_like(top_s, -1))
        return TokenRouting(top_s.view(batch, length, plan.k), top_w.view(batch, length, plan.k), slot_names)

    def _output(self, out: Any, input_ids: torch.Tensor, plan: CallRouting | None, aux_losses: bool
                ) -> RoutedOutput:
        past = _past_key_values(out)
        loss = getattr(out, "loss", None)
        routing = self.token_routing(plan, input_ids)
        if plan is None or not plan.learned or not plan.block_slots:
            return RoutedOutput(out.logits, past, routing, loss)
        # learned: losses averaged over blocks
        decisions = {b: [d for _, d in ds] for b, ds in plan.decisions.items()}
        flat = [d for ds in decisions.values() for d in ds]
        if not aux_losses:
            return RoutedOutput(out.logits, past, routing, loss, None, None, decisions)
        lb = torch.stack([load_balance_loss(d) for d in flat]).mean()
        z = torch.stack([router_z_loss(d) for d in flat]).mean()
        return RoutedOutput(out.logits, past, routing, loss, lb, z, decisions)
