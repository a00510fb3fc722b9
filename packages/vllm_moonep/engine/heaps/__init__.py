"""Symmetric heaps: one small interface (``base.SymmetricHeap``), three implementations.

- ``HostHeap`` (``"host"``): ``/dev/shm`` files shared by CPU ranks of one machine; tests, demo.
- ``TorchSymmHeap`` (``"torch"``): PyTorch symmetric memory, CUDA backend, GPUs of one node.
- ``NvshmemHeap`` (``"nvshmem"``): NVSHMEM via nvshmem4py (optional), imported lazily.

``make_heap(kind="auto", group=None, device=...)``: ``auto`` is ``host`` for a CPU device and
``torch`` for a CUDA one. Multicast is never used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_moonep.engine.errors import MoonEPInputError
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap
from vllm_moonep.engine.heaps.host import HostHeap

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers and editors
    from torch.distributed import ProcessGroup

    from vllm_moonep.engine.heaps.nvshmem_heap import NvshmemHeap
    from vllm_moonep.engine.heaps.torch_symm import TorchSymmHeap

HEAP_KINDS = ("auto", "host", "torch", "nvshmem")

__all__ = ["HEAP_KINDS", "HeapHandle", "HostHeap", "NvshmemHeap", "SymmetricHeap", "TorchSymmHeap", "make_heap"]


def __getattr__(name: str) -> type[SymmetricHeap]:  # lazy: the GPU heaps import their backends only when used
    if name == "TorchSymmHeap":
        from vllm_moonep.engine.heaps.torch_symm import TorchSymmHeap

        return TorchSymmHeap
    if name == "NvshmemHeap":
        from vllm_moonep.engine.heaps.nvshmem_heap import NvshmemHeap

        return NvshmemHeap
    raise AttributeError(name)


def resolve_heap_kind(kind: str, device: torch.device | str | None) -> str:
    if kind not in HEAP_KINDS:
        raise MoonEPInputError(f"heap kind must be one of {HEAP_KINDS}, got {kind!r}")
    if kind != "auto":
        return kind
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "torch" if dev.type == "cuda" else "host"


def make_heap(
    kind: str = "auto", group: ProcessGroup | None = None, device: torch.device | str | None = None, **kwargs: Any
) -> SymmetricHeap:
    """A heap of ``kind`` over ``group`` (collective). Extra keywords go to the heap class."""
    which = resolve_heap_kind(kind, device)
    if which == "host":
        return HostHeap(group, device=device or "cpu", **kwargs)
    if which == "torch":
        from vllm_moonep.engine.heaps.torch_symm import TorchSymmHeap

        return TorchSymmHeap(group, device, **kwargs)
    from vllm_moonep.engine.heaps.nvshmem_heap import NvshmemHeap

    return NvshmemHeap(group, device, **kwargs)
