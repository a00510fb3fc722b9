"""The MoonEP planner on the device: the host planner's plan, bit for bit, with no host sync.

Why: the engine plans on the host, which costs a device->host read of ``tpe[R, E]`` (a stream
sync) every step and keeps the step out of a CUDA graph. ``DevicePlanner`` computes the same
``GlobalPlan`` (rules 1-5 of ``docs/CONTRACT.md``, as ``planner.plan_global`` and
``planner.place_entries`` transcribe them) from a device tensor, in Triton kernels.

Contract:

- ``plan(tpe_all)`` gives exactly the values and dtypes of ``plan_global(tpe_all.cpu(), ...)``
  (every field; ``experts_to_copy`` int32, the rest int64) for non-negative counts whose total
  is at most the contract's R*S*K, and beyond it up to the width's limit: below 2**31 in int64,
  and, in the int32 arithmetic the planner picks where ``narrow_fits`` (Kimi-K2 at R=8 up to
  S=8192), while the padded rows packed with an index stay below ``NARROW_LIMIT``. It repeats
  the host's arithmetic, so counts that do not sum to S*K per rank give the host's plan too.
- ``place(gp, rank, ids)`` gives exactly ``place_entries(gp, rank, ids)`` whenever ``gp.tpe[rank]``
  is the bincount of ``ids`` (the contract's input; the host function then computes the same
  within-rank ordinal). Ids outside ``[0, E)`` are never dereferenced: their dest and row are -1,
  and they shift no other entry's ordinal.
- No host synchronization: no ``.item()``, no data-dependent shapes, no syncing torch ops. Loop
  bounds that depend on data are device-side ``while`` conditions inside a kernel.
- CUDA-graph capturable: a fixed sequence of launches (1 for ``plan``, 1 or 2 for ``place``) writing
  into tensors preallocated in ``__init__`` (the returned tensors are overwritten by the next
  call). Call each method once before capturing (Triton compiles on first use).

Kernels::

    tpe_all [R,E] ──► _plan_kernel, grid R; program d runs rules 1-3 (identical in every
                      program) and rule 4 for destination d, all in registers (the symmetric
                      transport's launch first exchanges the counts: put to d, wait for all):
                        rule 1  counts [R_P,EPN_P], balances; also ordinal_base[d,:], tpe[d,:]
                        rule 2  quotas z[h,u] by the argmax/argmin loop           [R_P,R_P]
                        rule 3  every home splits its quotas over its experts; only column d
                                is kept -> alloc[:,d], cum_alloc[:,d]            [R_P,EPN_P]
                        rule 4  remote experts of d (all from one home, see the kernel), in
                                (alloc, e) order: one sort of their keys (above RULE4_SORT_ABOVE
                                experts per rank) or, per expert, the number ahead by pairwise
                                compare; the first B -> experts_to_copy[d], seg_len[d],
                                cu_seqlens[d], row_base[:,d]
    ids [S,K] ──► (only above DIRECT_MAX_SUBBLOCKS sub-blocks; below, place_direct compares each
                  entry with the earlier entries directly, [SB,SB] at a time, in _place_kernel or
                  inside the symmetric transport's dispatch_rows kernel)
              ──► _hist_kernel, grid n/CH: per chunk of CH=KS*SB entries, per-expert counts of
                  the chunk (tot[c,:]) and of its sub-blocks before each sub-block (exs[c*KS+k,:])
              ──► _place_kernel, grid n/SB, one sub-block of SB entries (rule 5):
                    ordinal = ordinal_base[rank,e] + sum_{c'<c} tot[c',e] + exs[s,e]
                              + earlier same-expert entries in the sub-block ([SB,SB] compare)
                    dest = #{d : cum_alloc[e,d] <= ordinal}; row = row_base[e,dest] + ordinal
                           - cum_alloc[e,dest-1]

Every program of ``_plan_kernel`` runs rules 1-3 itself (they are small and identical), so the
plan needs one launch and no grid-wide barrier; each program keeps only its own column of
``alloc``. The rounds of rules 2-3 are chains of reductions (latency, not work), so each argmax
with its index is one reduction over packed ``value * 2**k + index`` words. Tiles are padded to
powers of two and masked. No kernel reads what another thread of its launch wrote.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vllm_moonep.engine.defaults import resolve_device
from vllm_moonep.engine.launch import Launcher
from vllm_moonep.engine.planning.planner import GlobalPlan
from vllm_moonep.engine.signals import exchange_counts

__all__ = ["DIRECT_MAX_SUBBLOCKS", "NARROW_LIMIT", "RULE4_SORT_ABOVE", "DevicePlanner", "narrow_fits"]

#: place without the histogram kernel up to this many sub-blocks of 128 entries (S*K <= 1024):
#: each program then compares its entries with at most this many earlier sub-blocks
DIRECT_MAX_SUBBLOCKS = 8
#: rule 4 orders slots by a sort above this many experts per rank (padded), by pairwise compare at
#: or below it (H200, plan kernel: E/R=48 sorted 26.7 us, pairwise 32.3; E/R=192 10.4 against 32.8)
RULE4_SORT_ABOVE = 32


#: the plan kernel computes in int32 when every value it forms stays below this (in magnitude);
#: its sentinels are +-NARROW_LIMIT
NARROW_LIMIT = 2**30


def narrow_fits(R: int, E: int, S: int, K: int, B: int, token_padding: int) -> bool:
    """Whether the plan kernel's int32 arithmetic is exact for the contract's input (counts summing
    to ``S*K`` per rank): the largest value it forms is a padded row total (at most ``R*S*K`` rows
    plus ``token_padding`` per segment of ``E+B``) packed with an index of up to ``2*max(R_P, EPN_P)``."""
    rows = R * S * K + token_padding * (E + B)
    return rows * 2 * max(_np2(R), _np2(E // R)) < NARROW_LIMIT


def _np2(x: int) -> int:
    """Padded tile extent: a power of two, at least 2 (no size-1 aranges)."""
    return max(2, triton.next_power_of_2(max(int(x), 1)))


# ----------------------------------------------------------------------------------------------
# plan: rules 1-4
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["B", "CAP", "me"])
def _plan_kernel(
    tpe_ptr, s_tr, s_te,
    tpe_out, alloc_out, etc_out, seg_out, cu_out, rb_out, ob_out, cum_out,
    R, E, EPN, B, CAP,
    x_tpe, x_table, x_sig, x_epoch, x_board, x_timeout_ns, me,
    R_P: tl.constexpr, EPN_P: tl.constexpr, R_SH: tl.constexpr, J_SH: tl.constexpr,
    RB: tl.constexpr, JC: tl.constexpr, TAIL: tl.constexpr, TP: tl.constexpr, SORT: tl.constexpr,
    EXCHANGE: tl.constexpr, IDT: tl.constexpr, BIG: tl.constexpr,
):
    """Program ``d``: rules 1-3 for every home (identical in all programs), then rule 4 for rank ``d``.
    ``EXCHANGE`` (the symmetric transport): first put this rank's counts ``x_tpe`` into row ``me``
    of rank ``d``'s ``tpe_ptr`` table and wait for every peer's (``signals.exchange_counts``).

    Experts live in an ``[R_P, EPN_P]`` tile (row = home ``h``, column = ``j``, ``e = h*EPN + j``),
    so group sums are row sums and row-major order is expert order (padding holds zeros).
    """
    NEG: tl.constexpr = -BIG
    POS: tl.constexpr = BIG
    d = tl.program_id(0)
    hr = tl.arange(0, R_P)
    hh = hr[:, None]
    jj = tl.arange(0, EPN_P)[None, :]
    uu = tl.arange(0, R_P)[None, :]
    ee = hh * EPN + jj
    emask = (hh < R) & (jj < EPN)
    rvalid = hr < R
    if EXCHANGE:
        exchange_counts(x_tpe, ee, emask, x_table, x_sig, x_epoch, x_board, x_timeout_ns, R, E, me, R_P)

    # Rule 1 (and the row-wise tables): counts, ordinal_base[d,:] (exclusive sum over ranks), tpe[d,:].
    count = tl.zeros([R_P, EPN_P], IDT)
    before = tl.zeros([R_P, EPN_P], IDT)
    mine = tl.zeros([R_P, EPN_P], IDT)
    for r0 in range(0, R, RB):
        rr = r0 + tl.arange(0, RB)[:, None, None]
        m3 = (rr < R) & emask[None, :, :]
        t = tl.load(tpe_ptr + rr * s_tr + ee[None, :, :] * s_te, mask=m3, other=0).to(IDT)
        count += tl.sum(t, axis=0)
        before += tl.sum(tl.where(rr < d, t, 0), axis=0)
        mine += tl.sum(tl.where(rr == d, t, 0), axis=0)
    tl.store(ob_out + d * E + ee, before, mask=emask)
    tl.store(tpe_out + d * E + ee, mine, mask=emask)

    # Rule 2: quota[h, u]. Same arithmetic as planner.rank_quotas (accumulating, so any input
    # gives the host's answer); the loop stops on the device once no rank is over-full.
    # An argmax/argmin with the smallest index is one reduction over values packed with their
    # index in the low bits: v*R_P + (R_P-1-i) for the max, v*R_P + i for the min (>> and & decode,
    # also for negative v).
    bal = tl.sum(count, axis=1) - CAP
    pmax = tl.where(rvalid, bal * R_P + (R_P - 1 - hr), NEG)
    pmin = tl.where(rvalid, bal * R_P + hr, POS)
    quota = tl.zeros([R_P, R_P], IDT)
    xmax = tl.max(pmax, axis=0)
    it = 0
    while (it < R - 1) & (xmax >= R_P):  # max balance > 0
        h = R_P - 1 - (xmax & (R_P - 1))
        xmin = tl.min(pmin, axis=0)
        mn = xmin >> R_SH
        u = xmin & (R_P - 1)
        quota = tl.where((hh == h) & (uu == u), quota - mn, quota)
        step = tl.where(hr == h, mn, 0) - tl.where(hr == u, mn, 0)
        pmax += step * R_P
        pmin += step * R_P
        xmax = tl.max(pmax, axis=0)
        it += 1

    # Rule 3: every home splits its quotas over its experts (planner.split_quotas), all homes at
    # once, on packed tiles (quota with its destination, remaining rows with their expert).
    # Only column d of alloc (and of its cumsum over ranks) is kept.
    qpk = tl.where((hh < R) & (uu < R), quota * R_P + (R_P - 1 - uu), NEG)
    rpk = tl.where(emask, count * EPN_P + (EPN_P - 1 - jj), NEG)
    a_d = tl.zeros([R_P, EPN_P], IDT)
    c_d = tl.zeros([R_P, EPN_P], IDT)
    qx = tl.max(qpk, axis=1)
    it = 0
    while (it < R - 1 + EPN) & (tl.max(qx, axis=0) >= R_P):  # some quota > 0
        qmax = qx >> R_SH
        dst = R_P - 1 - (qx & (R_P - 1))
        rx = tl.max(rpk, axis=1)
        rmax = rx >> J_SH
        le = EPN_P - 1 - (rx & (EPN_P - 1))
        take = tl.where(qmax > 0, tl.minimum(rmax, qmax), 0)
        tk = take[:, None]
        hit = jj == le[:, None]
        rpk = tl.where(hit, rpk - tk * EPN_P, rpk)
        qpk = tl.where(uu == dst[:, None], qpk - tk * R_P, qpk)
        a_d = tl.where(hit & (dst[:, None] == d), a_d + tk, a_d)
        c_d = tl.where(hit & (dst[:, None] <= d), c_d + tk, c_d)
        qx = tl.max(qpk, axis=1)
        it += 1
    rem = rpk >> J_SH
    left = tl.where(emask, rem, 0)
    a_d += tl.where(hh == d, left, 0)
    c_d += tl.where(hh <= d, left, 0)
    acol = ee * R + d
    tl.store(alloc_out + acol, a_d, mask=emask)
    tl.store(cum_out + acol, c_d, mask=emask)

    # Rule 4 for destination d. Rule 2 fills a receiver in one shot, so at most one home h* has
    # z[h*, d] > 0, and only h* moves rows to d: every remote expert of d sits in row h* of the
    # tile. One reduction down the columns gives each column's remote alloc and its row. Slot
    # order is (alloc, e) descending, which within one home is (alloc, j) descending. Reductions
    # are the cost here (each is a chain of shuffles and a barrier), so they are packed wherever
    # two values travel together. Each way below yields, per lane: slot q_, expert e_, alloc a_,
    # padded rows p_, padded rows of the slots before it ahead_, and whether it holds a slot (has_).
    remote = (a_d > 0) & (hh != d) & emask
    hx = tl.max(tl.where(remote, a_d * R_P + hh, -1), axis=0)  # [EPN_P]
    arow = tl.where(hx >= 0, hx >> R_SH, 0)  # alloc of remote expert (h*, j) on d, else 0
    erow = (hx & (R_P - 1)) * EPN + tl.arange(0, EPN_P)  # its expert id (where arow > 0)
    prow = tl.where(arow > 0, (arow + TP - 1) // TP * TP, 0)
    jr = tl.arange(0, EPN_P)
    if SORT:
        # one sort of (alloc, j) keys, descending: lane q of the result is slot q; the slot
        # holders are the keys at or above the smallest held one
        key = tl.where(arow > 0, arow * EPN_P + jr, -1)
        srt = tl.sort(key, descending=True)
        has_ = (srt >= 0) & (jr < B)
        q_ = jr
        a_ = tl.where(has_, srt >> J_SH, 0)
        hstar = tl.max(tl.where(hx >= 0, hx & (R_P - 1), 0), axis=0)
        e_ = hstar * EPN + (srt & (EPN_P - 1))
        p_ = tl.where(has_, (a_ + TP - 1) // TP * TP, 0)
        ahead_ = tl.cumsum(p_, axis=0) - p_
        mrow = (arow > 0) & (key >= tl.min(tl.where(has_, srt, POS), axis=0))
    else:
        # an expert's slot is the number of remote experts ahead of it, counted by pairwise
        # comparison of the row with itself (no sort), in one sum that also carries their padded
        # rows (count in the low J_SH bits)
        a32 = arow.to(tl.int32)
        if JC == EPN_P:
            gt = (a32[None, :] > a32[:, None]) | ((a32[None, :] == a32[:, None]) & (jr[None, :] > jr[:, None]))
            packed = tl.sum(tl.where(gt, prow[None, :] * EPN_P + 1, 0), axis=1)
        else:  # large EPN: JC columns at a time, each chunk picked out of the row by a masked max
            NCH: tl.constexpr = EPN_P // JC
            a2 = tl.reshape(a32, [NCH, JC])
            ci = tl.arange(0, NCH)[:, None]
            packed = tl.zeros([EPN_P], IDT)
            for c in range(NCH):
                ac = tl.max(tl.where(ci == c, a2, -1), axis=0)
                jc = c * JC + tl.arange(0, JC)
                pc = tl.where(ac > 0, (ac.to(IDT) + TP - 1) // TP * TP, 0)
                gt = (ac[None, :] > a32[:, None]) | ((ac[None, :] == a32[:, None]) & (jc[None, :] > jr[:, None]))
                packed += tl.sum(tl.where(gt, pc[None, :] * EPN_P + 1, 0), axis=1)
        q_ = packed & (EPN_P - 1)
        mrow = (arow > 0) & (q_ < B)  # holds slot q_
        has_, e_, a_, p_ = mrow, erow, arow, prow
        ahead_ = packed >> J_SH
    member = (ee == erow[None, :]) & mrow[None, :]
    used = tl.sum(tl.where(has_, p_ * (2 * EPN_P) + 1, 0), axis=0)
    n_used = used & (2 * EPN_P - 1)
    slot_rows = used >> (J_SH + 1)

    # segments 0..E-1 in expert order: cumsum along each home's row plus the rows before it
    seg = tl.where(member, 0, a_d)
    pad = tl.where(seg > 0, (seg + TP - 1) // TP * TP, 0)
    rsum = tl.sum(pad, axis=1)
    rcu = tl.cumsum(rsum, axis=0)
    cu = tl.cumsum(pad, axis=1) + (rcu - rsum)[:, None]
    total = tl.max(rcu, axis=0)
    W = E + B
    tl.store(seg_out + d * W + ee, seg, mask=emask)
    tl.store(cu_out + d * W + ee, cu, mask=emask)
    tl.store(rb_out + acol, cu - pad, mask=emask & (member == 0))

    # used slots
    start = total + ahead_
    tl.store(etc_out + d * B + q_, e_.to(tl.int32), mask=has_)
    tl.store(seg_out + d * W + E + q_, a_, mask=has_)
    tl.store(cu_out + d * W + E + q_, start + p_, mask=has_)
    tl.store(rb_out + e_ * R + d, start, mask=has_)
    # unused slots [n_used, B)
    stotal = total + slot_rows
    for b0 in range(0, B, TAIL):
        q = b0 + tl.arange(0, TAIL)
        qm = (q < B) & (q >= n_used)
        tl.store(etc_out + d * B + q, tl.full([TAIL], -1, tl.int32), mask=qm)
        tl.store(seg_out + d * W + E + q, tl.zeros([TAIL], IDT), mask=qm)
        tl.store(cu_out + d * W + E + q, tl.zeros([TAIL], IDT) + stotal, mask=qm)


# ----------------------------------------------------------------------------------------------
# place: rule 5
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N"])
def _hist_kernel(ids_ptr, exs_ptr, tot_ptr, N, E, KS: tl.constexpr, SB: tl.constexpr, E_P: tl.constexpr):
    """Chunk ``c`` (KS sub-blocks of SB entries): per-expert counts of the whole chunk, and of the
    chunk's sub-blocks before each sub-block (one 2-D histogram over (sub-block, expert) bins)."""
    c = tl.program_id(0)
    k = tl.arange(0, KS)[:, None]
    i = tl.arange(0, SB)[None, :]
    offs = (c * KS + k) * SB + i
    m = offs < N
    x = tl.load(ids_ptr + offs, mask=m, other=-1)
    valid = m & (x >= 0) & (x < E)
    bins = tl.where(valid, k * E_P + x, 0).to(tl.int32)
    h = tl.histogram(tl.reshape(bins, [KS * SB]), KS * E_P, mask=tl.reshape(valid, [KS * SB]))
    h = tl.reshape(h, [KS, E_P])
    e = tl.arange(0, E_P)[None, :]
    tl.store(exs_ptr + (c * KS + k) * E + e, tl.cumsum(h, axis=0) - h, mask=e < E)
    tot = tl.sum(h, axis=0)[None, :]
    tl.store(tot_ptr + c * E + e, tot, mask=e < E)


