"""Eager dispatch and combine replayed from private CUDA graphs instead of their kernels' launches.

    call k of a launch sequence, key seen before?   no ─► run the launches (eager), remember key
                                                  yes ─► captured yet? no ─► capture once on a side
                                                                            stream (nothing runs)
                                                       copy the inputs into the graph's static
                                                       tensors ─► replay ─► the captured outputs

Why: under a CUDA graph the engine's dispatch and combine of 1-128 tokens take about one
all-to-all each (docs/PERFORMANCE.md), but called eagerly (vLLM's eager mode, batches above its
capture sizes, piecewise graphs that leave the MoE op out) each launch costs 15-35 us of host
time, ten or eleven of them per dispatch and combine then (four now), while the peer waits: the host, not NVLink,
set the time. A replay costs one graph launch (dispatch: plus the copies of its four inputs;
combine: plus copies of its outputs). Each ``GraphCache`` belongs to one transport (one buffer
capacity), so every graph holds one token count, as graphs must.

What a replay may assume: the launch sequence is fixed for the key (the buffer's own tensors,
its epochs and plan live at fixed addresses, and every data-dependent decision is made on the
device), the copied inputs have the shapes and dtypes the buffer already checked, and any other
address the launches read (combine's ``hidden_nvsh``; dispatch's inputs in its in-place graphs,
which the MoE step's staging tensors make the same every step) is part of the key. The first call with a
key runs eagerly (it also compiles the kernels); a key seen again is captured once. A key that
never repeats (an input address that changes every call) just stays eager; at most
``MAX_GRAPHS`` graphs per cache, the least recently replayed one giving way to a new key. Inside
a caller's own capture (vLLM's CUDA graphs) the launches go straight into that capture. A
capture that fails (or cannot allocate its static inputs) stops further captures (said once,
WARNING; the graphs made so far stay) and that call launches its kernels: nothing ran during the
failed capture, so every rank still runs the same kernels in the same order.

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

    #: graphs kept per cache; a new key past it replaces the least recently replayed one
    MAX_GRAPHS = 4
    #: keys remembered while waiting for a repeat (then forgotten: a key that never repeats)
    MAX_SEEN = 64
    #: captures per cache at most (more distinct keys than MAX_GRAPHS in rotation would otherwise
    #: capture on every call); past it, calls without a graph launch their kernels
    MAX_CAPTURES = 16

    def __init__(self, device: torch.device, what: str, enabled: bool = True):
        self.device = device
        self.what = what
        self.enabled = bool(enabled) and device.type == "cuda"
        self.capturing = self.enabled  # False after a failed capture: the graphs made so far stay
        self._graphs: dict[Hashable, tuple[Any, tuple, Any]] = {}  # least recently replayed first
        self._seen: set[Hashable] = set()
        self._stream: torch.cuda.Stream | None = None
        self.replays = 0  # calls served by a replay (tests read it)
        self.captures = 0

    def ready(self, key: Hashable) -> bool:
        """Whether ``run(key, ...)`` now replays or captures (a key seen before, captures left)
        rather than launching eagerly; a caller with a fallback asks first, then ``remember``s."""
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return False
        return key in self._graphs or (self.capturing and key in self._seen and self.captures < self.MAX_CAPTURES)

    def remember(self, key: Hashable) -> None:
        """Note ``key`` as seen: the next call with it captures (see ``ready``)."""
        if len(self._seen) >= self.MAX_SEEN:
            self._seen.clear()
        self._seen.add(key)

    def run(self, key: Hashable, fn: Callable[..., Any], copied: tuple, fixed: tuple = ()) -> tuple[Any, bool]:
        """``(fn(*copied, *fixed), replayed)``. ``copied``: tensors whose values change between
        calls (copied into the graph's static tensors); ``fixed``: everything else, the same for
        every call with ``key``. A replayed result is the graph's own tensors: a caller that must
        keep it past the next call copies it."""
        if not self.enabled or torch.cuda.is_current_stream_capturing():
            return fn(*copied, *fixed), False
        entry = self._graphs.pop(key, None)
        if entry is None:
            if not self.capturing or key not in self._seen or self.captures >= self.MAX_CAPTURES:
                self.remember(key)
                return fn(*copied, *fixed), False
            if len(self._graphs) >= self.MAX_GRAPHS:
                # the least recently replayed graph goes (its memory is reused in stream order)
                self._graphs.pop(next(iter(self._graphs)))
            self.captures += 1
            entry = self._capture(fn, copied, fixed)
            self._seen.discard(key)
            if entry is None:
                return fn(*copied, *fixed), False
        self._graphs[key] = entry  # most recently replayed last
        graph, static, out = entry
        for s, x in zip(static, copied):
            s.copy_(x)
        graph.replay()
        self.replays += 1
        return out, True

    def _capture(self, fn: Callable[..., Any], copied: tuple, fixed: tuple):
        """A graph of ``fn`` on static copies of ``copied``, or ``None`` (capturing stops, said once)."""
        failure: BaseException | None = None
        graph = out = None
        static: tuple = ()
        try:  # an allocation failing here (out of memory) must not leave this rank's call alone
            static = tuple(torch.empty_like(x) for x in copied)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()
        except Exception as exc:
            failure = exc
        if failure is None:
            assert graph is not None and self._stream is not None
            with torch.cuda.stream(self._stream):
                try:
                    # relaxed: this thread may still load a kernel module (a first specialization)
                    # while capturing; nothing here synchronizes
                    graph.capture_begin(pool=pool, capture_error_mode="relaxed")
                except Exception as exc:
                    failure = exc
                else:
                    try:
                        out = fn(*static, *fixed)
                    except Exception as exc:  # recorded launches only: nothing ran
                        failure = exc
                    try:
                        graph.capture_end()
                    except Exception as exc:
                        failure = failure or exc
                        _stop_allocating_to(self.device, pool)
        if failure is not None:
            self.capturing = False
            say_once(f"MoonEP: {self.what}: capturing an eager call in a CUDA graph failed ({type(failure).__name__}: "
                     f"{failure}); calls without a graph launch each kernel from now on", __name__, logging.WARNING)
            return None
        say_once("MoonEP: eager dispatch and combine of buffers up to "
                 f"{EAGER_GRAPH_MAX_TOKENS} tokens replay private CUDA graphs (a dispatch: input copies and one "
                 "graph launch instead of its kernels; VLLM_MOONEP_EAGER_GRAPHS=0 launches each kernel)", __name__)
        return (graph, static, out)

    def clear(self) -> None:
        """Drop every graph (before the memory its launches address is freed)."""
        self._graphs.clear()
        self._seen.clear()


def _stop_allocating_to(device: torch.device, pool) -> None:
    """After a capture that ``capture_end`` could not finish: torch's allocator must stop routing
    to the graph's pool (else a later ``empty_cache`` finds a capture still under way). Torch's
    own call, when it got that far, already did; then this one refuses, which is fine."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except Exception:
        pass
