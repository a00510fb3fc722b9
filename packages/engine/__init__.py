"""The MoonEP engine: the ``Buffer`` contract (dispatch, prefetch_weight, combine).

``Buffer`` is the built-in engine; ``make_buffer(engine="auto"|"builtin"|"moonep")`` picks the
real ``moonep`` when it is installed and usable. Depends on torch only.
"""

from vllm_moonep.engine.buffer import Buffer, Plan, copy_slots_from_rows, nvs_rows, validate_config
from vllm_moonep.engine.errors import (
    MoonEPCollectiveTimeout,
    MoonEPError,
    MoonEPInputError,
    MoonEPStateError,
    MoonEPUnavailableError,
)
from vllm_moonep.engine.planner import GlobalPlan, place_entries, plan_global
from vllm_moonep.engine.select import ENGINES, make_buffer, real_moonep_status, resolve_engine
from vllm_moonep.engine.transports import TRANSPORTS, resolve_transport

__all__ = [
    "ENGINES",
    "Buffer",
    "GlobalPlan",
    "MoonEPCollectiveTimeout",
    "MoonEPError",
    "MoonEPInputError",
    "MoonEPStateError",
    "MoonEPUnavailableError",
    "Plan",
    "copy_slots_from_rows",
    "make_buffer",
    "nvs_rows",
    "place_entries",
    "plan_global",
    "real_moonep_status",
    "resolve_engine",
    "resolve_transport",
    "TRANSPORTS",
    "validate_config",
]
