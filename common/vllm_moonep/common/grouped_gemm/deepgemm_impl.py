"""DeepGEMM's grouped bf16 GEMMs as MoonEP's expert compute (``impl="deepgemm"``; optional: present
where vLLM's bundled DeepGEMM, ``vllm.third_party.deep_gemm``, or a standalone ``deep_gemm`` imports,
on an sm_90 or sm_100 GPU; DeepGEMM compiles each kernel with the CUDA toolkit at its first use).

Like ``grouped_mm`` and ``quack`` it takes the weights only when the used groups are the rows of one
dense tensor (``GroupedWeights.dense_groups``: pool 0 row ``j`` serves group ``dense_groups[j]``,
every other group empty), in ascending group order. MoonEP's segments are already DeepGEMM's
"contiguous" layout: each group's rows start at a multiple of the engine's ``token_padding`` (128 by
default), which DeepGEMM's M alignment (128) must divide: with a padding it does not divide, a row block
would straddle two groups, and the path refuses (``deepgemm_unusable``). Data flow (``G0`` = rows of pool 0)::

    ends = cu_seqlens[dense_groups]                       int32 [G0]: group j's rows end there
    x [NvS, H] --m_grouped_bf16_gemm_nt_contiguous--> h [NvS, 2I] bf16   (w13 [G0, 2I, H], one operand)
    h          --swiglu_route (deepgemm_act.py)-----> act [NvS, I] = bf16(silu(g) * u * route_w)
                 (g, u: h's halves, or its even and odd columns when w13 is stored interleaved)
    act        --m_grouped_bf16_gemm_nt_contiguous--> out [NvS, H]        (down [G0, H, I])

The grouped layout DeepGEMM reads is either those ends (``ROW_LAYOUT = "psum"``: its prefix-sum
form, each group starting at the previous end rounded up to its block) or one group index per row
(``"rows"``: ``-1`` past the last segment, built on the device). Gate and up as separate tensors
(the replicated layout) take two GEMMs into the two halves of ``h``. Rows whose route weight is 0
(the padding tail) get an activation of exactly 0, so their outputs are 0 whatever the rows held;
rows past ``cu_seqlens[-1]`` are not written. No host synchronisation: it captures in a CUDA graph.

``impl="deepgemm_down"`` (``expert_ffn_deepgemm_down``) runs only the down GEMM here, after the Triton
gate/up tiles (the activation in their epilogue, no ``h``): those write each segment's rows up to its live
end, ``zero_tails`` writes zeros from there to the segment's end, and DeepGEMM's down GEMM then runs every
segment whole, so the padding tails come out 0 as above::

    x --Triton gate/up tiles (triton_kernels)--> act [NvS, I] up to each live end --zero_tails--> the rest 0
    act --m_grouped_bf16_gemm_nt_contiguous--> out [NvS, H]

The activation rounds DeepGEMM's bf16 ``h`` (the float32 sums rounded once), as vLLM's DeepGEMM MoE
does; the Triton kernels keep them in float32 up to the activation: the two differ by bf16 rounding.
"""

from __future__ import annotations

import torch

from vllm_moonep.common.grouped_gemm import probes
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING
from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["DEEPGEMM_MODULES", "ROW_LAYOUT", "deep_gemm", "deepgemm_unusable", "down", "expert_ffn_deepgemm",
           "expert_ffn_deepgemm_down", "gate_up_act", "grouped_layout"]

#: where DeepGEMM is looked for, in order: vLLM's bundled copy, then a standalone install
DEEPGEMM_MODULES = ("vllm.third_party.deep_gemm", "deep_gemm")

#: the grouped layout handed to DeepGEMM (see the module doc)
ROW_LAYOUT = "psum"

def deep_gemm():
    """The DeepGEMM module (the first of ``DEEPGEMM_MODULES`` that imports); raises
    ``MoonEPInputError`` naming each import error where none does."""
    errors = []
    for name in DEEPGEMM_MODULES:
        err = probes.import_error(name)
        if err is None:
            import importlib

            return importlib.import_module(name)
        errors.append(f"{name}: {err}")
    raise MoonEPInputError("DeepGEMM does not import (" + "; ".join(errors) + ")")


_ASCENDING_KEY = "deepgemm_ascending"


