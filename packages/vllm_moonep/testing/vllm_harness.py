"""vLLM 0.33's MoE pieces outside a vLLM engine, for tests and tools that drive vLLM's own
``FusedMoEKernel`` by hand (the vLLM tests, the ``vllm-poc`` configuration of ``moonep-ab``).

vLLM is imported inside the functions only: importing this module does not need vLLM.
"""

from __future__ import annotations

import torch

__all__ = ["LayoutHolder", "ensure_workspace", "vllm_moe_config"]


def vllm_moe_config(E: int, K: int, H: int, I: int, R: int, rank: int, max_tokens: int, device: torch.device):
    """A vLLM ``FusedMoEConfig`` for DP = EP = R with the moonep backend (no distributed state needed)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    pc = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=R, ep_size=R, tp_rank=0, pcp_rank=0, dp_rank=rank, ep_rank=rank,
        sp_size=1, use_ep=True, all2all_backend="moonep", enable_eplb=False,
    )
    return FusedMoEConfig(
        num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I, num_local_experts=E // R,
        num_logical_experts=E, activation=MoEActivation.SILU, device=str(device),
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=pc, in_dtype=torch.bfloat16,
        max_num_tokens=max_tokens,
    )


def ensure_workspace(device: torch.device) -> None:
    """vLLM's workspace manager on ``device`` (the modular kernel asks it for scratch), made once."""
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(device)


class LayoutHolder(torch.nn.Module):
    """Stands in for the vLLM layer the experts read ``_moonep_weight_layout`` from."""

    def __init__(self, layout):
        super().__init__()
        self._moonep_weight_layout = layout
