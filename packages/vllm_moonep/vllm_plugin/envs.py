"""Our ``VLLM_MOONEP_*`` variables, made known to vLLM's environment validation.

vLLM warns about (``--fail-on-environ-validation``: refuses) any ``VLLM_*`` variable that is not a
key of ``vllm.envs.environment_variables``. ``register_env_vars()`` adds ours there (each getter
returns the raw string, or ``None`` when unset; the plugin parses and validates the values itself),
so they neither warn nor fail validation, and vLLM's Ray executor copies them to its workers.
It runs first in ``register()``, before the ``VLLM_MOONEP_PLUGIN=0`` early return.

A ``VLLM_MOONEP_*`` variable that is none of ours is left unregistered (vLLM warns about it) and
named here with the closest known name, so a typo is not silently ignored.
"""

from __future__ import annotations

import difflib
import logging
import os

from vllm_moonep.engine.faults.arrival_board import ARRIVAL_ENV, HEARTBEAT_ENV
from vllm_moonep.engine.faults.timeouts import TIMEOUT_ENV
from vllm_moonep.engine.multicast import OPT_IN_VAR
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.vllm_plugin.options import ENV_VARS, PLUGIN_ENV

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["KNOWN_ENV_VARS", "register_env_vars"]

#: variables the rank launcher (``vllm_moonep.testing.launch``) and the test suite set in rank processes,
#: which may load vLLM (and so this plugin)
LAUNCHER_ENV_VARS = (
    "VLLM_MOONEP_RANK",
    "VLLM_MOONEP_THREADS_PER_RANK",
    "VLLM_MOONEP_BACKEND",
    "VLLM_MOONEP_NNODES",
    "VLLM_MOONEP_TEST_DEVICE",
    "VLLM_MOONEP_TEST_GROUP_TIMEOUT_S",
    "VLLM_MOONEP_TEST_CALL_TIMEOUT_S",
    "VLLM_MOONEP_TEST_FAILURES",
    "VLLM_MOONEP_RANK_START",
    "VLLM_MOONEP_TEST_TRANSPORT",
    "VLLM_MOONEP_TEST_COMPARE_JSON",  # tests/gpu/test_vs_vllm_fused_experts.py: where its figures go
)

#: every VLLM_MOONEP_* name this project reads
KNOWN_ENV_VARS = tuple(ENV_VARS.values()) + (PLUGIN_ENV, TIMEOUT_ENV, ARRIVAL_ENV, HEARTBEAT_ENV, OPT_IN_VAR,
                                            RANKS_PER_NODE_ENV) \
    + LAUNCHER_ENV_VARS \
    + ("VLLM_MOONEP_NVSHMEM_FORCE_RMA",  # NvshmemHeap: every peer read by RMA (engine/heaps/nvshmem_heap.py)
       "VLLM_MOONEP_FAST_LAUNCH",  # 0: Triton's ordinary launch for every engine kernel (engine/launch.py)
       "VLLM_MOONEP_EAGER_GRAPHS")  # 0: eager dispatch/combine launch each kernel (engine/transports/eager_graphs.py)

_warned: set[str] = set()


def _getter(name: str):
    return lambda: os.environ.get(name)


def register_env_vars() -> list[str]:
    """Add our names to ``vllm.envs.environment_variables`` (idempotent); returns the names added."""
    import vllm.envs as envs

    table = envs.environment_variables
    added = []
    for name in KNOWN_ENV_VARS:
        if name not in table:
            table[name] = _getter(name)
            added.append(name)
    for name in os.environ:
        if name.startswith("VLLM_MOONEP_") and name not in KNOWN_ENV_VARS and name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, KNOWN_ENV_VARS, n=1)
            log.warning("vllm-moonep: %s is not a vllm-moonep variable and is ignored%s", name,
                        f" (did you mean {close[0]}?)" if close else "")
    return added