@triton.jit
def dest_row(cum_ptr, rb_ptr, xc, valid, g, R, R_P: tl.constexpr):
    """Rule 5's last step for entries of experts ``xc`` with global ordinals ``g``: destination =
    first ``d`` with ``cum_alloc[e, d] > g`` (how many are ``<= g``, as the host counts), row =
    ``row_base[e, dest] + g - cum_alloc[e, dest-1]``; ``-1`` for entries that are not ``valid``."""
    dd = tl.arange(0, R_P)[None, :]
    dm = valid[:, None] & (dd < R)
    cum = tl.load(cum_ptr + xc[:, None] * R + dd, mask=dm, other=0)
    dest = tl.sum((dm & (cum <= g[:, None])).to(tl.int64), axis=1)
    prev = tl.sum(tl.where(dd == dest[:, None] - 1, cum, 0), axis=1)
    dcl = tl.minimum(dest, R - 1)
    rb = tl.load(rb_ptr + xc * R + dcl, mask=valid, other=0)
    return tl.where(valid, dest, -1), tl.where(valid, rb + g - prev, -1)


@triton.jit
def place_direct(ids_ptr, i, im, ob_ptr, cum_ptr, rb_ptr, rank, E, R, R_P: tl.constexpr, CH: tl.constexpr):
    """Rule 5 for this rank's flat entries ``i`` (where ``im``) with no histogram: each entry's
    ordinal among its expert's entries is ``ordinal_base[rank, e]`` plus the earlier entries of
    this rank with the same id, counted by comparing with them ``CH`` at a time (small batches).
    Returns ``(dest, row)``, ``-1`` for ids outside ``[0, E)`` (which shift no other ordinal)."""
    x = tl.load(ids_ptr + i, mask=im, other=-1)
    valid = im & (x >= 0) & (x < E)
    xc = tl.where(valid, x, 0).to(tl.int32)
    xe = tl.where(valid, x, -1)
    g = tl.load(ob_ptr + rank * E + xc, mask=valid, other=0).to(tl.int64)
    hi = tl.max(tl.where(im, i, 0), axis=0)  # no entry at or past the last one counts
    c = tl.arange(0, CH)
    cnt = tl.zeros(i.shape, tl.int32)
    for c0 in range(0, hi, CH):
        k = c0 + c
        y = tl.load(ids_ptr + k, mask=k < hi, other=-1)  # a valid id never equals an invalid one
        cnt += tl.sum(((xe[:, None] == y[None, :]) & (k[None, :] < i[:, None])).to(tl.int32), axis=1)
    return dest_row(cum_ptr, rb_ptr, xc, valid, g + cnt.to(tl.int64), R, R_P)


