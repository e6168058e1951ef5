"""HotSetCache: fixed slot tensors, LRU over unpinned adapters, all-or-nothing acquire, counters, threads, and a
hypothesis state machine checking the invariants over long random sequences of operations."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from molora.routing import (
    AdapterError,
    AdapterInfo,
    CacheFullError,
    HotSetCache,
    LoraAdapter,
    RoutedLoRALinear,
    UnknownAdapterError,
)

LAYER_SHAPES = {"a.q": (6, 5), "a.v": (6, 3), "b.up": (4, 7)}  # name -> (in, out)


def make_cache(num_slots: int = 2, r_max: int = 4) -> HotSetCache:
    torch.manual_seed(0)
    layers = {name: RoutedLoRALinear(torch.nn.Linear(i, o), num_slots, r_max, name=name)
              for name, (i, o) in LAYER_SHAPES.items()}
    return HotSetCache(layers, num_slots, r_max)


def make_adapter(name: str, seed: int, rank: int = 3, modules=tuple(LAYER_SHAPES)) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {m: (torch.randn(rank, LAYER_SHAPES[m][0], generator=gen), torch.randn(LAYER_SHAPES[m][1], rank, generator=gen))
               for m in modules}
    return LoraAdapter(name, weights, {m: 0.5 + seed for m in modules})


def assert_slot_holds(cache: HotSetCache, slot: int, adapter: LoraAdapter | None) -> None:
    """The slot's tensors in every layer equal `adapter` zero-padded to r_max (or all zero when empty)."""
    for name, layer in cache.layers.items():
        a, b, scale = layer.lora_A[slot], layer.lora_B[slot], layer.lora_scale[slot]
        if adapter is None or name not in adapter.weights:
            assert not a.any() and not b.any() and float(scale) == 0
            continue
        wa, wb = adapter.weights[name]
        r = wa.shape[0]
        assert torch.equal(a[:r], wa) and not a[r:].any()
        assert torch.equal(b[:, :r], wb) and not b[:, r:].any()
        assert float(scale) == pytest.approx(adapter.scales[name])


def snapshot(cache: HotSetCache):
    return cache.stats(), [(layer.lora_A.clone(), layer.lora_B.clone(), layer.lora_scale.clone())
                           for layer in cache.layers.values()]


def assert_unchanged(cache: HotSetCache, before) -> None:
    stats, tensors = snapshot(cache)
    assert stats == before[0]
    for (a, b, s), (a0, b0, s0) in zip(tensors, before[1]):
        assert torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(s, s0)


def test_acquire_loads_misses_counts_hits_and_bytes():
    cache = make_cache()
    x, y = make_adapter("x", 1), make_adapter("y", 2, rank=4)
    cache.add(x)
    cache.add(y)
    assert cache.acquire(["x"]) == [0]
    assert_slot_holds(cache, 0, x)
    cache.release(["x"])
    assert cache.acquire(["y", "x"]) == [1, 0]
    assert_slot_holds(cache, 1, y)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 2, 0)
    per_adapter = sum(4 * i * 4 + o * 4 * 4 for i, o in LAYER_SHAPES.values())  # padded fp32 A + B
    assert stats["bytes_copied"] == 2 * per_adapter
    assert stats["slots"] == ["x", "y"] and stats["pinned"] == {"x": 1, "y": 1}


def test_slot_tensors_keep_their_addresses_across_swaps():
    cache = make_cache(num_slots=2)
    ptrs = [(layer.lora_A.data_ptr(), layer.lora_B.data_ptr(), layer.lora_scale.data_ptr())
            for layer in cache.layers.values()]
    adapters = [make_adapter(f"a{i}", i, rank=1 + i % 4) for i in range(5)]
    for adapter in adapters:
        cache.add(adapter)
    for step in range(12):
        names = [adapters[step % 5].name, adapters[(step * 3 + 1) % 5].name]
        slots = cache.acquire(names)
        for name, slot in zip(names, slots):
            assert_slot_holds(cache, slot, cache.adapter(name))
        cache.release(names)
    assert cache.stats()["evictions"] > 0
    assert ptrs == [(layer.lora_A.data_ptr(), layer.lora_B.data_ptr(), layer.lora_scale.data_ptr())
                    for layer in cache.layers.values()]


