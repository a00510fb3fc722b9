"""MoonEP for vLLM 0.33's modular fused-MoE kernel: prepare/finalize and experts.

This is the only module of ``vllm_moonep.common`` that imports vLLM; nothing in the core imports
it (``import vllm_moonep.common`` works without vLLM). Both classes are layout-agnostic: they read
expert weights through a ``WeightLayout`` (replicated ``[E+B]`` or symmetric) and run the same
step functions as ``common/vllm_moonep/common/moe_step.py`` split at vLLM's seams:

- ``MoonEPPrepareAndFinalize.prepare``: checks (no pending step, unquantized only: the same on
  every rank; then this rank's inputs, BF16 ``[s, H]``, whose refusal the peers already in the
  dispatch are told of, as every input refusal before it), top-1 ``apply_router_weight_on_input``
  folded into the input, buffer choice from vLLM's DP
  metadata (max token count across DP ranks; the local count outside a forward context), padding,
  ``dispatch``, ``layout.prefetch``. Returns the expert-grouped ``[NvS, H]`` rows, the per-group
  row counts as ``ExpertTokensMetadata`` (on GPUs written by the dispatch kernel; with dispatch's
  ``cu_seqlens`` beside them, so ``apply`` launches no cumsum) and the route weights in row order.
- ``MoonEPExperts.apply``: ``expert_ffn`` over the ``cu_seqlens`` groups with the route weights
  applied inside (the activation is plain torch or our Triton kernel, never vLLM's compiled ops);
  batch invariant under ``VLLM_BATCH_INVARIANT=1`` (``grouped_gemm/invariance.py``).
- ``MoonEPPrepareAndFinalize.finalize``: ``combine`` (which does the K-sum), so it requires
  ``TopKWeightAndReduceNoOP``.

Prepare and finalize are strictly paired: a second ``prepare`` before ``finalize`` raises
``MoonEPStateError`` and drops the pending step (a forward that failed between the two leaves the
layer usable; ``reset`` drops it without the error). Constructors accept and ignore extra keyword
arguments (vLLM's signatures drift).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import vllm.envs as envs
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from vllm_moonep.common.grouped_gemm import expert_ffn, invariance
from vllm_moonep.common.grouped_gemm.api import IMPLS
from vllm_moonep.common.layout import WeightLayout
from vllm_moonep.common.moe_step import (
    DispatchState,
    StepInfo,
    check_step_tokens,
    combine_rows,
    dispatch_and_prefetch,
)
from vllm_moonep.engine import MoonEPInputError, MoonEPStateError, dispatched_rows
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING, say_once

__all__ = [
    "MoonEPExperts",
    "MoonEPPrepareAndFinalize",
    "check_unquantized",
    "dp_max_num_tokens",
]

log = logging.getLogger("vllm_moonep.vllm")


@dataclasses.dataclass
class MoonEPTokensMetadata(mk.ExpertTokensMetadata):
    """vLLM's per-expert row counts plus what our experts pick their kernels by; the modular kernel
    hands prepare's metadata to the experts unchanged."""

    step_tokens: int | None = None  # the step's tokens per rank (the max over DP ranks)
    padded: bool = True  # this rank's tokens do not fill the buffer (weight-0 rows inside segments)
    cu_seqlens: torch.Tensor | None = None  # dispatch's [E+B] int32 (our experts need no cumsum)
    row_ends: torch.Tensor | None = None  # where each segment's entries end, if the engine wrote it (no trim launch)
    zero_tail: bool = True  # the engine's combine may read the segments' padding tails: write them as zeros
    token_padding: int = DEFAULT_TOKEN_PADDING  # the multiple each segment starts at (DeepGEMM's paths need it)


def _rows_per_group(plan: object, cu: torch.Tensor) -> torch.Tensor:
    """Rows per segment of a dispatch (``expert_num_tokens``): the built-in engine's plan has them
    (on GPUs written by the dispatch kernel: no launch here); any other engine's are counted from
    ``cu_seqlens``."""
    rows = getattr(plan, "rows_per_group", None)
    if isinstance(rows, torch.Tensor):
        return rows
    return torch.diff(cu, prepend=cu.new_zeros(1))


