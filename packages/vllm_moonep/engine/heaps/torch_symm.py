"""``TorchSymmHeap``: PyTorch symmetric memory (``torch.distributed._symmetric_memory``), CUDA
backend, for the GPUs of one node.

Each allocation is ``symm_mem.empty`` + ``symm_mem.rendezvous(t, group_name)``; peer views come
from ``handle.get_buffer(peer, shape, dtype, storage_offset)``. Works with torch 2.11 and later.
Several processes on one GPU (tests) need ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``.
Multicast is never used: the heap refuses to start when the environment enables it (unless the
user opted in, ``vllm_moonep.engine.multicast``).

``barrier()`` synchronizes this rank's device (every write issued before it has landed) and then
the ranks' hosts; peer reads issued afterwards see the writes. It is a load-time barrier;
``device_barrier()`` is the stream-ordered one for hot paths.

Without an initialised process group (a single process) the heap runs in local mode: plain
device allocations, no peers.

The heap spans one real node. Across simulated nodes (``VLLM_MOONEP_RANKS_PER_NODE``,
``engine/nodes.py``) peers on another simulated node are not addressable, and
``copy_from_peer`` reads their rows by an emulated RMA get (``_rma_read``: a stream-ordered copy
out of the peer's mapping that never hands out a view), so the layouts' cross-node paths run on
one GPU host. (The hybrid transport builds its heap on its node's ranks instead.)
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPUnavailableError
from vllm_moonep.engine.multicast import check_multicast_off
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap, cuda_heap_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from vllm_moonep.engine.nodes import NodeMap

__all__ = ["TorchSymmHeap", "device_memory_state"]

def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def device_memory_state(device: torch.device) -> str:
    """Free and total device memory and what torch's allocator holds: what an OOM report needs."""
    try:
        free, total = torch.cuda.mem_get_info(device)
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    except Exception as exc:  # the report must not replace the error it explains
        return f"device memory unknown: {exc}"
    gib = 2**30
    return (f"{device}: {free / gib:.1f} of {total / gib:.1f} GiB free; torch's allocator holds {reserved / gib:.1f} "
            f"GiB, {allocated / gib:.1f} GiB of it in tensors; the rest is other processes, contexts and heaps")


def _symm_mem() -> ModuleType:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # pragma: no cover - builds without distributed
        raise MoonEPUnavailableError(f"TorchSymmHeap: torch.distributed._symmetric_memory does not import ({exc})") from exc
    return symm_mem


