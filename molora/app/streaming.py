"""Running a generation in a worker thread while the request's thread refreshes the page."""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def in_background(make_events: Callable[[], Iterator[object]], interval: float) -> Iterator[list[object]]:
    """Run an event generator in a worker thread; yield what it produced, in batches at most `interval` apart.

    Why: consumed inline, the decoder waits while each page update is serialised and sent. Measured on the
    2-core CPU (tiny model, one 258-token image, headless Chromium watching): 37.2 s inline, 10.0 s with this
    worker thread, 0.8 s once unchanged outputs are also skipped (see `_outputs`). Closing this generator (the
    visitor left) stops the worker after its current event. Errors in the worker are raised here.
    """
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            source = make_events()
            try:
                for event in source:
                    events.put(event)
                    if stop.is_set():
                        break
            finally:
                getattr(source, "close", lambda: None)()
        except BaseException as err:  # handed to the consumer, which raises it in the request's thread
            events.put(_Failed(err))
        finally:
            events.put(_END)

    # the worker runs in a copy of this request's context: Gradio's per-request state (and ZeroGPU's quota
    # accounting, which reads it inside @spaces.GPU) lives in contextvars, which new threads do not inherit
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(work,), name="molora-generate", daemon=True).start()
    try:
        while True:
            batch = [events.get()]
            deadline = time.perf_counter() + interval
            while batch[-1] is not _END and not isinstance(batch[-1], _Failed):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    batch.append(events.get(timeout=remaining))
                except queue.Empty:
                    break
            last = batch[-1]
            if isinstance(last, _Failed):
                raise last.error
            if last is _END:
                yield batch[:-1]
                return
            yield batch
    finally:
        stop.set()
