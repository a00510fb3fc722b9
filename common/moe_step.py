"""One MoonEP MoE step over a ``WeightLayout``, without vLLM.

``MoonEPMoE.forward`` is the whole pipeline of DESIGN.md's "One MoE step": sanitize and pad to
the pool's capacity, dispatch, prefetch the planned slots, the grouped expert compute, combine.
The vLLM prepare/finalize and experts classes run the same pieces split at vLLM's seams; tools
and tests use this class directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_moonep.common.grouped_gemm import expert_ffn
from vllm_moonep.common.layout import WeightLayout
from vllm_moonep.common.padding import pad_to_capacity, tokens_per_expert
from vllm_moonep.common.pool import MoonEPBufferPool
from vllm_moonep.common.timing import NullTimer
from vllm_moonep.engine import MoonEPInputError


@dataclass
class StepInfo:
    """What the last step did (for balance reports and tests)."""

    capacity: int
    num_tokens: int
    cu_seqlens: torch.Tensor
    experts_to_copy: torch.Tensor
    rows: int  # real rows this rank computed (S*K by construction)


class MoonEPMoE:
    """Runs MoE steps for one layer on one rank.

    Args:
        pool: the buffer pool (shared by every layer of the same shape).
        layout: this layer's ``WeightLayout``.
        impl: grouped GEMM implementation (``vllm_moonep.common.grouped_gemm.IMPLS``).
    """

    def __init__(self, pool: MoonEPBufferPool, layout: WeightLayout, *, impl: str = "auto", timer=None):
        self.pool = pool
        self.layout = layout
        self.impl = impl
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
        if hidden.dtype != torch.bfloat16:
            raise MoonEPInputError(f"MoonEP supports BF16 hidden states only, got {hidden.dtype}")
        if hidden.dim() != 2 or hidden.shape[1] != self.layout.hidden_size:
            raise MoonEPInputError(f"hidden states must be [s, H={self.layout.hidden_size}], got {list(hidden.shape)}")
        t = self.timer
        with t.phase("pad"):
            if apply_router_weight_on_input:
                if topk_ids.shape[1] != 1:
                    raise MoonEPInputError("apply_router_weight_on_input requires top-1 routing")
                hidden = hidden * topk_weights.to(hidden.dtype)
                topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
            n = hidden.shape[0] if num_tokens_across_dp is None else int(num_tokens_across_dp)
            if n < hidden.shape[0]:
                raise MoonEPInputError(f"num_tokens_across_dp={n} is smaller than this rank's {hidden.shape[0]} tokens")
            cap, buf = self.pool.get(n)
            x, ids, w, s = pad_to_capacity(hidden, topk_ids, topk_weights, cap)
            tpe = tokens_per_expert(ids, self.layout.num_experts)
        with t.phase("dispatch"):
            x_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
        with t.phase("prefetch"):
            self.layout.prefetch(buf, plan)
        with t.phase("experts"):
            y = expert_ffn(x_nvsh, w_nvs, cu, self.layout.grouped_weights(), impl=self.impl)
        with t.phase("combine"):
            out, _, _ = buf.combine(plan, y)
        self.last = StepInfo(cap, s, cu, plan.experts_to_copy, cap * ids.shape[1])
        return out[:s]
