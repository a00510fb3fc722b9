"""The ``WeightLayout`` protocol: how one MoE layer's expert weights live on one rank.

A layout answers three questions: which rows the grouped GEMM reads for each ``cu_seqlens``
group (``grouped_weights()``), how slot rows are filled from a plan (``prefetch``), and how many
bytes it holds by kind (``memory_report()``). The prepare/finalize, experts and the MoE step are
written against this protocol only, so the replicated and symmetric layouts are interchangeable.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights
from vllm_moonep.common.memory import MemoryReport
from vllm_moonep.engine import MoonEPInputError

#: MoonEP's weight prefetch tiles H and I by 128 (vLLM: MOONEP_WEIGHT_TILE)
WEIGHT_TILE = 128


@runtime_checkable
class WeightLayout(Protocol):
    kind: str  # "replicated" | "symmetric"
    num_experts: int
    num_slots: int
    hidden_size: int
    intermediate_size: int

    def grouped_weights(self) -> GroupedWeights:
        """The row source for the ``E + B`` groups of ``cu_seqlens``."""
        ...

    def prefetch(self, buffer, plan) -> None:
        """Fill this rank's slot rows as ``plan.experts_to_copy[rank]`` says."""
        ...

    def memory_report(self) -> MemoryReport:
        ...

    def destroy(self) -> None:
        ...


def check_local_experts(w13: torch.Tensor, w2: torch.Tensor, num_experts: int, world_size: int, num_slots: int) -> tuple[int, int, int]:
    """Validate a rank's local expert weights; returns ``(epn, I, H)``.

    ``w13 [epn, 2I, H]`` (gate rows first) and ``w2 [epn, H, I]``, bf16, H and I multiples of
    128, ``E`` divisible by the world size, ``num_slots > 0``.
    """
    if not isinstance(num_slots, int) or num_slots <= 0:
        raise MoonEPInputError(f"num_prefetch_slots must be a positive int, got {num_slots!r}")
    if world_size <= 0 or num_experts % world_size:
        raise MoonEPInputError(f"num_experts={num_experts} must be divisible by the EP world size {world_size}")
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise MoonEPInputError(f"MoonEP supports BF16 expert weights only, got w13 {w13.dtype}, w2 {w2.dtype}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise MoonEPInputError(f"w13 must be [epn, 2I, H] and w2 [epn, H, I], got {list(w13.shape)}, {list(w2.shape)}")
    epn, two_i, H = w13.shape
    if epn * world_size != num_experts:
        raise MoonEPInputError(
            f"this rank holds {epn} experts, but num_experts={num_experts} over {world_size} ranks needs {num_experts // world_size}"
        )
    if two_i % 2:
        raise MoonEPInputError(f"w13's second dim (2I) must be even, got {two_i}")
    I = two_i // 2
    if tuple(w2.shape) != (epn, H, I):
        raise MoonEPInputError(f"w2 must be [epn={epn}, H={H}, I={I}] to match w13 {list(w13.shape)}, got {list(w2.shape)}")
    if H % WEIGHT_TILE or I % WEIGHT_TILE:
        raise MoonEPInputError(
            f"MoonEP weight prefetch needs hidden and intermediate sizes that are multiples of {WEIGHT_TILE}; got H={H}, I={I}"
        )
    if w13.device != w2.device:
        raise MoonEPInputError(f"w13 is on {w13.device}, w2 on {w2.device}")
    return epn, I, H
