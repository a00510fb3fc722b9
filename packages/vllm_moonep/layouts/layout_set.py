"""``LayoutSet``: the weight layouts of one configuration over a model's MoE layers on one rank.

What a set owns, by kind (``LAYOUT_KINDS``):

- ``replicated``: one ``ReplicatedWeightLayout`` per layer (``[E+B]`` rows each, all-gathered at
  load time over ``group``); no heap.
- ``symmetric``: one ``SymmetricWeightLayout`` per layer (``E/R`` home rows and ``B`` slots
  each) on one symmetric heap, made at the first layer (``heap_kind`` over ``group``, on that
  layer's device) unless the caller passed ``heap``.
- ``symmetric-shared``: the same with one ``SharedSlotPool`` of ``B`` slots for all layers of a
  shape ``(H, I)``, made on the heap right before the first layer of that shape.

``destroy()`` frees in the order a symmetric heap needs (its frees are LIFO): the layouts and
slot pools newest first, then the heap if the set made it. Construction of a symmetric layer,
and ``destroy()`` of a symmetric set, are collective (every rank of ``group``, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_moonep.common.layout import check_local_experts
from vllm_moonep.common.memory import MemoryReport
from vllm_moonep.engine import MoonEPCollectiveTimeout, MoonEPInputError, MoonEPStateError, group_rank_world
from vllm_moonep.engine.heaps import HEAP_KINDS, SymmetricHeap, make_heap
from vllm_moonep.engine.faults.teardown import each
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.symmetric import SharedSlotPool, SymmetricWeightLayout

__all__ = ["LAYOUT_KINDS", "LayoutSet", "build_layouts", "layout_kind"]

#: the configurations a set can hold
LAYOUT_KINDS = ("replicated", "symmetric", "symmetric-shared")

#: what a set holds per layer (both implement ``vllm_moonep.common.layout.WeightLayout``)
Layout = ReplicatedWeightLayout | SymmetricWeightLayout


def layout_kind(weight_layout: str, shared_slot_pool: bool = False) -> str:
    """The set kind of a ``weight_layout`` choice (``replicated`` | ``symmetric``) and the shared
    slot-pool switch (symmetric only)."""
    if weight_layout == "replicated":
        if shared_slot_pool:
            raise MoonEPInputError("a shared slot pool needs the symmetric weight layout")
        return "replicated"
    if weight_layout == "symmetric":
        return "symmetric-shared" if shared_slot_pool else "symmetric"
    raise MoonEPInputError(f"weight_layout must be 'replicated' or 'symmetric', got {weight_layout!r}")


@dataclass(eq=False)
class LayoutSet:
    """The layouts of one configuration on this rank, built layer by layer (``add_layer``).

    Args:
        kind: one of ``LAYOUT_KINDS``.
        num_experts: ``E`` of every layer (``add_layer`` may name another for one layer).
        num_slots: ``B``: slots per layer, or of the shared pool.
        group: the EP process group the layouts and the heap run over (``None``: the default
            group). Symmetric sets: the group the heap kind needs (gloo for ``host``).
        heap_kind: the ``make_heap`` kind of the heap the set makes (symmetric kinds only).
        heap: an existing heap to use instead; the caller closes it, after ``destroy()``.
        keeps_local_params: replicated only: whether the caller keeps its ``[E/R]`` parameters
            beside the ``[E+B]`` copy (counted as home rows in ``memory_report``).
        adopt_parameters: symmetric only: rebind the tensors passed to ``add_layer`` onto the
            heap's home rows (``SymmetricWeightLayout.adopt_parameters``, no copy), so the home
            experts are held once.
        timeout_s: replicated only: bound of the load-time all-gathers (``None``: the default).

    Fields the set fills: ``layouts`` (in layer order), ``slot_pools`` (``(H, I)`` -> the shared
    pool of that shape; ``symmetric-shared`` only), ``owns_heap`` (the set made ``heap`` and
    closes it), ``device`` (of the first layer), ``destroyed``.
    """

    kind: str
    num_experts: int
    num_slots: int
    group: Any = None
    heap_kind: str = "auto"
    heap: SymmetricHeap | None = None
    keeps_local_params: bool = True
    adopt_parameters: bool = False
    timeout_s: float | None = None
    layouts: list[Layout] = field(default_factory=list, init=False)
    slot_pools: dict[tuple[int, int], SharedSlotPool] = field(default_factory=dict, init=False)
    owns_heap: bool = field(default=False, init=False)
    device: torch.device | None = field(default=None, init=False)
    destroyed: bool = field(default=False, init=False)
    #: layouts and slot pools in creation order (what ``destroy`` frees in reverse)
    _created: list[SymmetricWeightLayout | SharedSlotPool] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise MoonEPInputError(f"LayoutSet: kind must be one of {', '.join(LAYOUT_KINDS)}, got {self.kind!r}")
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots <= 0:
            raise MoonEPInputError(f"LayoutSet: num_slots must be a positive int, got {self.num_slots!r}")
        if self.heap_kind not in HEAP_KINDS:
            raise MoonEPInputError(f"LayoutSet: heap_kind must be one of {', '.join(HEAP_KINDS)}, got {self.heap_kind!r}")
        # an option the kind does not use is refused, not ignored
        unused = ({"heap": self.heap is not None, "heap_kind": self.heap_kind != "auto",
                   "adopt_parameters": self.adopt_parameters} if self.kind == "replicated" else
                  {"keeps_local_params": not self.keeps_local_params, "timeout_s": self.timeout_s is not None})
        given = [name for name, set_ in unused.items() if set_]
        if given:
            raise MoonEPInputError(f"LayoutSet: {', '.join(given)} do(es) not apply to a {self.kind} set "
                                   f"({'heap options are for the symmetric kinds' if self.kind == 'replicated' else 'replicated only'})")
        if self.heap is not None and not isinstance(self.heap, SymmetricHeap):
            raise MoonEPInputError(f"LayoutSet: heap must be a SymmetricHeap, got {type(self.heap).__name__}")

    @property
    def symmetric(self) -> bool:
        """Whether the set's layouts live on a symmetric heap (construction and teardown collective)."""
        return self.kind != "replicated"

    # ------------------------------------------------------------------ building
    def add_layer(self, w13_local: torch.Tensor, w2_local: torch.Tensor, num_experts: int | None = None) -> Layout:
        """The next layer's layout from this rank's ``w13 [E/R, 2I, H]`` and ``w2 [E/R, H, I]``
        (tensors or ``torch.nn.Parameter``; read, not kept, unless ``adopt_parameters``).
        Collective: every rank adds its layers in the same order."""
        if self.destroyed:
            raise MoonEPStateError("LayoutSet.add_layer: the set was destroyed")
        if not isinstance(w13_local, torch.Tensor) or not isinstance(w2_local, torch.Tensor):
            raise MoonEPInputError(f"LayoutSet.add_layer: w13_local and w2_local must be tensors, got "
                                   f"{type(w13_local).__name__}, {type(w2_local).__name__}")
        E = self.num_experts if num_experts is None else num_experts
        w13, w2 = w13_local.detach(), w2_local.detach()
        if self.kind == "replicated":
            layout: Layout = ReplicatedWeightLayout(w13, w2, E, self.num_slots, self.group,
                                                          keeps_local_params=self.keeps_local_params,
                                                          timeout_s=self.timeout_s)
        else:
            # the weights first: a w2 that is not 3-D was read for the slot pool's shape (a bare
            # IndexError), and a bad layer made the heap and a slot pool of its shape before the
            # layout refused it
            _, world = group_rank_world(self.group)
            check_local_experts(w13, w2, E, world, self.num_slots)
            heap = self._heap(w13.device)
            made = self.kind == "symmetric-shared" and (w2.shape[1], w2.shape[2]) not in self.slot_pools
            pool = self._slot_pool(heap, hidden_size=w2.shape[1], intermediate_size=w2.shape[2]) \
                if self.kind == "symmetric-shared" else None
            try:
                layout = SymmetricWeightLayout(w13, w2, E, num_slots=None if pool is not None else self.num_slots,
                                               group=self.group, heap=heap, slot_pool=pool)
            except MoonEPInputError:  # refused before any allocation, on every rank: the pool this call made goes too
                if made and pool is not None:
                    self._drop_pool(pool)
                raise
            self._created.append(layout)
            if self.adopt_parameters:
                layout.adopt_parameters(w13_local, w2_local, copy=False)
        if self.device is None:
            self.device = w13.device
        self.layouts.append(layout)
        return layout

    def _drop_pool(self, pool: SharedSlotPool) -> None:
        """Free a slot pool made for a layer that was then refused (collective; the newest allocation)."""
        pool.destroy()
        self._created.remove(pool)
        self.slot_pools = {k: p for k, p in self.slot_pools.items() if p is not pool}

    def _heap(self, device: torch.device) -> SymmetricHeap:
        if self.heap is None:
            self.heap = make_heap(self.heap_kind, self.group, device=device)
            self.owns_heap = True
        return self.heap

    def _slot_pool(self, heap: SymmetricHeap, *, hidden_size: int, intermediate_size: int) -> SharedSlotPool:
        key = (int(hidden_size), int(intermediate_size))
        pool = self.slot_pools.get(key)
        if pool is None:
            pool = SharedSlotPool(self.num_slots, key[0], key[1], self.group, heap=heap,
                                  name=f"slot_pool.h{key[0]}.i{key[1]}")
            self.slot_pools[key] = pool
            self._created.append(pool)
        return pool

    # ------------------------------------------------------------------ reading
    def memory_report(self) -> MemoryReport:
        """Accounted bytes of every layer and slot pool of the set (``common/memory.py``)."""
        rep = MemoryReport()
        for obj in (*self.layouts, *self.slot_pools.values()):
            rep = rep + obj.memory_report()
        return rep

    def __len__(self) -> int:
        return len(self.layouts)

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Free everything the set holds; idempotent. Symmetric sets: collective, the layouts and
        slot pools newest first (LIFO heap frees), then the heap if the set made it; after a failed
        collective every object is still tried (locally), then that error is raised. Replicated:
        local. Run before the process group is destroyed."""
        if self.destroyed:
            return
        try:  # after a collective failed, every object is still tried (its frees go local)
            each(lambda obj: obj.destroy(), reversed(self._created if self.symmetric else self.layouts),
                 MoonEPCollectiveTimeout)
        finally:
            if self.owns_heap and self.heap is not None and not self.heap.live():
                self.heap.close()  # everything released (also after a failure); else the error says why
        self.destroyed = True  # not after an error: a retry destroys what is left


def build_layouts(kind: str, local: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int, num_slots: int,
                  **options) -> LayoutSet:
    """A ``LayoutSet`` of ``kind`` with one layer per ``(w13_local, w2_local)`` of ``local``, in
    order; ``options`` are ``LayoutSet``'s (``group``, ``heap_kind``, ``heap``, ...). On a failure
    what was built is destroyed before the error propagates."""
    layouts = LayoutSet(kind, num_experts, num_slots, **options)
    try:
        for w13, w2 in local:
            layouts.add_layer(w13, w2)
    except BaseException:
        layouts.destroy()
        raise
    return layouts
