"""HotSetCache: a fixed set of GPU adapter slots in front of a CPU pool holding every loaded adapter.

The pool is the one registry of loaded adapters: beside each adapter's weights it keeps a thin AdapterInfo
(modality, description, the folder it came from), so what is loaded and what is known about it can never disagree.

Every routed layer owns stacked slot tensors A[S, r_max, in], B[S, out, r_max], scale[S], allocated once when
the layer is wrapped.  Swapping an adapter in copies into those tensors (`copy_`), so their addresses never
change and a captured CUDA graph stays valid while adapters come and go (DESIGN.md §4).

`acquire(names)` pins the adapters a request needs and returns their slots, loading misses into free slots or
over the least-recently-used adapter that no running request holds; `release(names)` unpins.  An acquire that
cannot be satisfied raises CacheFullError before touching anything.  All bookkeeping is under one lock, so the
generation engine can serve several requests from several threads.

Each layer's slots live on the device that layer computes on (a model spread over devices by accelerate has
several); a swap-in writes every layer's copy on its own device.  On CUDA the pool is pinned and copies are issued non-blocking on a side stream that first waits for the
compute stream (work already queued on a slot finishes before the slot is overwritten).  `acquire` then makes the
compute stream wait for the copies (no host synchronisation); `acquire_nowait` (the serving engine) returns their
events instead, so rows that do not need the new adapter keep decoding while it is copied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from molora.routing.adapters import LoraAdapter
from molora.routing.errors import AdapterError, CacheFullError, UnknownAdapterError
from molora.routing.lora import RoutedLoRALinear

log = logging.getLogger(__name__)


@dataclass
class AdapterInfo:
    """What the registry knows of an adapter beside its weights: its name, modality ("text" | "image" | "any" when
    molora.json is absent, "merged" for a sum of adapters), the folder it came from (None: made in memory) and a
    description."""

    name: str
    path: Path | None = None
    modality: str = "any"
    description: str = ""


@dataclass
class _PoolEntry:
    """One adapter in the CPU pool, already zero-padded to r_max so a swap-in is one contiguous copy per tensor."""

    adapter: LoraAdapter  # name, scales, config; its weights dict points at the padded pool tensors' slices
    A: dict[str, torch.Tensor]  # layer name -> [r_max, in]
    B: dict[str, torch.Tensor]  # layer name -> [out, r_max]
    info: AdapterInfo

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.A.values()) + sum(t.nbytes for t in self.B.values())


class HotSetCache:
    """LRU hot set of `num_slots` adapter slots over the routed layers `layers` (name -> RoutedLoRALinear)."""

    def __init__(self, layers: Mapping[str, RoutedLoRALinear], num_slots: int, r_max: int) -> None:
        if not layers:
            raise AdapterError("HotSetCache needs at least one routed layer")
        for name, layer in layers.items():
            if layer.num_slots != num_slots or layer.r_max != r_max:
                raise AdapterError(f"layer '{name}' has {layer.num_slots} slots of rank {layer.r_max}, "
                                   f"but the cache was asked for {num_slots} of rank {r_max}")
        self.layers = dict(layers)
        self.num_slots = num_slots
        self.r_max = r_max
        self._lock = threading.RLock()
        self._pool: dict[str, _PoolEntry] = {}
        self._slot_name: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._last_use: dict[str, int] = {}
        self._tick = 0
        self._streams: dict[torch.device, Any] = {}
        # adapter name -> (CUDA event ending its copy, that copy's device), one per device holding routed layers
        self._in_flight: dict[str, list[tuple[Any, torch.device]]] = {}
        self.hits = self.misses = self.evictions = self.bytes_copied = 0

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: a lock and CUDA streams cannot be copied
        state = self.__dict__.copy()
        del state["_lock"]
        state["_streams"] = {}
        state["_in_flight"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # --- pool ------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._pool)

    def __contains__(self, name: str) -> bool:
        return name in self._pool

    def adapter(self, name: str) -> LoraAdapter:
        """The LoraAdapter stored under `name` (weights are views into the pool: do not modify)."""
        with self._lock:
            return self._entry(name).adapter

    def infos(self) -> dict[str, AdapterInfo]:
        """{name: AdapterInfo} of every loaded adapter, in the order they were added."""
        with self._lock:
            return {name: entry.info for name, entry in self._pool.items()}

    def _entry(self, name: str) -> _PoolEntry:
        entry = self._pool.get(name)
        if entry is None:
            loaded = ", ".join(sorted(self._pool)) or "none"
            raise UnknownAdapterError(f"no adapter named '{name}' is loaded (loaded: {loaded}); "
                                      "load it first with load_adapter / add_adapter")
        return entry

    def check_shapes(self, name: str, shapes: Mapping[str, tuple[Sequence[int], Sequence[int]]]) -> None:
        """{module: (A shape, B shape)} fit this cache's routed layers and r_max.  The loader calls this with the
        shapes a safetensors header declares, before any tensor is read (routing.load_peft_adapter `fits`)."""
        for module, (a_shape, b_shape) in shapes.items():
            layer = self.layers.get(module)
            if layer is None:
                raise AdapterError(f"adapter '{name}' has weights for '{module}', which is not a routed "
                                   f"layer of this model ({len(self.layers)} routed layers, e.g. "
                                   f"'{next(iter(self.layers))}'); the adapter belongs to another model or "
                                   "attach_routed_lora needs that module in target_modules")
            r = a_shape[0]
            if r > self.r_max:
                raise AdapterError(f"adapter '{name}' has rank {r} at '{module}' but the cache holds ranks "
                                   f"up to r_max={self.r_max}; attach_routed_lora(..., r_max>={r})")
            if a_shape[1] != layer.in_features or b_shape[0] != layer.out_features:
                raise AdapterError(f"adapter '{name}' at '{module}': A {tuple(a_shape)} / B {tuple(b_shape)} "
                                   f"do not fit the layer (in={layer.in_features}, out={layer.out_features}); "
                                   "the adapter was made for a model of another size")

    def validate(self, adapter: LoraAdapter) -> None:
        """Every check `add` does, without changing anything."""
        adapter.validate()
        self.check_shapes(adapter.name, {m: (a.shape, b.shape) for m, (a, b) in adapter.weights.items()})
        for module, (a, b) in adapter.weights.items():
            layer = self.layers[module]
            for label, t, dtype in (("A", a, layer.lora_A.dtype), ("B", b, layer.lora_B.dtype)):
                # finite in its own dtype (adapter.validate) but maybe not in the layer's: float64 1e300 -> Inf
                if t.dtype != dtype and not bool(torch.isfinite(t.detach().to(dtype)).all()):
                    raise AdapterError(f"adapter '{adapter.name}' at '{module}': lora_{label} ({t.dtype}) holds values "
                                       f"beyond the range of the model's {dtype}, which would become Inf; re-export "
                                       "the adapter with values that fit")
            scale_dtype = layer.lora_scale.dtype
            if not bool(torch.isfinite(torch.tensor(float(adapter.scales[module]), dtype=scale_dtype))):
                raise AdapterError(f"adapter '{adapter.name}' at '{module}': scale {adapter.scales[module]!r} is beyond "
                                   f"the range of the model's {scale_dtype}; check lora_alpha and r")

    def add(self, adapter: LoraAdapter, info: AdapterInfo | None = None) -> None:
        """Put `adapter` in the CPU pool (it reaches a GPU slot on its first acquire), registered with `info`
        (stored under the adapter's name; None: an adapter of modality "any" made in memory)."""
        with self._lock:
            if adapter.name in self._pool:
                raise AdapterError(f"an adapter named '{adapter.name}' is already loaded; remove_adapter it first "
                                   "or load this one under another name")
            self.validate(adapter)
            pin = torch.cuda.is_available() and any(layer.lora_A.is_cuda for layer in self.layers.values())
            A: dict[str, torch.Tensor] = {}
            B: dict[str, torch.Tensor] = {}
            weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for module, (a, b) in adapter.weights.items():
                layer = self.layers[module]
                r = a.shape[0]
                pa = torch.zeros(self.r_max, layer.in_features, dtype=layer.lora_A.dtype, pin_memory=pin)
                pb = torch.zeros(layer.out_features, self.r_max, dtype=layer.lora_B.dtype, pin_memory=pin)
                pa[:r].copy_(a.detach())
                pb[:, :r].copy_(b.detach())
                A[module], B[module] = pa, pb
                weights[module] = (pa[:r], pb[:, :r])
            stored = LoraAdapter(adapter.name, weights, dict(adapter.scales), dict(adapter.config))
            info = AdapterInfo(adapter.name) if info is None else replace(info, name=adapter.name)
            self._pool[adapter.name] = _PoolEntry(stored, A, B, info)
            self._last_use[adapter.name] = 0
            log.debug("adapter '%s' added to the pool (%d modules, %.1f KiB)", adapter.name, len(A),
                     self._pool[adapter.name].nbytes() / 1024)

    def remove(self, name: str) -> None:
        """Drop `name` from the pool and its slot.  Refused while a running request holds it."""
        with self._lock:
            self._entry(name)
            if self._pins.get(name, 0) > 0:
                raise AdapterError(f"adapter '{name}' is in use by {self._pins[name]} running request(s); "
                                   "remove it after they finish")
            self._sync_side_streams()  # an in-flight copy may still read its pinned memory or write its slot
            self._in_flight.pop(name, None)
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self._slot_name[slot] = None
                for layer in self.layers.values():
                    layer.clear_slot(slot)
            del self._pool[name]
            self._last_use.pop(name, None)
            self._pins.pop(name, None)

    # --- hot set ---------------------------------------------------------------------------------------
    def acquire(self, names: Sequence[str]) -> list[int]:
        """Pin `names` in the hot set and return their slots (same order).  All or nothing.  The compute stream
        waits for any copy into those slots, so the next forward on it sees the adapters."""
        slots, pending = self._acquire(names)
        for event, device in pending:  # each copy's event waits on its own device's compute stream
            torch.cuda.current_stream(device).wait_event(event)
        return slots

    def acquire_nowait(self, names: Sequence[str]) -> tuple[list[int], list[Any]]:
        """Like `acquire`, but nothing waits for the copies: returns (slots, events still in flight).  The
        caller (the serving engine) runs a forward that reads these slots only once every event has completed
        (`event.query()`), so rows that do not need the new adapters never stall behind their copy."""
        slots, pending = self._acquire(names)
        return slots, [event for event, _ in pending]

    def _acquire(self, names: Sequence[str]) -> tuple[list[int], list[tuple[Any, torch.device]]]:
        """Pin and copy in; returns (slots, (event, device) of every copy into them still in flight)."""
        with self._lock:
            unique = list(dict.fromkeys(names))
            for name in unique:
                self._entry(name)
            misses = [n for n in unique if n not in self._slot_of]
            free = [s for s, n in enumerate(self._slot_name) if n is None]
            evictable = sorted((n for n in self._slot_of if self._pins.get(n, 0) == 0 and n not in unique),
                               key=lambda n: self._last_use[n])
            if len(misses) > len(free) + len(evictable):
                pinned = sorted(n for n in self._slot_of if self._pins.get(n, 0) > 0)
                raise CacheFullError(f"request needs {len(unique)} distinct adapters ({len(misses)} not resident) "
                                     f"but the cache has {self.num_slots} slots and {len(pinned)} are held by "
                                     f"running requests ({', '.join(pinned) or 'none'}); use fewer adapters per "
                                     "batch, wait for running requests, or attach with a larger num_slots")
            self._tick += 1
            to_copy: list[tuple[int, _PoolEntry]] = []
            for name in misses:
                if free:
                    slot = free.pop(0)
                else:
                    victim = evictable.pop(0)
                    slot = self._slot_of.pop(victim)
                    self.evictions += 1
                    log.debug("evict '%s' from slot %d", victim, slot)
                self._slot_of[name] = slot
                self._slot_name[slot] = name
                to_copy.append((slot, self._pool[name]))
            self.misses += len(misses)
            self.hits += len(unique) - len(misses)
            for name in unique:
                self._pins[name] = self._pins.get(name, 0) + 1
                self._last_use[name] = self._tick
            if to_copy:
                events = self._copy_in(to_copy)
                if events:
                    for _, entry in to_copy:
                        self._in_flight[entry.adapter.name] = events
            pending = []
            for name in unique:
                events = [(e, d) for e, d in self._in_flight.get(name, ()) if not e.query()]
                if events:
                    self._in_flight[name] = events
                    pending += events
                else:
                    self._in_flight.pop(name, None)
            return [self._slot_of[n] for n in names], pending

    def release(self, names: Iterable[str]) -> None:
        """Unpin adapters acquired by a finished request (each name once per acquire that named it)."""
        with self._lock:
            for name in dict.fromkeys(names):
                count = self._pins.get(name, 0)
                if count <= 0:
                    raise AdapterError(f"release('{name}') without a matching acquire")
                self._pins[name] = count - 1

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slot_of.get(name)

    def pins(self, name: str) -> int:
        with self._lock:
            return self._pins.get(name, 0)

    @property
    def slots(self) -> list[str | None]:
        with self._lock:
            return list(self._slot_name)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "bytes_copied": self.bytes_copied, "slots": list(self._slot_name),
                    "pinned": {n: c for n, c in self._pins.items() if c > 0}, "pool": list(self._pool),
                    "num_slots": self.num_slots, "r_max": self.r_max, "layers": len(self.layers)}

    # --- copies --------------------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _sync_side_streams(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _by_device(self) -> dict[torch.device, dict[str, RoutedLoRALinear]]:
        """The routed layers grouped by the device of their slots (one group unless the model is spread over
        devices: then each layer's slots live on that layer's device)."""
        groups: dict[torch.device, dict[str, RoutedLoRALinear]] = {}
        for name, layer in self.layers.items():
            groups.setdefault(layer.lora_A.device, {})[name] = layer
        return groups

    def _copy_in(self, items: list[tuple[int, _PoolEntry]]) -> list[tuple[Any, torch.device]]:
        """Copy pool entries into their slots on every layer's own device; on CUDA on a side stream per device,
        returning (event, device) pairs that mark the end of the copies (none on the CPU, where the copy is done
        when this returns)."""
        events = []
        for device, layers in self._by_device().items():
            if device.type != "cuda":
                self._copy(items, layers, non_blocking=False)
                continue
            compute = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            side.wait_stream(compute)  # kernels already queued on these slots run before we overwrite them
            with torch.cuda.stream(side):
                self._copy(items, layers, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            events.append((done, device))
        return events

    @torch.no_grad()
    def _copy(self, items: list[tuple[int, _PoolEntry]], layers: Mapping[str, RoutedLoRALinear],
              non_blocking: bool) -> None:
        for slot, entry in items:
            for name, layer in layers.items():
                a = entry.A.get(name)
                if a is None:
                    layer.clear_slot(slot)
                    continue
                b = entry.B[name]
                if layer.lora_A.is_cuda and not a.is_pinned():  # model moved to the GPU after the adapter was added
                    a, b = a.pin_memory(), b.pin_memory()
                    entry.A[name], entry.B[name] = a, b
                layer.lora_A[slot].copy_(a, non_blocking=non_blocking)
                layer.lora_B[slot].copy_(b, non_blocking=non_blocking)
                layer.lora_scale[slot] = entry.adapter.scales[name]
                self.bytes_copied += a.nbytes + b.nbytes
