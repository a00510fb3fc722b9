"""``NvshmemHeap``: NVSHMEM through nvshmem4py (optional extra ``nvshmem4py-cu13``).

NVSHMEM is initialised from the torch process group: rank 0's unique id is all-gathered over
``torch.distributed`` and every rank calls ``nvshmem.core.init(..., initializer_method="uid")``
with its group rank. Allocations are ``nvshmem.core.tensor`` (collective), peer views
``nvshmem.core.get_peer_tensor`` (peers reachable over NVLink / P2P), frees
``nvshmem.core.free_tensor`` (collective; this heap's LIFO rule is stricter than NVSHMEM's "same
order on every PE").

Peers that are not addressable (ranks on other nodes) are read by RMA: ``copy_from_peer`` issues
``nvshmemx_getmem_on_stream`` (``nvshmem.bindings.getmem_on_stream``) for each row, in chunks,
into a symmetric scratch buffer of this heap (the local side of a get over a remote transport
must be registered memory), then copies the chunk into the destination on the same stream. The
symmetric layout then refuses ``B < E/R`` (overflow reads need a peer view).
``force_rma=True`` (or ``VLLM_MOONEP_NVSHMEM_FORCE_RMA=1``) treats every peer as not addressable,
so one node runs the path ranks on other nodes take (tests; NVSHMEM itself still moves the bytes
over NVLink there).

nvshmem4py is imported lazily; where it does not import, constructing the heap raises
``MoonEPUnavailableError`` saying how to get it. Multicast (NVLS) stays off
(``NVSHMEM_DISABLE_NVLS=1``; the heap refuses to start otherwise unless the user opted in).

Not exercised in this repository's CPU CI (nvshmem4py is not installed there); the multi-GPU
tests (``tests/distributed/test_multi_gpu.py``) run it where the nvshmem4py wheel is installed
(``tools/gpu_suite.sh`` installs it from a carried ``.whl/`` folder).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vllm_moonep.engine.errors import MoonEPInputError, MoonEPStateError, MoonEPUnavailableError
from vllm_moonep.engine.multicast import check_multicast_off
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap, cuda_heap_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from vllm_moonep.engine.nodes import NodeMap

__all__ = ["FORCE_RMA_ENV", "NvshmemHeap", "nvshmem_status", "rma_chunks"]

#: set to 1 to treat every peer as not addressable (the RMA path of ranks on other nodes)
FORCE_RMA_ENV = "VLLM_MOONEP_NVSHMEM_FORCE_RMA"
#: default size of the symmetric scratch buffer RMA gets land in (bytes)
RMA_SCRATCH_BYTES = 16 * 2**20

#: processes initialise NVSHMEM once; heaps share it
_STATE = {"initialised_by_us": False, "users": 0, "stale": False}


def nvshmem_status() -> tuple[ModuleType | None, str]:
    """``(nvshmem.core module, "")`` when nvshmem4py imports, else ``(None, reason)``."""
    try:
        core = importlib.import_module("nvshmem.core")
    except Exception as exc:
        return None, (
            f"nvshmem4py does not import ({type(exc).__name__}: {exc}); install the optional extra "
            "`pip install vllm-moonep[nvshmem]` (nvshmem4py-cu13) with the NVSHMEM libraries"
        )
    for name in ("init", "get_unique_id", "tensor", "free_tensor", "get_peer_tensor"):
        if not hasattr(core, name):
            return None, f"the installed nvshmem4py lacks nvshmem.core.{name} (incompatible version)"
    return core, ""


def rma_chunks(rows: list[int], row_bytes: int, scratch_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """The gets that copy ``rows`` (row indices of a ``[n, row_bytes]`` allocation) through a scratch
    buffer of ``scratch_bytes``: batches, each a list of ``(src_offset, scratch_offset, dst_offset,
    nbytes)`` filling the scratch at most once; a batch is followed by one copy of the scratch's
    used prefix to the destination at ``batch[0][2]`` (contiguous). Rows larger than the scratch
    are split into several batches."""
    if row_bytes <= 0 or scratch_bytes <= 0:
        raise MoonEPInputError(f"rma_chunks: row_bytes and scratch_bytes must be > 0, got {row_bytes}, {scratch_bytes}")
    batches: list[list[tuple[int, int, int, int]]] = []
    if row_bytes <= scratch_bytes:
        per = scratch_bytes // row_bytes
        for i0 in range(0, len(rows), per):
            batches.append([(r * row_bytes, j * row_bytes, (i0 + j) * row_bytes, row_bytes)
                            for j, r in enumerate(rows[i0:i0 + per])])
    else:
        for i, r in enumerate(rows):
            for off in range(0, row_bytes, scratch_bytes):
                n = min(scratch_bytes, row_bytes - off)
                batches.append([(r * row_bytes + off, 0, i * row_bytes + off, n)])
    return batches


def _cuda_core_device(index: int | None) -> Any:  # a cuda.core Device
    for modname in ("cuda.core", "cuda.core.experimental"):
        try:
            mod = importlib.import_module(modname)
            return mod.Device(index)
        except Exception:
            continue
    raise MoonEPUnavailableError("NvshmemHeap: cuda.core (cuda-python) is needed by nvshmem4py and does not import")


class NvshmemHeap(SymmetricHeap):
    """Symmetric heap on NVSHMEM (see the module doc).

    Args:
        group: the process group whose ranks become the NVSHMEM PEs (``None``: default group).
        device: the CUDA device of this rank (default: the current one).
        force_rma: treat every peer as not addressable, so peer rows are read by RMA gets (what
            ranks on other nodes need), on one node too (``None``: ``$VLLM_MOONEP_NVSHMEM_FORCE_RMA``).
            Peers on another simulated node (``VLLM_MOONEP_RANKS_PER_NODE``) are read by RMA too.
        nodes: the ranks' nodes (``None``: simulated nodes from ``VLLM_MOONEP_RANKS_PER_NODE``, else
            what NVSHMEM can map).
        rma_scratch_bytes: size of the symmetric scratch buffer RMA gets land in (allocated only
            where some rank has a peer it cannot address).
    """

    kind = "nvshmem"

    def __init__(self, group: ProcessGroup | None = None, device: torch.device | str | None = None, *,
                 force_rma: bool | None = None, rma_scratch_bytes: int = RMA_SCRATCH_BYTES,
                 nodes: NodeMap | None = None) -> None:
        core, why = nvshmem_status()
        if core is None:
            raise MoonEPUnavailableError(f"NvshmemHeap: {why}")
        check_multicast_off("NvshmemHeap")
        device = cuda_heap_device("NvshmemHeap", device)
        if force_rma is None:
            force_rma = os.environ.get(FORCE_RMA_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
        if not isinstance(rma_scratch_bytes, int) or rma_scratch_bytes < 1:
            raise MoonEPInputError(f"NvshmemHeap: rma_scratch_bytes must be a positive int, got {rma_scratch_bytes!r}")
        super().__init__(group, device, nodes)
        self._core = core
        self.force_rma = bool(force_rma)
        self._scratch: torch.Tensor | None = None
        torch.cuda.set_device(device)
        self._init_nvshmem()
        _STATE["users"] += 1
        # which peers NVSHMEM can map directly (P2P / NVLink); others need RMA
        probe = self._core.tensor((1,), dtype=torch.uint8)
        try:
            self._addressable: list[bool] = []
            for r in range(self.world_size):
                if r == self.rank:
                    self._addressable.append(True)
                    continue
                try:
                    ok = self._core.get_peer_tensor(probe, r) is not None
                except Exception:
                    ok = False
                self._addressable.append(ok)
        finally:
            self._core.free_tensor(probe)
        if self.force_rma:
            self._addressable = [r == self.rank for r in range(self.world_size)]
        self._addressable = [ok and self.nodes.same_node(self.rank, r) for r, ok in enumerate(self._addressable)]
        # every rank allocates the scratch if any rank needs it (allocation is collective)
        need = self._all_gather_object(not all(self._addressable))
        if any(need):
            self._scratch = self._core.tensor((rma_scratch_bytes,), dtype=torch.uint8)
            torch.cuda.synchronize(self.device)

    def _init_nvshmem(self) -> None:
        if _STATE["stale"]:
            raise MoonEPUnavailableError(
                "NvshmemHeap: NVSHMEM in this process was left initialised by a teardown after a failed step "
                "(finalize is collective and peers may be gone); a new NVSHMEM heap needs a fresh process")
        core = self._core
        n_pes = getattr(core, "n_pes", None)
        already = False
        try:
            already = n_pes is not None and int(n_pes()) > 0 and bool(_STATE["initialised_by_us"])
        except Exception:
            already = False
        if already:
            if int(core.n_pes()) != self.world_size or int(core.my_pe()) != self.rank:
                raise MoonEPUnavailableError(
                    f"NvshmemHeap: NVSHMEM is already initialised with {core.n_pes()} PEs (this PE {core.my_pe()}); "
                    f"the group has {self.world_size} ranks (this rank {self.rank})"
                )
            return
        import numpy as np

        uid = core.get_unique_id(empty=(self.rank != 0))
        mine = bytes(uid._data.view(np.uint8).tobytes())
        root = self._all_gather_object(mine)[0]
        uid._data.view(np.uint8)[:] = np.frombuffer(root, dtype=np.uint8)
        core.init(
            device=_cuda_core_device(self.device.index), uid=uid, rank=self.rank, nranks=self.world_size,
            initializer_method="uid",
        )
        _STATE["initialised_by_us"] = True

    def addressable(self, rank: int) -> bool:
        return 0 <= rank < self.world_size and self._addressable[rank]

    def _stream(self) -> Any:  # the stream wrapper nvshmem4py's collectives take, or None
        wrap = getattr(self._core, "NvshmemStream", None)
        if wrap is not None:
            return wrap(torch.cuda.current_stream(self.device))
        for modname in ("cuda.core", "cuda.core.experimental"):
            try:
                mod = importlib.import_module(modname)
                return mod.Stream.from_handle(torch.cuda.current_stream(self.device).cuda_stream)
            except Exception:
                continue
        return None

    def _allocate(self, handle: HeapHandle) -> None:
        shape = handle.shape if all(handle.shape) else (1,)
        torch.cuda.synchronize(self.device)
        t = self._core.tensor(shape, dtype=handle.dtype)
        torch.cuda.synchronize(self.device)
        handle.tensor = t if all(handle.shape) else t[:0].view(handle.shape)
        handle._impl = {"base": t}

    def _peer_view(self, handle: HeapHandle, rank: int) -> torch.Tensor:
        view: torch.Tensor | None = self._core.get_peer_tensor(handle._impl["base"], rank)
        if view is None:
            raise MoonEPUnavailableError(f"NvshmemHeap: no peer mapping of rank {rank} from rank {self.rank}")
        return view if all(handle.shape) else view[:0].view(handle.shape)

    def _rma_read(self, dst: torch.Tensor, handle: HeapHandle, rank: int, src_rows: torch.Tensor) -> None:
        """``dst[i] = peer(rank)[src_rows[i]]`` for a peer that is not addressable (``copy_from_peer``
        checked the rows and ``dst``): RMA gets into the symmetric scratch buffer, each followed
        (same stream) by a copy into ``dst``. Stream-ordered; the heap's ``barrier()`` completes it."""
        rows = [int(r) for r in src_rows.tolist()]
        n = handle.shape[0] if handle.shape else 0
        if not dst.is_contiguous():
            raise MoonEPInputError(f"heap.copy_from_peer: dst must be contiguous, got strides {dst.stride()}")
        if not rows:
            return
        if self._scratch is None:  # not reachable: the scratch exists wherever a peer is not addressable
            raise MoonEPStateError("NvshmemHeap: no RMA scratch buffer although a peer is not addressable")
        try:
            bindings = importlib.import_module("nvshmem.bindings")
            getmem = bindings.getmem_on_stream
        except Exception as exc:
            raise MoonEPUnavailableError(f"NvshmemHeap: nvshmem.bindings.getmem_on_stream is unavailable ({exc})") from exc
        row_bytes = handle.nbytes // n
        src_base = handle._impl["base"].data_ptr()
        scratch = self._scratch
        dst_bytes = dst.view(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(self.device)
        for batch in rma_chunks(rows, row_bytes, scratch.numel()):
            for src_off, scr_off, _, nbytes in batch:
                getmem(scratch.data_ptr() + scr_off, src_base + src_off, nbytes, rank, stream.cuda_stream)
            used = batch[-1][1] + batch[-1][3]
            start = batch[0][2]
            dst_bytes[start:start + used].copy_(scratch[:used])

    def _barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        barrier = getattr(self._core, "barrier", None)
        teams = getattr(self._core, "Teams", None)
        stream = self._stream()
        if barrier is not None and teams is not None and stream is not None:
            barrier(teams.TEAM_WORLD, stream=stream)
            torch.cuda.synchronize(self.device)
        self._host_barrier()

    def _free(self, handle: HeapHandle) -> None:
        torch.cuda.synchronize(self.device)
        self._host_barrier()
        if not self._teardown_local:  # nvshmem_free is collective: not with peers gone
            self._core.free_tensor(handle._impl["base"])

    def _close(self) -> None:
        if self._scratch is not None and not self._teardown_local:
            torch.cuda.synchronize(self.device)
            self._core.free_tensor(self._scratch)
        self._scratch = None
        _STATE["users"] -= 1
        # finalize is collective too: not after a failure (peers may be gone); NVSHMEM then stays
        # initialised, with the failed peers in it, until the process ends (_init_nvshmem refuses it)
        if self._teardown_local and _STATE["initialised_by_us"]:
            _STATE["stale"] = True
        if _STATE["users"] == 0 and _STATE["initialised_by_us"] and not _STATE["stale"]:
            try:
                self._core.finalize()
            finally:
                _STATE["initialised_by_us"] = False
