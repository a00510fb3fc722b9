"""What the benchmarks share to time a call: barrier-aligned medians across ranks, and a call
captured in a CUDA graph (warm-up on a side stream first, as capture requires)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["capture_graph", "on_side_stream", "sync_device", "timed_median"]


def sync_device(dev: torch.device) -> None:
    """Wait for ``dev``'s work (no-op on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_median(fn, dev: torch.device, iters: int, warmup: int, barrier: bool = True) -> tuple[float, float | None]:
    """``(host median s, device median s or None)`` of ``fn()``: each call after a barrier of the
    default group (every rank calls it together) and a synchronize; device time from CUDA events."""
    host, device = [], []
    cuda = dev.type == "cuda"
    for i in range(warmup + iters):
        if barrier:
            dist.barrier()
        sync_device(dev)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            e1.record()
        sync_device(dev)
        t1 = time.perf_counter()
        if i >= warmup:
            host.append(t1 - t0)
            if cuda:
                device.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(host), (statistics.median(device) if device else None)


def on_side_stream(fn, calls: int = 1) -> None:
    """Call ``fn`` ``calls`` times on a fresh stream ordered after the current one, then wait for it
    (a capture's warm-up: kernels compiled and memory allocated outside the capture)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    cur.wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(fn, warm_calls: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warm_calls`` calls on a side stream (capture needs
    its kernels compiled and its allocations made outside the capture); replay with ``.replay()``.

    The graph holds ``fn`` (``graph.captured_fn``), and so every buffer ``fn`` closes over, for as long
    as it lives: its kernels keep those addresses, and each capture (``torch.cuda.graph``) empties the
    allocator's cache first, which hands a buffer dropped after an earlier capture back to the driver
    under that earlier graph (an illegal address at its next replay)."""
    on_side_stream(fn, warm_calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    graph.captured_fn = fn  # type: ignore[attr-defined]  # torch's class has a __dict__; mypy sees no such field
    return graph
