"""Plain-torch expert compute: the CPU path (the float64 precision reference of the tests is
``vllm_moonep.testing.reference.expert_ffn_float64``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm.weights import GroupedWeights


def _segments(cu_seqlens: torch.Tensor):
    start = 0
    for g, end in enumerate(cu_seqlens.tolist()):
        if end > start:
            yield g, start, end
        start = end


def expert_ffn_reference(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per group in float32 from the stored weights; the activation is rounded to ``x.dtype``
    once (as a fused kernel writes it), the output once. Rows past the last segment are zero."""
    if out is None:
        out = torch.empty_like(x)
    for g, a, b in _segments(cu_seqlens):
        gate, up, down = weights.rows(g)
        xs = x[a:b].float()
        act = F.silu(xs @ gate.float().T) * (xs @ up.float().T) * route_w[a:b, None].float()
        act = act.to(x.dtype).float()
        out[a:b] = (act @ down.float().T).to(out.dtype)
    # zero everything that is not inside a non-empty segment (padding between is computed above)
    total = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
    out[total:].zero_()
    return out

