"""The worker's check before each step: a failure a device-side wait recorded is raised there.

Under CUDA graphs vLLM replays the MoE layers' launches, and no MoonEP ``dispatch`` or ``combine``
runs its check on entry: a symmetric-transport wait that timed out (or a peer that gave up on the
group, ``engine/signals.py``) would leave the server generating from wrong rows with no error. So
``seams.py`` rebinds vLLM's ``Worker.execute_model`` and ``Worker.execute_dummy_batch`` (an idle
data-parallel rank's step; the CPU worker inherits both) in the worker process, when the EP group's
all2all manager is built, to::

    step(...) --> error_board.raise_recorded()   every open board: plain host reads, no sync
             --> vLLM's step                      (raises the recorded MoonEPCollectiveTimeout instead)

The board is read when a step starts on the host, and the failed step's kernels may still be running
then: vLLM's async scheduling (on by default in 0.33) issues step N+1 before step N's output is read.
So the server stops one or two steps after the failed one, and those steps' tokens may go out.
Nothing here imports vLLM.
"""

from __future__ import annotations

import functools

from vllm_moonep.engine.faults.error_board import raise_recorded

__all__ = ["hook_step"]


def hook_step(orig):
    """vLLM's worker step ``orig``, after raising what any MoonEP error board of this process holds."""

    @functools.wraps(orig)
    def step(self, *args, **kwargs):
        raise_recorded()
        return orig(self, *args, **kwargs)

    step.__vllm_moonep__ = True
    return step
