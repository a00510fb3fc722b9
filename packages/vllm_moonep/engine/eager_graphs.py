"""Eager dispatch and combine replayed from private CUDA graphs: one launch instead of eight.

    call k of a launch sequence, key seen before?   no ─► run the launches (eager), remember key
                                                  yes ─► captured yet? no ─► capture once on a side
                                                                            stream (nothing runs)
                                                       copy the inputs into the graph's static
                                                       tensors ─► replay ─► the captured outputs

Why: under a CUDA graph the engine's dispatch and combine of 1-128 tokens take about one
all-to-all each (docs/PERFORMANCE.md), but called eagerly (vLLM's eager mode, batches above its
capture sizes, piecewise graphs that leave the MoE op out) each launch costs 15-35 us of host
time, eleven of them per step, while the peer waits: the host, not NVLink, set the time. A
graph replay costs one launch. Each ``GraphCache`` belongs to one transport (one buffer
capacity), so every graph holds one token count, as graphs must.

What a replay may assume: the launch sequence is fixed for the key (the buffer's own tensors,
its epochs and plan live at fixed addresses, and every data-dependent decision is made on the
device), the copied inputs have the shapes and dtypes the buffer already checked, and any other
address the launches read (combine's ``hidden_nvsh``) is part of the key. The first call with a
key runs eagerly (it also compiles the kernels); a key seen again is captured once. A key that
never repeats (an input address that changes every call) just stays eager; at most
``MAX_GRAPHS`` graphs per cache. Inside a caller's own capture (vLLM's CUDA graphs) the launches
go straight into that capture. A capture that fails turns the cache off (said once, WARNING) and
that call runs eagerly: nothing ran during the failed capture.

``EAGER_GRAPHS`` (``VLLM_MOONEP_EAGER_GRAPHS=0`` turns it off) and ``EAGER_GRAPH_MAX_TOKENS``
(buffers up to this capacity use it; above it the input copy costs more device time than the
launches save host time) are the defaults, defined here once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Hashable

import torch

from vllm_moonep.engine.defaults import say_once

__all__ = ["EAGER_GRAPHS", "EAGER_GRAPH_MAX_TOKENS", "GraphCache"]

#: eager dispatch/combine through private CUDA graphs; ``VLLM_MOONEP_EAGER_GRAPHS=0`` turns it off
EAGER_GRAPHS = os.environ.get("VLLM_MOONEP_EAGER_GRAPHS", "1") != "0"
#: buffers of at most this many tokens per rank use it
EAGER_GRAPH_MAX_TOKENS = 1024


class GraphCache:
    """Captured launch sequences of one transport, by key (see the module doc)."""

    #: graphs kept per cache; keys beyond it run eagerly
    MAX_GRAPHS = 4
    #: keys remembered while waiting for a repeat (then forgotten: a key that never repeats)
    MAX_SEEN = 64

    def __init__(self, device: torch.device, what: str, enabled: bool = True):
        self.device = device
        self.what = what
        self.enabled = bool(enabled) and device.type == "cuda"
        self._graphs: dict[Hashable, tuple[Any, tuple, Any]] = {}
        self._seen: set[Hashable] = set()
        self._stream: torch.cuda.Stream | None = None
        self.replays = 0  # calls served by a replay (tests read it)

    def run(self, key: Hashable, fn: Callable[..., Any], copied: tuple, fixed: tuple = ()) -> tuple[Any, bool]:
        """``(fn(*copied, *fixed), replayed)``. ``copied``: tensors whose values change between
        calls (copied into the graph's static tensors); ``fixed``: everything else, the same for
        every call with ``key``. A replayed result is the graph's own tensors: a caller that must
        keep it past the next call copies it."""
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return fn(*copied, *fixed), False
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen or len(self._graphs) >= self.MAX_GRAPHS:
                if len(self._seen) >= self.MAX_SEEN:
                    self._seen.clear()
                self._seen.add(key)
                return fn(*copied, *fixed), False
            entry = self._capture(key, fn, copied, fixed)
            if entry is None:
                return fn(*copied, *fixed), False
        graph, static, out = entry
        for s, x in zip(static, copied):
            s.copy_(x)
        graph.replay()
        self.replays += 1
        return out, True

    def _capture(self, key: Hashable, fn: Callable[..., Any], copied: tuple, fixed: tuple):
        static = tuple(torch.empty_like(x) for x in copied)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                # thread-local: other threads (NCCL's watchdog) keep their CUDA calls
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = fn(*static, *fixed)
                finally:
                    graph.capture_end()
        except Exception as exc:  # nothing ran: the launches were only recorded
            self.enabled = False
            self._graphs.clear()
            say_once(f"MoonEP: {self.what}: capturing an eager call in a CUDA graph failed ({type(exc).__name__}: "
                     f"{exc}); its calls launch each kernel from now on", __name__, logging.WARNING)
            return None
        say_once("MoonEP: eager dispatch and combine of buffers up to "
                 f"{EAGER_GRAPH_MAX_TOKENS} tokens replay private CUDA graphs (one launch instead of eight; "
                 "VLLM_MOONEP_EAGER_GRAPHS=0 launches each kernel)", __name__)
        entry = (graph, static, out)
        self._graphs[key] = entry
        self._seen.discard(key)
        return entry

    def clear(self) -> None:
        """Drop every graph (before the memory its launches address is freed)."""
        self._graphs.clear()
        self._seen.clear()
