"""attach_routed_lora and RoutedModel: per-token LoRA routing around any transformers causal LM.

attach_routed_lora replaces the target nn.Linear modules by RoutedLoRALinear (sharing their weights), puts a
HotSetCache over them, and registers a forward pre-hook on every transformer block so learned gates can route on
the block input.  RoutedModel.forward then, per call:

    1. collects the adapters the routers name and pins them in the hot set (acquire),
    2. builds the routing of every token ONCE (CallRouting: slots [N], or per-block top-k for learned rows),
    3. runs ONE forward of the HF model with that routing set in a ContextVar (per thread / task),
    4. resets the context and unpins (release), even when the forward raises.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from molora.routing.adapters import LoraAdapter, check_base_model, load_peft_adapter, save_peft_adapter
from molora.routing.cache import AdapterInfo, HotSetCache
from molora.routing.context import BlockDecision, CallRouting, current_routing, reset_routing, set_routing
from molora.routing.errors import AdapterError, RoutingError
from molora.routing.lora import RoutedLoRALinear, group_projections
from molora.routing.routers import LearnedGroup, LearnedRouter, Router, load_balance_loss, router_z_loss
from torch import nn

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


# --- attaching ---------------------------------------------------------------------------------------------

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
    """Wrap the target nn.Linear modules of a transformers causal LM (in place) and return a RoutedModel."""
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
    layers: dict[str, RoutedLoRALinear] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = None
        if block_path is not None:
            prefix = f"{block_path}." if block_path else ""
            if name.startswith(prefix):
                block = int(name[len(prefix):].split(".", 1)[0])
        layer = RoutedLoRALinear(getattr(parent, child), num_slots, r_max, name=name, block=block)
        setattr(parent, child, layer)
        layers[name] = layer
    group_projections(layers.values())  # q/k/v and gate/up share one routed-LoRA call (routing/lora.py)
    for index, block_module in enumerate(blocks):
        block_module.register_forward_pre_hook(_block_pre_hook(index), with_kwargs=True)
    log.info("routed LoRA on %d linear layers in %d blocks: %d slots, r_max %d", len(layers), len(blocks),
             num_slots, r_max)
    return RoutedModel(model, HotSetCache(layers, num_slots, r_max), num_blocks=len(blocks))


# --- the routed model ----------------------------------------------------------------------------------------

class RoutedModel(nn.Module):
    """A transformers causal LM with routed LoRA layers, a hot-set cache and per-call routers."""

    def __init__(self, model: nn.Module, cache: HotSetCache, num_blocks: int) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.num_blocks = num_blocks
        # transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated, to be removed
        # in 5.40); callers pass past_key_values=, which forward renames where the model wants `cache`
        self._takes_cache = "cache" in inspect.signature(model.forward).parameters

    # --- facts about the model -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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
        return CallRouting(batch, length, slots.reshape(-1), self.cache.num_slots, slot_of=dict(slot_of),
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
            return self.run(input_ids, plan, aux_losses=aux_losses, **hf_kwargs)

    def run(self, input_ids: torch.Tensor, plan: CallRouting | None, *, aux_losses: bool | None = None,
            **hf_kwargs: Any) -> RoutedOutput:
        """One HF forward under a routing the caller built and whose adapters the caller holds (the serving
        engine pins adapters per request, not per forward, and writes its routing tables in place)."""
        if self._takes_cache and "past_key_values" in hf_kwargs:
            hf_kwargs["cache"] = hf_kwargs.pop("past_key_values")
        token = set_routing(plan)
        try:
            out = self.model(input_ids=input_ids, **hf_kwargs)
        finally:
            reset_routing(token)
        return self._output(out, input_ids, plan, torch.is_grad_enabled() if aux_losses is None else aux_losses)

    def _output(self, out: Any, input_ids: torch.Tensor, plan: CallRouting | None, aux_losses: bool
                ) -> RoutedOutput:
        batch, length = input_ids.shape
        slot_names = {} if plan is None else {s: n for n, s in plan.slot_of.items()}
        past = _past_key_values(out)
        loss = getattr(out, "loss", None)
        if plan is None:
            routing = TokenRouting(torch.full((batch, length), -1, dtype=torch.long, device=input_ids.device),
                                   None, slot_names)
            return RoutedOutput(out.logits, past, routing, loss)
        if not plan.learned or not plan.block_slots:
            return RoutedOutput(out.logits, past, TokenRouting(plan.slots.view(batch, length), None, slot_names), loss)
        # learned: report the top-k of the routing weight averaged over blocks; losses averaged over blocks
        with torch.no_grad():
            mass = torch.zeros(plan.num_tokens, self.cache.num_slots, device=input_ids.device)
            for slots, weights in plan.block_slots.values():
                mass.scatter_add_(1, slots.clamp(min=0), weights.float() * (slots >= 0))
            mass /= len(plan.block_slots)
            top_w, top_s = mass.topk(plan.k, dim=-1)
            top_s = torch.where(top_w > 0, top_s, torch.full_like(top_s, -1))
        routing = TokenRouting(top_s.view(batch, length, plan.k), top_w.view(batch, length, plan.k), slot_names)
        decisions = {b: [d for _, d in ds] for b, ds in plan.decisions.items()}
        flat = [d for ds in decisions.values() for d in ds]
        if not aux_losses:
            return RoutedOutput(out.logits, past, routing, loss, None, None, decisions)
        lb = torch.stack([load_balance_loss(d) for d in flat]).mean()
        z = torch.stack([router_z_loss(d) for d in flat]).mean()
        return RoutedOutput(out.logits, past, routing, loss, lb, z, decisions)
