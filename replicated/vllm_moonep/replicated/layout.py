"""The replicated ``[E+B]`` layout (vLLM 0.33's proof of concept, our A/B baseline).

Every rank all-gathers every rank's local experts once at load time into contiguous
``[E+B, out, in]`` gate, up and down tensors in global expert order; rows ``[E, E+B)`` are the
prefetch slots, filled by the engine's ``prefetch_weight``. Contiguous, so ``torch._grouped_mm``
reads it directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights
from vllm_moonep.common.layout import check_local_experts
from vllm_moonep.common.memory import MemoryReport, replicated_accounting
from vllm_moonep.engine import MoonEPBuffer, MoonEPPlan, MoonEPStateError
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class ReplicatedWeightLayout:
    """``[E+B]`` gate/up/down on every rank, built from this rank's ``w13 [epn,2I,H]``, ``w2 [epn,H,I]``.

    ``keeps_local_params`` says whether the caller keeps its own local parameters allocated
    beside the copy (vLLM's PoC does); it only affects the memory report. The load-time
    all-gathers go through the engine's bounded transport (``timeout_s``; ``None``:
    ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S`` or 300 s): a peer that dies or never loads makes the
    others raise ``MoonEPCollectiveTimeout`` naming it. ``destroy()`` is local and idempotent.
    """

    kind = "replicated"

    def __init__(self, w13_local: torch.Tensor, w2_local: torch.Tensor, num_experts: int, num_slots: int,
                 group: ProcessGroup | None = None, *, keeps_local_params: bool = True,
                 timeout_s: float | None = None) -> None:
        transport = BoundedCollectives(group, timeout_s=timeout_s)
        try:
            self._load(transport, w13_local, w2_local, num_experts, num_slots, keeps_local_params)
        finally:
            transport.close()  # the layout issues no collective after loading
        self._destroyed = False

    def _load(self, transport: BoundedCollectives, w13_local: torch.Tensor, w2_local: torch.Tensor,
              num_experts: int, num_slots: int, keeps_local_params: bool) -> None:
        world, rank = transport.world_size, transport.rank
        epn, I, H = check_local_experts(w13_local, w2_local, num_experts, world, num_slots)
        self.num_experts, self.num_slots = num_experts, num_slots
        self.hidden_size, self.intermediate_size = H, I
        self.world_size, self.rank, self.epn = world, rank, epn
        self.keeps_local_params = keeps_local_params
        self.dtype = torch.bfloat16  # check_local_experts refuses any other
        E, B = num_experts, num_slots
        dev = w13_local.device
        w13 = transport.all_gather(w13_local, "ReplicatedWeightLayout: all_gather(w13)").view(E, 2 * I, H)
        w2 = transport.all_gather(w2_local, "ReplicatedWeightLayout: all_gather(w2)").view(E, H, I)
        # [E+B, out, in] each; None once destroyed
        gate = torch.zeros(E + B, I, H, dtype=torch.bfloat16, device=dev)
        up = torch.zeros(E + B, I, H, dtype=torch.bfloat16, device=dev)
        down = torch.zeros(E + B, H, I, dtype=torch.bfloat16, device=dev)
        gate[:E].copy_(w13[:, :I])
        up[:E].copy_(w13[:, I:])
        down[:E].copy_(w2)
        del w13, w2
        self.full_gate_weight: torch.Tensor | None = gate
        self.full_up_weight: torch.Tensor | None = up
        self.full_down_weight: torch.Tensor | None = down
        self._weights: GroupedWeights | None = GroupedWeights.contiguous(gate, up, down)

    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise MoonEPStateError(f"ReplicatedWeightLayout.{what}: the layout was destroyed")

    def grouped_weights(self) -> GroupedWeights:
        self._alive("grouped_weights")
        assert self._weights is not None  # cleared only by destroy (_alive)
        return self._weights

    def prefetch(self, buffer: MoonEPBuffer, plan: MoonEPPlan,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The contract's ``prefetch_weight`` from the local full weights (every planned slot;
        ``rows`` is not used: local copies are what the proof of concept does)."""
        self._alive("prefetch")
        buffer.prefetch_weight(
            plan=plan,
            full_gate_weight=self.full_gate_weight,
            full_up_weight=self.full_up_weight,
            full_down_weight=self.full_down_weight,
        )

    def memory_report(self) -> MemoryReport:
        return replicated_accounting(
            self.num_experts, self.world_size, self.num_slots, self.hidden_size, self.intermediate_size,
            dtype=self.dtype, keeps_local_params=self.keeps_local_params,
        )

    def destroy(self) -> None:
        """Release the tensors; idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        self._weights = None
        self.full_gate_weight = self.full_up_weight = self.full_down_weight = None


if TYPE_CHECKING:  # the type checker verifies the class honours the protocol it is used through
    from vllm_moonep.common.layout import WeightLayout

    _IS_A_WEIGHT_LAYOUT: type[WeightLayout] = ReplicatedWeightLayout
