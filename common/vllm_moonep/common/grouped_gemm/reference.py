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
    row_block: int | None = None,
) -> torch.Tensor:
    """Per group in float32 from the stored weights; the activation is rounded to ``x.dtype``
    once (as a fused kernel writes it), the output once. Rows past the last segment are zero.
    ``row_block``: every matmul over exactly that many rows (a segment's last block filled with zero
    rows), so that a row's output does not follow how many rows share its matmul
    (``invariance.py``); ``None``: one matmul per segment."""
    if out is None:
        out = torch.empty_like(x)
    for g, a, b in _segments(cu_seqlens):
        gate, up, down = (t.float() for t in weights.rows(g))
        for s in (a,) if row_block is None else range(a, b, row_block):
            e = b if row_block is None else min(s + row_block, b)
            xs, ws = x[s:e].float(), route_w[s:e].float()
            if row_block is not None and e - s < row_block:
                xs = torch.cat([xs, xs.new_zeros(row_block - (e - s), xs.shape[1])])
                ws = torch.cat([ws, ws.new_zeros(row_block - (e - s))])
            act = F.silu(xs @ gate.T) * (xs @ up.T) * ws[:, None]
            act = act.to(x.dtype).float()
            out[s:e] = (act @ down.T)[: e - s].to(out.dtype)
    # zero everything that is not inside a non-empty segment (padding between is computed above)
    total = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
    out[total:].zero_()
    return out

