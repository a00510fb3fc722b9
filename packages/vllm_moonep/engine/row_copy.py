"""Expert-row copies driven by slot ids on the device: the prefetch without a host read.

``copy_rows(slot_ids [B] int32, dst [B, ...], src=..., rows_per_source=...)``: for every ``b``
with ``e = slot_ids[b] >= 0``, ``dst[b]`` becomes a bitwise copy of row ``e % rows_per_source`` of
source ``e // rows_per_source``; slots with ``-1`` are untouched. The sources are one tensor (the
replicated layout: its own rows ``[0, E)``) or a device table of addresses (the symmetric layout:
every peer's home rows, read over NVLink). Several ``dst`` (planes: a layer's w13 and w2, or
gate, up and down) take the same slot ids in one call. On CUDA one Triton launch does all
planes with no host synchronization (graph-capturable); on CPU, the slot ids are read on the
host and only used slots move.

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

__all__ = ["MAX_PLANES", "copy_rows", "address_table", "live_slot_ids"]

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

    global _copy_rows_kernel, copy_chunk  # a @jit helper must be a module global (the kernel resolves it there)
    if _copy_rows_kernel is not None:
        return _copy_rows_kernel

    @triton.jit
    def copy_chunk(dst, src, table, owner, local, rows_per_source, b, row_elems, c,
                   TABLE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Chunk ``c`` of one plane's row: slot ``b`` <- row ``local`` of source ``owner``."""
        if TABLE:
            base = tl.load(table + owner).to(dst.dtype)
        else:
            base = src + owner.to(tl.int64) * rows_per_source * row_elems
        s = base + local * row_elems
        d = dst + b.to(tl.int64) * row_elems
        o = tl.arange(0, BLOCK)
        lo = c * CHUNK  # int32: copy_rows bounds row_elems below 2**31 - CHUNK
        for k in range(0, CHUNK, BLOCK):
            m = lo + k + o < row_elems
            tl.store(d + lo + k + o, tl.load(s + lo + k + o, mask=m), mask=m)

    @triton.jit
    def copy_rows_kernel(ids, dst0, dst1, dst2, src0, src1, src2, tab0, tab1, tab2, elems0, elems1, elems2,
                         chunks0, chunks1, chunks2, rows_per_source, B, cu, w, E, n_prog,
                         PLANES: tl.constexpr, TABLE: tl.constexpr, LIVE: tl.constexpr, B_PAD: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Persistent: every program reads the ``B`` slot ids at once and walks the used slots only;
        a used slot's chunks run over its ``PLANES`` rows in turn (plane 0's, then 1's, then 2's),
        and chunk ``c`` of the ``j``-th used slot is work item ``j * chunks + c``, taken by program
        ``item % n_prog``. (A grid of ``B x chunks`` programs, most of which found their slot
        unused, cost a Kimi-K2 decode step 138 us of empty programs for the two weights at B=192;
        one launch per plane cost ~2 us each with nothing to copy.)"""
        pid = tl.program_id(0)
        bi = tl.arange(0, B_PAD)
        e_all = tl.load(ids + bi, mask=bi < B, other=-1)
        used = e_all >= 0
        n_used = tl.sum(used.to(tl.int32), 0)
        order = tl.cumsum(used.to(tl.int32), 0) - 1
        n_chunks = chunks0 + chunks1 + chunks2  # the unused planes have 0
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
                first = (pid - (j * n_chunks) % n_prog + n_prog) % n_prog  # this program's first chunk of slot j
                for c in range(first, n_chunks, n_prog):
                    if c < chunks0:
                        copy_chunk(dst0, src0, tab0, owner, local, rows_per_source, b, elems0, c, TABLE, CHUNK, BLOCK)
                    elif PLANES > 1:
                        if c < chunks0 + chunks1:
                            copy_chunk(dst1, src1, tab1, owner, local, rows_per_source, b, elems1, c - chunks0,
                                       TABLE, CHUNK, BLOCK)
                        elif PLANES > 2:
                            copy_chunk(dst2, src2, tab2, owner, local, rows_per_source, b, elems2,
                                       c - chunks0 - chunks1, TABLE, CHUNK, BLOCK)

    from vllm_moonep.engine.launch import Launcher

    _copy_rows_kernel = Launcher(copy_rows_kernel)
    return _copy_rows_kernel


_copy_rows_kernel: Launcher | None = None


#: planes (tensors sharing the slot ids) one launch copies
MAX_PLANES = 3


def copy_rows(slot_ids: torch.Tensor, dst, *, src=None, table=None, rows_per_source: int,
              live: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """See the module doc. ``dst`` is ``[B, ...]`` contiguous, or a list of up to ``MAX_PLANES``
    such tensors (planes: e.g. w13 and w2) that take the same slot ids, copied in one launch;
    ``src`` is ``[N, ...]`` (rows of the same shape), or ``table`` holds one address per source (a
    list of either, one per plane); ``live``: skip slots whose rows all have weight 0."""
    dsts = list(dst) if isinstance(dst, (list, tuple)) else [dst]
    srcs = list(src) if isinstance(src, (list, tuple)) else [src] * len(dsts)
    tabs = list(table) if isinstance(table, (list, tuple)) else [table] * len(dsts)
    if not 1 <= len(dsts) <= MAX_PLANES or len(srcs) != len(dsts) or len(tabs) != len(dsts):
        raise ValueError(f"copy_rows: 1 to {MAX_PLANES} planes, with one src or table each "
                         f"(got {len(dsts)} dst, {len(srcs)} src, {len(tabs)} table)")
    B = dsts[0].shape[0]
    if any(d.shape[0] != B for d in dsts):
        raise ValueError(f"copy_rows: every plane needs the same slot count, got {[d.shape[0] for d in dsts]}")
    planes = [(d, s_, t) for d, s_, t in zip(dsts, srcs, tabs) if B and d[0].numel()]
    if not planes:
        return
    if planes[0][0].device.type == "cuda":
        import triton

        # the kernel reads the slot ids (and the live rule's tables) by raw pointer as dense
        # vectors: a strided view (a column of a transposed plan) would be read as other slots' ids
        slot_ids = slot_ids.contiguous()
        if live is not None:
            live = (live[0].contiguous(), live[1].contiguous(), live[2])

        from vllm_moonep.engine.launch import sm_count

        elems = [d[0].numel() for d, _, _ in planes]
        if max(elems) >= 2**31 - _CHUNK:
            raise ValueError(f"copy_rows: a row of {max(elems)} elements is beyond the kernel's int32 offsets")
        use_table = planes[0][2] is not None
        if any((t is not None) != use_table or (t is None and s_ is None) for _, s_, t in planes):
            raise ValueError("copy_rows: every plane needs a src, or every plane a table")
        kern = _kernel()
        chunks = [triton.cdiv(n, _CHUNK) for n in elems]
        n_prog = max(1, min(B * sum(chunks), sm_count(dsts[0].device) * _PROGRAMS_PER_SM))  # persistent
        cu, w, E = live if live is not None else (slot_ids, planes[0][0], 0)
        pad = 3 - len(planes)  # unused planes: any valid pointer, 0 elements, 0 chunks (never read)
        d_args = [d for d, _, _ in planes] + [planes[0][0]] * pad
        s_args = [s_ if s_ is not None else d for d, s_, _ in planes] + [planes[0][0]] * pad
        t_args = [t if t is not None else slot_ids for _, _, t in planes] + [slot_ids] * pad
        kern((n_prog, 1, 1), slot_ids, *d_args, *s_args, *t_args, *(elems + [0] * pad), *(chunks + [0] * pad),
             rows_per_source, B, cu, w, E, n_prog, PLANES=len(planes), TABLE=use_table, LIVE=live is not None,
             B_PAD=triton.next_power_of_2(B), CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=8)
        return
    used = [(b, e) for b, e in enumerate(live_slot_ids(slot_ids.tolist(), live)) if e >= 0]
    if not used:
        return
    if any(s_ is None for _, s_, _ in planes):
        raise ValueError("copy_rows on CPU needs src (address tables are a device feature)")
    d = torch.tensor([b for b, _ in used], dtype=torch.int64)
    s = torch.tensor([e for _, e in used], dtype=torch.int64)
    for dt, sr, _ in planes:
        dt.index_copy_(0, d, sr.reshape((-1,) + tuple(dt.shape[1:])).index_select(0, s))


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
