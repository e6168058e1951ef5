"""CUDA-graph capture as PyTorch's documentation gives it: warm up on a side stream (Triton compiles, lazy CUDA
state and the caching allocator settle), then capture one call. Used by the serving engine's decode and prefill
steps and by the kernel benchmark."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture_graph(fn: Callable[[], Any], *, warmup: int = 2, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what `fn` returned while captured): replaying the graph recomputes those tensors in place."""
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