def dp_max_num_tokens() -> int | None:
    """Max token count across DP ranks from vLLM's forward context, ``None`` outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    dp = get_forward_context().dp_metadata
    if dp is None:
        return None
    return int(dp.num_tokens_across_dp_cpu.max())


def check_unquantized(quant_config, where: str) -> None:
    """Raise ``MoonEPInputError`` for any quantized, SwiGLU-parameterised or biased config.

    The expert compute has no bias term: a biased layer accepted here would run with its biases
    silently dropped.
    """
    if quant_config is None:
        return
    qd = getattr(quant_config, "quant_dtype", None)
    if qd is not None:
        raise MoonEPInputError(
            f"{where}: MoonEP supports unquantized BF16 experts only, got quant_dtype={qd!r}; "
            "use another --all2all-backend for quantized models"
        )
    for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
        if getattr(quant_config, name, None) is not None:
            raise MoonEPInputError(
                f"{where}: MoonEP implements plain silu(gate) * up; SwiGLU parameter {name} is not supported"
            )
    for name in ("w1_bias", "w2_bias"):
        if getattr(quant_config, name, None) is not None:
            raise MoonEPInputError(
                f"{where}: MoonEP's expert compute has no bias term, got {name}; "
                "use another --all2all-backend for MoE layers with expert biases"
            )


class MoonEPPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """MoonEP dispatch/prefetch (prepare) and combine (finalize) over a ``WeightLayout``.

    Args:
        buffer_pool: a ``vllm_moonep.common.MoonEPBufferPool`` (vLLM's all2all handle).
        max_tokens_per_rank: the largest step (``moe.max_num_tokens``).
        num_dispatchers: EP world size.
        num_global_experts: ``E``.
        weight_layout: the layer's layout; ``None``: taken from the experts once their
            ``process_weights_after_loading`` has run (vLLM builds the kernel before that).
    """

    def __init__(
        self,
        buffer_pool,
        max_tokens_per_rank: int | None = None,
        num_dispatchers: int | None = None,
        num_global_experts: int | None = None,
        weight_layout: WeightLayout | None = None,
        **_extra: Any,
    ):
        super().__init__()
        self.buffer_pool = buffer_pool
        if max_tokens_per_rank is None:
            max_tokens_per_rank = buffer_pool.max_tokens_per_rank
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.num_dispatchers_ = int(num_dispatchers) if num_dispatchers is not None else None
        self.num_global_experts = num_global_experts
        self.weight_layout = weight_layout
        self._fused_experts = None
        self._state: DispatchState | None = None
        self.last: StepInfo | None = None

    # ---------------------------------------------------------------- wiring
    def post_init_setup(self, fused_experts) -> None:
        # The layout reaches the experts in process_weights_after_loading, after the kernel
        # (and so this hook) was built: keep the reference and resolve it at the first prepare.
        self._fused_experts = fused_experts

    def _layout(self) -> WeightLayout:
        if self.weight_layout is None and self._fused_experts is not None:
            self.weight_layout = getattr(self._fused_experts, "weight_layout", None)
        if self.weight_layout is None:
            raise MoonEPStateError(
                "MoonEPPrepareAndFinalize: no weight layout (pass weight_layout=, or run the experts' "
                "process_weights_after_loading first); the slots must be filled before expert compute"
            )
        return self.weight_layout

    # ---------------------------------------------------------------- vLLM's questions
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int32

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.num_dispatchers_ if self.num_dispatchers_ is not None else 1

    def output_is_reduced(self) -> bool:
        return True  # combine returns the weighted, K-summed token-major output

    def supports_async(self) -> bool:
        return False

    # ---------------------------------------------------------------- step state
    @property
    def pending(self) -> bool:
        """Whether a prepared step waits for its finalize."""
        return self._state is not None

    def _need_state(self, what: str) -> DispatchState:
        if self._state is None:
            raise MoonEPStateError(f"MoonEPPrepareAndFinalize.{what}: prepare() has not been called")
        return self._state

    @property
    def plan(self):
        return self._need_state("plan").plan

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self._need_state("cu_seqlens").cu_seqlens

    @property
    def num_dispatched_slots(self) -> int:
        """``NvS`` of the buffer the pending step uses."""
        return dispatched_rows(self._need_state("num_dispatched_slots").buffer)

    def reset(self) -> None:
        """Drop a pending step (after a failed forward); the next prepare starts clean."""
        self._state = None

    # ---------------------------------------------------------------- prepare / finalize
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config,
        defer_input_quant: bool = False,
        **_extra: Any,
    ) -> mk.PrepareResultType:
        if self._state is not None:
            # Either a caller bug (prepare twice) or a forward that failed between prepare and
            # finalize. Say so once, and drop the dead step so the layer is usable again.
            self._state = None
            raise MoonEPStateError(
                "MoonEPPrepareAndFinalize.prepare() called again before finalize(): the pending MoonEP step "
                "was dropped (a step is collective: every rank must finish it or fail it); call prepare again"
            )
        layout = self._layout()
        # the configuration first (the same on every rank, refused by each alike), then this rank's inputs (told)
        check_unquantized(quant_config, "MoonEPPrepareAndFinalize.prepare")
        E = layout.num_experts
        if num_experts not in (E, -1) or (self.num_global_experts is not None and self.num_global_experts != E):
            raise MoonEPInputError(
                f"num_experts={num_experts} (P/F configured for {self.num_global_experts}) does not match the "
                f"weight layout's {E} global experts"
            )
        # expert_map is not used: MoonEP dispatches on global expert ids and the layout addresses
        # global rows; ownership is linear (rank r holds [r*E/R, (r+1)*E/R)).
        a1, topk_weights, n = check_step_tokens(self.buffer_pool, layout.hidden_size, a1, topk_ids, topk_weights,
                                                dp_max_num_tokens(), apply_router_weight_on_input)
        x_nvsh, w_nvs, cu, state = dispatch_and_prefetch(
            self.buffer_pool, layout, a1, topk_ids, topk_weights, n
        )
        self._state = state
        self.last = state.info()
        meta = MoonEPTokensMetadata(expert_num_tokens=_rows_per_group(state.plan, cu), expert_num_tokens_cpu=None,
                                    step_tokens=n, padded=state.padded, cu_seqlens=cu,
                                    row_ends=state.row_ends, zero_tail=state.tails_read,
                                    token_padding=state.token_padding)
        # No per-row top-k ids after dispatch; route weights come back in row order.
        return x_nvsh, None, meta, None, w_nvs

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl,
        **_extra: Any,
    ) -> None:
        state = self._need_state("finalize")
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            raise MoonEPInputError(
                "MoonEPPrepareAndFinalize.finalize requires TopKWeightAndReduceNoOP (the experts apply the "
                "route weights and MoonEP's combine does the K-sum), got "
                f"{type(weight_and_reduce_impl).__name__}; pair it with MoonEP-aware experts"
            )
        try:
            out = combine_rows(state, fused_expert_output)
        finally:
            self._state = None  # the step is over, finished or failed
        output.copy_(out)


class MoonEPExperts(mk.FusedMoEExpertsModular):
    """The grouped expert compute over MoonEP's ``[NvS, H]`` rows, through a ``WeightLayout``.

    ``weight_layout`` comes from ``layer._moonep_weight_layout`` in
    ``process_weights_after_loading`` (or is passed directly). ``impl`` picks the grouped GEMM
    (``reference`` | ``grouped_mm`` | ``triton`` | ``auto``); ``None`` uses ``default_impl``,
    which the vLLM plugin sets from its options.
    """

    default_impl = "auto"

    def __init__(
        self,
        moe_config,
        quant_config,
        max_num_tokens: int | None = None,
        num_dispatchers: int | None = None,
        *,
        weight_layout: WeightLayout | None = None,
        impl: str | None = None,
        **_extra: Any,
    ):
        check_unquantized(quant_config, "MoonEPExperts")
        # Standard activation format: vLLM's base class rejects these for non-batched experts.
        super().__init__(moe_config, quant_config, None, None)
        impl = self.default_impl if impl is None else impl
        if impl not in IMPLS:
            raise MoonEPInputError(f"MoonEPExperts: impl must be one of {IMPLS}, got {impl!r}")
        # read at construction, as vLLM's own kernels read it when the engine builds them
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        if self.batch_invariant:
            invariance.check_impl(impl, "MoonEPExperts: VLLM_BATCH_INVARIANT=1")
            say_once("MoonEP expert compute: batch invariant (VLLM_BATCH_INVARIANT=1): a token's expert outputs "
                     "do not depend on the step's other tokens or on where the plan puts its rows", "vllm_moonep.vllm")
        self.impl = impl
        self._weight_layout = weight_layout

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layout = getattr(layer, "_moonep_weight_layout", None)
        if layout is None:
            raise MoonEPStateError(
                "MoonEPExperts: the layer carries no _moonep_weight_layout (the MoonEP weight conversion "
                "after loading did not run; is the vllm-moonep plugin loaded?)"
            )
        if not isinstance(layout, WeightLayout):
            raise MoonEPStateError(
                f"MoonEPExperts: layer._moonep_weight_layout is a {type(layout).__name__}, not a vllm-moonep "
                "WeightLayout (vLLM's in-tree MoonEP conversion ran instead of the plugin's)"
            )
        self._weight_layout = layout

    @property
    def weight_layout(self) -> WeightLayout | None:
        return self._weight_layout

    # ---------------------------------------------------------------- capabilities
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # plain torch on any device; grouped_mm / Triton where they apply

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return bool(moe_parallel_config.use_moonep_kernels) and not moe_parallel_config.enable_eplb

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_batch_invariance() -> bool:
        return True  # apply passes VLLM_BATCH_INVARIANT on (expert_ffn(batch_invariant=True))

    def supports_chunking(self) -> bool:
        return False  # NvS is static and segments must stay whole

    def supports_expert_map(self) -> bool:
        return False  # global expert rows on every rank

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        # a1 is [NvS, H] in segment order, not token-major; the layer's w1 may be the replicated
        # [E+B, I, H] gate or the symmetric [E/R, 2I, H] home rows, so sizes come from the layout.
        lay = self._weight_layout
        if a1.dim() != 2:
            raise MoonEPInputError(f"MoonEPExperts: expected [NvS, H] rows, got {list(a1.shape)}")
        if lay is None:
            return w1.shape[0], a1.size(0), w1.shape[1], a1.size(1), topk_ids.size(1)
        return (lay.num_experts + lay.num_slots, a1.size(0), 2 * lay.intermediate_size, lay.hidden_size,
                topk_ids.size(1))

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation, *args, **kwargs):
        return (0,), (0,), (M, K)  # expert_ffn keeps its own intermediates; output is [NvS, H]

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta,
        apply_router_weight_on_input: bool,
        **_extra: Any,
    ) -> None:
        if activation != MoEActivation.SILU:
            raise MoonEPInputError(f"MoonEPExperts supports the SiLU gated activation only, got {activation}")
        lay = self._weight_layout
        if lay is None:
            raise MoonEPStateError("MoonEPExperts.apply: process_weights_after_loading() has not run")
        if expert_tokens_meta is None or topk_weights is None or topk_weights.dim() != 1:
            raise MoonEPInputError(
                "MoonEPExperts.apply needs MoonEP's prepare output (per-group row counts and [NvS] route "
                "weights); it cannot run behind a token-major prepare/finalize"
            )
        # our prepare passes dispatch's cu_seqlens along (a cumsum launch saved per layer); another's
        # metadata has only the counts
        cu = getattr(expert_tokens_meta, "cu_seqlens", None)
        if cu is None:
            cu = torch.cumsum(expert_tokens_meta.expert_num_tokens, dim=0, dtype=torch.int32)
        route_w = topk_weights.float()
        if apply_router_weight_on_input:
            # The weight was folded into the input rows before dispatch: real rows get 1 (vLLM's
            # own prepare still ships the original weight), padding and sanitized invalid ids keep 0.
            route_w = (route_w != 0).to(route_w.dtype)
        # the step's tokens and whether it was padded, from our prepare (the MoE step passes the same):
        # the Triton kernels' tiles, quack's regimes and the weight-0 tile skip follow them
        expert_ffn(hidden_states, route_w, cu, lay.grouped_weights(), impl=self.impl, out=output,
                   tokens=getattr(expert_tokens_meta, "step_tokens", None),
                   padded=getattr(expert_tokens_meta, "padded", True),
                   row_ends=getattr(expert_tokens_meta, "row_ends", None),
                   zero_tail=getattr(expert_tokens_meta, "zero_tail", True),
                   batch_invariant=self.batch_invariant,
                   # another prepare's metadata has no padding: the one that gets here is vLLM's own MoonEP
                   # prepare, whose buffer pads to the same default
                   token_padding=getattr(expert_tokens_meta, "token_padding", DEFAULT_TOKEN_PADDING))