class TorchSymmHeap(SymmetricHeap):
    """Symmetric heap on PyTorch symmetric memory (see the module doc).

    Args:
        group: process group (``None``: the default group; none initialised: local mode).
        device: CUDA device (default: the current one).
        backend: symmetric-memory backend to select (``"CUDA"``); ``None`` leaves torch's choice.
        nodes: the ranks' nodes (``None``: simulated nodes from ``VLLM_MOONEP_RANKS_PER_NODE``, else one).
    """

    kind = "torch"

    def __init__(self, group: ProcessGroup | None = None, device: torch.device | str | None = None, *,
                 backend: str | None = "CUDA", nodes: NodeMap | None = None) -> None:
        check_multicast_off("TorchSymmHeap")
        device = cuda_heap_device("TorchSymmHeap", device)
        super().__init__(group, device, nodes)
        self._local_mode = not (dist.is_available() and dist.is_initialized())
        self._symm: ModuleType | None = None  # torch's symmetric memory; None in local mode
        if not self._local_mode:
            symm_mem = _symm_mem()
            self._symm = symm_mem
            pg = group if group is not None else dist.group.WORLD
            assert pg is not None  # the default group exists: torch.distributed is initialised
            self.group_name = pg.group_name
            if backend is not None and hasattr(symm_mem, "get_backend"):
                current = symm_mem.get_backend(device)
                if current != backend:
                    try:
                        symm_mem.set_backend(backend)
                    except Exception as exc:
                        if current is None:  # nothing to switch away from; torch keeps its default
                            return
                        raise MoonEPUnavailableError(
                            f"TorchSymmHeap: cannot select the {backend!r} symmetric-memory backend (current: {current!r}): {exc}"
                        ) from exc

    def _rendezvous(self, t: torch.Tensor) -> Any:  # torch's _SymmetricMemory handle
        symm = self._symm
        assert symm is not None  # not in local mode (its allocations need no rendezvous)
        try:
            return symm.rendezvous(t, self.group_name)
        except Exception as first:
            # older releases needed the group registered explicitly
            enable = getattr(symm, "enable_symm_mem_for_group", None)
            is_enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
            if enable is None or (is_enabled is not None and is_enabled(self.group_name)):
                raise MoonEPUnavailableError(f"TorchSymmHeap: rendezvous failed: {first}") from first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
            try:
                return symm.rendezvous(t, self.group_name)
            except Exception as exc:
                raise MoonEPUnavailableError(f"TorchSymmHeap: rendezvous failed: {exc}") from exc

    def _reserve(self, handle: HeapHandle) -> None:
        # the allocator's call, before the rendezvous (a CUDA OOM here is agreed on by every rank)
        if self._local_mode:
            handle.tensor = torch.empty(handle.shape, dtype=handle.dtype, device=self.device)
            return
        assert self._symm is not None  # not in local mode (returned above)
        symm = self._symm
        # a zero-size allocation still needs a symmetric buffer: use one element
        shape = handle.shape if all(handle.shape) else (1,)
        try:
            base = symm.empty(shape, dtype=handle.dtype, device=self.device)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            # symmetric memory is mapped outside torch's caching allocator, so blocks that
            # allocator keeps free (a load's transients) starve it: hand them back, try once more
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            try:
                base = symm.empty(shape, dtype=handle.dtype, device=self.device)
            except Exception as again:
                if not _is_oom(again):
                    raise
                raise MoonEPUnavailableError(f"{again} ({device_memory_state(self.device)})") from again
            say_once("MoonEP: a symmetric allocation found the GPU full of torch's cached free blocks; "
                     "TorchSymmHeap emptied torch's CUDA cache and retried (it does so on every such failure)",
                     __name__)
        handle._impl = {"base": base}

    def _allocate(self, handle: HeapHandle) -> None:
        if self._local_mode:
            return
        shape = handle.shape if all(handle.shape) else None
        t = handle._impl["base"]
        hdl = self._rendezvous(t)
        el = t.element_size()
        off = getattr(hdl, "offset", None)
        if off is None:  # locate the tensor inside the rendezvoused buffer
            base = hdl.get_buffer(self.rank, (1,), torch.uint8, 0).data_ptr()
            off = t.data_ptr() - base
        if off % el:
            raise MoonEPUnavailableError(f"TorchSymmHeap: allocation offset {off} is not a multiple of the element size {el}")
        mine = hdl.get_buffer(self.rank, tuple(t.shape), handle.dtype, off // el)
        if mine.data_ptr() != t.data_ptr():
            raise MoonEPUnavailableError(
                "TorchSymmHeap: symmetric-memory handle does not map the allocation where expected "
                f"(0x{mine.data_ptr():x} != 0x{t.data_ptr():x}); unsupported torch version?"
            )
        handle.tensor = t if shape else t[:0].view(handle.shape)
        handle._impl = {"hdl": hdl, "base": t, "offset": off // el}

    def _peer_view(self, handle: HeapHandle, rank: int) -> torch.Tensor:
        impl = handle._impl
        if impl is None:  # local mode has no peers (world size 1)
            raise MoonEPUnavailableError("TorchSymmHeap in local mode has no peers")
        base = impl["base"]
        view: torch.Tensor = impl["hdl"].get_buffer(rank, tuple(base.shape), handle.dtype, impl["offset"])
        return view if all(handle.shape) else view[:0].view(handle.shape)

    def _rma_read(self, dst: torch.Tensor, handle: HeapHandle, rank: int, rows: torch.Tensor) -> None:
        # the emulated get (one real node): a copy out of the peer's mapping, no view handed out
        src = self._peer_view(handle, rank)
        torch.index_select(src, 0, rows.to(src.device), out=dst)

    def _barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        self._host_barrier()

    def device_barrier(self, channel: int = 0) -> None:
        """Stream-ordered barrier across ranks through a live allocation's signal pads (hot path)."""
        self._check_open("device_barrier")
        if self._local_mode or self.world_size == 1:
            return
        if not self._live:
            self._barrier()
            return
        self._live[-1]._impl["hdl"].barrier(channel=channel)

    def _free(self, handle: HeapHandle) -> None:
        torch.cuda.synchronize(self.device)
        self._host_barrier()  # no rank still reads the allocation
        handle._impl = None
