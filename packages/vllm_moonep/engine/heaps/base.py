"""The symmetric-heap interface and its allocation ledger.

A symmetric heap gives every rank of a process group an allocation of the same shape and dtype
for each collective ``allocate`` call, and lets every rank address its peers' allocations
(``peer_view``). Four operations:

- ``allocate(shape, dtype, tag) -> HeapHandle`` (collective): every rank passes the same
  ``shape``, ``dtype`` and ``tag``; the ranks check this with one all-gather and all raise
  ``MoonEPInputError`` together when they disagree (nothing is allocated then).
  ``handle.tensor`` is this rank's allocation.
- ``peer_view(handle, rank) -> Tensor``: a tensor aliasing ``rank``'s allocation (``handle.tensor``
  itself for the own rank). Heaps that cannot address a peer raise ``MoonEPUnavailableError``;
  ``addressable(rank)`` / ``peers_addressable`` say so beforehand. Peers on another node
  (``nodes``, a ``vllm_moonep.engine.nodes.NodeMap``: real hosts, or simulated nodes from
  ``VLLM_MOONEP_RANKS_PER_NODE``) are never addressable; ``copy_from_peer`` reads their rows by
  the heap's RMA path (``_rma_read``: NVSHMEM's gets; the host and torch heaps emulate it with a
  read of the peer's mapping that does not go through ``peer_view``, so code that wrongly takes a
  peer view across nodes fails on one host too).
- ``barrier()`` (collective): memory-ordering point. Writes a rank made to its own allocations
  before the barrier are visible through every peer's ``peer_view`` after it; reads of peer
  memory issued before the barrier are complete before any rank passes it (so the owner may
  overwrite afterwards). Nothing else is promised: a read of a peer's memory without a barrier
  after the peer's write may return stale data (``HostHeap`` really does).
- ``free(handle)`` (collective, ordered): **LIFO**. Every rank frees the same allocation in the
  same call (checked by an all-gather), and it must be the most recent live allocation. LIFO
  was chosen because it is what a symmetric bump allocator (NVSHMEM's heap) can reclaim
  without fragmentation, it makes "same order on every rank" checkable locally, and it matches
  how models are built and torn down (layer by layer; destroy in reverse). ``live()`` lists
  what is still allocated, in allocation order; ``close()`` refuses (naming the leaked tags)
  while anything is live unless ``force=True``, which frees everything in LIFO order.

Errors leave the heap usable: every check runs before anything changes. The one exception is a
free whose collective failed (a peer gone): the group is unusable then, and the free still
releases this rank's memory before it raises, so that teardown after a failure finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, Sequence

import torch

from vllm_moonep.engine.defaults import group_rank_world, resolve_device
from vllm_moonep.engine.errors import (
    MoonEPCollectiveTimeout,
    MoonEPInputError,
    MoonEPStateError,
    MoonEPUnavailableError,
)
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.faults.teardown import each
from vllm_moonep.engine.nodes import NodeMap, parse_ranks_per_node, ranks_per_node_text, refuse_bad_ranks_per_node

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HeapHandle", "SymmetricHeap", "cuda_heap_device", "group_rank_world"]


def cuda_heap_device(heap_name: str, device: torch.device | str | None) -> torch.device:
    """The CUDA device a GPU heap allocates on (``None``: the current one), or why it cannot."""
    if not torch.cuda.is_available():
        raise MoonEPUnavailableError(f"{heap_name} needs a CUDA device and none is available")
    device = resolve_device(device)
    if device.type != "cuda":
        raise MoonEPUnavailableError(f"{heap_name} allocates CUDA memory; got device {device}")
    return device


@dataclass(eq=False)
class HeapHandle:
    """One collective allocation. ``tensor`` is this rank's memory (``None`` once freed)."""

    heap_id: str
    index: int  # allocation sequence number, the same on every rank
    tag: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None = field(repr=False)
    freed: bool = False
    _peers: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _impl: Any = field(default=None, repr=False)  # heap-specific state

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"#{self.index} {self.tag!r} {list(self.shape)} {str(self.dtype).replace('torch.', '')}"


def describe_failure(exc: BaseException) -> str:
    """``Type: first line of the message`` (what each rank reports of its failure)."""
    text = str(exc).splitlines()[0][:240] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


