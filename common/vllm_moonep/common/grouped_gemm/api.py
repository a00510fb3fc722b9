"""``GroupedWeights`` (the per-group row source) and the ``expert_ffn`` dispatcher."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPInputError

IMPLS = ("auto", "reference", "grouped_mm", "triton", "quack")


@dataclass(frozen=True)
class GroupedWeights:
    """Where each ``cu_seqlens`` group's expert weights live.

    Attributes:
        gate, up: pools of rows, each ``[N_p, I, H]``; ``down``: pools ``[N_p, H, I]`` (same
            pool count; pool ``p`` of each projection holds the same experts).
        group_pool, group_row: ``[G]`` int64 on the host: group ``g`` reads row
            ``group_row[g]`` of pool ``group_pool[g]``; ``-1`` means the group has no weights
            and must be empty.
        dense_groups: optional ``[N_0]`` int64: when set, row ``j`` of pool 0 serves group
            ``dense_groups[j]`` and every other group is empty by construction, so pool 0 can
            be handed to ``torch._grouped_mm`` as one dense tensor.
    """

    gate: Sequence[torch.Tensor]
    up: Sequence[torch.Tensor]
    down: Sequence[torch.Tensor]
    group_pool: torch.Tensor
    group_row: torch.Tensor
    dense_groups: torch.Tensor | None = None
    _device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    def dense_groups_on(self, device: torch.device) -> torch.Tensor:
        """``dense_groups`` on ``device``, copied once (not on every expert call)."""
        key = str(device)
        t = self._device_copies.get(key)
        if t is None:
            assert self.dense_groups is not None, "dense_groups_on: these weights are not dense"
            t = self._device_copies[key] = self.dense_groups.to(device)
        return t

    @staticmethod
    def contiguous(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> "GroupedWeights":
        """One ``[G, out, in]`` tensor per projection; group ``g`` reads row ``g``."""
        G = gate.shape[0]
        ar = torch.arange(G, dtype=torch.int64)
        return GroupedWeights([gate], [up], [down], torch.zeros(G, dtype=torch.int64), ar, ar)

    @property
    def num_groups(self) -> int:
        return int(self.group_pool.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.gate[0].dtype

    @property
    def hidden(self) -> int:
        return int(self.gate[0].shape[2])

    @property
    def intermediate(self) -> int:
        return int(self.gate[0].shape[1])

    def rows(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [I,H], up [I,H], down [H,I])`` of group ``g``."""
        p = int(self.group_pool[g])
        if p < 0:
            raise MoonEPInputError(f"group {g} has rows but no weights (its row source is -1)")
        r = int(self.group_row[g])
        return self.gate[p][r], self.up[p][r], self.down[p][r]

    def validate(self) -> None:
        n = len(self.gate)
        if not (n == len(self.up) == len(self.down)) or n == 0:
            raise MoonEPInputError("GroupedWeights: gate, up and down need the same, non-zero number of pools")
        I, H = self.intermediate, self.hidden
        for p in range(n):
            g, u, d = self.gate[p], self.up[p], self.down[p]
            if g.dim() != 3 or tuple(g.shape[1:]) != (I, H) or tuple(u.shape) != tuple(g.shape):
                raise MoonEPInputError(f"GroupedWeights pool {p}: gate/up must be [N, I={I}, H={H}], got {list(g.shape)}, {list(u.shape)}")
            if d.dim() != 3 or tuple(d.shape[1:]) != (H, I) or d.shape[0] != g.shape[0]:
                raise MoonEPInputError(f"GroupedWeights pool {p}: down must be [N={g.shape[0]}, H={H}, I={I}], got {list(d.shape)}")
            if len({g.dtype, u.dtype, d.dtype, self.dtype}) != 1:
                raise MoonEPInputError(f"GroupedWeights pool {p}: all weights must share one dtype")


#: modules whose import was probed: name -> ``None`` (imports) or the error text; an import is
#: probed once per process (a missing package would otherwise be looked for on every call)
_IMPORTS: dict[str, str | None] = {}


def import_error(module: str) -> str | None:
    """Why ``module`` does not import (``"ModuleNotFoundError: No module named 'quack'"``), or
    ``None`` when it does; probed once per process."""
    if module not in _IMPORTS:
        try:
            importlib.import_module(module)
            _IMPORTS[module] = None
        except Exception as exc:
            _IMPORTS[module] = f"{type(exc).__name__}: {exc}"
    return _IMPORTS[module]


def _cuda_capability(x: torch.Tensor) -> tuple[int, int] | None:
    """``x``'s GPU's compute capability, ``None`` off CUDA."""
    if x.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(x.device)