@triton.jit(do_not_specialize=["rank", "N"])
def _place_kernel(
    ids_ptr, exs_ptr, tot_ptr, ob_ptr, cum_ptr, rb_ptr, dest_ptr, row_ptr,
    rank, N, E, R,
    KS: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr, R_P: tl.constexpr, DIRECT: tl.constexpr,
):
    """Sub-block ``s`` of SB entries: global ordinal of each entry, then its destination and row.
    ``DIRECT`` (few sub-blocks): earlier entries are compared one by one, no histogram."""
    s = tl.program_id(0)
    i = tl.arange(0, SB)
    offs = s * SB + i
    m = offs < N
    if DIRECT:
        dest, row = place_direct(ids_ptr, offs, m, ob_ptr, cum_ptr, rb_ptr, rank, E, R, R_P, SB)
    else:
        x = tl.load(ids_ptr + offs, mask=m, other=-1)
        valid = m & (x >= 0) & (x < E)
        xc = tl.where(valid, x, 0).to(tl.int32)
        xe = tl.where(valid, x, -1)
        # entries of expert e before this sub-block: earlier ranks, earlier chunks (their totals),
        # earlier sub-blocks of this chunk (the histogram's prefix)
        g = tl.load(ob_ptr + rank * E + xc, mask=valid, other=0).to(tl.int64)
        c = s // KS
        g += tl.load(exs_ptr + s * E + xc, mask=valid, other=0).to(tl.int64)
        acc = tl.zeros([CB, SB], tl.int32)
        for c0 in range(0, c, CB):
            cc = c0 + tl.arange(0, CB)[:, None]
            acc += tl.load(tot_ptr + cc * E + xc[None, :], mask=(cc < c) & valid[None, :], other=0)
        g += tl.sum(acc, axis=0).to(tl.int64)
        # and inside the sub-block
        same = (xe[:, None] == xe[None, :]) & (i[None, :] < i[:, None])
        g += tl.sum(same.to(tl.int32), axis=1).to(tl.int64)
        dest, row = dest_row(cum_ptr, rb_ptr, xc, valid, g, R, R_P)
    tl.store(dest_ptr + offs, dest, mask=m)
    tl.store(row_ptr + offs, row, mask=m)


