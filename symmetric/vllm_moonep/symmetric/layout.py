"""The symmetric (sharded) weight layout: each rank holds only its ``E/R`` home experts, on a
symmetric heap; the logical rows ``[0, E)`` alias the home ranks' memory.

Logical row ``e`` lives on rank ``owner = e // epn`` at local row ``e % epn``. Per layer, each rank
allocates on the heap (collective)::

    w13 [epn + B, 2I, H]   rows [0, epn): home experts, [epn, epn+B): slots; each expert's gate and up
                           interleaved (row 2j gate row j, 2j + 1 up row j: ``grouped_gemm/weights.py``)
    w2  [epn + B, H, I]

The home rows are converted from the caller's gate-rows-first ``w13`` once, as they are copied in
(``interleave_w13``): the expert compute reads gate and up as one weight (one MMA twice as wide),
and every copy of a row (prefetch, a peer's read) keeps the order. An adopted parameter (vLLM's
``w13_weight``) therefore holds its rows interleaved after loading.

(``B`` slot rows are left out when a ``SharedSlotPool`` serves every layer). ``prefetch`` copies
``peer_view(owner)[e % epn]`` into slot ``b`` for every ``e = plan.experts_to_copy[rank, b] >= 0``.

Row sources handed to the grouped GEMM (``GroupedWeights``), one pool per tensor set:

- pool 0: this rank's ``[home ; slots]`` tensors;
- pools 1..: one per addressable peer, that peer's allocation viewed through the heap
  (overflow: with ``B < epn`` a remote expert can miss a slot and then segment ``e`` reads the
  owner's row in place);
- last pool: the shared slot pool, when used.

With per-layer slots and ``B >= epn`` every remote expert a rank computes has a slot (a rank
receives from at most one remote home group, which has ``epn`` experts), so only pool 0 is read
and ``dense_groups`` (home ids, then ``E..E+B-1``) lets ``torch._grouped_mm`` take it directly.

Barriers (``heap.barrier()``, collective): the home rows are written only while loading. The
constructor publishes what it copied; ``adopt_parameters`` publishes again; anything written
through the parameters later (weight loading after adoption) must be written in the interleaved order
(``interleave_w13``: a write in gate-rows-first order would be read as pairs) and followed by
``publish()`` on every rank before the first step. The conversion is done once: a layout built from
parameters already adopted (already interleaved) would interleave them again. Slots are written and read by
their own rank only, so steps need no barrier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_w13
from vllm_moonep.common.layout import WEIGHT_TILE, check_local_experts
from vllm_moonep.common.memory import MemoryReport, expert_bytes, measured_bytes, symmetric_accounting
from vllm_moonep.engine import (
    MoonEPBuffer,
    MoonEPCollectiveTimeout,
    MoonEPInputError,
    MoonEPPlan,
    MoonEPStateError,
    check_plan,
    default_num_slots,
    group_rank_world,
    resolve_device,
)
from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.row_copy import address_table, copy_rows, live_slot_ids
from vllm_moonep.engine.heaps import HeapHandle, SymmetricHeap, make_heap
from vllm_moonep.engine.faults.teardown import each

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["SharedSlotPool", "SymmetricWeightLayout", "destroy_in_order"]


def _resolve_heap(
    heap: SymmetricHeap | str | None, group: ProcessGroup | None, device: torch.device
) -> tuple[SymmetricHeap, bool]:
    """``(heap, owned)``: a heap object is used as is; a kind string (or None: auto) makes one."""
    if heap is None:
        heap = "auto"
    if isinstance(heap, str):
        return make_heap(heap, group=group, device=device), True
    if not isinstance(heap, SymmetricHeap):
        raise MoonEPInputError(f"heap must be a SymmetricHeap or a kind string, got {type(heap).__name__}")
    if heap.closed:
        raise MoonEPStateError("the given heap was closed")
    if dist.is_available() and dist.is_initialized():
        _, world = group_rank_world(group)
        if world != heap.world_size:
            raise MoonEPInputError(f"the heap spans {heap.world_size} ranks, the EP group {world}")
    return heap, False


def _rows(handle: HeapHandle) -> torch.Tensor:
    """This rank's tensor of a live allocation (``None`` only once freed, after ``destroy``)."""
    assert handle.tensor is not None, f"allocation {handle.describe()} was freed"
    return handle.tensor


