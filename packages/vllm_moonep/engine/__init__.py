"""The MoonEP engine: the ``Buffer`` contract (dispatch, prefetch_weight, combine).

``Buffer`` is the built-in engine; ``make_buffer(engine="auto"|"builtin"|"moonep")`` picks the
real ``moonep`` when it is installed and usable. Callers hold either engine's buffer as a
``MoonEPBuffer`` (``protocol.py``); the defaults of ``B``, ``group`` and ``device`` are in
``defaults.py``. Depends on torch only.
"""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

from vllm_moonep.engine.buffer import Buffer, Plan, check_buffer_settings, copy_slots_from_rows, nvs_rows, validate_config
from vllm_moonep.engine.defaults import current_cuda_device, default_num_slots, group_rank_world, resolve_device
from vllm_moonep.engine.errors import (
    MoonEPCollectiveTimeout,
    MoonEPError,
    MoonEPInputError,
    MoonEPStateError,
    MoonEPUnavailableError,
)
from vllm_moonep.engine.planning.planner import GlobalPlan, place_entries, plan_global
from vllm_moonep.engine.protocol import MoonEPBuffer, MoonEPPlan, check_plan, dispatched_rows, refuse_step
from vllm_moonep.engine.select import ENGINES, make_buffer, real_moonep_status, resolve_engine
from vllm_moonep.engine.transports import TRANSPORTS, resolve_transport

__all__ = [
    "ENGINES",
    "Buffer",
    "GlobalPlan",
    "MoonEPBuffer",
    "MoonEPCollectiveTimeout",
    "MoonEPError",
    "MoonEPInputError",
    "MoonEPPlan",
    "MoonEPStateError",
    "MoonEPUnavailableError",
    "Plan",
    "check_buffer_settings",
    "check_plan",
    "copy_slots_from_rows",
    "current_cuda_device",
    "default_num_slots",
    "dispatched_rows",
    "group_rank_world",
    "make_buffer",
    "nvs_rows",
    "place_entries",
    "plan_global",
    "real_moonep_status",
    "refuse_step",
    "resolve_device",
    "resolve_engine",
    "resolve_transport",
    "TRANSPORTS",
    "validate_config",
]
