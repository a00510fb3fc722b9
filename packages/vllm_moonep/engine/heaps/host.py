"""``HostHeap``: a symmetric heap in host memory for CPU ranks of one machine (tests, CPU demo).

Each allocation is one shared-memory file per rank under ``/dev/shm`` (names derived from a
prefix rank 0 makes and all-gathers), mapped by every rank with ``mmap`` and wrapped with
``torch.frombuffer``. The files are unlinked as soon as every rank has mapped them, so nothing
is left in ``/dev/shm`` even if a process dies; an ``atexit`` hook removes the few that could
exist in the window between creation and unlink.

Visibility, like the real thing where it matters: with ``staging=True`` (default) a rank's
``handle.tensor`` is a private staging copy; peers read the shared mapping, which is refreshed
from the staging copy only in ``barrier()``. A read of a peer without a barrier after the peer's
write therefore returns stale data, so a missing barrier fails tests instead of passing by luck.
Peer views are for reading in this mode (a write through one is overwritten at the owner's
next barrier). ``staging=False`` maps the shared file directly as ``handle.tensor`` (immediate
visibility; peer writes allowed; half the memory).

Simulated nodes (``VLLM_MOONEP_RANKS_PER_NODE``, ``engine/nodes.py``): peers on another simulated
node are not addressable (``peer_view`` refuses them), and ``copy_from_peer`` reads their rows
by an emulated RMA get (``_rma_read``): a copy out of the peer's shared mapping (what it
published at its last barrier) that never hands out a view of it. Code that takes a peer view
across nodes therefore fails in CPU tests, as it would across real nodes.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import uuid

from typing import TYPE_CHECKING

import torch

from vllm_moonep.engine.errors import MoonEPInputError, MoonEPUnavailableError
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap, describe_failure

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from vllm_moonep.engine.nodes import NodeMap

__all__ = ["HostHeap"]

#: files created but not yet unlinked by this process (removed at exit if still there)
_PENDING: set[str] = set()


def _cleanup_pending() -> None:
    for path in list(_PENDING):
        try:
            os.unlink(path)
        except OSError:
            pass
        _PENDING.discard(path)


atexit.register(_cleanup_pending)


def _map_file(path: str, nbytes: int, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    size = max(nbytes, 1)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            # a tmpfs file is sparse until written: claim its pages now, so a full /dev/shm fails
            # here (an agreed error) instead of killing the process with SIGBUS at the first write
            os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=size)
    return mm, raw[:nbytes]


class HostHeap(SymmetricHeap):
    """Symmetric heap over ``/dev/shm`` for CPU ranks of one machine (see the module doc).

    Args:
        group: the process group (``None``: the default group, or a world of one).
        staging: keep owner writes private until ``barrier()`` (default; see the module doc).
        shm_dir: where the files live (``/dev/shm``).
        nodes: the ranks' nodes (``None``: simulated nodes from ``VLLM_MOONEP_RANKS_PER_NODE``, else one).
    """

    kind = "host"

    def __init__(self, group: ProcessGroup | None = None, *, staging: bool = True, shm_dir: str = "/dev/shm",
                 device: torch.device | str = "cpu", nodes: NodeMap | None = None) -> None:
        if torch.device(device).type != "cpu":
            raise MoonEPInputError(f"HostHeap holds host memory; device must be cpu, got {device}")
        super().__init__(group, "cpu", nodes)
        if not os.path.isdir(shm_dir):
            raise MoonEPUnavailableError(f"HostHeap: {shm_dir} does not exist (needs a tmpfs such as /dev/shm)")
        self.staging = bool(staging)
        self.shm_dir = shm_dir
        mine = f"vllm_moonep_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self.prefix = self._all_gather_object(mine)[0]
        modes = self._all_gather_object(self.staging)
        if len(set(modes)) != 1:
            raise MoonEPInputError(f"HostHeap: every rank must use the same staging mode, got {modes}")

    def _path(self, handle: HeapHandle, rank: int) -> str:
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", handle.tag)[:40]
        return os.path.join(self.shm_dir, f"{self.prefix}_a{handle.index}_{tag}_r{rank}")

    def _reserve(self, handle: HeapHandle) -> None:
        # this rank's file and mapping (a full tmpfs or an address-space limit fails here, before
        # any collective); the staging copy too
        own_path = self._path(handle, self.rank)
        _PENDING.add(own_path)
        try:
            mm, raw = _map_file(own_path, handle.nbytes, create=True)
            handle._impl = {"own": (mm, raw.view(handle.dtype).view(handle.shape))}
            if self.staging:
                handle.tensor = torch.zeros(handle.shape, dtype=handle.dtype)
        except BaseException:
            self._drop_file(own_path)
            raise

    def _unreserve(self, handle: HeapHandle) -> None:
        handle.tensor = handle._impl = None
        self._drop_file(self._path(handle, self.rank))

    @staticmethod
    def _drop_file(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
        _PENDING.discard(path)

    def _allocate(self, handle: HeapHandle) -> None:
        nbytes = handle.nbytes
        own_path = self._path(handle, self.rank)
        mm, own = handle._impl.pop("own")
        maps: dict[int, mmap.mmap] = {self.rank: mm}
        shared = {self.rank: own}
        failed = None
        try:
            self._host_barrier()  # every file exists
            try:
                for r in range(self.world_size):
                    if r != self.rank:
                        maps[r], raw = _map_file(self._path(handle, r), nbytes, create=False)
                        shared[r] = raw.view(handle.dtype).view(handle.shape)
            except Exception as exc:  # mapping the peers' files (address space) can fail on one rank
                failed = describe_failure(exc)
            # every rank mapped every file (or says why not): the names can go
            every = self._all_gather_object(failed)
        finally:
            self._drop_file(own_path)
        if any(every):
            shared.clear()
            maps.clear()
            handle.tensor = handle._impl = None
            raise self.allocation_failed(handle, every)
        if not self.staging:
            handle.tensor = shared[self.rank]
        handle._impl = {"shared": shared, "maps": maps}

    def _peer_view(self, handle: HeapHandle, rank: int) -> torch.Tensor:
        view: torch.Tensor = handle._impl["shared"][rank]
        return view

    def _rma_read(self, dst: torch.Tensor, handle: HeapHandle, rank: int, rows: torch.Tensor) -> None:
        # the emulated get: rows copied out of the peer's shared mapping (its published state)
        shared: torch.Tensor = handle._impl["shared"][rank]
        torch.index_select(shared, 0, rows, out=dst)

    def _barrier(self) -> None:
        # 1) every rank finished the reads of the previous epoch; 2) publish; 3) visible to all
        self._host_barrier()
        if self.staging:
            for h in self._live:
                h._impl["shared"][self.rank].copy_(h.tensor)
            self._host_barrier()

    def _free(self, handle: HeapHandle) -> None:
        self._host_barrier()  # nobody reads the allocation any more
        # the files are already unlinked; the pages go when the last mapping (tensor) is dropped
        handle._impl["shared"].clear()
        handle._impl["maps"].clear()
