"""``MoonEPBuffer``: what callers use of a MoonEP engine buffer, whichever engine made it.

The built-in ``Buffer`` and the real ``moonep`` package's ``Buffer`` honour one contract
(docs/CONTRACT.md). The step, the layouts, the vLLM classes and the tools are written against
this protocol, not against either class. ``MoonEPPlan`` is the public part of what ``dispatch``
returns. The real package exposes the dispatched row count only as ``buffer._ctx["NvS"]``;
``dispatched_rows(buffer)`` reads it from either engine's buffer.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["MoonEPBuffer", "MoonEPPlan", "check_plan", "dispatched_rows", "refuse_step"]


@runtime_checkable
class MoonEPPlan(Protocol):
    """What ``dispatch`` decided; ``prefetch_weight``, ``combine`` and the layouts take it back."""

    @property
    def experts_to_copy(self) -> torch.Tensor:
        """``[R, B]`` int32, the same on every rank: the global expert id in each rank's slots
        (row ``rank`` is this rank's), ``-1`` for an unused slot."""
        ...


@runtime_checkable
class MoonEPBuffer(Protocol):
    """One MoE layer shape's engine buffer on one rank (collective, one step in flight).

    Per step, in this order: ``dispatch``, then the slots are filled (``prefetch_weight``, or
    a layout that owns its slots), then the expert compute, then ``combine``. Construction,
    every call and ``destroy()`` are collective. Shapes and rules: docs/CONTRACT.md. Of the
    shape, only what callers read from a buffer is here (``S``, ``B``); the rest comes from the
    configuration the buffer was made with. Two capability flags say what a caller may count on
    beyond the contract (``accepts_num_tokens``, ``combine_reads_entry_rows_only``); the real
    ``moonep`` package's buffer is seen through an adapter that says no to both (``select.py``).
    Both engines' buffers also tell whether a plan is their latest dispatch's (``check_plan``
    below), which a layout that fills its slots itself needs; it is not a member here, so that a
    contract engine that lacks it still passes for one (the layouts that need it refuse it).
    """

    @property
    def num_dispatched_rows(self) -> int:
        """``NvS``, the rows of the dispatched shard (``S*K + (tp - 1) * 2 * E/R``): how many
        rows ``dispatch`` returns and ``combine`` takes."""
        ...

    @property
    def S(self) -> int:
        """Token capacity per rank: every rank passes exactly ``S`` rows to ``dispatch``."""
        ...

    @property
    def B(self) -> int:
        """Prefetch slots per rank: ``cu_seqlens`` has ``E + B`` groups."""
        ...

    @property
    def accepts_num_tokens(self) -> bool:
        """Whether ``dispatch`` takes the keyword ``num_tokens`` (tokens from there to ``S`` are the
        caller's padding, whose rows it may leave unmoved): the step passes it only then, since an
        engine without it refuses the keyword. The built-in engine: yes; the real ``moonep``: no."""
        ...

    @property
    def combine_reads_entry_rows_only(self) -> bool:
        """Whether ``combine`` reads only the rows that hold an entry (each token's K rows) of
        ``hidden_nvsh``, never a segment's padding tail: the expert compute may then leave the tails
        unwritten (``expert_ffn(zero_tail=False)``), saving their writes every step. An engine that
        may read them must say no, and gets zeros there. The built-in engine: yes; the real
        ``moonep``: no (not known)."""
        ...

    def dispatch(
        self,
        hidden_sh: torch.Tensor,
        route_weights_sk: torch.Tensor,
        topk_experts_sk: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MoonEPPlan]:
        """``[S,H]`` bf16, ``[S,K]`` f32, ``[S,K]`` int32, ``[E]`` int32 in; ``(hidden_nvsh [NvS,H],
        route_weights_nvs [NvS] f32, cu_seqlens [E+B] int32, plan)`` out, rows grouped by expert."""
        ...

    def prefetch_weight(
        self,
        plan: MoonEPPlan | None = None,
        full_gate_weight: torch.Tensor | None = None,
        full_up_weight: torch.Tensor | None = None,
        full_down_weight: torch.Tensor | None = None,
    ) -> None:
        """Row ``E+b`` of each ``[E+B, out, in]`` bf16 weight becomes a copy of row
        ``plan.experts_to_copy[rank, b]``; unused slots (``-1``) are not touched."""
        ...

    def combine(
        self, plan: MoonEPPlan, hidden_nvsh: torch.Tensor, route_weights_nvs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Expert outputs ``[NvS,H]`` back to ``(hidden_sh [S,H], route_weights_sk or None, _)``:
        each token's K rows summed in fp32, rounded once; no route weights applied."""
        ...

    def destroy(self) -> None:
        """Idempotent; before the process group is destroyed."""
        ...


def check_plan(buffer: MoonEPBuffer, plan: MoonEPPlan, op: str) -> None:
    """``MoonEPStateError`` (naming ``op``) unless ``plan`` is the one ``buffer``'s latest dispatch
    returned: for a layout that fills its slots without ``buffer.prefetch_weight`` (which checks for
    itself), so that a stale plan or another buffer's cannot leave the wrong experts in the slots.
    Both engines' buffers have ``check_plan(plan, op)`` (metadata only); ``MoonEPInputError`` for
    an engine buffer without it."""
    checker = getattr(buffer, "check_plan", None)  # not a protocol member (see MoonEPBuffer)
    if checker is None:
        raise MoonEPInputError(
            f"{op}: {type(buffer).__name__} has no check_plan(plan, op), so whether the plan is its latest "
            "dispatch's cannot be told; pass a buffer of the built-in or the real moonep engine"
        )
    checker(plan, op)


def refuse_step(buffer: MoonEPBuffer | Any) -> None:
    """The caller refused this rank's step before ``buffer.dispatch``: the built-in engine's buffer tells its
    peers (``Buffer.refuse_step``), so they refuse the dispatch they are in. The real ``moonep`` package has no
    such call: its peers wait and time out."""
    refuse = getattr(buffer, "refuse_step", None)  # not a protocol member: only the built-in engine has it
    if refuse is not None:
        refuse()


def dispatched_rows(buffer: MoonEPBuffer | Any) -> int:
    """``NvS`` of either engine's buffer: the public ``num_dispatched_rows``, else the real
    ``moonep`` package's ``_ctx["NvS"]`` (the only place it keeps it)."""
    rows = getattr(buffer, "num_dispatched_rows", None)
    if rows is None:
        rows = getattr(buffer, "_ctx")["NvS"]  # not MoonEPBuffer's: only the real package has it
    return int(rows)
