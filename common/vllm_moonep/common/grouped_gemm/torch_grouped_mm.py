"""The proof of concept's expert compute: three ``torch._grouped_mm`` calls plus elementwise ops.

Used where the weights of the used groups are the rows of one dense tensor (replicated
``[E+B]``, or the symmetric layout's ``[home ; slots]`` view); bf16 on sm90+.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm import probes
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights
from vllm_moonep.engine.errors import MoonEPInputError

_CPU_GROUPED_MM: bool | None = None


def _cpu_grouped_mm_works() -> bool:
    """Whether this torch build runs ``torch._grouped_mm`` on CPU (recent builds do); probed once."""
    global _CPU_GROUPED_MM
    if _CPU_GROUPED_MM is None:
        try:
            x = torch.ones(4, 8, dtype=torch.bfloat16)
            w = torch.ones(2, 8, 8, dtype=torch.bfloat16)
            y = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32))
            _CPU_GROUPED_MM = bool((y == 8).all())
        except Exception:
            _CPU_GROUPED_MM = False
    return _CPU_GROUPED_MM


def grouped_mm_unusable(x: torch.Tensor, w: GroupedWeights) -> str | None:
    """Why ``torch._grouped_mm`` cannot take ``x`` and ``w`` (``None``: it can)."""
    ok = w.dense_groups is not None and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    if ok:
        cap = probes.cuda_capability(x)
        ok = cap[0] >= 9 if cap is not None else (x.device.type == "cpu" and _cpu_grouped_mm_works())
    return None if ok else ("it needs the dense [home ; slots] weights (per-layer slots, B >= E/R), bf16 rows, and "
                            "sm_90 on CUDA or a torch that runs it on CPU")


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
