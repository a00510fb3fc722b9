"""Per-phase timing of a MoE step (pad, dispatch, prefetch, experts, combine).

``PhaseTimer`` records device events on CUDA (no synchronization inside the step) and
``perf_counter`` on CPU; ``NullTimer`` costs nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

PHASES = ("pad", "dispatch", "prefetch", "experts", "combine")


class NullTimer:
    @contextlib.contextmanager
    def phase(self, name: str):
        yield


class PhaseTimer:
    """Accumulates per-phase times (seconds) over steps; ``results()`` synchronizes once."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.samples: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._pending.append((name, a, b))
        else:
            t0 = time.perf_counter()
            yield
            self.samples[name].append(time.perf_counter() - t0)

    def results(self) -> dict[str, list[float]]:
        if self._pending:
            torch.cuda.synchronize(self.device)
            for name, a, b in self._pending:
                self.samples[name].append(a.elapsed_time(b) / 1e3)
            self._pending.clear()
        return dict(self.samples)

    def reset(self) -> None:
        self._pending.clear()
        self.samples.clear()
