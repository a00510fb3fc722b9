"""The layout-agnostic core: pool, padding, grouped GEMM, the layout protocol, the MoE step.

Import vLLM-facing classes from ``vllm_moonep.common.vllm_modular`` (that module imports vLLM;
nothing else here does).
"""

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn
from vllm_moonep.common.layout import WEIGHT_TILE, WeightLayout, check_local_experts
from vllm_moonep.common.memory import MemoryReport, expert_bytes, replicated_accounting, symmetric_accounting
from vllm_moonep.common.moe_step import MoonEPMoE, StepInfo
from vllm_moonep.common.padding import pad_to_capacity, sanitize_routing, tokens_per_expert
from vllm_moonep.common.pool import MIN_CAPACITY, MoonEPBufferPool, capacity_for

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
