"""The expert compute in one launch with down split by activation columns (a ``"fused"`` entry with
``"split": true``): decode without the wait between gate/up and down.

The one launch of ``triton_fused`` runs two streaming phases in series: every gate/up item of a group
before any of its down items (down reads every activation column). At decode each phase is a few tens
of MB read by a few hundred programs, and each pays a ramp and a tail of ~7 us beyond its bytes at the
copy rate (docs/PERFORMANCE.md, what limits the expert compute). Down is linear in the activation
columns, so an item that computed columns ``j`` of ``act`` can run its share of down at once::

    work list (same in every program, from cu_seqlens; groups with no rows have no items):
      [ (g, j, m): group g, act columns j (BN1 of I), row tile m  for every busy g, j < cdiv(I, BN1) ]

    program:  t = next++ (atomic)  while t < items:
        gate/up tile over the rows -> act[rows, j] (registers, bf16: what three launches store)
        for each BN2 block n of H:  acc[rows, n] += act[rows, j] @ down_g[n, j]^T   (float32 atomics)
        done[tile] += 1 (acq_rel); the item that completes the row tile (the cdiv(I, BN1)-th):
            out[rows] = acc[rows] (bf16), acc[rows] = 0; the group's last row tile writes zeros to
            the segment's tail (ZT); done[tile] = 0
    last program to leave: next = 0, left = 0 (the launch leaves its counters as it found them)

One streaming phase: every item reads its gate/up slice (``2 BN1 x H``) and its down slice (``H x BN1``)
and no item waits for another. The cost is the float32 sums: each live row's ``H`` outputs are added
``cdiv(I, BN1)`` times (atomics at L2: at decode a few MB), then read once and written as bf16. Rows
with weight 0 (padding inside a segment, and rows past the group's end) add nothing.

The sums are taken in the order the items finish, so the output is not bitwise the same from run to
run (float32 sums of ``cdiv(I, BN1)`` partials, rounded to bf16 once: within one bf16 rounding of the
three launches' output, which sums in a fixed order).

``acc`` (``float32 [NvS, H]``) and the counters (``int32 [2 + tiles]``) are at rest at zero between
launches: the item that completes a row tile clears its rows of ``acc`` and its counter, the last
program the two work counters. Both are per device and size (``triton_kernels._split_scratch``), shared
by every layer, so one device's expert compute runs in stream order (the layers of a step do; replayed
CUDA graphs keep that).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_moonep.common.grouped_gemm.triton_tiles import (acc_out, acc_zeros, gate_up_acc, mma, pick, rows_end,
                                                          tile_index, zero_rows)

__all__ = ["split_kernel", "SPLIT_SYNC_WORDS", "split_tiles"]

#: counter words before ``done[tiles]``: the next work item, the programs that have left
SPLIT_SYNC_WORDS = 2


def split_tiles(rows: int, groups: int, bm: int) -> int:
    """An upper bound on the row tiles of a launch over ``rows`` rows in ``groups`` groups (``BM`` rows per tile,
    a group's last tile partial): the counters ``done`` needs."""
    return -(-rows // bm) + groups


@triton.jit
def split_kernel(
    x_ptr, rw_ptr, cu_ptr, ends_ptr, tab_ptr, out_ptr, acc_ptr, sync_ptr,
    M, G, I, H, stride_xm, stride_om,
    s_gn, s_gk, s_un, s_uk, s_dn, s_dk,
    GP2: tl.constexpr, TB: tl.constexpr, ZM: tl.constexpr,
    BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_N1: tl.constexpr,
    BN2: tl.constexpr, EVEN_N2: tl.constexpr,
    DOT_F32: tl.constexpr, SKIP: tl.constexpr, TMA1: tl.constexpr, SWAP1: tl.constexpr, SWAP2: tl.constexpr,
    ZT: tl.constexpr, HAS_ENDS: tl.constexpr, W13I1: tl.constexpr,
):
    nprog = tl.num_programs(0)
    gidx = tl.arange(0, GP2)
    gmask = gidx < G
    end = tl.load(cu_ptr + gidx, mask=gmask, other=0).to(tl.int32)
    start = tl.load(cu_ptr + gidx - 1, mask=gmask & (gidx > 0), other=0).to(tl.int32)
    busy = (end > start).to(tl.int32)
    n1 = tl.cdiv(I, BN1)
    if HAS_ENDS:  # one item per row tile and column block (the caller's ends, clamped into the segments)
        ends = tl.load(ends_ptr + gidx, mask=gmask, other=0).to(tl.int32)
        ends = tl.minimum(tl.maximum(ends, start), end)
        mb = (ends - start + BM - 1) // BM
        if ZT:  # a busy group with no rows to compute still has its tail zeroed, by its one row tile's items
            mb = tl.maximum(mb, busy)
    else:  # one item per column block; its rows end where its trim scan says
        ends = end
        mb = busy
    cum_mb = tl.cumsum(mb, 0)
    items = mb * n1
    cum = tl.cumsum(items, 0)
    total = tl.sum(items, 0)
    done = sync_ptr + 2
    wty = tl.pointer_type(x_ptr.dtype.element_ty)
    xd = x_ptr
    if TMA1:  # rows past the group's end load the next group's (never added), past M zeros
        xd = tl.make_tensor_descriptor(x_ptr, shape=[M, H], strides=[stride_xm, 1], block_shape=[BM, BK1])
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while t < total:
        g = tl.sum((cum <= t).to(tl.int32), 0)
        sel = gidx == g
        local = t - pick(sel, cum - items)
        mbg = pick(sel, mb)
        j = local // mbg
        m = local - j * mbg
        s = pick(sel, start)
        en = pick(sel, end)
        if HAS_ENDS:
            ee = pick(sel, ends)
            lo = s + m * BM
            hi = tl.minimum(ee, lo + BM)
        else:
            ee = rows_end(rw_ptr, ends_ptr, g, s, en, TB, False)
            lo = s
            hi = ee
        col0 = j * BN1
        wg = tl.multiple_of(tl.load(tab_ptr + g * 3).to(wty), 16)
        wu = tl.multiple_of(tl.load(tab_ptr + g * 3 + 1).to(wty), 16)
        wd = tl.multiple_of(tl.load(tab_ptr + g * 3 + 2).to(wty), 16)
        kk = col0 + tl.arange(0, BN1)  # the act columns: down's reduction columns of this item
        if EVEN_N1:  # unclamped: the loads stay contiguous (vectorized, asynchronous)
            kk_ld = kk
        else:
            kk_ld = tl.minimum(kk, I - 1)
        for row0 in range(lo, hi, BM):
            rows, rows_ld, cols, cols_ld = tile_index(row0, col0, ee, I, BM, BN1, EVEN_N1)
            acc_g, acc_u = gate_up_acc(x_ptr, rw_ptr, wg, wu, xd, rows, rows_ld, ee, cols_ld, row0, col0, 0, H,
                                       I, H, stride_xm, s_gn, s_gk, s_un, s_uk, BM, BN1, BK1, EVEN_K1, DOT_F32, SKIP,
                                       TMA1, False, SWAP1, W13I1)
            rw = tl.load(rw_ptr + rows_ld)
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * rw[:, None]
            if not EVEN_N1:  # columns past I hold a clamped column's values: no share of down
                act = tl.where((cols < I)[None, :], act, 0.0)
            act = act.to(x_ptr.dtype.element_ty)  # the activation dtype, as three launches store it
            add = (rows < ee) & (rw != 0.0)  # weight-0 rows add 0: no atomics for them
            if tl.max(add.to(tl.int32), 0) > 0:
                for n0 in tl.range(0, H, BN2):
                    nn = n0 + tl.arange(0, BN2)
                    if EVEN_N2:
                        nn_ld = nn
                    else:
                        nn_ld = tl.minimum(nn, H - 1)
                    d_ptrs = wd + nn_ld[:, None] * s_dn + kk_ld[None, :] * s_dk
                    if EVEN_N1:
                        wdb = tl.load(d_ptrs)
                    else:
                        wdb = tl.load(d_ptrs, mask=(kk < I)[None, :], other=0.0)
                    part = acc_out(mma(act, wdb, acc_zeros(BM, BN2, SWAP2), DOT_F32, SWAP2), SWAP2)
                    a_ptrs = acc_ptr + rows.to(tl.int64)[:, None] * H + nn[None, :]
                    if EVEN_N2:
                        amask = add[:, None]
                    else:
                        amask = add[:, None] & (nn < H)[None, :]
                    tl.atomic_add(a_ptrs, part, mask=amask, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # every thread's sums, then one acq_rel carries them
        key = pick(sel, cum_mb - mb) + m
        c = tl.atomic_add(done + key, 1, sem="acq_rel", scope="gpu")
        if c == n1 - 1:  # this item completed the row tile: its rows' sums are final
            if HAS_ENDS:
                f_hi = tl.minimum(en, lo + BM)  # rows past ee within the tile are written as 0
            else:
                f_hi = tl.minimum(en, s + tl.cdiv(ee - s, BM) * BM)
            for r0 in range(lo, f_hi, BM):
                fr = r0 + tl.arange(0, BM)
                live_r = fr < ee
                for n0 in tl.range(0, H, BN2):
                    nn = n0 + tl.arange(0, BN2)
                    a_ptrs = acc_ptr + fr.to(tl.int64)[:, None] * H + nn[None, :]
                    lmask = live_r[:, None] & (nn < H)[None, :]
                    v = tl.load(a_ptrs, mask=lmask, other=0.0, cache_modifier=".cg")
                    o_ptrs = out_ptr + fr.to(tl.int64)[:, None] * stride_om + nn[None, :]
                    tl.store(o_ptrs, v.to(out_ptr.dtype.element_ty), mask=(fr < f_hi)[:, None] & (nn < H)[None, :])
                    tl.store(a_ptrs, tl.zeros((BM, BN2), dtype=tl.float32), mask=lmask)
            if ZT:  # the caller reads the segment's tail: zeros there, from the group's last row tile
                if m == mbg - 1:
                    for z0 in range(tl.minimum(s + tl.cdiv(ee - s, BM) * BM, en), en, ZM):
                        for n0 in range(0, H, BN2):
                            zero_rows(out_ptr, z0 + tl.arange(0, ZM), en, n0 + tl.arange(0, BN2), H, stride_om, ZM,
                                      BN2)
            tl.store(done + key, 0)
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == nprog - 1:  # every item is done: restore the work counters for the next launch
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
