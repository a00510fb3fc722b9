"""Our ``gather_moonep_weight_layout``: each MoE layer's weight layout, built after its weights load.

vLLM's ``convert_to_unquantized_kernel_format`` calls ``build_weight_layout`` with the layer's
local ``[E/R]`` parameters and rebinds them to what it returns:

    layer.w13_weight, layer.w2_weight --build_weight_layout--> layout (replicated | symmetric)
        --joins--> STATE.layouts (the process's LayoutSet: heap, shared slot pool, teardown order)

The first layer makes the ``LayoutSet`` from the options; every later layer must ask for the same
layout kind and ``B``. ``vllm_ep_group()``: vLLM's EP group (imported when called).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vllm_moonep.engine import MoonEPStateError
from vllm_moonep.vllm_plugin.options import MoonEPOptions, options_from_vllm_config
from vllm_moonep.vllm_plugin.state import STATE

if TYPE_CHECKING:  # the layouts are imported when the first layer is built
    from vllm_moonep.layouts import LayoutSet

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["build_weight_layout", "vllm_ep_group"]


def vllm_ep_group():
    """vLLM's EP group of this process."""
    from vllm.distributed import get_ep_group

    return get_ep_group()


def _group_for_heap(kind: str, device: torch.device):
    from vllm_moonep.engine.heaps import resolve_heap_kind

    ep = vllm_ep_group()
    which = resolve_heap_kind(kind, device)
    return which, (ep.cpu_group if which == "host" else ep.device_group)


def build_weight_layout(w13_local: torch.Tensor, w2_local: torch.Tensor, num_global_experts: int,
                        num_prefetch_slots: int | None = None, **_extra):
    """Our ``gather_moonep_weight_layout``: the layer's layout from its local ``[E/R]`` parameters.

    vLLM passes the layer's ``w13_weight`` / ``w2_weight`` parameters and then rebinds them to
    the returned object's ``full_gate_weight`` / ``full_down_weight``:

    - replicated: all-gather into ``[E+B]`` gate/up/down (vLLM's PoC memory model); the layer's
      parameters become the ``[E+B]`` gate and down tensors (its ``[E/R]`` storage is released).
    - symmetric: the layer's parameters are adopted onto the symmetric heap (no all-gather, no
      copy kept); ``full_gate_weight`` / ``full_down_weight`` are those same heap views, so vLLM's
      rebinding is a no-op and the parameters keep their ``[E/R]`` shapes.

    ``num_prefetch_slots`` from vLLM is ignored: the plugin's option is the one source of ``B``.
    The layout joins the process's ``LayoutSet`` (made at the first layer from the options), which
    makes the heap and the shared slot pool once and frees everything in order on ``STATE.reset``.
    """
    from vllm_moonep.layouts import layout_kind

    opts = options_from_vllm_config()
    if STATE.layouts is None:
        STATE.layouts = _layout_set(opts, num_global_experts, w13_local.device)
    layouts = STATE.layouts
    if layouts.kind != layout_kind(opts.weight_layout, opts.shared_slot_pool) or layouts.num_slots != opts.num_prefetch_slots:
        raise MoonEPStateError(
            f"vllm-moonep: this process's layouts are {layouts.kind} with B={layouts.num_slots}; a layer now asks for "
            f"weight_layout={opts.weight_layout} (shared_slot_pool={opts.shared_slot_pool}) with "
            f"B={opts.num_prefetch_slots}: destroy the EP group's all2all manager before building another model")
    layout = layouts.add_layer(w13_local, w2_local, num_global_experts)
    if layouts.symmetric:  # vLLM rebinds the parameters to these: a no-op (they were adopted onto the heap)
        layout.full_gate_weight = w13_local.data
        layout.full_down_weight = w2_local.data
    log.debug("vllm-moonep: built %r", layout)
    return layout


def _layout_set(opts: MoonEPOptions, num_experts: int, device: torch.device) -> LayoutSet:
    """The process's ``LayoutSet``: replicated layers all-gather over the EP device group and report
    no local copy (vLLM rebinds its parameters to the ``[E+B]`` tensors); symmetric layers adopt the
    parameters onto a heap over the group its kind needs."""
    from vllm_moonep.layouts import LayoutSet, layout_kind

    kind = layout_kind(opts.weight_layout, opts.shared_slot_pool)
    if kind == "replicated":
        return LayoutSet(kind, num_experts, opts.num_prefetch_slots, vllm_ep_group().device_group,
                         keeps_local_params=False)
    heap_kind, group = _group_for_heap(opts.heap, device)
    return LayoutSet(kind, num_experts, opts.num_prefetch_slots, group, heap_kind=heap_kind, adopt_parameters=True)
