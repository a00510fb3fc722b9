"""The independent references checks compare against.

- ``dense_moe``: the dense MoE, ``out[t] = sum_k w[t,k] * FFN_{ids[t,k]}(x[t])`` with
  ``FFN_e(x) = (silu(x gate_e^T) * (x up_e^T)) down_e^T``, in float32 on the full (global)
  weights. No MoonEP code is involved.
- ``expert_ffn_float64``: the grouped expert compute in float64 with no intermediate rounding,
  the precision reference for the grouped-GEMM kernels (it reads the same ``GroupedWeights``
  row source as the code under test, nothing else of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm import GroupedWeights

__all__ = ["dense_moe", "expert_ffn_float64", "random_expert_weights", "relative_error"]


def random_expert_weights(E: int, H: int, I: int, seed: int = 0, device: torch.device | str = "cpu",
                          keep_on: torch.device | str | None = None):
    """Seeded ``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]`` in bf16, scaled so a layer's
    output is O(1); the same on every rank for the same seed, device type and ``keep_on``. Drawn on
    ``device`` (full-size experts are GBs). ``keep_on``: where the result lives, when not on
    ``device`` (a GPU draws, host memory keeps): drawn a few experts at a time, so ``device``
    never holds a whole layer (other values than an undivided draw)."""
    g = torch.Generator(device=device).manual_seed(int(seed))
    if keep_on is None or torch.device(keep_on) == torch.device(device):
        w13 = (torch.randn(E, 2 * I, H, generator=g, device=device) / H**0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, generator=g, device=device) / I**0.5).to(torch.bfloat16)
        return w13, w2
    step = max(1, (1 << 29) // max(1, 2 * I * H))  # about 2 GiB of float32 per draw
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=keep_on)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=keep_on)
    for e0 in range(0, E, step):
        n = min(step, E - e0)
        w13[e0:e0 + n] = (torch.randn(n, 2 * I, H, generator=g, device=device) / H**0.5).to(torch.bfloat16)
        w2[e0:e0 + n] = (torch.randn(n, H, I, generator=g, device=device) / I**0.5).to(torch.bfloat16)
    return w13, w2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float32 (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``x [s,H]``, ``ids/weights [s,K]``, global ``w13 [E,2I,H]`` (gate rows first), ``w2 [E,H,I]``.

    Returns float32 ``[s, H]`` on ``x``'s device. Negative ids contribute nothing. The weights may
    live on another device (a full-size reference kept in host memory): each used expert's rows
    are brought to ``x``'s device one at a time.
    """
    x = x.float()
    dev = x.device
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=dev)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        gate = w13[e, :I].to(dev).float()
        up = w13[e, I:].to(dev).float()
        h = F.silu(xe @ gate.T) * (xe @ up.T)
        out.index_add_(0, tok, (h @ w2[e].to(dev).float().T) * topk_weights[tok, k].float()[:, None])
    return out


def expert_ffn_float64(
    x: torch.Tensor, route_w: torch.Tensor, cu_seqlens: torch.Tensor, weights: GroupedWeights
) -> torch.Tensor:
    """The float64 reference for precision checks (no intermediate rounding): rows of group ``g``
    (``[cu[g-1], cu[g])``) through that group's weights; rows past the end are zero."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    start = 0
    for g, end in enumerate(cu_seqlens.tolist()):
        if end > start:
            gate, up, down = (w.double() for w in weights.rows(g))
            xs = x[start:end].double()
            act = F.silu(xs @ gate.T) * (xs @ up.T) * route_w[start:end, None].double()
            out[start:end] = act @ down.T
        start = end
    return out
