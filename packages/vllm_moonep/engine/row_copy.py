"""Expert-row copies driven by slot ids on the device: the prefetch without a host read.

``copy_rows(slot_ids [B] int32, dst [B, ...], src=..., rows_per_source=...)``: for every ``b``
with ``e = slot_ids[b] >= 0``, ``dst[b]`` becomes a bitwise copy of row ``e % rows_per_source`` of
source ``e // rows_per_source``; slots with ``-1`` are untouched. The sources are one tensor (the
replicated layout: its own rows ``[0, E)``) or a device table of addresses (the symmetric layout:
every peer's home rows, read over NVLink). On CUDA one Triton launch does it with no host
synchronization (graph-capturable); on CPU, the slot ids are read on the host and only used
slots move.

``live=(cu_seqlens [E+B], route_weights [NvS], E)`` (the dispatched rows): a slot whose segment
``E+b`` holds only rows of weight 0 is not copied either. Those are padding entries (a padded
step's pad expert, split across ranks by the plan like any hot expert): the expert compute skips
rows of weight 0, so nothing reads that slot, and a decode step no longer pulls a whole remote
expert (88 MB for Kimi-K2) over NVLink to compute zeros. The slot keeps what it held (zeros
from allocation or an earlier expert: finite, so even a compute that multiplies such rows by
their weight 0 gets 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where the kernel is made: CPU-only installs have no Triton
    from vllm_moonep.engine.launch import Launcher

__all__ = ["copy_rows", "address_table", "live_slot_ids"]

_CHUNK = 1 << 16  # elements per work item (one chunk of one slot's row)
_PROGRAMS_PER_SM = 4  # persistent programs per SM
_BLOCK = 4096  # elements per load/store of a chunk, and weights per load of the live check


def address_table(tensors) -> torch.Tensor:
    """Device int64 table of the tensors' addresses (build once, outside graph capture)."""
    tensors = list(tensors)
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


def _kernel():
    import triton
    import triton.language as tl

    global _copy_rows_kernel
    if _copy_rows_kernel is not None:
        return _copy_rows_kernel

    @triton.jit
    def copy_rows_kernel(ids, dst, src, table, rows_per_source, row_elems, n_chunks, B, cu, w, E, n_prog,
                         TABLE: tl.constexpr, LIVE: tl.constexpr, B_PAD: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr):
        """Persistent: every program reads the ``B`` slot ids at once and walks the used slots only;
        chunk ``c`` of the ``j``-th used slot is work item ``j * n_chunks + c``, taken by program
        ``item % n_prog``. (A grid of ``B x chunks`` programs, most of which found their slot
        unused, cost a Kimi-K2 decode step 138 us of empty programs for the two weights at B=192.)"""
        pid = tl.program_id(0)
        bi = tl.arange(0, B_PAD)
        e_all = tl.load(ids + bi, mask=bi < B, other=-1)
        used = e_all >= 0
        n_used = tl.sum(used.to(tl.int32), 0)
        order = tl.cumsum(used.to(tl.int32), 0) - 1
        for j in range(0, n_used):
            pick = used & (order == j)
            b = tl.sum(tl.where(pick, bi, 0), 0)
            e = tl.sum(tl.where(pick, e_all, 0), 0)
            live = 1
            if LIVE:  # a slot whose rows all have weight 0 is not read: no copy (stops at the first live row)
                r0 = tl.load(cu + E + b - 1)
                end = tl.load(cu + E + b)
                r = tl.arange(0, BLOCK)
                live = 0
                while (r0 < end) & (live == 0):
                    v = tl.load(w + r0 + r, mask=r0 + r < end, other=0.0)
                    live = (tl.max(tl.abs(v), 0) > 0.0).to(tl.int32)
                    r0 += BLOCK
            if live != 0:
                owner = e // rows_per_source
                local = (e % rows_per_source).to(tl.int64)
                if TABLE:
                    base = tl.load(table + owner).to(dst.dtype)
                else:
                    base = src + owner.to(tl.int64) * rows_per_source * row_elems
                s = base + local * row_elems
                d = dst + b.to(tl.int64) * row_elems
                o = tl.arange(0, BLOCK)
                first = (pid - (j * n_chunks) % n_prog + n_prog) % n_prog  # this program's first chunk of slot j
                for c in range(first, n_chunks, n_prog):
                    lo = c * CHUNK  # int32: copy_rows bounds row_elems below 2**31 - CHUNK
                    for k in range(0, CHUNK, BLOCK):
                        m = lo + k + o < row_elems
                        tl.store(d + lo + k + o, tl.load(s + lo + k + o, mask=m), mask=m)

    from vllm_moonep.engine.launch import Launcher

    _copy_rows_kernel = Launcher(copy_rows_kernel)
    return _copy_rows_kernel


_copy_rows_kernel: Launcher | None = None


def copy_rows(slot_ids: torch.Tensor, dst: torch.Tensor, *, src: torch.Tensor | None = None,
              table: torch.Tensor | None = None, rows_per_source: int,
              live: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """See the module doc. ``dst`` is ``[B, ...]`` contiguous; ``src`` is ``[N, ...]`` (rows of
    the same shape) or ``table`` holds one address per source; ``live``: skip slots whose rows
    all have weight 0."""
    B = dst.shape[0]
    row_elems = dst[0].numel() if B else 0
    if B == 0 or row_elems == 0:
        return
    if dst.device.type == "cuda":
        import triton

        if row_elems >= 2**31 - _CHUNK:
            raise ValueError(f"copy_rows: a row of {row_elems} elements is beyond the kernel's int32 offsets")
        kern = _kernel()
        n_chunks = triton.cdiv(row_elems, _CHUNK)
        from vllm_moonep.engine.launch import sm_count

        n_prog = max(1, min(B * n_chunks, sm_count(dst.device) * _PROGRAMS_PER_SM))  # persistent
        cu, w, E = live if live is not None else (slot_ids, dst, 0)
        kern((n_prog, 1, 1), slot_ids, dst, src if src is not None else dst, table if table is not None else slot_ids,
             rows_per_source, row_elems, n_chunks, B, cu, w, E, n_prog, TABLE=table is not None,
             LIVE=live is not None, B_PAD=triton.next_power_of_2(B), CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=8)
        return
    used = [(b, e) for b, e in enumerate(live_slot_ids(slot_ids.tolist(), live)) if e >= 0]
    if not used:
        return
    if src is None:
        raise ValueError("copy_rows on CPU needs src (address tables are a device feature)")
    d = torch.tensor([b for b, _ in used], dtype=torch.int64)
    s = torch.tensor([e for _, e in used], dtype=torch.int64)
    dst.index_copy_(0, d, src.reshape((-1,) + tuple(dst.shape[1:])).index_select(0, s))


def live_slot_ids(slots: list[int], live: tuple[torch.Tensor, torch.Tensor, int] | None) -> list[int]:
    """The host's version of the ``live`` rule: ``-1`` for a slot whose rows all have weight 0."""
    if live is None:
        return list(slots)
    cu, w, E = live
    ends = cu.tolist()
    wl = w.detach().abs().cpu()
    out = []
    for b, e in enumerate(slots):
        lo, hi = int(ends[E + b - 1]), int(ends[E + b])
        out.append(e if e >= 0 and hi > lo and bool((wl[lo:hi] > 0).any()) else -1)
    return out
