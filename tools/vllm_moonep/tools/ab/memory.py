"""Memory attribution of ``moonep-ab``: one rank's measured memory against its accounting.

    measure.rank_build -> {accounted (the layouts' own report), measured_resident (process growth),
                           detail: tensors held (torch, heap), host staging, allocator deltas}
      --memory_check--> {measured, accounted, difference, relative, parts: [(cause, bytes)], unexplained,
                       why, fresh_process}
      where they differ by more than common.memory.EXPLAIN_ABOVE, ``why`` names the causes
"""

from __future__ import annotations

from vllm_moonep.common.memory import explain_difference

__all__ = ["WHY_OUTSIDE", "WHY_STAGING", "WHY_TENSORS", "WHY_TORCH_CACHE", "memory_check"]

#: causes of a difference between measured and accounted memory, as the output names them
WHY_TENSORS = "tensors held beyond the accounting"
WHY_STAGING = ("the CPU host heap's private staging copy of every allocation (HostHeap(staging=True) makes "
               "writes visible at barriers; GPU heaps hold one copy)")
WHY_TORCH_CACHE = "torch's CUDA allocator beyond its tensors (block rounding)"
WHY_OUTSIDE = ("device memory outside torch's allocator beyond the heaps' allocations (allocation granularity, "
               "signal pads, NVSHMEM's reserved heap, communication buffers)")


def memory_check(mem: dict, device_kind: str) -> dict:
    """One rank's measured memory against its accounting, with the difference attributed to causes
    (``explain_difference``): tensors the accounting leaves out, the host heap's staging copies,
    and on GPUs the allocators' rounding and memory outside torch's allocator."""
    acc = mem["accounted"]["resident"]
    d = mem.get("detail", {})
    measured = mem["measured_resident"]
    parts = []
    if "tensors_torch" in d:
        parts.append((WHY_TENSORS, d["tensors_torch"] + d["tensors_heap"] - acc))
    if d.get("host_staging"):
        parts.append((WHY_STAGING, d["host_staging"]))
    if device_kind == "cuda" and "torch_reserved_delta" in d:
        reserved = d["torch_reserved_delta"]
        parts.append((WHY_TORCH_CACHE, reserved - d["tensors_torch"]))
        parts.append((WHY_OUTSIDE, measured - reserved - d["tensors_heap"]))
    out = explain_difference(measured, acc, parts)
    out["fresh_process"] = d.get("fresh_process", False)
    return out
