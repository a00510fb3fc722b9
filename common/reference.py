"""The independent reference every end-to-end check compares against: the dense MoE.

``out[t] = sum_k w[t,k] * FFN_{ids[t,k]}(x[t])`` with ``FFN_e(x) = (silu(x gate_e^T) * (x up_e^T)) down_e^T``,
in float32 on the full (global) weights. No MoonEP code is involved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``x [s,H]``, ``ids/weights [s,K]``, global ``w13 [E,2I,H]`` (gate rows first), ``w2 [E,H,I]``.

    Returns float32 ``[s, H]``. Negative ids contribute nothing.
    """
    x = x.float()
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        gate = w13[e, :I].float()
        up = w13[e, I:].float()
        h = F.silu(xe @ gate.T) * (xe @ up.T)
        out.index_add_(0, tok, (h @ w2[e].float().T) * topk_weights[tok, k].float()[:, None])
    return out
