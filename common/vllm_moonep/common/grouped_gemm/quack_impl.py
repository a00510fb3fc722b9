"""quack-kernels' varlen grouped GEMM as MoonEP's expert compute (``impl="quack"``; optional:
``pip install 'vllm-moonep[quack]'``). A third path beside the Triton kernels and the PoC's
``torch._grouped_mm``, kept so the three can be measured on the same rows
(``tools/vllm_moonep/tools/bench_experts.py``) and ``impl="auto"`` can take it where it was
measured faster (``policy.py``: the GPU's ``auto`` regimes in ``tuning.json``).

Like ``grouped_mm`` it takes the weights only when the used groups are the rows of one dense
tensor (``GroupedWeights.dense_groups``: pool 0 row ``j`` serves group ``dense_groups[j]``, every
other group is empty). Data flow (``G0`` = rows of pool 0)::

    cu_m = [0, cu_seqlens[dense_groups]...]      int32 [G0 + 1], group j = rows [cu_m[j], cu_m[j+1])
    x [NvS, H] --gemm, epilogue swiglu_route--> act [NvS, I] = bf16(silu(x@gate^T) * (x@up^T) * route_w)
    act        --gemm------------------------> out [NvS, H] = act @ down^T
    (both quack.gemm varlen calls with cu_seqlens_m=cu_m; B = the weight rows, transposed views)

The first GEMM runs gate and up as one ``[G0, 2I, H]`` operand, a view, no copy: stored interleaved (the
symmetric layout's ``w13``, ``weights.py``) its adjacent output columns are a gate and an up column, the pair
quack's ``acc_pair`` epilogue takes as it comes; stored in halves (vLLM's ``w13``: up's rows follow gate's in one
tensor) ``concat_layout=("B",)`` has quack view them in that same adjacent order first (its
``_concat_interleave``). Gate
and up as separate tensors (``GroupedWeights.contiguous``, the replicated layout) take the split form instead,
still without copying weights::

    x --gemm--> g [NvS, I] fp32,  x --gemm--> u [NvS, I] fp32,  act = bf16(silu(g) * u * route_w)

Both forms round the activation to bf16 once, from float32 accumulators, as
``expert_ffn_reference`` does. Scratch per call: ``act`` (``NvS * I`` bf16), plus ``g`` and ``u``
(``2 * NvS * I`` fp32) in the split form; no per-weights memory. Rows past ``cu_seqlens[-1]`` are
not written. No host synchronisation (``cu_m`` is built on the device).

quack compiles each kernel variant on its first call (the CuTe DSL: tens of seconds; shapes are
symbolic, so new token counts do not recompile) and caches it on disk. ``tuned=QUACK_TUNED``
(off) uses quack's per-arch default tiles; ``tuned=True`` runs quack's autotuner, which compiles
and times its whole config space per new shape (minutes): a measurement, not a serving setting.

This module imports without quack; quack itself is imported on first use
(``quack_epilogue``, whose import is also the probe in ``quack_unusable``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm import probes
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights
from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["QUACK_TUNED", "expert_ffn_quack", "quack_unusable"]

#: quack's autotuner off by default (see the module doc)
QUACK_TUNED = False

def quack_unusable(x: torch.Tensor, w: GroupedWeights) -> str | None:
    """Why quack-kernels' varlen GEMM (``impl="quack"``) cannot run on ``x`` and ``w``
    (``None``: it can). The first call imports quack (the CuTe DSL: seconds)."""
    err = probes.import_error("vllm_moonep.common.grouped_gemm.quack_epilogue")  # imports quack
    if err is not None:
        return f"quack-kernels does not import ({err}; pip install 'vllm-moonep[quack]')"
    cap = probes.cuda_capability(x)
    if cap is None:
        return f"quack-kernels' GEMMs need a CUDA GPU of sm_90 or newer, the rows are on {x.device}"
    if cap[0] < 9:
        return f"quack-kernels' GEMMs need sm_90 or newer, this GPU is sm_{cap[0]}{cap[1]}"
    if x.dtype != torch.bfloat16:
        return f"the quack path takes bf16 rows and weights, got {x.dtype}"
    if w.dense_groups is None:
        return ("the quack path needs the used groups' weights as the rows of one tensor (GroupedWeights.dense_groups: "
                "per-layer slots, B >= E/R, no shared slot pool)")
    return None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dim is contiguous and its base and outer strides are 16-byte aligned (what
    quack's TMA loads assume), else an aligned copy."""
    es = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def expert_ffn_quack(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
    tuned: bool = QUACK_TUNED,
) -> torch.Tensor:
    """The expert compute through quack's varlen GEMMs (see the module doc). Raises
    ``MoonEPInputError`` where it cannot run (``quack_unusable``); quack's compile and launch
    errors propagate."""
    why = quack_unusable(x, weights)
    if why is not None:
        raise MoonEPInputError(f"expert_ffn_quack: {why}")
    from vllm_moonep.common.grouped_gemm.quack_epilogue import gemm, swiglu_route

    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    groups = weights.dense_groups_on(cu_seqlens.device)
    cu_m = F.pad(cu_seqlens.index_select(0, groups).to(torch.int32), (1, 0))
    xa = _aligned(x)
    act = torch.empty(x.shape[0], weights.intermediate, dtype=x.dtype, device=x.device)
    w13i = weights.gate_up_interleaved()
    one, concat = (w13i, {}) if w13i is not None else (weights.gate_up_as_one(), {"concat_layout": ("B",)})
    if one is not None:
        rw = route_w if route_w.stride(0) == 1 and route_w.data_ptr() % 16 == 0 else route_w.clone()
        swiglu_route(xa, one.mT, out={"act": act}, store_d=False, tuned=tuned, cu_seqlens_m=cu_m, route_w=rw,
                     **concat)
    else:
        g = gemm(xa, weights.gate[0].mT, out_dtype=torch.float32, cu_seqlens_m=cu_m, tuned=tuned)
        u = gemm(xa, weights.up[0].mT, out_dtype=torch.float32, cu_seqlens_m=cu_m, tuned=tuned)
        F.silu(g, inplace=True)
        g.mul_(u)
        torch.mul(g, route_w[:, None], out=act)
    dst = _aligned(out)
    gemm(act, weights.down[0].mT, out=dst, cu_seqlens_m=cu_m, tuned=tuned)
    if dst is not out:
        out.copy_(dst)
    return out