def _check_device(heap: SymmetricHeap, device: torch.device, what: str) -> None:
    if heap.device.type != device.type or (device.type == "cuda" and heap.device.index != device.index):
        raise MoonEPInputError(f"{what}: the weights are on {device}, the {type(heap).__name__} allocates on {heap.device}")


def _free_weights(owner: SharedSlotPool | SymmetricWeightLayout) -> None:
    """Teardown of a pool or layout: its two allocations, newest first. Once both are released
    (also after an error: the group failed, so released locally) it is destroyed and a heap it
    made is closed; a retry after an error frees only what is left."""
    try:
        owner.heap.free_all(owner._w2, owner._w13)
    finally:
        if owner._w2.freed and owner._w13.freed:
            owner._destroyed = True
            if isinstance(owner, SharedSlotPool):
                owner.holder = None
            else:
                owner._weights = None
            if owner._owns_heap:
                owner.heap.close()


class SharedSlotPool:
    """``B`` prefetch slots shared by every MoE layer of a model (layers run one at a time).

    Per-rank expert memory then approaches ``L*E/R + B`` rows instead of ``L*(E/R + B)``. The
    slots hold the experts of whichever layer prefetched last (``holder``), so a layer's expert
    compute must follow its own prefetch with no other layer's prefetch in between. Create it
    before the layers and destroy it after them (heap frees are LIFO). Its rows are addressed
    through a row table (``GroupedWeights`` pools), so ``torch._grouped_mm`` (one dense tensor)
    does not apply; the reference and row-table kernels do.

    Args:
        num_slots: ``B``; hidden_size/intermediate_size: ``H``/``I`` (multiples of 128).
        group, heap: as for ``SymmetricWeightLayout`` (a kind string or None makes a heap the
            pool owns; layouts built with ``slot_pool=`` and no heap then share it).
        device: where the slots live (default: CUDA if available, else CPU).
    """

    def __init__(self, num_slots: int, hidden_size: int, intermediate_size: int, group: ProcessGroup | None = None, *,
                 heap: SymmetricHeap | str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, name: str = "slot_pool") -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise MoonEPInputError(f"SharedSlotPool: num_slots must be a positive int, got {num_slots!r}")
        for nm, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or v <= 0 or v % WEIGHT_TILE:
                raise MoonEPInputError(f"SharedSlotPool: {nm} must be a positive multiple of {WEIGHT_TILE}, got {v!r}")
        if dtype != torch.bfloat16:
            raise MoonEPInputError(f"SharedSlotPool: MoonEP supports BF16 expert weights only, got {dtype}")
        if device is None:
            device = heap.device if isinstance(heap, SymmetricHeap) else resolve_device(None)
        device = torch.device(device)
        self.heap, self._owns_heap = _resolve_heap(heap, group, device)
        try:
            _check_device(self.heap, device, "SharedSlotPool")
            self.num_slots, self.hidden_size, self.intermediate_size = num_slots, hidden_size, intermediate_size
            self.dtype, self.device = dtype, self.heap.device
            B, H, I = num_slots, hidden_size, intermediate_size
            self._w13 = self.heap.allocate((B, 2 * I, H), dtype, f"{name}.w13")
            try:
                self._w2 = self.heap.allocate((B, H, I), dtype, f"{name}.w2")
            except Exception:
                self.heap.free(self._w13)
                raise
            _rows(self._w13).zero_()
            _rows(self._w2).zero_()
            self.heap.barrier()
        except Exception:
            if self._owns_heap:
                self.heap.close(force=True)
            raise
        self.holder: SymmetricWeightLayout | None = None  # the layout whose experts the slots hold
        self._destroyed = False

    @property
    def w13(self) -> torch.Tensor:
        self._alive("w13")
        return _rows(self._w13)

    @property
    def w2(self) -> torch.Tensor:
        self._alive("w2")
        return _rows(self._w2)

    @property
    def first_index(self) -> int:
        return self._w13.index

    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise MoonEPStateError(f"SharedSlotPool.{what}: the pool was destroyed")

    def memory_report(self) -> MemoryReport:
        return MemoryReport(slots=self.num_slots * expert_bytes(self.hidden_size, self.intermediate_size, self.dtype))

    def destroy(self) -> None:
        """Collective, idempotent; after every layout that uses the pool (LIFO heap)."""
        if self._destroyed:
            return
        _free_weights(self)