def _ascending(w: GroupedWeights) -> bool:
    """Whether pool 0's rows serve groups in ascending order (found once per weights object)."""
    cache = w._device_copies
    if _ASCENDING_KEY not in cache:
        d = w.dense_groups
        cache[_ASCENDING_KEY] = d is not None and (d.numel() < 2 or bool((d[1:] > d[:-1]).all()))
    return cache[_ASCENDING_KEY]


def deepgemm_unusable(x: torch.Tensor, w: GroupedWeights, token_padding: int = DEFAULT_TOKEN_PADDING) -> str | None:
    """Why ``impl="deepgemm"`` cannot run on ``x`` and ``w`` whose segments start at multiples of
    ``token_padding`` (``None``: it can). Imports DeepGEMM only on a GPU it supports (vLLM's copy imports
    vLLM's package: seconds, once)."""
    cap = probes.cuda_capability(x)
    if cap is None:
        return f"DeepGEMM's GEMMs need a CUDA GPU (sm_90 or sm_100), the rows are on {x.device}"
    if cap[0] not in (9, 10):
        return f"DeepGEMM's GEMMs need sm_90 or sm_100, this GPU is sm_{cap[0]}{cap[1]}"
    if x.dtype != torch.bfloat16:
        return f"the DeepGEMM path takes bf16 rows and weights, got {x.dtype}"
    if w.dense_groups is None:
        return ("the DeepGEMM path needs the used groups' weights as the rows of one tensor "
                "(GroupedWeights.dense_groups: per-layer slots, B >= E/R, no shared slot pool)")
    if not _ascending(w):
        return "the DeepGEMM path needs the dense rows to serve groups in ascending order (GroupedWeights.dense_groups)"
    if w.hidden % 128 or w.intermediate % 128:
        return f"the DeepGEMM path needs H and I multiples of 128, got H={w.hidden}, I={w.intermediate}"
    if isinstance(token_padding, bool) or not isinstance(token_padding, int) or token_padding < 1:
        return f"the segments' padding must be an int >= 1, got token_padding={token_padding!r}"
    try:
        dg = deep_gemm()
    except MoonEPInputError as exc:
        return str(exc)
    align = int(dg.get_mk_alignment_for_contiguous_layout())
    if token_padding % align:
        return (f"DeepGEMM's M alignment ({align}) does not divide the segments' padding (token_padding="
                f"{token_padding}): its row blocks would straddle two groups (use a multiple of {align})")
    return None


def grouped_layout(cu_seqlens: torch.Tensor, weights: GroupedWeights, rows: int, layout: str = ROW_LAYOUT) -> torch.Tensor:
    """The grouped layout both GEMMs read: the ends of pool 0's groups (``"psum"``), or one group index per
    row (``"rows"``); see the module doc."""
    if layout not in ("psum", "rows"):
        raise MoonEPInputError(f"expert_ffn_deepgemm: layout must be 'psum' or 'rows', got {layout!r}")
    ends = cu_seqlens.index_select(0, weights.dense_groups_on(cu_seqlens.device)).to(torch.int32)
    if layout == "psum":
        return ends
    idx = torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=torch.int32), right=True)
    return torch.where(idx < ends.numel(), idx, -1).to(torch.int32)


def gate_up_act(x: torch.Tensor, route_w: torch.Tensor, weights: GroupedWeights, layout_t: torch.Tensor,
                act: torch.Tensor, *, psum: bool = True) -> torch.Tensor:
    """The first half of the compute: DeepGEMM's gate/up GEMM(s) into ``h``, then ``swiglu_route`` into
    ``act`` ``[NvS, I]`` (every row: 0 where the route weight is)."""
    from vllm_moonep.common.grouped_gemm.deepgemm_act import swiglu_route

    dg = deep_gemm()
    M, I = x.shape[0], weights.intermediate
    xc = x.contiguous()
    w13i, w13 = weights.gate_up_interleaved(), weights.gate_up_as_one()
    one = w13i if w13i is not None else w13
    if one is not None and one.is_contiguous():
        h = torch.empty(M, 2 * I, dtype=x.dtype, device=x.device)
        dg.m_grouped_bf16_gemm_nt_contiguous(xc, one, h, layout_t, use_psum_layout=psum)
        g, u = (h[:, 0::2], h[:, 1::2]) if one is w13i else (h[:, :I], h[:, I:])
    else:
        g = torch.empty(M, I, dtype=x.dtype, device=x.device)  # DeepGEMM writes dense outputs
        u = torch.empty(M, I, dtype=x.dtype, device=x.device)
        dg.m_grouped_bf16_gemm_nt_contiguous(xc, weights.gate[0].contiguous(), g, layout_t, use_psum_layout=psum)
        dg.m_grouped_bf16_gemm_nt_contiguous(xc, weights.up[0].contiguous(), u, layout_t, use_psum_layout=psum)
    return swiglu_route(g, u, route_w, act)


