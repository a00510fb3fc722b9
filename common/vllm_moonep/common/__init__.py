"""The layout-agnostic core: pool, padding, grouped GEMM, the layout protocol, the MoE step.

The vLLM modular-kernel classes ``MoonEPPrepareAndFinalize`` and ``MoonEPExperts`` are exported
here too, lazily: ``vllm_moonep.common.vllm_modular`` (the one module of this package that imports
vLLM) is imported on first access to either name, so ``import vllm_moonep.common`` works without
vLLM.
"""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn
from vllm_moonep.common.layout import WEIGHT_TILE, WeightLayout, check_local_experts
from vllm_moonep.common.memory import MemoryReport, expert_bytes, replicated_accounting, symmetric_accounting
from vllm_moonep.common.moe_step import MoonEPMoE, StepInfo
from vllm_moonep.common.padding import pad_to_capacity, sanitize_routing, tokens_per_expert
from vllm_moonep.common.pool import MIN_CAPACITY, MoonEPBufferPool, capacity_for

#: names served by ``vllm_modular`` (imports vLLM), resolved on first access; left out of
#: ``__all__`` so that ``from vllm_moonep.common import *`` does not import vLLM either
_VLLM_NAMES = ("MoonEPExperts", "MoonEPPrepareAndFinalize")

__all__ = [
    "MIN_CAPACITY",
    "WEIGHT_TILE",
    "GroupedWeights",
    "MemoryReport",
    "MoonEPBufferPool",
    "MoonEPMoE",
    "StepInfo",
    "WeightLayout",
    "capacity_for",
    "check_local_experts",
    "expert_bytes",
    "expert_ffn",
    "pad_to_capacity",
    "replicated_accounting",
    "sanitize_routing",
    "symmetric_accounting",
    "tokens_per_expert",
]


def __getattr__(name: str):
    if name in _VLLM_NAMES:
        try:
            from vllm_moonep.common import vllm_modular
        except ImportError as exc:
            raise ImportError(f"vllm_moonep.common.{name} needs vLLM 0.33 importable: {exc}") from exc
        value = getattr(vllm_modular, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_VLLM_NAMES))
