"""CUDA-graph capture for the CUDA tests (not a test module)."""

from __future__ import annotations

import torch


def capture(fn, *args, warmup: int = 3):
    """Run ``fn(*args)`` ``warmup`` times on a side stream (compiles, autotunes, allocates), then capture one
    call into a CUDA graph: ``(graph, outputs)``. A replay recomputes ``outputs`` in place from whatever the
    argument tensors hold then."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*args)
    return graph, outs