def _triton_unusable(x: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on ``x`` (``None``: they can)."""
    if _cuda_capability(x) is None:
        return f"the Triton kernels need a CUDA device, the rows are on {x.device}"
    err = import_error("vllm_moonep.common.grouped_gemm.triton_kernels")  # the probe is the import
    if err is not None:
        return f"the Triton kernels do not import ({err})"
    return None


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


def _grouped_mm_usable(x: torch.Tensor, w: GroupedWeights) -> bool:
    if w.dense_groups is None or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    cap = _cuda_capability(x)
    if cap is not None:
        return cap[0] >= 9
    return x.device.type == "cpu" and _cpu_grouped_mm_works()


_GROUPED_MM_NEEDS = ("it needs the dense [home ; slots] weights (per-layer slots, B >= E/R), bf16 rows, and sm_90 on "
                     "CUDA or a torch that runs it on CPU")


def quack_unusable(x: torch.Tensor, w: GroupedWeights) -> str | None:
    """Why quack-kernels' varlen GEMM (``impl="quack"``) cannot run on ``x`` and ``w``
    (``None``: it can). The first call imports quack (the CuTe DSL: seconds)."""
    err = import_error("vllm_moonep.common.grouped_gemm.quack_epilogue")  # imports quack
    if err is not None:
        return f"quack-kernels does not import ({err}; pip install 'vllm-moonep[quack]')"
    cap = _cuda_capability(x)
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


def impl_unusable(impl: str, x: torch.Tensor, w: GroupedWeights) -> str | None:
    """Why the implementation ``impl`` (not ``auto``) cannot run on ``x`` and ``w``; ``None``: it can."""
    if impl == "reference":
        return None
    if impl == "grouped_mm":
        return None if _grouped_mm_usable(x, w) else _GROUPED_MM_NEEDS
    if impl == "triton":
        return _triton_unusable(x)
    if impl == "quack":
        return quack_unusable(x, w)
    raise MoonEPInputError(f"expert_ffn: impl must be one of {IMPLS}, got {impl!r}")


def available_impls(x: torch.Tensor, w: GroupedWeights) -> list[str]:
    return [i for i in IMPLS if i != "auto" and impl_unusable(i, x, w) is None]


#: Where quack-kernels' varlen GEMM (``impl="quack"``) was measured faster than the Triton kernels,
#: so ``impl="auto"`` takes it there (when it can run and the caller passes the step's tokens)
#: instead of keeping our own kernels: ``(H, I) -> tokens per rank from which on``. From
#: ``python -m vllm_moonep.tools.bench_experts --shapes kimi-k2,qwen3-30b-a3b --tokens 256,1024,4096
#: --rep 20`` on an H200 (its quack column, CUDA-graph times; the tool prints, per shape, the smallest
#: measured token count from which quack beat Triton at every measured point, both routings).
#: 2026-12-01, quack-kernels 0.6.5 against the TMA-tiled Triton kernels: Qwen3 at 1024 and 4096
#: tokens (161-177 us against 189-195; 498-517 against 566-590). Kimi-K2 no longer: at 4096 quack
#: won balanced routing (4815 against 5080) and lost skewed (5295 against 5125), at 1024 it lost
#: both (it had won 4096 against the pointer-load tiles on 2026-11-30). Decode and mid sizes stay
#: on Triton. Keyed by tokens, not by the buffer's rows: NvS carries slack that depends on E/R and
#: B, the tokens do not.
QUACK_FROM_TOKENS: dict[tuple[int, int], int] = {(2048, 768): 1024}


#: Why ``auto`` takes the reference path on every CPU, even where torch runs ``_grouped_mm`` there: a
#: CPU grouped_mm is bf16 matmuls, which ran 5-8x slower than the reference's float32 ones on an
#: AVX2-only CI machine (docs/PERFORMANCE.md, "A/B on CPU ranks"); one kernel on every CPU keeps the
#: CPU A/B and the tests on the same bits whatever the machine. ``impl="grouped_mm"`` still runs it.
_CPU_AUTO_WHY = ("on CPU the float32 reference path, the same on every CPU: torch's CPU _grouped_mm runs bf16 "
                 "matmuls, 5-8x slower than float32 ones on CPUs without bf16 instructions")


def _resolve_auto(x: torch.Tensor, w: GroupedWeights, tokens: int | None) -> tuple[str, str]:
    """``(impl, why)`` of ``impl="auto"``: quack where ``QUACK_FROM_TOKENS`` says it was measured
    faster (and it runs here), else triton, else grouped_mm (on CUDA), else reference."""
    note = ""
    start = QUACK_FROM_TOKENS.get((w.hidden, w.intermediate))
    if start is not None and tokens is not None and tokens >= start:
        why_not = quack_unusable(x, w)
        if why_not is None:
            return "quack", (f"quack-kernels was measured faster than the Triton kernels at H={w.hidden}, "
                             f"I={w.intermediate} from {start} tokens per rank (QUACK_FROM_TOKENS)")
        note = f"; quack was measured faster at this shape and step size but cannot run: {why_not}"
    why_not_triton = _triton_unusable(x)
    if why_not_triton is None:
        return "triton", "the Triton kernels run here" + note
    if x.device.type == "cpu":
        ask = " (impl='grouped_mm' asks for it)" if _grouped_mm_usable(x, w) else ""
        return "reference", f"{why_not_triton}; {_CPU_AUTO_WHY}{ask}{note}"
    if _grouped_mm_usable(x, w):
        return "grouped_mm", why_not_triton + note
    return "reference", why_not_triton + "; torch._grouped_mm cannot take these rows or weights" + note


def auto_regimes(x: torch.Tensor, w: GroupedWeights) -> list[tuple[int, str]]:
    """What ``impl="auto"`` runs for these rows and weights by the step's tokens per rank:
    ``[(from_tokens, impl), ...]`` ascending from 0 (a step whose tokens are unknown runs the
    first). Says nothing (``resolve_impl`` says what a real call took)."""
    base, _ = _resolve_auto(x, w, None)
    start = QUACK_FROM_TOKENS.get((w.hidden, w.intermediate))
    if start is None:
        return [(0, base)]
    top, _ = _resolve_auto(x, w, start)
    return [(0, base)] if top == base else [(0, base), (start, top)]


def resolve_impl(impl: str, x: torch.Tensor, w: GroupedWeights, tokens: int | None = None) -> str:
    """The implementation ``impl`` runs as (``tokens``: the step's tokens per rank, where known).
    ``auto`` says once per process (per distinct outcome) which one it took and why; an explicit
    ``impl`` that cannot run raises ``MoonEPInputError`` with the reason (the import error, the
    device), never falls back to another."""
    if impl not in IMPLS:
        raise MoonEPInputError(f"expert_ffn: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        cand, why = _resolve_auto(x, w, tokens)
        say_once(f"MoonEP expert compute: impl=auto -> {cand} on {x.device.type} ({why})", "vllm_moonep.common")
        return cand
    reason = impl_unusable(impl, x, w)
    if reason is not None:
        raise MoonEPInputError(
            f"expert_ffn: impl={impl!r} cannot run here: {reason} (available: {available_impls(x, w)})")
    return impl


def check_tail_args(row_ends: torch.Tensor | None, zero_tail: bool, who: str) -> None:
    """``zero_tail=False`` only with ``row_ends``: without each segment's end of entries an entry row of
    weight 0 (a sanitized invalid id's), which combine reads, cannot be told from the padding tail."""
    if not zero_tail and row_ends is None:
        raise MoonEPInputError(f"{who}: zero_tail=False needs row_ends (each segment's end of entries): without "
                               "them an entry row of weight 0, which combine reads, cannot be told from the "
                               "padding tail")


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
) -> torch.Tensor:
    """The MoonEP expert compute: ``[NvS, H]`` rows in, ``[NvS, H]`` rows out (see the package doc).
    ``tokens``: the step's tokens per rank (before padding), where the caller knows it: the Triton
    kernels pick their tiles by it (``None``: by the row count ``NvS``), and ``auto`` whether quack
    runs it (``QUACK_FROM_TOKENS``; ``None``: Triton). ``padded=False``: the
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
    or not, is written as with ``True``."""
    if x.dim() != 2 or x.shape[1] != weights.hidden:
        raise MoonEPInputError(f"expert_ffn: x must be [NvS, H={weights.hidden}], got {list(x.shape)}")
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
    if route_w.device != x.device or weights.gate[0].device != x.device:
        raise MoonEPInputError(
            f"expert_ffn: x is on {x.device}, route_w on {route_w.device}, weights on {weights.gate[0].device}"
        )
    if row_ends is not None and (row_ends.shape != cu_seqlens.shape or row_ends.dtype != torch.int32
                                 or row_ends.device != x.device):
        raise MoonEPInputError(f"expert_ffn: row_ends must be [{weights.num_groups}] int32 on {x.device}, got "
                               f"{list(row_ends.shape)} {row_ends.dtype} on {row_ends.device}")
    check_tail_args(row_ends, zero_tail, "expert_ffn")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise MoonEPInputError(f"expert_ffn: out must be {list(x.shape)} {x.dtype}")
    which = resolve_impl(impl, x, weights, tokens)
    if which == "reference":
        from vllm_moonep.common.grouped_gemm.reference import expert_ffn_reference

        return expert_ffn_reference(x, route_w, cu_seqlens, weights, out=out)
    if which == "grouped_mm":
        from vllm_moonep.common.grouped_gemm.torch_grouped_mm import expert_ffn_grouped_mm

        return expert_ffn_grouped_mm(x, route_w, cu_seqlens, weights, out=out)
    if which == "quack":
        from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack

        return expert_ffn_quack(x, route_w, cu_seqlens, weights, out=out)
    from vllm_moonep.common.grouped_gemm.triton_kernels import expert_ffn_triton

    return expert_ffn_triton(x, route_w, cu_seqlens, weights, out=out, tokens=tokens, padded=padded,
                             row_ends=row_ends, zero_tail=zero_tail)