def test_evicts_least_recently_used_unpinned_adapter():
    cache = make_cache(num_slots=2)
    for i, name in enumerate("xyz"):
        cache.add(make_adapter(name, i))
    cache.acquire(["x"])
    cache.acquire(["y"])
    cache.release(["x"])
    cache.release(["y"])
    cache.acquire(["x"])  # x used more recently than y
    cache.release(["x"])
    assert cache.acquire(["z"]) == [1]  # y (LRU) evicted, x kept
    assert cache.slot_of("y") is None and cache.slot_of("x") == 0
    assert cache.stats()["evictions"] == 1


def test_pinned_adapters_are_never_evicted_and_a_full_cache_changes_nothing():
    cache = make_cache(num_slots=2)
    for i, name in enumerate("xyz"):
        cache.add(make_adapter(name, i))
    cache.acquire(["x", "y"])
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="2 slots"):
        cache.acquire(["z"])
    with pytest.raises(CacheFullError):
        cache.acquire(["x", "z"])
    assert_unchanged(cache, before)
    cache.release(["y"])
    assert cache.acquire(["z"]) == [1]
    assert cache.slot_of("x") == 0


def test_smaller_ranks_are_zero_padded_and_a_reused_slot_keeps_nothing_of_its_last_adapter():
    cache = make_cache(num_slots=1, r_max=4)
    full = make_adapter("full", 4, rank=4)
    small = make_adapter("small", 3, rank=1, modules=("a.v",))  # rank 1, one layer only
    cache.add(full)
    cache.add(small)
    cache.acquire(["full"])
    assert_slot_holds(cache, 0, full)
    cache.release(["full"])
    assert cache.acquire(["small"]) == [0]  # evicts `full` from the only slot
    assert_slot_holds(cache, 0, small)  # rows 1..3 of a.v and all of a.q / b.up are zero again


def test_bad_adapters_and_names_are_refused_without_changes():
    cache = make_cache(r_max=4)
    cache.add(make_adapter("x", 1))
    cache.acquire(["x"])
    before = snapshot(cache)
    with pytest.raises(AdapterError, match="r_max=4"):
        cache.add(make_adapter("big", 2, rank=5))
    with pytest.raises(AdapterError, match="already loaded"):
        cache.add(make_adapter("x", 3))
    bad = make_adapter("nan", 4)
    bad.weights["a.q"][1][0, 0] = float("nan")
    with pytest.raises(AdapterError, match="NaN"):
        cache.add(bad)
    wrong = make_adapter("wrong", 5)
    wrong.weights["a.q"] = (torch.randn(3, 9), torch.randn(5, 3))
    with pytest.raises(AdapterError, match="do not fit"):
        cache.add(wrong)
    with pytest.raises(AdapterError, match="not a routed layer"):
        cache.add(LoraAdapter("other", {"c.k": (torch.randn(2, 6), torch.randn(5, 2))}, {"c.k": 1.0}))
    with pytest.raises(UnknownAdapterError, match=r"'nope'.*loaded: x"):
        cache.acquire(["x", "nope"])
    with pytest.raises(AdapterError, match="in use"):
        cache.remove("x")
    with pytest.raises(UnknownAdapterError):
        cache.remove("nope")
    assert_unchanged(cache, before)
    cache.release(["x"])
    with pytest.raises(AdapterError, match="without a matching acquire"):
        cache.release(["x"])


def test_the_pool_is_the_registry_adapters_and_their_infos_come_and_go_together():
    cache = make_cache()
    cache.add(make_adapter("t", 1), AdapterInfo("ignored", Path("/adapters/t"), "text", "a style"))
    cache.add(make_adapter("m", 2))  # made in memory: no folder, modality "any"
    assert cache.infos() == {"t": AdapterInfo("t", Path("/adapters/t"), "text", "a style"), "m": AdapterInfo("m")}
    assert cache.names == ["t", "m"]  # the info is stored under the adapter's name
    with pytest.raises(AdapterError, match="already loaded"):
        cache.add(make_adapter("t", 3), AdapterInfo("t", None, "image"))
    assert cache.infos()["t"].modality == "text"  # a refused add changes nothing
    cache.remove("t")
    assert list(cache.infos()) == ["m"] and cache.stats()["pool"] == ["m"]


def test_remove_frees_the_slot():
    cache = make_cache()
    cache.add(make_adapter("x", 1))
    slot = cache.acquire(["x"])[0]
    cache.release(["x"])
    cache.remove("x")
    assert cache.names == [] and cache.slots == [None, None]
    assert_slot_holds(cache, slot, None)


