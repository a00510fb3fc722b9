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
from vllm_moonep.engine import MoonEPBuffer, MoonEPInputError, MoonEPPlan

#: MoonEP's weight prefetch tiles H and I by 128 (vLLM: MOONEP_WEIGHT_TILE)
WEIGHT_TILE = 128


@runtime_checkable
class WeightLayout(Protocol):
    """One MoE layer's expert weights on one rank: what the step reads and how the slots refill.

    ``num_experts`` (``E``) and ``num_slots`` (``B``) must be the engine buffers' ``E`` and ``B``
    (the plan names slot rows that must exist here); ``hidden_size``/``intermediate_size`` are
    ``H``/``I``. Built collectively from this rank's ``w13 [E/R, 2I, H]`` and ``w2 [E/R, H, I]``
    (``check_local_experts``). Implementations: ``ReplicatedWeightLayout``,
    ``SymmetricWeightLayout``.
    """

    kind: str  # "replicated" | "symmetric"
    num_experts: int
    num_slots: int
    hidden_size: int
    intermediate_size: int

    def grouped_weights(self) -> GroupedWeights:
        """The row source of the ``E + B`` groups of ``cu_seqlens``, in group order, so one grouped
        GEMM serves any layout.

        Group ``g < E`` reads expert ``g``'s rows, group ``E + b`` slot ``b``'s (what the last
        ``prefetch`` put there). Every pool is ``gate [N, I, H]``, ``up [N, I, H]`` (two tensors, or
        views of one ``w13`` in either order: ``grouped_gemm/weights.py``; one order for every pool) and
        ``down [N, H, I]``, bf16. ``group_pool[g] == -1`` only
        for a group the plan keeps empty on this rank; ``dense_groups`` is set when pool 0 alone
        serves every used group (``torch._grouped_mm`` needs that). The same object on every
        call: slot contents change per step, the tensors do not (a captured graph may hold them).
        """
        ...

    def prefetch(self, buffer: MoonEPBuffer, plan: MoonEPPlan,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Fill this rank's slot rows as ``plan.experts_to_copy[rank]`` says, so that the slot
        groups hold the planned experts when the expert compute reads them.

        ``rows=(cu_seqlens, route_weights_nvs)`` of the dispatch: a layout may then leave unfilled
        a slot whose rows all have weight 0 (padding entries; the expert compute never reads
        its weights: the symmetric layout does, the replicated one fills every planned slot).

        May assume: every rank calls it once per step, after ``buffer.dispatch`` returned
        ``plan`` and before the expert compute; ``buffer`` made ``plan`` (a layout that owns its
        slots need not use it); ``plan.experts_to_copy`` is ``[R, B]`` int32, the same on every
        rank, ids in ``{-1} ∪ [0, E)``, never one of this rank's home experts; no rank writes
        home rows while serving (they were published before the first step).
        Must: for each ``b`` with ``e = experts_to_copy[rank, b] >= 0``, make slot ``b``'s gate,
        up and down rows a bitwise copy of expert ``e``'s, ordered before the expert compute on
        this rank's stream; leave ``-1`` slots untouched (their groups are empty); write only
        this rank's slots and issue no barrier (none is needed: peers' rows are only read). A plan
        it cannot apply (e.g. a table that is not ``[R, B]``) is refused with an error before
        anything is written.
        """
        ...

    def memory_report(self) -> MemoryReport:
        """Accounted bytes of expert weights this layer holds on this rank, by kind, from the one
        accounting (``common/vllm_moonep/common/memory.py``), so reports and the projections in docs/MEMORY.md agree.

        ``home_rows``: this rank's ``E/R`` experts (replicated: the caller's own parameters, 0
        when it does not keep them); ``replicated_rows``: the ``[0, E)`` copy (replicated only);
        ``slots``: the ``B`` slot rows (0 on a shared slot pool, which reports its own);
        ``transient``: the peak extra held only while loading. One expert is ``3*H*I``
        elements. A formula, not a measurement (tests compare it with what is really held).
        """
        ...

    def destroy(self) -> None:
        """Release this layer's weights; idempotent. ``grouped_weights`` and ``prefetch`` raise
        ``MoonEPStateError`` afterwards.

        Replicated: local (drops its tensors, no collective). Symmetric: collective, because heap
        frees are; it frees this layer's heap allocations LIFO (a symmetric heap reclaims only
        its newest allocation, on every rank at once), so destroy layers in reverse creation
        order and a shared slot pool after them (``destroy_in_order``). A layout closes a heap
        only if it made it; the caller closes a heap it passed in, after the last layout. Run
        before the process group is destroyed (order after a failure: docs/VALIDATION.md).
        """
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
