"""Expert-weight memory: one accounting for both layouts, used by the layouts' reports and by
the projection mode for full-size models (so the two can never disagree), plus measured figures.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

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