# ----------------------------------------------------------------------------------------------
# host-side wrapper
# ----------------------------------------------------------------------------------------------


class DevicePlanner:
    """Plans and places on ``device`` into preallocated tensors (see the module docstring).

    ``fast_launch``: launch through the compiled kernel's C launcher once a kernel is compiled
    (saves the 28-38 us of host time Triton's dispatch takes per ``plan()``; ``engine/launch.py``).
    ``None``: the engine's ``FAST_LAUNCH`` default. The GPU random-case test alternates both paths.
    ``plan_warps``, ``place_warps``, ``rule4``, ``rule4_chunk``, ``wide``: choices to benchmark
    (``None``: the planner's own). ``rule4``: how slots are ordered, ``"sort"`` (one sort of the
    remote experts' keys) or ``"pairwise"`` (each expert compared with every other, ``rule4_chunk``
    columns at a time); both give the same plan. ``wide``: the plan kernel's arithmetic in int64
    (``True``) or int32 (``False``, refused where a value of the contract's input could overflow);
    by default int32 wherever ``narrow_fits`` says it is exact (half the instructions of every
    compare, select and packed reduction of the latency-bound rounds).
    """

    def __init__(self, R: int, E: int, S: int, K: int, B: int, token_padding: int, device: torch.device,
                 *, plan_warps: int | None = None, place_warps: int | None = None, fast_launch: bool | None = None,
                 rule4: str | None = None, rule4_chunk: int | None = None, wide: bool | None = None):
        R, E, S, K, B, tp = (int(v) for v in (R, E, S, K, B, token_padding))
        if R < 1 or E < 1 or E % R != 0:
            raise ValueError(f"need R >= 1 and E % R == 0 (R={R}, E={E})")
        if S < 1 or K < 1 or B < 1 or tp < 1:
            raise ValueError(f"S, K, B and token_padding must be positive (S={S}, K={K}, B={B}, tp={tp})")
        if S * K * R >= 2**31 or (E + B) * R >= 2**31:
            raise ValueError("problem too large for 32-bit offsets")
        self.R, self.E, self.S, self.K, self.B, self.tp = R, E, S, K, B, tp
        self.epn = E // R
        self.device = dev = resolve_device(device)

        # plan tiles
        self._R_P = _np2(R)
        self._EPN_P = _np2(self.epn)
        n_p = self._R_P * self._EPN_P
        if self._R_P > 256 or n_p > 16384:  # [R_P, R_P] quotas and [R_P, EPN_P] experts live in registers
            raise ValueError(f"R={R}, E={E} exceeds the register tiles (R <= 256, padded E <= 16384)")
        rb = 1
        while rb * 2 <= self._R_P and rb * 2 * n_p <= 4096:
            rb *= 2
        self._RB = rb
        # rule 4: a sort above RULE4_SORT_ABOVE experts per rank (measured faster there; above 64
        # the pairwise tile needs column chunks, each a chain of reductions), else the whole
        # [EPN_P, EPN_P] compare at once
        if rule4 not in (None, "sort", "pairwise"):
            raise ValueError(f"rule4 must be 'sort' or 'pairwise', got {rule4!r}")
        self._sort = (rule4 or ("sort" if self._EPN_P > RULE4_SORT_ABOVE else "pairwise")) == "sort"
        # the pairwise tile [EPN_P, JC] (``rule4_chunk`` overrides JC, a power of two up to EPN_P)
        self._JC = self._EPN_P if self._EPN_P <= 64 else max(2, 2048 // self._EPN_P)
        if rule4_chunk is not None:
            jc = int(rule4_chunk)
            if jc < 2 or jc > self._EPN_P or jc & (jc - 1):
                raise ValueError(f"rule4_chunk must be a power of two in [2, {self._EPN_P}] (E/R padded), got {rule4_chunk}")
            self._JC = jc
        big = max(self._R_P * self._R_P, n_p, rb * n_p, 0 if self._sort else self._EPN_P * self._JC)
        # warps by the largest register tile and R (H200, rule 4 sorted: R=8, E=384 26.7 us at 8 warps
        # against 42.2 at 4; R=4, E=1024 20.3 at 4 against 32.6 at 8; R=2, E=384 10.4 at 4)
        self._plan_warps = plan_warps or (4 if self._R_P < 8 and big <= 4096 else 8 if big <= 8192 else 16)

        i64: dict[str, Any] = dict(dtype=torch.int64, device=dev)
        self._gp = GlobalPlan(
            tpe=torch.zeros(R, E, **i64),
            alloc=torch.zeros(E, R, **i64),
            experts_to_copy=torch.full((R, B), -1, dtype=torch.int32, device=dev),
            seg_len=torch.zeros(R, E + B, **i64),
            cu_seqlens=torch.zeros(R, E + B, **i64),
            row_base=torch.zeros(E, R, **i64),
            ordinal_base=torch.zeros(R, E, **i64),
            cum_alloc=torch.zeros(E, R, **i64),
        )

        # place tiles: sub-blocks of SB entries, chunks of KS sub-blocks
        n = S * K
        self._n = n
        self._E_P = _np2(E)
        # tile sizes depend on E only (one compiled variant per expert count): <= 4096 histogram bins
        self._SB = 128
        self._KS = max(2, min(8, 4096 // self._E_P))
        self._CB = max(2, 4096 // self._SB)
        n_sub = triton.cdiv(n, self._SB)
        self._n_chunks = triton.cdiv(n_sub, self._KS)
        self._n_sub = n_sub
        tile = self._SB * max(self._R_P, 32)  # [SB, R_P] cum_alloc gather, [CB, SB] counts, [SB, SB] compare
        self._place_warps = place_warps or (4 if tile <= 4096 else 8 if tile <= 8192 else 16)
        self._exs = torch.zeros(self._n_chunks * self._KS, E, dtype=torch.int32, device=dev)
        self._tot = torch.zeros(self._n_chunks, E, dtype=torch.int32, device=dev)
        self._dest = torch.zeros(n, **i64)
        self._row = torch.zeros(n, **i64)

        fits = narrow_fits(R, E, S, K, B, tp)
        if wide is False and not fits:
            raise ValueError(f"wide=False: int32 plan arithmetic could overflow at R={R}, E={E}, S={S}, K={K}, "
                             f"B={B}, token_padding={tp} (narrow_fits)")
        self._wide = not fits if wide is None else bool(wide)
        self._plan_launch = Launcher(_plan_kernel, fast_launch)
        self._plan_consts = dict(
            R_P=self._R_P, EPN_P=self._EPN_P, R_SH=self._R_P.bit_length() - 1, J_SH=self._EPN_P.bit_length() - 1,
            RB=self._RB, JC=self._JC, TAIL=64, TP=tp, SORT=self._sort,
            IDT=tl.int64 if self._wide else tl.int32, BIG=2**62 if self._wide else NARROW_LIMIT,
        )
        self._hist_launch = Launcher(_hist_kernel, fast_launch)
        self._hist_consts = dict(KS=self._KS, SB=self._SB, E_P=self._E_P)
        self._place_launch = Launcher(_place_kernel, fast_launch)
        # few sub-blocks (small batches): place compares entries directly and the histogram launch
        # (a constant ~15 us of device time on an H200, docs/PERFORMANCE.md) is skipped
        self._direct = n_sub <= DIRECT_MAX_SUBBLOCKS
        self._place_consts = dict(KS=self._KS, SB=self._SB, CB=self._CB, R_P=self._R_P, DIRECT=self._direct)

    def plan(self, tpe_all: torch.Tensor, exchange: tuple | None = None) -> GlobalPlan:
        """Rules 1-4 from the all-gathered ``tpe_all [R, E]`` (int32 or int64, on ``device``); one launch.

        ``exchange``: the symmetric transport's ``(tpe [E], table, sig, epoch, board address,
        timeout_ns, rank)``: the same launch first puts ``tpe`` into row ``rank`` of every peer's
        ``tpe_all`` (the transport's counts buffer) and waits for theirs (``signals.exchange_counts``).
        """
        R, E = self.R, self.E
        if tuple(tpe_all.shape) != (R, E) or tpe_all.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tpe_all must be [R={R}, E={E}] int32/int64, got {tuple(tpe_all.shape)} {tpe_all.dtype}")
        if tpe_all.device != self.device:
            raise ValueError(f"tpe_all is on {tpe_all.device}, the planner on {self.device}")
        gp = self._gp
        exchanging = exchange is not None
        # without it, unused pointers and values (EXCHANGE=False)
        xargs: tuple = exchange if exchange is not None else (gp.tpe, gp.tpe, gp.tpe, gp.tpe, 0, 0, 0)
        self._plan_launch(
            (R, 1, 1),
            tpe_all, tpe_all.stride(0), tpe_all.stride(1),
            gp.tpe, gp.alloc, gp.experts_to_copy, gp.seg_len, gp.cu_seqlens, gp.row_base, gp.ordinal_base,
            gp.cum_alloc,
            R, E, self.epn, self.B, self.S * self.K, *xargs,
            num_warps=self._plan_warps, EXCHANGE=exchanging, **self._plan_consts,
        )
        return gp

    @property
    def arithmetic(self) -> str:
        """The plan kernel's integer width, ``"int32"`` or ``"int64"`` (see ``wide``)."""
        return "int64" if self._wide else "int32"

    @property
    def result(self) -> GlobalPlan:
        """The ``GlobalPlan`` every ``plan`` call rewrites in place (and returns)."""
        return self._gp

    @property
    def direct(self) -> bool:
        """Whether ``place`` runs without the histogram (small batches): then rule 5 can also run
        inside another kernel (``place_direct``), as the symmetric transport's dispatch does."""
        return self._direct

    def tables(self, gp: GlobalPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ordinal_base, cum_alloc, row_base)`` as rule 5's kernels read them."""
        return self._table(gp.ordinal_base), self._table(gp.cum_alloc), self._table(gp.row_base)

    @property
    def launchers(self) -> list[Launcher]:
        """The launchers a ``plan`` + ``place`` runs, in order (the histogram's only for large batches)."""
        return [self._plan_launch] + ([] if self._direct else [self._hist_launch]) + [self._place_launch]

    def place(self, gp: GlobalPlan, rank: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rule 5 for ``rank``'s ``ids [S, K]``: ``(dest [S*K], row [S*K])`` int64; one launch up to
        ``DIRECT_MAX_SUBBLOCKS`` sub-blocks of entries, two above.

        Ids outside ``[0, E)`` get ``dest = row = -1``.
        """
        if not 0 <= int(rank) < self.R:
            raise ValueError(f"rank {rank} outside [0, {self.R})")
        if ids.numel() != self._n or ids.device != self.device or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be [S={self.S}, K={self.K}] int32/int64 on {self.device}")
        flat = ids.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        ob, cum, rb = self.tables(gp)
        if not self._direct:
            self._hist_launch((self._n_chunks, 1, 1), flat, self._exs, self._tot, self._n, self.E,
                              num_warps=4, **self._hist_consts)
        self._place_launch(
            (self._n_sub, 1, 1),
            flat, self._exs, self._tot, ob, cum, rb, self._dest, self._row,
            int(rank), self._n, self.E, self.R,
            num_warps=self._place_warps, **self._place_consts,
        )
        return self._dest, self._row

    def _table(self, t: torch.Tensor) -> torch.Tensor:
        """A plan table as the kernels read it (our own plan's tables pass through untouched)."""
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device != self.device:
            t = t.to(device=self.device, dtype=torch.int64).contiguous()
        return t