class SymmetricHeap:
    """Base class: the ledger, the collective checks and the LIFO rule. Subclasses implement
    ``_allocate``, ``_peer_view``, ``_barrier``, ``_free`` and optionally ``_close``."""

    kind = "abstract"

    def __init__(self, group: ProcessGroup | None = None, device: torch.device | str = "cpu",
                 nodes: NodeMap | None = None) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_world(group)
        self.device = torch.device(device)
        self._live: list[HeapHandle] = []
        self._next_index = 0
        self._closed = False
        self._id = f"{type(self).__name__}@{id(self):x}"
        self.nodes = self._agree_on_nodes(nodes)

    def _agree_on_nodes(self, nodes: NodeMap | None) -> NodeMap:
        """The nodes of the heap's ranks: ``nodes`` when given (the hybrid transport's node heap
        passes one node), else simulated nodes from ``VLLM_MOONEP_RANKS_PER_NODE``, else one node
        (each heap kind spans one host: ``/dev/shm``, a node's GPUs; NVSHMEM probes its peers
        itself). Every rank must see the same setting, a valid one: the setting's text is all-gathered
        before it is parsed, so a bad or differing value on one rank is refused on every rank."""
        if nodes is not None:
            if nodes.world_size != self.world_size:
                raise MoonEPInputError(f"{type(self).__name__}: nodes cover {nodes.world_size} ranks, the group has "
                                       f"{self.world_size}")
            return nodes
        text = ranks_per_node_text()
        every = self._all_gather_object(text) if self.world_size > 1 else [text]
        refuse_bad_ranks_per_node(every, type(self).__name__)
        values = [parse_ranks_per_node(t) for t in every]
        if len(set(values)) != 1:
            raise MoonEPInputError(f"{type(self).__name__}: ranks disagree on VLLM_MOONEP_RANKS_PER_NODE "
                                   f"(per rank: {every}); set it to the same value for every rank")
        k = values[0]
        return NodeMap.one_node(self.world_size) if not k else NodeMap.blocks(self.world_size, k)

    # ------------------------------------------------------------------ collectives
    # Every heap collective goes through the engine's bounded collectives: a dead or stuck peer
    # raises MoonEPCollectiveTimeout naming it instead of hanging construction or teardown.
    # After such a failure the group is unusable, and teardown only releases local memory.
    #: set by ``teardown_locally``: frees and ``close`` then release this rank's memory only
    _teardown_local = False
    #: made on first use (a heap of one rank never needs it)
    _collectives_obj: BoundedCollectives | None = None

    @property
    def _collectives(self) -> BoundedCollectives:
        t = self._collectives_obj
        if t is None:
            t = self._collectives_obj = BoundedCollectives(self.group, world_size=self.world_size)
        return t

    def teardown_locally(self) -> None:
        """From now on frees and ``close`` release this rank's memory only, with no collective:
        the group failed, and a collective would wait for peers that may be gone."""
        self._teardown_local = True

    def _local_only(self) -> bool:
        return self.world_size == 1 or self._teardown_local

    def _teardown_local_if_broken(self) -> None:
        """Teardown after a failure on the group releases local memory only: the peers may be gone.
        Any failure on the group counts (every ``BoundedCollectives`` on it shares the group's arrival
        board), so a failed step makes a layout's frees local as well as the buffer's."""
        t = self._collectives_obj
        if t is not None and t.broken:
            self.teardown_locally()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if self._local_only():
            return [obj] * self.world_size if self.world_size > 1 else [obj]
        return self._collectives.all_gather_object(obj, f"{type(self).__name__} all_gather_object")

    def _host_barrier(self) -> None:
        if not self._local_only():
            self._collectives.barrier(f"{type(self).__name__} barrier")

    # ------------------------------------------------------------------ public API
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise MoonEPStateError(f"{type(self).__name__}.{what}: the heap was closed")

    def addressable(self, rank: int) -> bool:
        """Whether ``peer_view(handle, rank)`` works on this heap: ``rank`` is on this rank's node."""
        return 0 <= rank < self.world_size and self.nodes.same_node(self.rank, rank)

    @property
    def peers_addressable(self) -> bool:
        return all(self.addressable(r) for r in range(self.world_size))

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, tag: str) -> HeapHandle:
        """Collective: allocate ``shape``/``dtype`` on every rank; returns this rank's handle."""
        self._check_open("allocate")
        try:
            shape_t = tuple(int(s) for s in shape)
        except TypeError:
            raise MoonEPInputError(f"heap.allocate: shape must be a sequence of ints, got {shape!r}") from None
        if not isinstance(tag, str) or not tag:
            raise MoonEPInputError(f"heap.allocate: tag must be a non-empty string, got {tag!r}")
        if not isinstance(dtype, torch.dtype):
            raise MoonEPInputError(f"heap.allocate: dtype must be a torch.dtype, got {dtype!r}")
        mine = (self._next_index, tag, shape_t, str(dtype))
        every = self._all_gather_object(mine)
        if any(o != mine for o in every):
            rows = "; ".join(f"rank {r}: #{o[0]} {o[1]!r} {list(o[2])} {o[3]}" for r, o in enumerate(every))
            raise MoonEPInputError(
                f"heap.allocate is collective and every rank must request the same allocation; got {rows}"
            )
        if any(s < 0 for s in shape_t):
            raise MoonEPInputError(f"heap.allocate({tag!r}): negative dimension in {list(shape_t)}")
        if any(h.tag == tag for h in self._live):
            raise MoonEPInputError(f"heap.allocate: tag {tag!r} is already live on this heap; tags name allocations")
        handle = HeapHandle(self._id, self._next_index, tag, shape_t, dtype, None)
        # the fallible local part first, then agreement: a rank whose allocator refuses must not
        # leave its peers in the publishing collective (they would wait for it until a watchdog
        # kills the job); every rank raises the same error and the heap stays usable
        failed = None
        try:
            self._reserve(handle)
        except Exception as exc:  # an allocator's refusal (torch.OutOfMemoryError, OSError, ...)
            failed = describe_failure(exc)
        try:
            every = self._all_gather_object(failed)
        except BaseException:  # a peer is gone: keep nothing of this allocation
            self._unreserve(handle)
            raise
        if any(every):
            self._unreserve(handle)
            raise self.allocation_failed(handle, every)
        self._allocate(handle)
        self._next_index += 1
        self._live.append(handle)
        return handle

    def _check_handle(self, handle: HeapHandle, what: str) -> None:
        if not isinstance(handle, HeapHandle):
            raise MoonEPInputError(f"heap.{what}: expected a HeapHandle, got {type(handle).__name__}")
        if handle.heap_id != self._id:
            raise MoonEPInputError(f"heap.{what}: allocation {handle.describe()} belongs to another heap ({handle.heap_id})")

    def _check_live_peer(self, handle: HeapHandle, rank: int, what: str) -> None:
        """An open heap, a live allocation of it and a rank of the group (checked before any access)."""
        self._check_open(what)
        self._check_handle(handle, what)
        if handle.freed:
            raise MoonEPStateError(f"heap.{what}: allocation {handle.describe()} was freed")
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise MoonEPInputError(f"heap.{what}: rank must be in [0, {self.world_size}), got {rank!r}")

    def peer_view(self, handle: HeapHandle, rank: int) -> torch.Tensor:
        """A tensor aliasing ``rank``'s memory of ``handle`` (this rank's own tensor for ``rank == self.rank``)."""
        self._check_live_peer(handle, rank, "peer_view")
        if rank == self.rank:
            assert handle.tensor is not None  # live (checked above): freeing clears it
            return handle.tensor
        view = handle._peers.get(rank)
        if view is None:
            if not self.addressable(rank):
                where = ("another node: " + self.nodes.describe()) if not self.nodes.same_node(self.rank, rank) \
                    else "no peer-to-peer mapping"
                raise MoonEPUnavailableError(
                    f"{type(self).__name__}: rank {rank}'s memory is not addressable from rank {self.rank} ({where}); "
                    "read it with copy_from_peer (RMA)"
                )
            view = self._peer_view(handle, rank)
            handle._peers[rank] = view
        return view

    def copy_from_peer(self, dst: torch.Tensor, handle: HeapHandle, rank: int, src_rows: torch.Tensor) -> None:
        """``dst[i] = peer(rank)[src_rows[i]]`` (rows along dim 0): through ``peer_view`` where ``rank``
        is addressable, else by the heap's RMA path (``_rma_read``). Reads what ``rank`` published
        (its last ``barrier()``)."""
        if self.addressable(rank):
            src = self.peer_view(handle, rank)
            dst.copy_(src.index_select(0, src_rows.to(src.device)))
            return
        self._check_live_peer(handle, rank, "copy_from_peer")
        n = handle.shape[0] if handle.shape else 0
        rows = src_rows.to(torch.int64).flatten()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise MoonEPInputError(f"heap.copy_from_peer: rows {rows.tolist()} outside [0, {n}) of {handle.describe()}")
        if dst.device != self.device or dst.dtype != handle.dtype or tuple(dst.shape) != (rows.numel(), *handle.shape[1:]):
            raise MoonEPInputError(
                f"heap.copy_from_peer: dst must be a {handle.dtype} [{rows.numel()}, {', '.join(map(str, handle.shape[1:]))}] "
                f"tensor on {self.device}, got {dst.dtype} {list(dst.shape)} on {dst.device}")
        self._rma_read(dst, handle, rank, rows)

    def barrier(self) -> None:
        """Collective memory-ordering point (see the module doc)."""
        self._check_open("barrier")
        self._barrier()

    def free(self, handle: HeapHandle) -> None:
        """Collective, LIFO: free the most recent live allocation on every rank. A free that fails
        because the group failed (a peer gone) still releases this rank's memory, then raises; so
        do the frees after it, locally."""
        self._check_open("free")
        self._check_handle(handle, "free")
        self._teardown_local_if_broken()
        mine = (handle.index, handle.tag)
        try:
            every = self._all_gather_object(mine)
        except BaseException:
            self._teardown_local_if_broken()
            if self._local_only() and not handle.freed and self._live and self._live[-1] is handle:
                self._release(handle)
            raise
        if any(o != mine for o in every):
            rows = "; ".join(f"rank {r}: #{o[0]} {o[1]!r}" for r, o in enumerate(every))
            raise MoonEPStateError(f"heap.free is collective: every rank must free the same allocation in the same call; got {rows}")
        if handle.freed:
            raise MoonEPStateError(f"heap.free: double free of allocation {handle.describe()}")
        top = self._live[-1] if self._live else None
        if top is not handle:
            live = ", ".join(h.describe() for h in self._live)
            raise MoonEPStateError(
                f"heap.free: out-of-order free of {handle.describe()}; this heap frees in LIFO order, so the next "
                f"allocation to free is {top.describe() if top else '(none)'} (live, oldest first: {live})"
            )
        self._release(handle)

    def free_all(self, *handles: HeapHandle) -> None:
        """Teardown's free: ``handles`` in the order given (newest first), skipping those already
        freed (a retried teardown). After a failed collective the rest are still freed (locally:
        the group failed), then that error is raised; any other error stops at once."""
        each(lambda h: None if h.freed else self.free(h), handles, MoonEPCollectiveTimeout)

    def _release(self, handle: HeapHandle) -> None:
        """Free ``handle``, the top of the LIFO stack, and forget it (the checks are the caller's)."""
        self._free(handle)
        self._live.pop()
        handle.freed = True
        handle.tensor = None
        handle._peers.clear()
        handle._impl = None

    def live(self) -> list[HeapHandle]:
        """Live allocations, oldest first."""
        return list(self._live)

    def local_bytes(self) -> int:
        """Bytes this rank holds in live allocations (each allocation counted once)."""
        return sum(h.nbytes for h in self._live)

    def close(self, force: bool = False) -> None:
        """Collective and idempotent. Raises (heap unchanged) while allocations are live, unless ``force``
        (then they are freed like a teardown's ``free_all``: a collective that fails on the way
        still leaves every allocation released and the heap closed, then raises)."""
        if self._closed:
            return
        if self._live and not force:
            tags = ", ".join(h.describe() for h in self._live)
            raise MoonEPStateError(
                f"{type(self).__name__}.close: {len(self._live)} allocation(s) leaked (still live): {tags}; "
                "destroy their owners first (LIFO) or close(force=True)"
            )
        self._teardown_local_if_broken()
        t = self._collectives_obj
        failed: MoonEPCollectiveTimeout | None = None
        try:
            self.free_all(*self._live[::-1])
        except MoonEPCollectiveTimeout as exc:  # every allocation was released (locally): close too
            failed = exc
        self._close()
        self._closed = True
        if t is not None:
            t.close()
        if failed is not None:
            raise failed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device}, live={len(self._live)})"

    def allocation_failed(self, handle: HeapHandle, every: list[str | None]) -> MoonEPUnavailableError:
        """The error every rank raises when some rank's part of an allocation failed (``every``:
        each rank's failure, or ``None``)."""
        who = "; ".join(f"rank {r}: {e}" for r, e in enumerate(every) if e)
        return MoonEPUnavailableError(
            f"heap.allocate({handle.tag!r}, {list(handle.shape)} {handle.dtype}, {handle.nbytes / 2**20:.1f} MiB per "
            f"rank) failed: {who}. No rank allocated it and the heap is still usable (free memory or ask for less)"
        )

    # ------------------------------------------------------------------ subclass hooks
    def _reserve(self, handle: HeapHandle) -> None:
        """The local part of an allocation that can fail (the allocator's call), before any
        collective; ``allocate`` agrees on the outcome across ranks before ``_allocate``."""

    def _unreserve(self, handle: HeapHandle) -> None:
        """Undo ``_reserve`` on this rank (some rank failed its reservation)."""
        handle.tensor = None
        handle._impl = None

    def _allocate(self, handle: HeapHandle) -> None:  # sets handle.tensor (and handle._impl)
        raise NotImplementedError

    def _peer_view(self, handle: HeapHandle, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def _rma_read(self, dst: torch.Tensor, handle: HeapHandle, rank: int, rows: torch.Tensor) -> None:
        """``dst[i] = rank's rows[i]`` for a peer that is not addressable (checked by the caller)."""
        raise MoonEPUnavailableError(
            f"{type(self).__name__} has no RMA path: rank {rank}'s memory is not addressable from rank {self.rank} "
            f"({self.nodes.describe()})")

    def _barrier(self) -> None:
        raise NotImplementedError

    def _free(self, handle: HeapHandle) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        pass
