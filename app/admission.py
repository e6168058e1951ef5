"""Admission control: a generation starts only when the adapters it pins fit in the hot set beside the others'.

The hot-set cache pins a request's adapters for each forward and raises CacheFullError when the slots are all held
by running requests (routing/cache.py). The queue's concurrency limit alone cannot rule that out: a learned-router
request pins every domain adapter. So each running generation holds as many "slot tickets" as distinct adapters
its router names, and a request that would overflow the slots waits for tickets instead of failing. Counting per
request (not per distinct adapter across requests) is conservative: two requests sharing an adapter hold two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from routing.errors import CacheFullError

WAIT_SECONDS = 600.0  # a waiting request gives up after this long (the queue shows it as running meanwhile)


class SlotBudget:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = int(num_slots)
        self.in_use = 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, count: int, timeout: float = WAIT_SECONDS) -> Iterator[None]:
        """Hold `count` tickets while the block runs; wait for them if running requests hold too many."""
        if count > self.num_slots:
            raise CacheFullError(f"this request routes over {count} distinct adapters but the hot set has only "
                                 f"{self.num_slots} slots; choose fewer adapters")
        with self._changed:
            if not self._changed.wait_for(lambda: self.in_use + count <= self.num_slots, timeout=timeout):
                raise CacheFullError(f"no free adapter slots after waiting {timeout:.0f} s; try again later")
            self.in_use += count
        try:
            yield
        finally:
            with self._changed:
                self.in_use -= count
                self._changed.notify_all()


def admitted(budget: SlotBudget, count: int, make_events: Callable[[], Iterator[object]]) -> Iterator[object]:
    """The events of `make_events()`, started only once `count` tickets are held; they are returned when the
    events end or the consumer closes this generator (a visitor who left)."""
    with budget.hold(count):
        yield from make_events()
