"""The proof of concept's expert compute: three ``torch._grouped_mm`` calls plus elementwise ops.

Used where the weights of the used groups are the rows of one dense tensor (replicated
``[E+B]``, or the symmetric layout's ``[home ; slots]`` view); bf16 on sm90+.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm.api import GroupedWeights
from vllm_moonep.engine.errors import MoonEPInputError


def expert_ffn_grouped_mm(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if weights.dense_groups is None:
        raise MoonEPInputError("grouped_mm needs a dense row source (GroupedWeights.dense_groups)")
    gate, up, down = weights.gate[0], weights.up[0], weights.down[0]
    groups = weights.dense_groups_on(cu_seqlens.device)
    offs = cu_seqlens.index_select(0, groups).to(torch.int32)
    h_gate = torch._grouped_mm(x, gate.transpose(1, 2), offs=offs)
    h_up = torch._grouped_mm(x, up.transpose(1, 2), offs=offs)
    act = (F.silu(h_gate.float()) * h_up.float() * route_w[:, None]).to(x.dtype)
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    if out is None:
        return y
    out.copy_(y)
    return out
