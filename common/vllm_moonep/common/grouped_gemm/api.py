"""The ``expert_ffn`` dispatcher: which implementation runs a call, and why.

    expert_ffn(x, route_w, cu_seqlens, weights, impl=...)
        --checks-----------------> MoonEPInputError naming the bad argument (nothing written)
        --resolve_impl-----------> reference | grouped_mm | triton | quack | deepgemm | deepgemm_down
                                   (auto: policy.py's measured regimes for this GPU, else triton on
                                   CUDA, else grouped_mm on CUDA, else reference; said once;
                                   batch_invariant: triton, else reference, invariance.py)
        --that module's entry----> out

The dispatcher imports the implementations (each says why it cannot run: ``*_unusable``); none of
them imports the dispatcher: the shared types live in ``weights.py``, the probes in ``probes.py``.
The Triton kernels are imported only when they are asked for (importing them is their probe).
"""

from __future__ import annotations

import torch

from vllm_moonep.common.grouped_gemm import invariance, policy, probes
from vllm_moonep.common.grouped_gemm.deepgemm_impl import (deepgemm_unusable, expert_ffn_deepgemm,
                                                           expert_ffn_deepgemm_down)
from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack, quack_unusable
from vllm_moonep.common.grouped_gemm.reference import expert_ffn_reference
from vllm_moonep.common.grouped_gemm.torch_grouped_mm import expert_ffn_grouped_mm, grouped_mm_unusable
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights, check_tail_args
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING, say_once
from vllm_moonep.engine.errors import MoonEPInputError

IMPLS = ("auto", "reference", "grouped_mm", "triton", "quack", "deepgemm", "deepgemm_down")

TRITON = "vllm_moonep.common.grouped_gemm.triton_kernels"


