"""The worker's check before each step: a failure a device-side wait recorded is raised there.

Under CUDA graphs vLLM replays the MoE layers' launches, and no MoonEP ``dispatch`` or ``combine``
runs its check on entry: a symmetric-transport wait that timed out (or a peer that gave up on the
group, ``engine/signals.py``) would leave the server generating from wrong rows with no error. So
``seams.py`` rebinds vLLM's ``Worker.execute_model`` (the CPU worker inherits it) in the worker
process, when the EP group's all2all manager is built, to::

    execute_model(...) --> error_board.raise_recorded()   every open board: plain host reads, no sync
                      --> vLLM's execute_model            (raises the recorded MoonEPCollectiveTimeout instead)

The step that failed has returned by then (vLLM reads each step's sampled tokens before the next),
so at most that one step's tokens go out. Nothing here imports vLLM.
"""

from __future__ import annotations

import functools

from vllm_moonep.engine.faults.error_board import raise_recorded

__all__ = ["hook_execute_model"]


def hook_execute_model(orig):
    """vLLM's ``Worker.execute_model``, after raising what any MoonEP error board of this process holds."""

    @functools.wraps(orig)
    def execute_model(self, *args, **kwargs):
        raise_recorded()
        return orig(self, *args, **kwargs)

    execute_model.__vllm_moonep__ = True
    return execute_model
