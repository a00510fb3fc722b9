"""What ``moonep-ab`` compares, and at what shape: the presets, the configurations, the shape a
preset is scaled to, and ``Built``, what each configuration's builder returns.

    --preset --> PRESETS[preset]  (a ModelShape: tiny, or a full-size model of testing.models)
      --scaled_shape(ranks, --layers, --budget-gb, --slots)-->  shape {hidden, intermediate,
        experts, topk, layers, slots, ...}: layers, then experts, cut until the replicated
        layout (the larger one) fits the budget per rank; run_shape adds what the run says
        about it (the layers it could not keep, a routing skew E and K cannot reach)
    --configs --> CONFIGS: replicated | symmetric | symmetric-shared  --build_ours-->  Built
                           vllm-poc                                   --vllm_poc.build_poc-->  Built
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.memory import MemoryReport, expert_bytes, replicated_accounting
from vllm_moonep.engine import default_num_slots
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING
from vllm_moonep.engine.heaps import SymmetricHeap
from vllm_moonep.layouts import LAYOUT_KINDS, build_layouts
from vllm_moonep.testing.models import MODELS, ModelShape

__all__ = ["Built", "CONFIGS", "DEFAULT_BUDGET_GB", "DEVICES", "GiB", "MAX_REF_ERR", "PRESETS", "TINY", "build_ours",
           "default_budget_gb", "max_skew", "run_shape", "scaled_shape"]

GiB = 1024**3

#: the embedded default: a small synthetic model (not a real one), top-4
TINY = ModelShape("tiny", 4, 32, 256, 256, "a small synthetic model for the embedded default", K=4)
#: run shapes: the tiny default and the full-size models (vllm_moonep.testing.models)
PRESETS: dict[str, ModelShape] = {TINY.key: TINY, **{m.key: m for m in MODELS}}

CONFIGS = (*LAYOUT_KINDS, "vllm-poc")
DEVICES = ("cpu", "cuda")
#: per-rank expert memory the scaled model may use by default, GiB
DEFAULT_BUDGET_GB = {"cpu": 1.0, "cuda": 0.5}  # cuda: a fraction of the GPU's memory (activations, heaps, buffers need the rest)
#: the reference check's default bound on the relative error of each configuration's output
MAX_REF_ERR = 2e-2


def default_budget_gb(device: str) -> float:
    """``--budget-gb`` when none is given: 1 GiB per CPU rank; half of a GPU's memory (an H200's
    70 GiB holds one full-width Kimi-K2 layer replicated on 2 ranks, 50 GiB)."""
    if device == "cuda":
        return DEFAULT_BUDGET_GB["cuda"] * torch.cuda.get_device_properties(0).total_memory / GiB
    return DEFAULT_BUDGET_GB[device]


def _replicated_bytes(p: ModelShape, ranks: int, E: int, L: int, slots: int | None) -> int:
    """What the replicated layout (the larger one) holds per rank with ``E`` experts and ``L`` layers."""
    B = slots or max(default_num_slots(E, ranks), 1)
    return replicated_accounting(E, ranks, B, p.H, p.I, layers=L).resident


def _expert_counts(p: ModelShape, ranks: int) -> list[int]:
    """The expert counts ``scaled_shape`` tries, largest first: the preset's, then halved (a
    multiple of ``ranks``, at least 2 per rank)."""
    E, out = p.E, [p.E]
    while E > 2 * ranks:
        E = max(2 * ranks, (E // 2) // ranks * ranks)
        out.append(E)
    return out


def scaled_shape(p: ModelShape, ranks: int, layers: int | None, budget_bytes: int, slots: int | None) -> dict:
    """Scale layers, then experts, so the replicated layout (the larger one) fits ``budget_bytes``
    per rank. Layers go first: the expert count shapes routing, plans and slots (what is
    measured), while fewer layers only shorten the step. Experts shrink (keeping a multiple of
    ``ranks`` and at least 2 per rank) only when one layer does not fit."""
    K = p.dims()["K"]
    L = min(layers or p.moe_layers, p.moe_layers)
    while _replicated_bytes(p, ranks, p.E, L, slots) > budget_bytes and L > 1:
        L -= 1
    E = next((e for e in _expert_counts(p, ranks) if _replicated_bytes(p, ranks, e, L, slots) <= budget_bytes),
             _expert_counts(p, ranks)[-1])
    E = max(E // ranks, 1) * ranks
    if E < K:
        E = ((K + ranks - 1) // ranks) * ranks
    B = slots or default_num_slots(E, ranks)
    return {
        "hidden": p.H, "intermediate": p.I, "experts": E, "topk": K,
        "layers": L, "slots": B, "expert_bytes": expert_bytes(p.H, p.I),
        "expert_scale": p.E / E, "layer_scale": p.moe_layers / L,
    }


def max_skew(experts: int, topk: int) -> float:
    """The largest routing skew (maxvio) ``experts`` experts with top-``topk`` routing can have: a
    token picks ``topk`` distinct experts, so the busiest expert gets at most every token, and
    max/mean - 1 is at most ``E/K - 1``."""
    return experts / topk - 1


def _skew_note(p: ModelShape, shape: dict, ranks: int, maxvios, slots: int | None) -> str | None:
    """The sentence ``run_shape`` says when a requested skew is above ``max_skew`` of the shape run
    (the "got" column would read lower with no word why): the bound, and the ``--budget-gb``
    that keeps enough experts, or that the preset itself has too few."""
    E, K = shape["experts"], shape["topk"]
    top = max_skew(E, K)
    over = [m for m in maxvios if m > top + 1e-9]
    if not over:
        return None
    note = (f"--maxvio {' '.join(f'{m:g}' for m in over)} cannot be reached with E={E} experts and top-{K} routing: "
            f"a token picks {K} distinct experts, so maxvio <= E/K - 1 = {top:g} (the got column shows what the "
            "routing reached)")
    want = max(over)
    enough = [e for e in _expert_counts(p, ranks) if e > E and max_skew(e, K) >= want - 1e-9]
    if enough:
        e = min(enough)
        gb = math.ceil(_replicated_bytes(p, ranks, e, 1, slots) / GiB * 10) / 10
        note += f"; --budget-gb {gb:g} keeps E={e} experts (maxvio up to {max_skew(e, K):g})"
    else:  # not even the preset's own expert count reaches it
        note += f"; the {p.key} preset's {p.E} experts reach at most {max_skew(p.E, K):g}"
    return note


def run_shape(preset: str, ranks: int, layers: int | None, budget_gb: float, slots: int | None, tokens,
              maxvios) -> dict:
    """The shape a run uses (``scaled_shape``), with ``max_tokens`` and a ``note`` saying what it
    could not honour: layers asked but not kept within the budget, a skew the shape cannot reach."""
    p = PRESETS[preset]
    shape = scaled_shape(p, ranks, layers, int(budget_gb * GiB), slots)
    shape["max_tokens"] = max(tokens)
    notes = []
    if layers is not None and shape["layers"] != layers:  # said, not silently honoured in part
        notes.append(f"--layers {layers} asked; {shape['layers']} of the preset's {p.moe_layers} fit --budget-gb "
                     f"{budget_gb:g} per rank (replicated layout)")
    skew = _skew_note(p, shape, ranks, maxvios, slots)
    if skew:
        notes.append(skew)
    if notes:
        shape["note"] = "; ".join(notes)
    return shape


@dataclass
class Built:
    """One configuration built on this rank: what ``measure.rank_point`` steps and
    ``measure.rank_teardown`` frees.

    ``moes``: one runner per layer (``forward(hidden, ids, weights)``, ``last``, ``timer``);
    ``pool``: the engine's buffer pool; ``report``: the accounted expert memory; ``held``: the
    objects whose tensors and heap allocations are the configuration's expert weights (what the
    memory check attributes); ``heaps``: the symmetric heaps they live on; ``destroy_layouts``:
    frees the layouts (in the order their heap needs)."""

    moes: list
    pool: Any
    report: MemoryReport
    held: list
    heaps: list[SymmetricHeap]
    destroy_layouts: Callable[[], None]


def build_ours(cfg: str, shape: dict, local: list, device: torch.device, impl: str, heap_kind: str = "auto") -> Built:
    """Our layouts (``cfg`` one of ``LAYOUT_KINDS``) over ``local`` (one ``(w13, w2)`` per layer).

    As the vLLM plugin does, the symmetric layouts adopt the framework's parameters (``local``) as
    their heap's home rows (their own storage is released), so the home experts are held once."""
    R, E, B = dist.get_world_size(), shape["experts"], shape["slots"]
    pool = MoonEPBufferPool(dict(H=shape["hidden"], K=shape["topk"], E=E, num_ep_ranks=R, B=B, token_padding=DEFAULT_TOKEN_PADDING,
                                 device=device, transport=shape.get("transport", "auto")),
                            max_tokens_per_rank=shape["max_tokens"], engine="builtin")
    heap_options = {"heap_kind": heap_kind, "adopt_parameters": True} if cfg != "replicated" else {}
    layouts = build_layouts(cfg, local, E, B, **heap_options)
    return Built(moes=[MoonEPMoE(pool, lay, impl=impl) for lay in layouts.layouts], pool=pool,
                 report=layouts.memory_report(), held=[*layouts.layouts, *layouts.slot_pools.values()],
                 heaps=[layouts.heap] if layouts.heap is not None else [], destroy_layouts=layouts.destroy)
