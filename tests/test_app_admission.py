"""Admission control (app/admission.py): requests wait for hot-set slots instead of failing with CacheFullError."""

from __future__ import annotations

import threading
import time

import pytest

from app.admission import SlotBudget, admitted
from routing.errors import CacheFullError


def test_a_request_waits_until_running_requests_free_enough_slots():
    budget = SlotBudget(4)
    started = threading.Event()
    order: list[str] = []

    def second() -> None:
        started.set()
        with budget.hold(2):
            order.append("second")

    with budget.hold(3):
        thread = threading.Thread(target=second)
        thread.start()
        started.wait()
        time.sleep(0.1)
        order.append("first done")  # 3 + 2 > 4: the second request is still waiting
    thread.join(timeout=5)
    assert order == ["first done", "second"] and budget.in_use == 0


def test_requests_that_can_never_fit_or_wait_too_long_get_a_clear_error():
    budget = SlotBudget(2)
    with pytest.raises(CacheFullError, match="3 distinct adapters .* only 2 slots"):
        with budget.hold(3):
            pass
    with budget.hold(2), pytest.raises(CacheFullError, match="no free adapter slots"):
        with budget.hold(1, timeout=0.05):
            pass
    assert budget.in_use == 0


def test_tickets_are_returned_when_the_consumer_stops_early():
    budget = SlotBudget(2)
    events = admitted(budget, 2, lambda: iter(range(10)))
    assert next(events) == 0 and budget.in_use == 2
    events.close()
    assert budget.in_use == 0