def down(act: torch.Tensor, weights: GroupedWeights, layout_t: torch.Tensor, out: torch.Tensor, *,
         psum: bool = True) -> torch.Tensor:
    """The second half: DeepGEMM's down GEMM of ``act`` into ``out`` ``[NvS, H]`` (every row up to the last
    segment's end)."""
    dst = out if out.is_contiguous() else torch.empty_like(out)
    deep_gemm().m_grouped_bf16_gemm_nt_contiguous(act, weights.down[0].contiguous(), dst, layout_t,
                                                  use_psum_layout=psum)
    if dst is not out:
        out.copy_(dst)
    return out


def expert_ffn_deepgemm(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
    layout: str = ROW_LAYOUT,
    token_padding: int = DEFAULT_TOKEN_PADDING,
) -> torch.Tensor:
    """The expert compute through DeepGEMM's contiguous grouped GEMMs (see the module doc; ``layout``:
    the grouped layout handed to DeepGEMM, ``"psum"`` or ``"rows"``; ``token_padding``: the multiple each
    segment starts at). Raises ``MoonEPInputError`` where it cannot run (``deepgemm_unusable``); DeepGEMM's
    compile and launch errors propagate."""
    why = deepgemm_unusable(x, weights, token_padding)
    if why is not None:
        raise MoonEPInputError(f"expert_ffn_deepgemm: {why}")
    if out is None:
        out = torch.empty_like(x)
    M = x.shape[0]
    if M == 0:
        return out
    layout_t = grouped_layout(cu_seqlens, weights, M, layout)
    act = torch.empty(M, weights.intermediate, dtype=x.dtype, device=x.device)
    gate_up_act(x, route_w, weights, layout_t, act, psum=layout == "psum")
    return down(act, weights, layout_t, out, psum=layout == "psum")


def expert_ffn_deepgemm_down(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    padded: bool = True,
    row_ends: torch.Tensor | None = None,
    zero_tail: bool = True,
    act: torch.Tensor | None = None,
    token_padding: int = DEFAULT_TOKEN_PADDING,
) -> torch.Tensor:
    """The Triton gate/up tiles (``tokens`` picks them, as for ``impl="triton"``), then DeepGEMM's down GEMM (see
    the module doc). Every row up to the last segment's end is written, the padding tails 0 (whatever
    ``zero_tail``); ``padded``, ``row_ends`` and ``token_padding`` as ``expert_ffn``'s; ``act``: an optional
    ``[NvS, I]`` scratch (``expert_ffn_triton``'s). Raises ``MoonEPInputError`` where DeepGEMM cannot run
    (``deepgemm_unusable``)."""
    why = deepgemm_unusable(x, weights, token_padding)
    if why is not None:
        raise MoonEPInputError(f"expert_ffn_deepgemm_down: {why}")
    from vllm_moonep.common.grouped_gemm.deepgemm_act import zero_tails
    from vllm_moonep.common.grouped_gemm.triton_kernels import expert_ffn_triton

    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    cu = cu_seqlens.to(torch.int32).contiguous()
    layout_t = grouped_layout(cu, weights, x.shape[0])

    def down_gemm(act: torch.Tensor, ends: torch.Tensor, dst: torch.Tensor) -> None:
        zero_tails(act, cu, ends)
        down(act, weights, layout_t, dst)

    return expert_ffn_triton(x, route_w, cu, weights, out=out, act=act, tokens=tokens, padded=padded,
                             row_ends=row_ends, zero_tail=zero_tail, down_gemm=down_gemm)
