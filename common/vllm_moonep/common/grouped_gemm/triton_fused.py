"""The expert compute in one launch (tile configs with a ``"fused"`` entry): the decode regime.

At decode a step's expert compute is a few microseconds of work per SM, and three launches
(trim, gate/up, down) each pay a ramp and a tail (Qwen3-30B-A3B at 1 token: 2.8 + 20.9 + 12.7 us
for 66 MB of weights, 2.5x the copy-rate floor). This kernel runs the same tiles
(``triton_tiles``) as one persistent launch::

    work list (same in every program, from cu_seqlens; groups with no rows have no items):
      [ A(g, j, m): gate/up of group g, act columns j, row tile m  for every busy g, j < cdiv(I, BN1) ]
      [ B(g, j, m): down of group g, out columns j, row tile m     for every busy g, j < cdiv(H, BN2) ]

    program:  t = next++ (atomic)  while t < items:
        A: the item's rows, gate/up tiles over them -> act; barrier; ready[g] += 1 (release)
        B: wait ready[g] == g's A items (acquire); down tiles -> out; the last row tile writes
           zeros to the segment's tail (ZT)
    last program to leave: ready[:] = 0, next = 0 (the launch leaves its counters as it found them)

Row tiles: with the caller's ends (``HAS_ENDS``, the built-in engine's dispatch) every program knows
each group's rows before it starts, so an item is one ``BM`` row tile and a hot group's rows spread
over many programs; without them the rows end where the item's own trim scan says, so an item runs
all of its group's row tiles for its columns (``m`` is 0). Within a group the row tiles of one column
block are adjacent in the list, so the programs that take them at once share the weight slice
through L2.

Items are taken from one counter in list order, so every A item is taken before any B item,
and only by a program that is running: a B item waits for A items that running programs
finish without waiting themselves. No wait can deadlock, however many programs fit on the GPU
at once (a grid barrier, or a fixed split of items between programs, could).

``TMA1`` and ``TMA2``: the gate/up and down row operands through tensor descriptors. Down's rows
(act) are written by other programs of this launch with ordinary stores, which the tensor
descriptors' loads (the async proxy) do not see through the release/acquire alone: ``FENCE2`` puts
a ``fence.proxy.async.global`` after the writer's stores and after the reader's acquire
(off under the interpreter, which runs no inline PTX and has one proxy).

``SWAP1`` and ``SWAP2``: the gate/up and down tiles' swap-AB (``triton_tiles.mma``), as in three launches;
``W13I1``: the gate/up tiles read gate and up interleaved in one weight (``triton_tiles.gate_up_acc``).

The counters are ``int32 [2 + G]`` (``next``, ``left``, ``ready[G]``), zeroed once per weights
(``prepare_weights``) and restored by each launch, so launches of one weights object must run
in order (one stream, as the layers of a step do); replayed CUDA graphs keep that.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_moonep.common.grouped_gemm.triton_tiles import down_tile, gate_up_tile, pick, rows_end, tile_index, zero_rows

__all__ = ["fused_kernel", "SYNC_WORDS"]

#: counter words before ``ready[G]``: the next work item, the programs that have left
SYNC_WORDS = 2


@triton.jit
def proxy_fence():
    """``fence.proxy.async.global``: orders this thread's view of global memory between the generic proxy (loads,
    stores, atomics) and the async proxy (tensor-descriptor loads), which a release/acquire alone does not."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def fused_kernel(
    x_ptr, rw_ptr, cu_ptr, ends_ptr, tab_ptr, act_ptr, out_ptr, sync_ptr,
    M, G, I, H, stride_xm, stride_am, stride_om,
    s_gn, s_gk, s_un, s_uk, s_dn, s_dk,
    GP2: tl.constexpr, TB: tl.constexpr, ZM: tl.constexpr,
    BM1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_N1: tl.constexpr,
    BM2: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, EVEN_K2: tl.constexpr, EVEN_N2: tl.constexpr,
    DOT_F32: tl.constexpr, SKIP: tl.constexpr, TMA1: tl.constexpr, SWAP1: tl.constexpr, SWAP2: tl.constexpr,
    ZT: tl.constexpr, HAS_ENDS: tl.constexpr, W13I1: tl.constexpr, TMA2: tl.constexpr,
    FENCE2: tl.constexpr,
):
    nprog = tl.num_programs(0)
    gidx = tl.arange(0, GP2)
    gmask = gidx < G
    end = tl.load(cu_ptr + gidx, mask=gmask, other=0).to(tl.int32)
    start = tl.load(cu_ptr + gidx - 1, mask=gmask & (gidx > 0), other=0).to(tl.int32)
    busy = (end > start).to(tl.int32)
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    if HAS_ENDS:  # one item per row tile (the caller's ends, clamped into the segments)
        ends = tl.load(ends_ptr + gidx, mask=gmask, other=0).to(tl.int32)
        ends = tl.minimum(tl.maximum(ends, start), end)
        mb1 = (ends - start + BM1 - 1) // BM1
        mb2 = (ends - start + BM2 - 1) // BM2
        if ZT:  # a busy group with no rows to compute still has its tail zeroed by one B item
            mb2 = tl.maximum(mb2, busy)
    else:  # one item per column block; its rows end where its trim scan says
        ends = end
        mb1 = busy
        mb2 = busy
    items1 = mb1 * n1
    items2 = mb2 * n2
    cum1 = tl.cumsum(items1, 0)
    cum2 = tl.cumsum(items2, 0)
    total1 = tl.sum(items1, 0)
    total = total1 + tl.sum(items2, 0)
    ready = sync_ptr + 2
    wty = tl.pointer_type(x_ptr.dtype.element_ty)
    xd = x_ptr
    if TMA1:  # rows past the group's end load the next group's (never stored), past M zeros
        xd = tl.make_tensor_descriptor(x_ptr, shape=[M, H], strides=[stride_xm, 1], block_shape=[BM1, BK1])
    ad = act_ptr
    if TMA2:  # act rows past the group's end: another group's, maybe being written (their sums never stored)
        ad = tl.make_tensor_descriptor(act_ptr, shape=[M, I], strides=[stride_am, 1], block_shape=[BM2, BK2])
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while t < total:
        if t < total1:
            g = tl.sum((cum1 <= t).to(tl.int32), 0)
            sel = gidx == g
            local = t - pick(sel, cum1 - items1)
            mbg = pick(sel, mb1)
            j = local // mbg
            s = pick(sel, start)
            if HAS_ENDS:
                ee = pick(sel, ends)
                lo = s + (local - j * mbg) * BM1
                hi = tl.minimum(ee, lo + BM1)
            else:
                ee = rows_end(rw_ptr, ends_ptr, g, s, pick(sel, end), TB, False)
                lo = s
                hi = ee
            col0 = j * BN1
            wg = tl.multiple_of(tl.load(tab_ptr + g * 3).to(wty), 16)
            wu = tl.multiple_of(tl.load(tab_ptr + g * 3 + 1).to(wty), 16)
            for row0 in range(lo, hi, BM1):
                rows, rows_ld, cols, cols_ld = tile_index(row0, col0, ee, I, BM1, BN1, EVEN_N1)
                gate_up_tile(x_ptr, rw_ptr, act_ptr, wg, wu, xd, rows, rows_ld, ee, cols, cols_ld, row0, col0,
                             I, H, stride_xm, stride_am, s_gn, s_gk, s_un, s_uk,
                             BM1, BN1, BK1, EVEN_K1, DOT_F32, SKIP, TMA1, False, SWAP1, W13I1)
            tl.debug_barrier()  # every thread's act stores, then one release carries them
            if FENCE2:  # the stores (generic proxy) ordered before the tensor-descriptor reads of them (async proxy)
                proxy_fence()
            tl.atomic_add(ready + g, 1, sem="release", scope="gpu")
        else:
            u = t - total1
            g = tl.sum((cum2 <= u).to(tl.int32), 0)
            sel = gidx == g
            local = u - pick(sel, cum2 - items2)
            mbg = pick(sel, mb2)
            j = local // mbg
            m = local - j * mbg
            s = pick(sel, start)
            en = pick(sel, end)
            if HAS_ENDS:
                ee = pick(sel, ends)
                lo = s + m * BM2
                hi = tl.minimum(ee, lo + BM2)
            else:
                ee = rows_end(rw_ptr, ends_ptr, g, s, en, TB, False)
                lo = s
                hi = ee
            col0 = j * BN2
            wd = tl.multiple_of(tl.load(tab_ptr + g * 3 + 2).to(wty), 16)
            if hi > lo:  # the group's act, every column of every row tile, written by its A items
                need = pick(sel, items1)
                seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
                while seen < need:
                    seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
                if FENCE2:  # what the acquire made visible, visible to this program's tensor-descriptor reads too
                    proxy_fence()
                tl.debug_barrier()
            for row0 in range(lo, hi, BM2):
                rows, rows_ld, cols, cols_ld = tile_index(row0, col0, ee, H, BM2, BN2, EVEN_N2)
                down_tile(act_ptr, rw_ptr, out_ptr, wd, ad, rows, rows_ld, ee, en, cols, cols_ld, row0, col0,
                          H, I, stride_am, stride_om, s_dn, s_dk,
                          BM2, BN2, BK2, EVEN_K2, DOT_F32, SKIP, TMA2, False, SWAP2)
            if ZT:  # the caller reads the segment's tail: zeros there, from the group's last row tile
                if m == mbg - 1:
                    zc = col0 + tl.arange(0, BN2)
                    for z0 in range(tl.minimum(s + tl.cdiv(ee - s, BM2) * BM2, en), en, ZM):
                        zero_rows(out_ptr, z0 + tl.arange(0, ZM), en, zc, H, stride_om, ZM, BN2)
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == nprog - 1:  # every item is done: restore the counters for the next launch
        tl.store(ready + gidx, tl.zeros([GP2], tl.int32), mask=gmask)
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