def triton_unusable(x: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on ``x`` (``None``: they can)."""
    if probes.cuda_capability(x) is None:
        return f"the Triton kernels need a CUDA device, the rows are on {x.device}"
    err = probes.import_error(TRITON)  # the probe is the import
    if err is not None:
        return f"the Triton kernels do not import ({err})"
    return None


def impl_unusable(impl: str, x: torch.Tensor, w: GroupedWeights, token_padding: int = DEFAULT_TOKEN_PADDING) -> str | None:
    """Why the implementation ``impl`` (not ``auto``) cannot run on ``x`` and ``w`` whose segments start at
    multiples of ``token_padding``; ``None``: it can."""
    if impl == "reference":
        return None
    if impl == "grouped_mm":
        return grouped_mm_unusable(x, w)
    if impl == "triton":
        return triton_unusable(x)
    if impl == "quack":
        return quack_unusable(x, w)
    if impl == "deepgemm":
        return deepgemm_unusable(x, w, token_padding)
    if impl == "deepgemm_down":  # the Triton gate/up tiles, then DeepGEMM's down GEMM
        return triton_unusable(x) or deepgemm_unusable(x, w, token_padding)
    raise MoonEPInputError(f"expert_ffn: impl must be one of {IMPLS}, got {impl!r}")


def available_impls(x: torch.Tensor, w: GroupedWeights, token_padding: int = DEFAULT_TOKEN_PADDING) -> list[str]:
    return [i for i in IMPLS if i != "auto" and impl_unusable(i, x, w, token_padding) is None]


#: Why ``auto`` takes the reference path on every CPU, even where torch runs ``_grouped_mm`` there: a
#: CPU grouped_mm is bf16 matmuls, which ran 5-8x slower than the reference's float32 ones on an
#: AVX2-only CI machine (docs/PERFORMANCE.md#ab-on-cpu-ranks); one kernel on every CPU keeps the
#: CPU A/B and the tests on the same bits whatever the machine. ``impl="grouped_mm"`` still runs it.
_CPU_AUTO_WHY = ("on CPU the float32 reference path, the same on every CPU: torch's CPU _grouped_mm runs bf16 "
                 "matmuls, 5-8x slower than float32 ones on CPUs without bf16 instructions")


def _resolve_auto(x: torch.Tensor, w: GroupedWeights, tokens: int | None,
                  token_padding: int = DEFAULT_TOKEN_PADDING) -> tuple[str, str]:
    """``(impl, why)`` of ``impl="auto"``: the library kernel of the GPU's measured regime for this shape
    and step size (``policy.py``; where it runs here), else triton, else grouped_mm (on CUDA), else
    reference."""
    note = ""
    for regime in policy.policy_of(x).regimes_at(w.hidden, w.intermediate, tokens):
        why_not = impl_unusable(regime.impl, x, w, token_padding)
        if why_not is None:
            return regime.impl, (f"{regime.impl} was measured faster than the Triton kernels at H={w.hidden}, "
                                 f"I={w.intermediate} from {regime.from_tokens}"
                                 f"{'' if regime.to_tokens is None else f' to {regime.to_tokens}'} tokens per rank "
                                 f"(tuning.json, auto)" + note)
        note += f"; {regime.impl} was measured faster at this shape and step size but cannot run: {why_not}"
    why_not_triton = triton_unusable(x)
    if why_not_triton is None:
        return "triton", "the Triton kernels run here" + note
    if x.device.type == "cpu":
        ask = " (impl='grouped_mm' asks for it)" if grouped_mm_unusable(x, w) is None else ""
        return "reference", f"{why_not_triton}; {_CPU_AUTO_WHY}{ask}{note}"
    if grouped_mm_unusable(x, w) is None:
        return "grouped_mm", why_not_triton + note
    return "reference", why_not_triton + "; torch._grouped_mm cannot take these rows or weights" + note


def auto_regimes(x: torch.Tensor, w: GroupedWeights, token_padding: int = DEFAULT_TOKEN_PADDING) -> list[tuple[int, str]]:
    """What ``impl="auto"`` runs for these rows and weights by the step's tokens per rank:
    ``[(from_tokens, impl), ...]`` ascending from 0 (a step whose tokens are unknown runs the
    first). Says nothing (``resolve_impl`` says what a real call took)."""
    base, _ = _resolve_auto(x, w, None, token_padding)
    out = [(0, base)]
    # every regime's ends, in token order (regimes may overlap: the first listed wins where they do)
    starts = {0}
    for r in policy.policy_of(x).regimes_for(w.hidden, w.intermediate):
        starts.add(r.from_tokens)
        if r.to_tokens is not None:
            starts.add(r.to_tokens + 1)
    for start in sorted(starts):
        took, _ = _resolve_auto(x, w, start, token_padding)
        if start == 0:
            out = [(0, took)]
        elif took != out[-1][1]:
            out.append((start, took))
    return out


def _resolve_invariant(x: torch.Tensor) -> tuple[str, str]:
    """``(impl, why)`` of ``impl="auto"`` when batch invariant: triton where it runs, else reference."""
    why_not_triton = triton_unusable(x)
    if why_not_triton is None:
        return "triton", ("batch invariant: the Triton kernels (their tiles without stream-K), never a "
                          "library kernel")
    return "reference", (f"batch invariant: {why_not_triton}; the reference path in matmuls of "
                         f"{invariance.ROW_BLOCK} rows")


def resolve_impl(impl: str, x: torch.Tensor, w: GroupedWeights, tokens: int | None = None,
                 batch_invariant: bool = False, token_padding: int = DEFAULT_TOKEN_PADDING) -> str:
    """The implementation ``impl`` runs as (``tokens``: the step's tokens per rank, where known;
    ``batch_invariant``: only one of ``invariance.IMPLS``; ``token_padding``: the multiple each segment
    starts at). ``auto`` says once per process (per distinct
    outcome) which one it took and why; an explicit ``impl`` that cannot run raises ``MoonEPInputError``
    with the reason (the import error, the device, batch invariance), never falls back to another."""
    if impl not in IMPLS:
        raise MoonEPInputError(f"expert_ffn: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        cand, why = _resolve_invariant(x) if batch_invariant else _resolve_auto(x, w, tokens, token_padding)
        say_once(f"MoonEP expert compute: impl=auto -> {cand} on {x.device.type} ({why})", "vllm_moonep.common")
        return cand
    if batch_invariant:
        invariance.check_impl(impl, "expert_ffn: batch_invariant=True")
    reason = impl_unusable(impl, x, w, token_padding)
    if reason is not None:
        raise MoonEPInputError(
            f"expert_ffn: impl={impl!r} cannot run here: {reason} (available: {available_impls(x, w, token_padding)})")
    return impl


def _check_ends(cu_seqlens: torch.Tensor, rows: int) -> None:
    """``cu_seqlens`` (on the host) as each group's end row: non-decreasing, in ``[0, rows]``."""
    ends = cu_seqlens.tolist()
    if not ends:
        return
    drop = next((g for g in range(1, len(ends)) if ends[g] < ends[g - 1]), None)
    if ends[0] < 0:
        bad = f"cu_seqlens[0]={ends[0]} < 0"
    elif drop is not None:
        bad = f"cu_seqlens[{drop}]={ends[drop]} < cu_seqlens[{drop - 1}]={ends[drop - 1]}"
    elif ends[-1] > rows:
        bad = f"cu_seqlens[-1]={ends[-1]} > {rows} rows"
    else:
        return
    raise MoonEPInputError(f"expert_ffn: cu_seqlens must be each group's end row (cumulative: non-decreasing, in "
                           f"[0, NvS={rows}]), got {bad}")


def expert_ffn(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    impl: str = "auto",
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    padded: bool = True,
    row_ends: torch.Tensor | None = None,
    zero_tail: bool = True,
    batch_invariant: bool = False,
    token_padding: int = DEFAULT_TOKEN_PADDING,
) -> torch.Tensor:
    """The MoonEP expert compute: ``[NvS, H]`` rows in, ``[NvS, H]`` rows out (see the package doc).
    ``tokens``: the step's tokens per rank (before padding), where the caller knows it: the Triton
    kernels pick their tiles by it (``None``: by the row count ``NvS``), and ``auto`` whether a
    library kernel runs it (``policy.py``'s regimes; ``None``: Triton). ``padded=False``: the
    step has no padding tokens on any rank, so the Triton kernels need not look for tiles of
    weight-0 rows inside segments (results are the same either way). ``row_ends``: optional ``[G]``
    int32 on the rows' device, where each group's rows that may have a non-zero weight end (every row
    from there to the segment's end has weight 0: the padding tail; the built-in engine's dispatch
    writes them, ``Plan.live_ends``): the Triton kernels then skip the launch that finds them (the
    same outputs; an end past the segment's counts as the segment's end, one short of a live row
    loses that row's output). ``zero_tail=False`` (needs ``row_ends``): the Triton kernels leave the
    rows from ``row_ends`` to each segment's end, its padding tail, as they were instead of writing
    zeros there, for a caller whose combine reads each token's entry rows only (the built-in
    engine's: 2-80 MB less to write per step, 1-4% of the compute at decode); every entry row, weight 0
    or not, is written as with ``True``. ``batch_invariant=True``: each row's output is the same bits
    whatever the other rows, their number and ``tokens`` (``invariance.py``: the Triton tiles without
    stream-K, or fixed-size reference matmuls; the library paths are refused). ``token_padding``: the
    multiple each group's segment starts at (the engine's setting): the DeepGEMM paths run only where their
    M alignment divides it (``auto`` passes over them elsewhere, saying why)."""
    if not isinstance(weights, GroupedWeights):
        raise MoonEPInputError(f"expert_ffn: weights must be a GroupedWeights, got {type(weights).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != weights.hidden:
        raise MoonEPInputError(f"expert_ffn: x must be [NvS, H={weights.hidden}], got "
                               f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if route_w.shape != (x.shape[0],):
        raise MoonEPInputError(f"expert_ffn: route_w must be [NvS={x.shape[0]}], got {list(route_w.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != weights.num_groups:
        raise MoonEPInputError(
            f"expert_ffn: cu_seqlens must have one entry per group ({weights.num_groups}), got {list(cu_seqlens.shape)}"
        )
    if x.dtype != weights.dtype:
        raise MoonEPInputError(f"expert_ffn: x is {x.dtype}, weights are {weights.dtype}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise MoonEPInputError(f"expert_ffn: cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    if not route_w.device == cu_seqlens.device == weights.gate[0].device == x.device:
        raise MoonEPInputError(
            f"expert_ffn: x is on {x.device}, route_w on {route_w.device}, cu_seqlens on {cu_seqlens.device}, "
            f"weights on {weights.gate[0].device}: all must be on one device"
        )
    if cu_seqlens.device.type == "cpu":  # values on the host only (the reference path reads them there too)
        _check_ends(cu_seqlens, x.shape[0])
    if row_ends is not None and (row_ends.shape != cu_seqlens.shape or row_ends.dtype != torch.int32
                                 or row_ends.device != x.device):
        raise MoonEPInputError(f"expert_ffn: row_ends must be [{weights.num_groups}] int32 on {x.device}, got "
                               f"{list(row_ends.shape)} {row_ends.dtype} on {row_ends.device}")
    check_tail_args(row_ends, zero_tail, "expert_ffn")
    if isinstance(token_padding, bool) or not isinstance(token_padding, int) or token_padding < 1:
        raise MoonEPInputError(f"expert_ffn: token_padding must be an int >= 1 (the multiple each segment starts at), "
                               f"got {token_padding!r}")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise MoonEPInputError(f"expert_ffn: out must be {list(x.shape)} {x.dtype} on {x.device}, got "
                               f"{list(out.shape)} {out.dtype} on {out.device}")
    which = resolve_impl(impl, x, weights, tokens, batch_invariant, token_padding)
    if which == "reference":
        return expert_ffn_reference(x, route_w, cu_seqlens, weights, out=out,
                                    row_block=invariance.ROW_BLOCK if batch_invariant else None)
    if which == "grouped_mm":
        return expert_ffn_grouped_mm(x, route_w, cu_seqlens, weights, out=out)
    if which == "quack":
        return expert_ffn_quack(x, route_w, cu_seqlens, weights, out=out)
    if which == "deepgemm":
        return expert_ffn_deepgemm(x, route_w, cu_seqlens, weights, out=out, token_padding=token_padding)
    if which == "deepgemm_down":
        return expert_ffn_deepgemm_down(x, route_w, cu_seqlens, weights, out=out, tokens=tokens, padded=padded,
                                        row_ends=row_ends, zero_tail=zero_tail, token_padding=token_padding)
    from vllm_moonep.common.grouped_gemm.triton_kernels import expert_ffn_triton

    return expert_ffn_triton(x, route_w, cu_seqlens, weights, out=out, tokens=tokens, padded=padded,
                             row_ends=row_ends, zero_tail=zero_tail, batch_invariant=batch_invariant)