class SymmetricWeightLayout:
    """The sharded layout of one MoE layer on one rank (see the module doc).

    Args:
        w13_local: ``[epn, 2I, H]`` bf16, this rank's home experts (gate rows first; stored interleaved).
        w2_local: ``[epn, H, I]`` bf16.
        num_experts: ``E`` (global).
        num_slots: ``B`` per-layer slots (``None``: ``epn``; with ``slot_pool``: the pool's).
        group: the EP process group (``None``: the default group, or a world of one).
        heap: a ``SymmetricHeap`` (shared, the caller closes it) or a kind string
            (``auto``/``host``/``torch``/``nvshmem``; the layout makes and owns the heap);
            ``None``: the slot pool's heap if given, else ``auto`` (host on CPU, torch on CUDA).
        slot_pool: ``None`` (per-layer slots) or a ``SharedSlotPool`` shared by all layers.
        name: tag prefix of this layer's heap allocations (default: derived from the heap's
            allocation counter, identical on every rank).

    Construction, ``adopt_parameters``, ``publish`` and ``destroy`` are collective.
    """

    kind = "symmetric"

    #: what vLLM 0.33 rebinds a moonep layer's parameters to after building its layout (the
    #: replicated layout's own ``[E+B]`` tensors); here the vLLM plugin sets them to the adopted
    #: parameters, so the rebinding changes nothing. Nothing in this project reads them.
    full_gate_weight: torch.Tensor | None = None
    full_down_weight: torch.Tensor | None = None

    def __init__(self, w13_local: torch.Tensor, w2_local: torch.Tensor, num_experts: int, num_slots: int | None = None,
                 group: ProcessGroup | None = None, *, heap: SymmetricHeap | str | None = None,
                 slot_pool: SharedSlotPool | None = None, name: str | None = None) -> None:
        if not isinstance(w13_local, torch.Tensor) or not isinstance(w2_local, torch.Tensor):
            raise MoonEPInputError("w13_local and w2_local must be tensors")
        if slot_pool is not None:
            if not isinstance(slot_pool, SharedSlotPool):
                raise MoonEPInputError(f"slot_pool must be a SharedSlotPool, got {type(slot_pool).__name__}")
            slot_pool._alive("SymmetricWeightLayout")
            if num_slots is not None and num_slots != slot_pool.num_slots:
                raise MoonEPInputError(f"num_slots={num_slots} differs from the shared slot pool's {slot_pool.num_slots}")
            if heap is None:
                heap = slot_pool.heap
        # world size before the heap exists (for validation), from the group
        _, world = group_rank_world(group)
        if slot_pool is not None:
            B = slot_pool.num_slots
        elif num_slots is None and isinstance(num_experts, int) and world > 0 and num_experts % world == 0:
            B = default_num_slots(num_experts, world)
        elif num_slots is None:
            B = 1  # no default for this E: check_local_experts names what is wrong with it
        else:
            B = num_slots
        epn, I, H = check_local_experts(w13_local, w2_local, num_experts, world, B)
        if slot_pool is not None:
            if (slot_pool.hidden_size, slot_pool.intermediate_size) != (H, I):
                raise MoonEPInputError(
                    f"the shared slot pool holds experts of H={slot_pool.hidden_size}, I={slot_pool.intermediate_size}; "
                    f"this layer has H={H}, I={I}"
                )
            if slot_pool.heap.world_size != world:
                raise MoonEPInputError(f"the shared slot pool spans {slot_pool.heap.world_size} ranks, the EP group {world}")
            _check_device(slot_pool.heap, w13_local.device, "SymmetricWeightLayout (slot pool)")
        heap, owns = _resolve_heap(heap, group, w13_local.device)
        try:
            _check_device(heap, w13_local.device, "SymmetricWeightLayout")
            overflow = B < epn and world > 1  # one rank has no remote experts
            if overflow and not heap.peers_addressable:
                raise MoonEPInputError(
                    f"B={B} slots < epn={epn} experts per rank needs overflow reads of the owners' rows, but this "
                    f"{type(heap).__name__} cannot address every peer (e.g. ranks on other nodes); use B >= epn"
                )
            self._build(w13_local, w2_local, num_experts, B, epn, I, H, heap, slot_pool, name)
        except Exception:
            if owns:
                heap.close(force=True)
            raise
        self.group = group
        self._owns_heap = owns

    # ------------------------------------------------------------------ construction
    def _build(self, w13_local: torch.Tensor, w2_local: torch.Tensor, E: int, B: int, epn: int, I: int, H: int,
               heap: SymmetricHeap, slot_pool: SharedSlotPool | None, name: str | None) -> None:
        self.heap = heap
        self.slot_pool = slot_pool
        self.num_experts, self.num_slots = E, B
        self.hidden_size, self.intermediate_size = H, I
        self.world_size, self.rank, self.epn = heap.world_size, heap.rank, epn
        self.device = heap.device
        self.dtype = torch.bfloat16
        if name is None:
            name = f"symmetric.a{heap._next_index}"
        self.name = name
        rows = epn + (0 if slot_pool is not None else B)
        self._w13 = heap.allocate((rows, 2 * I, H), torch.bfloat16, f"{name}.w13")
        try:
            self._w2 = heap.allocate((rows, H, I), torch.bfloat16, f"{name}.w2")
        except Exception:
            heap.free(self._w13)
            raise
        w13, w2 = _rows(self._w13), _rows(self._w2)
        say_once("MoonEP symmetric layout: each expert's w13 is stored with gate and up interleaved (row 2j gate row j, "
                 "2j + 1 up row j; converted once as the home rows are copied, so adopted parameters hold that order): "
                 "the expert kernels read the two as one weight", __name__)
        interleave_w13(w13_local, out=w13[:epn])
        w2[:epn].copy_(w2_local)
        w13[epn:].zero_()
        w2[epn:].zero_()
        heap.barrier()  # publish the home rows
        self._weights: GroupedWeights | None = self._make_grouped_weights()  # None once destroyed
        # on GPUs whose peers are all addressable, prefetch reads the owners' rows through a
        # device table of their addresses (built once: graph capture cannot build it)
        self._peer_tables: tuple[torch.Tensor, ...] | None = None
        if self.device.type == "cuda" and heap.peers_addressable:
            self._peer_tables = tuple(
                address_table(heap.peer_view(h, r) for r in range(self.world_size)) for h in (self._w13, self._w2))
        self._destroyed = False

    def _make_grouped_weights(self) -> GroupedWeights:
        E, B, epn, I, rank = self.num_experts, self.num_slots, self.epn, self.intermediate_size, self.rank
        w13s, w2s = [_rows(self._w13)], [_rows(self._w2)]
        pool_of_rank = {rank: 0}
        overflow = B < epn and self.world_size > 1
        for r in range(self.world_size):
            if r != rank and self.heap.addressable(r):
                pool_of_rank[r] = len(w13s)
                w13s.append(self.heap.peer_view(self._w13, r))
                w2s.append(self.heap.peer_view(self._w2, r))
        slot_pool_idx = None
        if self.slot_pool is not None:
            slot_pool_idx = len(w13s)
            w13s.append(self.slot_pool.w13)
            w2s.append(self.slot_pool.w2)
        group_pool = torch.full((E + B,), -1, dtype=torch.int64)
        group_row = torch.full((E + B,), -1, dtype=torch.int64)
        for e in range(E):
            owner = e // epn
            p = pool_of_rank.get(owner)
            # a remote expert's own segment is non-empty only on overflow (B < epn); without
            # peer access it stays -1 (must be empty), which B >= epn guarantees
            if p is not None:
                group_pool[e], group_row[e] = p, e % epn
        for b in range(B):
            if slot_pool_idx is None:
                group_pool[E + b], group_row[E + b] = 0, epn + b
            else:
                group_pool[E + b], group_row[E + b] = slot_pool_idx, b
        dense = None
        if self.slot_pool is None and not overflow:
            dense = torch.cat([torch.arange(rank * epn, (rank + 1) * epn), torch.arange(E, E + B)]).to(torch.int64)
        return GroupedWeights(  # every pool's w13 interleaved (the module doc)
            gate=[t[:, 0::2, :] for t in w13s],
            up=[t[:, 1::2, :] for t in w13s],
            down=w2s,
            group_pool=group_pool,
            group_row=group_row,
            dense_groups=dense,
        )

    # ------------------------------------------------------------------ protocol
    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise MoonEPStateError(f"SymmetricWeightLayout.{what}: the layout was destroyed")

    @property
    def home_w13(self) -> torch.Tensor:
        """``[epn, 2I, H]`` view of this rank's home rows on the heap."""
        self._alive("home_w13")
        return _rows(self._w13)[: self.epn]

    @property
    def home_w2(self) -> torch.Tensor:
        self._alive("home_w2")
        return _rows(self._w2)[: self.epn]

    @property
    def slots_w13(self) -> torch.Tensor:
        """``[B, 2I, H]``: this layer's slot rows (the shared pool's when one is used)."""
        self._alive("slots_w13")
        return self.slot_pool.w13 if self.slot_pool is not None else _rows(self._w13)[self.epn:]

    @property
    def slots_w2(self) -> torch.Tensor:
        self._alive("slots_w2")
        return self.slot_pool.w2 if self.slot_pool is not None else _rows(self._w2)[self.epn:]

    @property
    def dense_weights(self) -> bool:
        """Whether the compute view is the one dense ``[home ; slots]`` tensor (grouped_mm works)."""
        return self._weights is not None and self._weights.dense_groups is not None

    @property
    def first_index(self) -> int:
        return self._w13.index

    def peer_w13(self, rank: int) -> torch.Tensor:
        """``rank``'s ``w13`` allocation seen through the heap (rows ``[0, epn)`` are its home experts)."""
        self._alive("peer_w13")
        return self.heap.peer_view(self._w13, rank)

    def peer_w2(self, rank: int) -> torch.Tensor:
        self._alive("peer_w2")
        return self.heap.peer_view(self._w2, rank)

    def grouped_weights(self) -> GroupedWeights:
        self._alive("grouped_weights")
        if self.slot_pool is not None and self.slot_pool.holder is not self:
            raise MoonEPStateError(
                "SymmetricWeightLayout.grouped_weights: the shared slot pool holds another layer's experts "
                "(a layer's expert compute must follow its own prefetch, with no other layer's prefetch between)"
            )
        assert self._weights is not None  # cleared only by destroy (_alive)
        return self._weights

    def prefetch(self, buffer: MoonEPBuffer | None, plan: MoonEPPlan,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Slot ``b`` <- a bitwise copy of expert ``plan.experts_to_copy[rank, b]`` read from its owner; ``-1`` untouched.
        ``plan`` must be ``buffer``'s latest dispatch's (``MoonEPStateError`` otherwise, as
        ``buffer.prefetch_weight`` refuses it for the replicated layout); ``buffer=None`` takes a
        hand-made table unchecked (tests, tools). ``rows=(cu_seqlens, route_weights_nvs)`` of the
        dispatch: slots whose rows all have weight 0 (padding) are not copied (``engine/row_copy.py``, ``live``)."""
        self._alive("prefetch")
        if buffer is not None:
            # a stale plan (the buffer dispatched since) or another buffer's filled the slots with
            # experts the step's rows are not grouped for, silently
            check_plan(buffer, plan, "SymmetricWeightLayout.prefetch")
        etc = getattr(plan, "experts_to_copy", None)
        R, B, epn = self.world_size, self.num_slots, self.epn
        if not isinstance(etc, torch.Tensor) or etc.dim() != 2 or tuple(etc.shape) != (R, B):
            shape = list(etc.shape) if isinstance(etc, torch.Tensor) else type(etc).__name__
            raise MoonEPInputError(f"prefetch: plan.experts_to_copy must be [R={R}, B={B}], got {shape}")
        live = None if rows is None else (*self._check_rows(rows), self.num_experts)
        if self._peer_tables is not None:  # GPU, every owner addressable: no host read
            mine = etc[self.rank]
            copy_rows(mine, [self.slots_w13, self.slots_w2], table=list(self._peer_tables), rows_per_source=epn,
                      live=live)
        else:
            self._prefetch_host(live_slot_ids(etc[self.rank].tolist(), live))
        if self.slot_pool is not None:
            self.slot_pool.holder = self

    def _check_rows(self, rows: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``prefetch``'s ``rows`` as the slot skip reads them, or a ``MoonEPInputError`` naming what is
        wrong (shapes, dtypes and devices only: a value check would read the device)."""
        G = self.num_experts + self.num_slots
        pair = rows if isinstance(rows, tuple) and len(rows) == 2 else None
        if pair is not None:
            cu, w = pair
            if (isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() == G and not cu.is_floating_point()
                    and isinstance(w, torch.Tensor) and w.dim() == 1 and w.dtype == torch.float32
                    and cu.device == w.device == self.device):
                return cu, w
        got = type(rows).__name__ if pair is None else "(" + ", ".join(
            f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            for t in pair) + ")"
        raise MoonEPInputError(f"prefetch: rows must be (cu_seqlens: int [E+B={G}], route_weights_nvs: float32 "
                               f"[NvS]) on {self.device}, got {got}")

    def _prefetch_host(self, slots: list[int]) -> None:
        """Prefetch with the slot ids on the host: CPU ranks, and heaps that reach some owners
        only by RMA (``copy_from_peer``)."""
        E, epn = self.num_experts, self.epn
        bad = [e for e in slots if not -1 <= e < E]
        if bad:
            raise MoonEPInputError(f"prefetch: experts_to_copy[{self.rank}] has ids outside [-1, {E}): {bad}")
        by_owner: dict[int, tuple[list[int], list[int]]] = {}
        for b, e in enumerate(slots):
            if e >= 0:
                dst, src = by_owner.setdefault(e // epn, ([], []))
                dst.append(b)
                src.append(e % epn)
        dst13, dst2 = self.slots_w13, self.slots_w2
        for owner, (dst, src) in by_owner.items():
            d = torch.tensor(dst, dtype=torch.int64, device=self.device)
            s = torch.tensor(src, dtype=torch.int64, device=self.device)
            for handle, slot_rows in ((self._w13, dst13), (self._w2, dst2)):
                tmp = torch.empty((len(dst),) + tuple(slot_rows.shape[1:]), dtype=slot_rows.dtype, device=self.device)
                if owner == self.rank:  # not planned by the contract, but harmless
                    tmp.copy_(_rows(handle).index_select(0, s))
                else:
                    self.heap.copy_from_peer(tmp, handle, owner, s)
                slot_rows.index_copy_(0, d, tmp)

    def adopt_parameters(self, w13_param: torch.Tensor, w2_param: torch.Tensor, *, copy: bool = True) -> None:
        """Rebind the framework's parameters to the heap's home rows (collective).

        ``w13_param [epn,2I,H]`` (gate rows first) and ``w2_param [epn,H,I]`` (``torch.nn.Parameter`` or
        tensors): with ``copy`` their current contents are copied into the home rows first, ``w13``'s
        interleaved as the constructor does (skipped when they already alias them); then ``.data`` becomes
        the heap view, so the parameters ARE heap memory, ``w13``'s rows interleaved, and their old storage
        is released. Publishes (heap barrier) at the end.
        """
        self._alive("adopt_parameters")
        for nm, p, home in (("w13", w13_param, self.home_w13), ("w2", w2_param, self.home_w2)):
            if not isinstance(p, torch.Tensor):
                raise MoonEPInputError(f"adopt_parameters: {nm}_param must be a tensor/Parameter, got {type(p).__name__}")
            if tuple(p.shape) != tuple(home.shape) or p.dtype != home.dtype:
                raise MoonEPInputError(
                    f"adopt_parameters: {nm}_param must be {list(home.shape)} {home.dtype}, got {list(p.shape)} {p.dtype}"
                )
            if p.device.type != home.device.type:
                raise MoonEPInputError(f"adopt_parameters: {nm}_param is on {p.device}, the heap on {home.device}")
        for p, home in ((w13_param, self.home_w13), (w2_param, self.home_w2)):
            if copy and p.data_ptr() != home.data_ptr():
                with torch.no_grad():
                    if p is w13_param:
                        interleave_w13(p.data, out=home)
                    else:
                        home.copy_(p.data)
            p.data = home
            if p.data_ptr() != home.data_ptr():
                raise MoonEPStateError("adopt_parameters: the parameter does not alias the heap rows after rebinding")
        self.publish()

    def publish(self) -> None:
        """Collective heap barrier: make writes to the home rows visible to every peer."""
        self._alive("publish")
        self.heap.barrier()

    def memory_report(self) -> MemoryReport:
        """Accounted bytes of this layer (the shared pool's slots are reported by the pool)."""
        B = 0 if self.slot_pool is not None else self.num_slots
        return symmetric_accounting(self.num_experts, self.world_size, B, self.hidden_size, self.intermediate_size,
                                    dtype=self.dtype)

    def measured_bytes(self) -> dict[str, int]:
        """Measured: bytes of this layer's own heap allocations, and the process figures."""
        self._alive("measured_bytes")
        out = {"layout_bytes": self._w13.nbytes + self._w2.nbytes, "heap_live_bytes": self.heap.local_bytes()}
        out.update(measured_bytes(self.device))
        return out

    def destroy(self) -> None:
        """Collective and idempotent. Frees this layer's heap allocations (LIFO: destroy layers in
        reverse creation order, the slot pool last) and closes the heap if the layout made it."""
        if self._destroyed:
            return
        if self.slot_pool is not None and self.slot_pool.holder is self:
            self.slot_pool.holder = None
        _free_weights(self)

    def __repr__(self) -> str:
        return (
            f"SymmetricWeightLayout(E={self.num_experts}, R={self.world_size}, epn={self.epn}, B={self.num_slots}, "
            f"H={self.hidden_size}, I={self.intermediate_size}, heap={type(self.heap).__name__}, "
            f"shared_slots={self.slot_pool is not None})"
        )


def destroy_in_order(*objs: SymmetricWeightLayout | SharedSlotPool) -> None:
    """Destroy layouts and slot pools newest-first (what the LIFO heap needs); collective."""
    alive = [o for o in objs if not getattr(o, "_destroyed", True)]
    newest_first = sorted(alive, key=lambda o: o.first_index, reverse=True)
    each(lambda o: o.destroy(), newest_first, MoonEPCollectiveTimeout)


if TYPE_CHECKING:  # the type checker verifies the class honours the protocol it is used through
    from vllm_moonep.common.layout import WeightLayout

    _IS_A_WEIGHT_LAYOUT: type[WeightLayout] = SymmetricWeightLayout
