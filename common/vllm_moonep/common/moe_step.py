"""One MoonEP MoE step over a ``WeightLayout``, without vLLM.

``MoonEPMoE.forward`` is the whole pipeline of docs/DESIGN.md's "One MoE step": sanitize and pad to
the pool's capacity, dispatch, prefetch the planned slots, the grouped expert compute, combine.
The pieces are module-level functions (``check_hidden_states``, ``fold_router_weight_on_input``,
``dispatch_and_prefetch``, ``combine_rows``) so that the vLLM prepare/finalize and experts classes
(``common/vllm_moonep/common/vllm_modular.py``) run exactly the same code split at vLLM's seams; tools and tests use
``MoonEPMoE`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from vllm_moonep.common.grouped_gemm import expert_ffn, invariance
from vllm_moonep.common.layout import WeightLayout
from vllm_moonep.common.padding import pad_and_count
from vllm_moonep.common.pool import MoonEPBufferPool, as_int
from vllm_moonep.common.timing import NullTimer
from vllm_moonep.engine import MoonEPBuffer, MoonEPError, MoonEPInputError, MoonEPPlan, default_num_slots, refuse_step
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING

__all__ = [
    "DispatchState",
    "MoonEPMoE",
    "StepInfo",
    "check_hidden_states",
    "check_step_tokens",
    "combine_rows",
    "dispatch_and_prefetch",
    "fold_router_weight_on_input",
    "refuse_before_dispatch",
    "step_token_count",
]

_NULL = NullTimer()


@dataclass
class StepInfo:
    """What the last step did (for balance reports and tests)."""

    capacity: int
    num_tokens: int
    cu_seqlens: torch.Tensor
    experts_to_copy: torch.Tensor
    rows: int  # real rows this rank computed (S*K by construction)


@dataclass
class DispatchState:
    """What ``dispatch_and_prefetch`` leaves for ``combine_rows``."""

    buffer: MoonEPBuffer
    plan: MoonEPPlan
    capacity: int
    num_tokens: int  # this rank's real tokens (rows of the output)
    topk: int
    cu_seqlens: torch.Tensor
    token_padding: int = DEFAULT_TOKEN_PADDING  # the multiple each segment starts at (the buffer's)

    @property
    def padded(self) -> bool:
        """This rank's rows hold padding entries: its tokens do not fill the buffer (other ranks'
        padding reaches it only where the plan moves part of their pad expert here: those rows are
        then computed, with the same result)."""
        return self.num_tokens < self.capacity

    @property
    def row_ends(self) -> torch.Tensor | None:
        """Where each segment's entries end (``[E+B]`` int32, the padding tail after), when the engine
        wrote them on the device (the built-in engine's GPU dispatch, ``Plan.live_ends``): the expert
        kernels then skip the launch that finds them. ``None`` for any other engine or transport."""
        ends = getattr(self.plan, "live_ends", None)
        return ends if isinstance(ends, torch.Tensor) else None

    @property
    def tails_read(self) -> bool:
        """Whether the expert compute must write the segments' padding tails (as zeros): unless the engine's
        combine reads each token's entry rows only (``MoonEPBuffer.combine_reads_entry_rows_only``: the
        built-in engine's) and the plan says where each segment's entries end (``row_ends``: without them a
        weight-0 entry, which combine reads, cannot be told from the tail)."""
        return not (self.buffer.combine_reads_entry_rows_only and self.row_ends is not None)

    def info(self) -> StepInfo:
        return StepInfo(self.capacity, self.num_tokens, self.cu_seqlens, self.plan.experts_to_copy,
                        self.capacity * self.topk)


def check_hidden_states(hidden: torch.Tensor, hidden_size: int | None = None) -> None:
    """BF16 ``[s, H]`` hidden states, else ``MoonEPInputError`` (nothing is modified)."""
    if not isinstance(hidden, torch.Tensor):
        raise MoonEPInputError(f"hidden states must be a tensor, got {type(hidden).__name__}")
    if hidden.dtype != torch.bfloat16:
        raise MoonEPInputError(
            f"MoonEP supports BF16 hidden states only, got {hidden.dtype} (serve the model with --dtype bfloat16)"
        )
    if hidden.dim() != 2 or (hidden_size is not None and hidden.shape[1] != hidden_size):
        want = "H" if hidden_size is None else f"H={hidden_size}"
        raise MoonEPInputError(f"hidden states must be [s, {want}], got {list(hidden.shape)}")


def fold_router_weight_on_input(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 ``apply_router_weight_on_input``: scale the input rows, route with weight 1."""
    if topk_ids.dim() != 2 or topk_ids.shape[1] != 1:
        raise MoonEPInputError(
            f"apply_router_weight_on_input requires top-1 routing, got top-k ids of shape {list(topk_ids.shape)}"
        )
    if topk_weights.shape != (hidden.shape[0], 1) or topk_weights.device != hidden.device:
        raise MoonEPInputError(
            f"apply_router_weight_on_input needs topk_weights [s={hidden.shape[0]}, 1] on {hidden.device} (one weight "
            f"per token), got {list(topk_weights.shape)} on {topk_weights.device}"
        )
    hidden = hidden * topk_weights.to(hidden.dtype)
    return hidden, torch.ones_like(topk_weights, dtype=torch.float32)


def step_token_count(num_local: int, num_tokens_across_dp: int | None) -> int:
    """The token count that picks the buffer: the max across DP ranks, or the local count."""
    if num_tokens_across_dp is None:
        return int(num_local)
    n = as_int(num_tokens_across_dp)
    if n is None:
        raise MoonEPInputError(f"num_tokens_across_dp must be an int (the max token count over the DP ranks), "
                               f"got {type(num_tokens_across_dp).__name__} {num_tokens_across_dp!r}")
    if n < num_local:
        raise MoonEPInputError(f"num_tokens_across_dp={n} is smaller than this rank's {num_local} tokens")
    return n


def check_step_tokens(
    pool: MoonEPBufferPool,
    hidden_size: int,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_tokens_across_dp: int | None,
    apply_router_weight_on_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's checks of a step's hidden states (and the top-1 fold) before its dispatch: ``(hidden,
    topk_weights, n)``, ``n`` the token count that picks the buffer. Inputs differ per rank, so a refusal here tells
    the peers already in the dispatch (``refuse_before_dispatch``); checks of the configuration, the same on every
    rank, run before this and need not."""
    try:
        check_hidden_states(hidden, hidden_size)
        if apply_router_weight_on_input:
            hidden, topk_weights = fold_router_weight_on_input(hidden, topk_ids, topk_weights)
        n = step_token_count(hidden.shape[0], num_tokens_across_dp)
    except MoonEPInputError as exc:
        # the step's buffer by the count every rank passes (else this rank's own, which the ranks share then)
        local = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() else None
        refuse_before_dispatch(pool, local if num_tokens_across_dp is None else num_tokens_across_dp, exc)
    return hidden, topk_weights, n


def check_layout_matches_pool(pool: MoonEPBufferPool, layout: WeightLayout) -> None:
    """The layout's experts and slots must be the buffers' ``E`` and ``B`` (else the plan's slot
    rows would not exist in the layout); checked before any collective."""
    kw = pool.buffer_kwargs
    E, R = kw.get("E"), kw.get("num_ep_ranks")
    B = kw.get("B") or (default_num_slots(E, R) if E and R else None)
    if (E, B) != (layout.num_experts, layout.num_slots):
        raise MoonEPInputError(
            f"the weight layout has E={layout.num_experts} experts and B={layout.num_slots} slots, the buffer pool "
            f"E={E}, B={B}: build both from the same configuration"
        )


def dispatch_and_prefetch(
    pool: MoonEPBufferPool,
    layout: WeightLayout,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_tokens: int,
    *,
    timer=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchState]:
    """Pick the buffer for ``num_tokens`` (same on every rank), pad, dispatch, fill the slots.

    Returns ``(hidden_nvsh [NvS,H], route_weights_nvs [NvS], cu_seqlens [E+B], state)``.
    Every check that can fail on bad input runs before the first collective; a refusal then tells the peers
    through the step's buffer (``refuse_before_dispatch``), so that they refuse the step too.
    """
    t = timer or _NULL
    with t.phase("pad"):
        # the configuration, the same on every rank: refused by every rank alike, before any buffer is made
        check_layout_matches_pool(pool, layout)
        try:
            cap = pool.capacity_for(num_tokens)  # raises on capacity overflow, before any collective
            # on CUDA one kernel pads and counts into the pool's staging tensors (common/pad_kernel.py)
            x, ids, w, tpe, s = pad_and_count(hidden, topk_ids, topk_weights, cap, layout.num_experts,
                                              pool.pad_expert, pool.staging(cap, hidden))
        except MoonEPInputError as exc:
            refuse_before_dispatch(pool, num_tokens, exc)
        cap, buf = pool.get(num_tokens)
    with t.phase("dispatch"):
        if buf.accepts_num_tokens:  # the built-in engine: padding tokens' rows stay put (MoonEPBuffer)
            x_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe, num_tokens=s)
        else:
            x_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
    with t.phase("prefetch"):
        layout.prefetch(buf, plan, rows=(cu, w_nvs))  # slots that hold only padding rows stay unfilled
    return x_nvsh, w_nvs, cu, DispatchState(buf, plan, cap, s, int(ids.shape[1]), cu,
                                         int(getattr(buf, "token_padding", pool.token_padding)))


def refuse_before_dispatch(pool: MoonEPBufferPool, num_tokens: Any, refused: MoonEPInputError) -> NoReturn:
    """Raise ``refused``, this rank's refusal of its step's inputs before dispatch, once its peers are told.

    They are already in the step's dispatch, on the buffer of the step's capacity (``num_tokens`` is the same on
    every rank): this rank tells them through that buffer (``refuse_step``), so that they refuse the step too
    instead of pairing with this rank's next call. Every refusal of the step must tell them, or none: a told
    refusal on one rank and an untold one on another leave the ranks a call apart. Where the capacity cannot be
    known (``num_tokens`` itself refused), nothing tells them, and they time out naming this rank. A failure to
    tell (a peer gone) is the cause of ``refused``, not in its place."""
    if pool.buffer_kwargs.get("num_ep_ranks", 1) == 1:
        raise refused  # no peer to tell
    try:
        pool.capacity_for(num_tokens)
    except MoonEPError:
        raise refused from None
    try:
        refuse_step(pool.get(num_tokens)[1])
    except MoonEPError as told:
        raise refused from told
    raise refused


def combine_rows(state: DispatchState, y: torch.Tensor) -> torch.Tensor:
    """Expert outputs ``[NvS, H]`` back to this rank's ``[s, H]`` tokens (the K-sum)."""
    out, _, _ = state.buffer.combine(state.plan, y)
    return out[: state.num_tokens]


class MoonEPMoE:
    """Runs MoE steps for one layer on one rank.

    Args:
        pool: the buffer pool (shared by every layer of the same shape).
        layout: this layer's ``WeightLayout``.
        impl: grouped GEMM implementation (``vllm_moonep.common.grouped_gemm.IMPLS``).
        batch_invariant: each token's output independent of the step's other tokens
            (``grouped_gemm/invariance.py``).
    """

    def __init__(self, pool: MoonEPBufferPool, layout: WeightLayout, *, impl: str = "auto", timer=None,
                 batch_invariant: bool = False):
        if batch_invariant:
            invariance.check_impl(impl, "MoonEPMoE: batch_invariant=True")
        self.pool = pool
        self.layout = layout
        self.impl = impl
        self.batch_invariant = bool(batch_invariant)
        self.timer = timer or NullTimer()
        self.last: StepInfo | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        num_tokens_across_dp: int | None = None,
        apply_router_weight_on_input: bool = False,
    ) -> torch.Tensor:
        """``[s, H]`` hidden states and ``[s, K]`` routing in, ``[s, H]`` MoE output out.

        ``num_tokens_across_dp`` (the max token count over the DP ranks) picks the buffer; every
        rank must pass the same value. ``None``: this rank's count (all ranks must agree).
        """
        hidden, topk_weights, n = check_step_tokens(self.pool, self.layout.hidden_size, hidden, topk_ids, topk_weights,
                                                    num_tokens_across_dp, apply_router_weight_on_input)
        x_nvsh, w_nvs, cu, state = dispatch_and_prefetch(
            self.pool, self.layout, hidden, topk_ids, topk_weights, n, timer=self.timer
        )
        with self.timer.phase("experts"):
            y = expert_ffn(x_nvsh, w_nvs, cu, self.layout.grouped_weights(), impl=self.impl, tokens=n,
                           padded=state.padded, row_ends=state.row_ends, zero_tail=state.tails_read,
                           batch_invariant=self.batch_invariant, token_padding=state.token_padding)
        with self.timer.phase("combine"):
            out = combine_rows(state, y)
        self.last = state.info()
        return out
