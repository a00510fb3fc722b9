"""The symmetric (sharded) weight layout and its heaps.

``SymmetricWeightLayout`` holds one MoE layer's ``E/R`` home experts per rank on a symmetric heap
(``vllm_moonep.engine.heaps``: host, PyTorch symmetric memory, NVSHMEM); logical rows
``[0, E)`` alias the home ranks' memory and prefetch pulls remote experts into local slots.
``SharedSlotPool`` lets every layer of a model share one set of slots.
"""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

from vllm_moonep.engine.heaps import HEAP_KINDS, HeapHandle, HostHeap, SymmetricHeap, make_heap
from vllm_moonep.symmetric.layout import SharedSlotPool, SymmetricWeightLayout, destroy_in_order

__all__ = [
    "HEAP_KINDS",
    "HeapHandle",
    "HostHeap",
    "SharedSlotPool",
    "SymmetricHeap",
    "SymmetricWeightLayout",
    "destroy_in_order",
    "make_heap",
]
