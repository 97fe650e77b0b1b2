"""Timing a piece of GPU work as a decode step replays it: captured once in a CUDA graph, then
replayed and timed with CUDA events (the kernel microbenchmarks in benchmarks/ use it)."""

from __future__ import annotations

from collections.abc import Callable


def graph_replay_seconds(fn: Callable[[], object], iters: int) -> float:
    """Mean seconds per replay of `fn` captured in a CUDA graph: `fn` runs twice on a side
    stream first (lazy initialisation, allocator warm-up), then is captured, replayed once and
    timed over `iters` replays. `fn` must be capturable (no host syncs, fixed shapes).

    Raises:
        RuntimeError: from CUDA when there is no GPU or `fn` is not capturable.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters
