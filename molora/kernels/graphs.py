"""CUDA-graph capture as PyTorch's documentation gives it: warm up on a side stream (Triton compiles, lazy CUDA
state and the caching allocator settle), then capture one call. Used by the serving engine's decode and prefill
steps and by the kernel benchmark.

While capture_graph warms up and captures, `graph_mode()` is True, and the dispatcher (kernels/dispatch.py) takes
the paths that are fastest in GPU time (Triton kernels); outside it, decode-sized calls take the eager decode path
(one fused launch per group call, or the dense torch form on wide hot sets), which costs the least host time (an
eager step is host-bound). Warm-up and capture see the same flag, so what a capture records was compiled by the
warm-up. A graph captured by other means (torch.cuda.graph after an eager warm-up, as PyTorch's documentation and
most benchmark harnesses do it) is in graph mode while its stream captures, so it records the same paths; their
Triton modules must be loaded before that (loading one is refused while a stream captures), so an eager decode
call also runs, once per call shape, the path graph mode takes (`load_graph_path`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

_GRAPH_MODE: ContextVar[bool] = ContextVar("molora_graph_mode", default=False)


_LOADED: set[tuple] = set()


def graph_mode() -> bool:
    """True inside capture_graph (its warm-up and its capture), graph_paths(), or while the current CUDA stream
    captures a graph."""
    return _GRAPH_MODE.get() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def call_key(x: torch.Tensor, *parts: Any) -> tuple:
    """A call's shape key, cheap to build on an eager decode call's host path: x (the activations, the one input
    whose layout varies) as its shape, strides, dtype and 16-byte alignment (what a Triton kernel specialises on);
    every other tensor (adapter buffers, routing rows: contiguous, from the caching allocator) as its shape and
    dtype; anything else as itself."""
    return (x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0,
            *((p.shape, p.dtype) if isinstance(p, torch.Tensor) else p for p in parts))


def load_graph_path(key: tuple, call: Callable[[], Any]) -> None:
    """Run `call` (the same call an eager decode call makes) once per `key` in graph mode, its result dropped: the
    Triton kernels graph mode takes for it are then compiled and loaded before a capture by other means records
    them."""
    if key in _LOADED:
        return
    with graph_paths():
        call()
    _LOADED.add(key)


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
