"""``NvshmemHeap``: NVSHMEM through nvshmem4py (optional extra ``nvshmem4py-cu13``).

NVSHMEM is initialised from the torch process group: rank 0's unique id is all-gathered over
``torch.distributed`` and every rank calls ``nvshmem.core.init(..., initializer_method="uid")``
with its group rank. Allocations are ``nvshmem.core.tensor`` (collective), peer views
``nvshmem.core.get_peer_tensor`` (peers reachable over NVLink / P2P; ranks on other nodes are not
addressable and ``copy_from_peer`` falls back to an RMA get), frees ``nvshmem.core.free_tensor``
(collective; this heap's LIFO rule is stricter than NVSHMEM's "same order on every PE").

nvshmem4py is imported lazily; where it does not import, constructing the heap raises
``MoonEPUnavailableError`` saying how to get it. Multicast (NVLS) stays off
(``NVSHMEM_DISABLE_NVLS=1``; the heap refuses to start otherwise unless the user opted in).

Not exercised in this repository's CI (nvshmem4py is not installed there); written against the
nvshmem4py documentation (``nvshmem.core`` init/finalize, interop.torch, RMA, collectives).
"""

from __future__ import annotations

import importlib

import torch

from vllm_moonep.engine.errors import MoonEPUnavailableError
from vllm_moonep.multicast import check_multicast_off
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap

__all__ = ["NvshmemHeap", "nvshmem_status"]

#: processes initialise NVSHMEM once; heaps share it
_STATE = {"initialised_by_us": False, "users": 0}


def nvshmem_status() -> tuple[object | None, str]:
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


def _cuda_core_device(index: int):
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
    """

    kind = "nvshmem"

    def __init__(self, group=None, device: torch.device | str | None = None):
        core, why = nvshmem_status()
        if core is None:
            raise MoonEPUnavailableError(f"NvshmemHeap: {why}")
        check_multicast_off("NvshmemHeap")
        if not torch.cuda.is_available():
            raise MoonEPUnavailableError("NvshmemHeap needs a CUDA device and none is available")
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise MoonEPUnavailableError(f"NvshmemHeap allocates CUDA memory; got device {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(group, device)
        self._core = core
        torch.cuda.set_device(device)
        self._init_nvshmem()
        _STATE["users"] += 1
        # which peers NVSHMEM can map directly (P2P / NVLink); others need RMA
        probe = self._core.tensor((1,), dtype=torch.uint8)
        try:
            self._addressable = []
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

    def _init_nvshmem(self) -> None:
        core = self._core
        n_pes = getattr(core, "n_pes", None)
        already = False
        try:
            already = n_pes is not None and int(n_pes()) > 0 and _STATE["initialised_by_us"]
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

    def _stream(self):
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
        view = self._core.get_peer_tensor(handle._impl["base"], rank)
        if view is None:
            raise MoonEPUnavailableError(f"NvshmemHeap: no peer mapping of rank {rank} from rank {self.rank}")
        return view if all(handle.shape) else view[:0].view(handle.shape)

    def copy_from_peer(self, dst: torch.Tensor, handle: HeapHandle, rank: int, src_rows: torch.Tensor) -> None:
        if self.addressable(rank):
            return super().copy_from_peer(dst, handle, rank, src_rows)
        # RMA get of each row into a symmetric scratch row, then a local copy
        base = handle._impl["base"]
        rows = src_rows.tolist()
        stream = self._stream()
        for i, r in enumerate(rows):
            self._core.get(dst[i], base[r], remote_pe=rank, stream=stream)
        torch.cuda.current_stream(self.device).synchronize()

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
        self._core.free_tensor(handle._impl["base"])

    def _close(self) -> None:
        _STATE["users"] -= 1
        if _STATE["users"] == 0 and _STATE["initialised_by_us"]:
            try:
                self._core.finalize()
            finally:
                _STATE["initialised_by_us"] = False
