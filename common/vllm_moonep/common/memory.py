"""Expert-weight memory: one accounting for both layouts, used by the layouts' reports and by
the projection mode for full-size models (so the two can never disagree), and the measuring that
checks the accounting against what a process really holds (``resident_bytes`` after
``release_freed_memory``, ``held_tensor_bytes``, ``explain_difference``; ``moonep-ab`` measures
every configuration in fresh rank processes).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

KINDS = ("home_rows", "replicated_rows", "slots", "transient")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of expert weights one rank holds, by kind.

    - ``home_rows``: the rank's own experts (``E/R`` per layer), held once.
    - ``replicated_rows``: copies of experts in a replicated ``[0, E)`` block (the PoC layout).
    - ``slots``: prefetch slot rows.
    - ``transient``: the peak extra held only while loading (all-gather or adoption buffers).
    ``resident`` is what stays allocated while serving.
    """

    home_rows: int = 0
    replicated_rows: int = 0
    slots: int = 0
    transient: int = 0

    @property
    def resident(self) -> int:
        return self.home_rows + self.replicated_rows + self.slots

    def __add__(self, other: "MemoryReport") -> "MemoryReport":
        return MemoryReport(
            self.home_rows + other.home_rows,
            self.replicated_rows + other.replicated_rows,
            self.slots + other.slots,
            max(self.transient, other.transient),  # layers load one at a time
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["resident"] = self.resident
        return d


def expert_bytes(hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """One expert: gate and up ``[I, H]``, down ``[H, I]``."""
    return 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()


def replicated_accounting(E: int, R: int, B: int, H: int, I: int, *, layers: int = 1,
                          dtype: torch.dtype = torch.bfloat16, keeps_local_params: bool = True) -> MemoryReport:
    """The PoC layout: each layer holds ``[E+B]`` rows on every rank (all-gathered at load).

    With ``keeps_local_params`` the framework's own ``[E/R]`` parameters stay allocated beside
    the copy (as in vLLM 0.33's PoC). The load-time transient is one layer's all-gather output.
    """
    bpe = expert_bytes(H, I, dtype)
    return MemoryReport(
        home_rows=layers * (E // R) * bpe if keeps_local_params else 0,
        replicated_rows=layers * E * bpe,
        slots=layers * B * bpe,
        transient=E * bpe,
    )


def symmetric_accounting(E: int, R: int, B: int, H: int, I: int, *, layers: int = 1,
                         dtype: torch.dtype = torch.bfloat16, shared_slot_pool: bool = False) -> MemoryReport:
    """The sharded layout: each layer's ``E/R`` home rows once, on the heap (the parameters
    become views of them); ``B`` slots per layer, or one pool of ``B`` for all layers. The
    load-time transient is one layer's home rows while they are adopted."""
    bpe = expert_bytes(H, I, dtype)
    epn = E // R
    return MemoryReport(
        home_rows=layers * epn * bpe,
        replicated_rows=0,
        slots=(B if shared_slot_pool else layers * B) * bpe,
        transient=epn * bpe,
    )


def measured_bytes(device: torch.device | str) -> dict:
    """What the process holds now: CUDA allocator statistics on GPU, RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            # the whole device, so allocations outside torch's caching allocator count too
            # (PyTorch symmetric memory and NVSHMEM have their own)
            "device_used": total - free,
        }
    rss = 0
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return {"rss": rss}


# ----------------------------------------------------------------------------- measuring
# What a configuration really holds is measured in a fresh process (``moonep-ab`` spawns one
# per configuration): the baseline after start-up (torch, the process group, warm-ups), the
# figure again after building, each after ``release_freed_memory``. On CPU that is the resident
# set (RSS); on CUDA the device memory in use (``mem_get_info``, device-wide, so the symmetric
# heaps' allocations outside torch's caching allocator count too).

MiB = 2**20
#: |measured - accounted| / accounted above which the output explains the difference
EXPLAIN_ABOVE = 0.10
UNATTRIBUTED = "not attributed (allocator and page overhead, Python objects, communication buffers)"

_libc: Any = None  # ctypes.CDLL once loaded; False without glibc (the AttributeError below is caught)


def _malloc_trim() -> None:
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        _libc = False  # not glibc: nothing to trim


def release_freed_memory(device: torch.device | str) -> None:
    """Give memory that is free but still held back before a measurement: Python garbage, glibc's
    free lists (``malloc_trim``) and, on CUDA, torch's cached blocks (after a synchronize)."""
    import gc

    gc.collect()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    if _libc is not False:
        _malloc_trim()


def resident_bytes(device: torch.device | str) -> int:
    """What this process holds now: RSS on CPU; on CUDA the device's memory in use (every
    allocation on it, torch's or not). Call ``release_freed_memory`` first."""
    m = measured_bytes(device)
    return int(m["device_used"] if "device_used" in m else m["rss"])


def reset_peak(device: torch.device | str) -> bool:
    """Start a new peak: ``VmHWM`` on CPU (``/proc/self/clear_refs``), torch's peak statistics on
    CUDA. Returns whether it could (a kernel that refuses ``clear_refs`` leaves ``VmHWM`` at the
    process's lifetime peak, which a caller must not read as the peak since this call)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss() -> int | None:
    """The process's peak RSS since start or ``reset_peak`` (``VmHWM``), else ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def held_tensor_bytes(*objs) -> dict:
    """Bytes of the distinct storages that ``objs`` hold directly, looked up one attribute deep:
    tensors, tensors in tuples/lists (named tuples too) and symmetric-heap allocations (objects
    with ``tensor`` and ``nbytes``: ``HeapHandle``). Returns ``{"torch": ..., "heap": ...,
    "heap_allocations": n}`` (``heap``: bytes of heap allocations, which live outside torch's
    caching allocator on GPUs). Peer views and nested objects are not followed."""
    seen: set = set()
    out = {"torch": 0, "heap": 0, "heap_allocations": 0}

    def add_tensor(t: torch.Tensor, kind: str) -> None:
        st = t.untyped_storage()
        key = (t.device.type, t.device.index, st.data_ptr())
        if key in seen or st.nbytes() == 0:
            return
        seen.add(key)
        out[kind] += st.nbytes()

    def add_handle(h) -> None:
        if getattr(h, "freed", False) or getattr(h, "tensor", None) is None:
            return
        key = ("handle", id(h))
        if key in seen:
            return
        seen.add(key)
        # the allocation's bytes (a zero-size tensor stands for an empty allocation)
        out["heap"] += int(h.nbytes)
        out["heap_allocations"] += 1
        st = h.tensor.untyped_storage()
        seen.add((h.tensor.device.type, h.tensor.device.index, st.data_ptr()))

    def visit(v, kind_default: str = "torch", depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            add_tensor(v, kind_default)
        elif hasattr(v, "tensor") and hasattr(v, "nbytes") and hasattr(v, "heap_id"):
            add_handle(v)
        elif isinstance(v, (tuple, list)) and depth < 2:
            for x in v:
                visit(x, kind_default, depth + 1)

    # heap allocations first, so tensors aliasing them (adopted parameters) are not counted twice
    for obj in objs:
        for v in (vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor) else [obj]):
            if hasattr(v, "heap_id"):
                add_handle(v)
    for obj in objs:
        if isinstance(obj, (torch.Tensor, tuple, list)):
            visit(obj)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                visit(v, depth=1)
    return out


def explain_difference(measured: int, accounted: int, parts: list[tuple[str, int]], *,
                       above: float = EXPLAIN_ABOVE, floor: int = 64 * 1024) -> dict:
    """Measured against accounted bytes. ``parts``: ``(cause, bytes)`` the measurement holds beyond
    the accounting (negative: less). Returns the figures, the parts that matter, what they leave
    unexplained, and ``why``: a sentence when ``|measured - accounted|`` exceeds ``above`` of the
    accounted bytes (``None`` otherwise)."""
    diff = int(measured) - int(accounted)
    rel = diff / accounted if accounted else (float("inf") if diff else 0.0)
    listed = [(c, int(b)) for c, b in parts if abs(int(b)) >= max(floor, 0.005 * max(accounted, 0))]
    unexplained = diff - sum(int(b) for _, b in parts)
    why = None
    if abs(diff) > above * max(accounted, 0) and abs(diff) >= floor:
        pieces = [f"{c} {b / MiB:+.1f} MiB" for c, b in listed]
        if abs(unexplained) >= max(floor, 0.005 * max(accounted, 0)) or not pieces:
            pieces.append(f"{UNATTRIBUTED} {unexplained / MiB:+.1f} MiB")
        why = (f"measured {measured / MiB:.1f} MiB vs accounted {accounted / MiB:.1f} MiB "
               f"({'%+.0f%%' % (100 * rel) if accounted else 'nothing accounted'}): " + "; ".join(pieces))
    return {"measured": int(measured), "accounted": int(accounted), "difference": diff, "relative": rel,
            "parts": listed, "unexplained": unexplained, "why": why}