def test_concurrent_acquire_release_from_threads_keeps_invariants():
    cache = make_cache(num_slots=3)
    adapters = {f"a{i}": make_adapter(f"a{i}", i) for i in range(6)}
    for adapter in adapters.values():
        cache.add(adapter)
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(60):
            names = [f"a{int(i)}" for i in torch.randint(0, 6, (1,), generator=gen)]
            try:
                slots = cache.acquire(names)
            except CacheFullError:
                continue
            for name, slot in zip(names, slots):
                if cache.slots[slot] != name:
                    errors.append((name, slot, cache.slots))
            cache.release(names)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and cache.stats()["pinned"] == {}
    for slot, name in enumerate(cache.slots):
        assert_slot_holds(cache, slot, adapters[name] if name else None)


class CacheMachine(RuleBasedStateMachine):
    """Random add / acquire / release / remove sequences; the invariants hold after every step."""

    @initialize(num_slots=st.integers(1, 3))
    def setup(self, num_slots):
        self.cache = make_cache(num_slots=num_slots, r_max=4)
        self.adapters: dict[str, LoraAdapter] = {}
        self.held: list[list[str]] = []  # one entry per successful acquire still running
        self.counter = 0

    @rule(rank=st.integers(1, 4), modules=st.sets(st.sampled_from(sorted(LAYER_SHAPES)), min_size=1))
    def add(self, rank, modules):
        self.counter += 1
        adapter = make_adapter(f"n{self.counter}", self.counter, rank=rank, modules=tuple(sorted(modules)))
        self.cache.add(adapter)
        self.adapters[adapter.name] = adapter

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def acquire(self, data):
        names = data.draw(st.lists(st.sampled_from(sorted(self.adapters)), min_size=1, max_size=4))
        pinned_before = {n for req in self.held for n in req}
        needed = set(names)
        resident = {n for n in self.cache.slots if n is not None}
        free = self.cache.slots.count(None)
        evictable = resident - pinned_before - needed
        fits = len(needed - resident) <= free + len(evictable)
        before = snapshot(self.cache)
        event("acquire fits" if fits else "acquire: cache full")
        if fits:
            slots = self.cache.acquire(names)
            assert [self.cache.slots[s] for s in slots] == names
            self.held.append(names)
            for n in pinned_before:  # pinned adapters never evicted
                assert n in self.cache.slots
        else:
            with pytest.raises(CacheFullError):
                self.cache.acquire(names)
            assert_unchanged(self.cache, before)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        names = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.release(names)

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def remove(self, data):
        name = data.draw(st.sampled_from(sorted(self.adapters)))
        if any(name in req for req in self.held):
            with pytest.raises(AdapterError):
                self.cache.remove(name)
        else:
            self.cache.remove(name)
            del self.adapters[name]
        event("remove")

    @invariant()
    def slots_hold_what_the_map_says(self):
        for slot, name in enumerate(self.cache.slots):
            assert_slot_holds(self.cache, slot, self.adapters[name] if name else None)
            if name is not None:
                assert self.cache.slot_of(name) == slot

    @invariant()
    def pins_match_running_requests(self):
        want: dict[str, int] = {}
        for req in self.held:
            for n in set(req):
                want[n] = want.get(n, 0) + 1
        assert self.cache.stats()["pinned"] == want
        for n in want:
            assert self.cache.slot_of(n) is not None


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_is_pinned_and_side_stream_swaps_are_ordered_with_compute():
    cache = make_cache(num_slots=1, r_max=4)
    for layer in cache.layers.values():
        layer.cuda()
    adapters = [make_adapter(f"g{i}", i) for i in range(4)]
    for adapter in adapters:
        cache.add(adapter)
    assert all(t.is_pinned() for t in cache._pool["g0"].A.values())
    ptr = cache.layers["a.q"].lora_A.data_ptr()
    x = torch.randn(64, 6, device="cuda")
    layer = cache.layers["a.q"]
    for step in range(20):
        adapter = adapters[step % 4]
        slot = cache.acquire([adapter.name])[0]
        delta = (x @ layer.lora_A[slot].t() @ layer.lora_B[slot].t()) * layer.lora_scale[slot]
        cache.release([adapter.name])
        a, b = adapter.weights["a.q"]
        want = (x.cpu() @ a.t() @ b.t()) * adapter.scales["a.q"]
        torch.testing.assert_close(delta.cpu(), want, rtol=1e-4, atol=1e-4)
    assert layer.lora_A.data_ptr() == ptr and cache.stats()["evictions"] == 19
