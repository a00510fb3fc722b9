"""The plugin's process state and its error: the leaf every other module of the plugin records in.

It imports no other module of the plugin (``tests/unit/test_import_graph.py`` holds the plugin's
modules to a DAG), and no vLLM:

- ``LOAD`` (``LoadState``): what ``seams.apply_seams`` hooked in this process (the MoonEP seams,
  the config seam, the graph seams), the mismatch found for each group that is not, and the INFO
  line kept until vLLM's logging is configured; ``patched()`` / ``seam_error()`` read it.
- ``STATE`` (``PluginState``): the worker's objects shared by every MoE layer: the ``LayoutSet``
  (the layers' layouts, their heap and shared slot pool), what ``checks.check_worker`` resolved,
  the start-up line, the layer count of the prepare/finalize objects and the step statistics
  (``StepStats``).
- ``MoonEPSeamError``: vLLM's internals do not look like the 0.33 seams the plugin rebinds.

Both states are reset in place (other modules hold ``LOAD`` and ``STATE`` themselves):
``seams.undo_seams`` resets ``LOAD``, the all2all manager's ``destroy`` resets ``STATE``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from vllm_moonep.engine import MoonEPError

if TYPE_CHECKING:  # the layouts are imported when the first layer is built
    from vllm_moonep.layouts import LayoutSet

# under the "vllm" logger so the lines show in vLLM's own log format and level
log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["LOAD", "STATE", "LoadState", "MoonEPSeamError", "PluginState", "StepStats", "patched", "seam_error"]


class MoonEPSeamError(MoonEPError):
    """vLLM's internals do not look like the 0.33 seams this plugin rebinds."""


# ------------------------------------------------------------------------------------ what was hooked
@dataclass
class LoadState:
    """What ``seams.apply_seams`` found and hooked in this process."""

    applied: bool = False  # the MoonEP seams (all or none) are rebound
    config_hooked: bool = False  # EngineArgs.create_engine_config runs the front-end check
    graphs_hooked: bool = False  # the graph rule's hooks sit on VllmConfig.__post_init__'s path
    seam_error: MoonEPSeamError | None = None  # why the MoonEP seams are not hooked
    config_seam_error: MoonEPSeamError | None = None
    graph_seam_error: MoonEPSeamError | None = None
    step_hooked: bool = False  # Worker.execute_model / execute_dummy_batch check the error boards first (worker)
    step_seam_error: MoonEPSeamError | None = None
    #: ``seams.apply_step_seam``, set with the MoonEP seams: the all2all manager calls it in the worker process,
    #: where vLLM has imported its worker class (the front end never needs it)
    worker_seams: Callable[[], bool] | None = None
    load_line: str | None = None  # the INFO line, until vLLM's logging is configured

    def reset(self) -> None:
        vars(self).update(vars(type(self)()))


LOAD = LoadState()


def patched() -> bool:
    """Whether the MoonEP seams are hooked."""
    return LOAD.applied


def seam_error() -> MoonEPSeamError | None:
    """The seam mismatch found at load (``None``: every MoonEP seam is hooked or none was tried)."""
    return LOAD.seam_error


# ------------------------------------------------------------------------------------ the worker's objects
class StepStats:
    """Slot use and row balance of the MoE steps, logged every ``interval`` steps (EP rank 0).

    A step is counted when the first MoE layer's prepare runs; every layer's prepare adds its
    plan: slots used (all ranks), and max/mean rows per rank without the plan (all rows of each
    rank's home experts), with it (real rows) and padded. Reading the plan costs one host
    synchronization per layer on GPU, which is why this is off by default."""

    def __init__(self):
        self.steps = 0
        self.first_step = 1
        self.last: dict | None = None  # the last logged window, for tests and scrapers
        self._reset()

    def _reset(self):
        self.calls = 0
        self.used = 0
        self.total = 0
        self.ratios = {"without plan": [], "with plan": [], "padded": []}

    @staticmethod
    def _ratio(x: torch.Tensor) -> float:
        x = x.double()
        m = x.mean()
        return float(x.max() / m) if m > 0 else 1.0

    def record(self, layer_index: int, plan, interval: int, rank: int) -> None:
        if layer_index == 0:
            if self.steps and self.steps % interval == 0:
                self.emit(rank)
            self.steps += 1
        etc = plan.experts_to_copy
        R = int(etc.shape[0])
        self.calls += 1
        self.used += int((etc >= 0).sum())
        self.total += int(etc.numel())
        gp = getattr(plan, "global_plan", None)
        if gp is not None:
            self.ratios["without plan"].append(self._ratio(gp.tpe.sum(0).view(R, -1).sum(1)))
            self.ratios["with plan"].append(self._ratio(gp.seg_len.sum(1)))
            self.ratios["padded"].append(self._ratio(gp.cu_seqlens[:, -1]))

    def emit(self, rank: int) -> None:
        if self.calls == 0:
            return
        per_call = self.total / self.calls
        summary = {
            "steps": (self.first_step, self.steps), "layer_calls": self.calls,
            "slots_used_mean": self.used / self.calls, "slots_per_call": per_call,
            **{k: (sum(v) / len(v), max(v)) for k, v in self.ratios.items() if v},
        }
        self.last = summary
        if rank == 0:
            rows = ", ".join(f"{k} {m:.2f} (worst {w:.2f})" for k, (m, w) in
                             ((k, summary[k]) for k in self.ratios if k in summary))
            log.info(
                "vllm-moonep steps %d-%d (%d MoE layer calls): slots used %.1f of %d per layer and step (all EP ranks); "
                "rows per rank, max/mean: %s", self.first_step, self.steps, self.calls, summary["slots_used_mean"],
                int(per_call), rows or "n/a (the engine exposes no plan tables)",
            )
        self.first_step = self.steps + 1
        self._reset()


class PluginState:
    """Per-process objects shared by every MoE layer: the ``LayoutSet`` (the layers' layouts, their
    heap and shared slot pool), made at the first layer."""

    def __init__(self):
        self.layouts: LayoutSet | None = None
        self.summary_logged = False
        self.last_summary = ""
        self.worker: dict | None = None  # what check_worker resolved on this worker
        self.num_pf = 0
        self.stats = StepStats()

    def reset(self) -> None:
        try:
            if self.layouts is not None:
                self.layouts.destroy()  # layouts and slot pools newest first, then the heap (collective)
        finally:
            self.__init__()  # type: ignore[misc]  # reset in place: other modules hold STATE itself

    def built_layouts(self) -> list:
        """The layouts built so far in this process (in layer order)."""
        return self.layouts.layouts if self.layouts is not None else []


STATE = PluginState()
