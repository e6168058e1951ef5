"""CUDA-graph capture as PyTorch's documentation gives it: warm up on a side stream (Triton compiles, lazy CUDA
state and the caching allocator settle), then capture one call. Used by the serving engine's decode and prefill
steps and by the kernel benchmark.

While capture_graph warms up and captures, `graph_mode()` is True, and the dispatcher (kernels/dispatch.py) takes
the paths that are fastest in GPU time (Triton kernels); outside it, decode-sized calls take the eager decode path
(one fused launch per group call, or the dense torch form on wide hot sets), which costs the least host time (an
eager step is host-bound). Warm-up and capture see the same flag, so what a capture records was compiled by the
warm-up. A capture made without capture_graph gets the eager decode path, which is also capture-safe (no host
read; launches on the current stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

_GRAPH_MODE: ContextVar[bool] = ContextVar("molora_graph_mode", default=False)


def graph_mode() -> bool:
    """True inside capture_graph (its warm-up and its capture) or graph_paths()."""
    return _GRAPH_MODE.get()


@contextmanager
def graph_paths() -> Iterator[None]:
    """Pick the GPU-time paths (as inside capture_graph): for warming up a graph captured by other means."""
    token = _GRAPH_MODE.set(True)
    try:
        yield
    finally:
        _GRAPH_MODE.reset(token)


def capture_graph(fn: Callable[[], Any], *, warmup: int = 2, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what `fn` returned while captured): replaying the graph recomputes those tensors in place."""
    with graph_paths():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    return graph, outputs
