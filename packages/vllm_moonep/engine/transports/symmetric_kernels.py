"""Triton kernels of the symmetric transport (GPU): one-sided writes into peers' buffers.
``symmetric.py`` owns the buffers and the order of launches; ``engine/signals.py`` the
signals, bounded waits and the address table; this module only moves bytes.

A step's launches (the counts exchange runs inside the device planner's plan kernel)::

    dispatch:  plan (put counts, wait, rules 1-4) [-> hist -> place, large batches]
               -> dispatch_rows: place (small batches) -> rows, weights, source ids into each
                  destination's recv_*; this rank's real-row list, cu_seqlens and rows per
                  segment; the last program signals every peer once and waits for every
                  peer's rows
    combine:   combine_rows: each real row's output into its source's comb_*; the row becomes
                  padding again (hidden 0, weight 0, source -1); the last program signals
                  every peer once and waits for every peer's outputs
               -> reduce: out[t] = bf16(sum_k fp32 comb_x[t*K + k])
    clear_rows only when a dispatch follows a dispatch with no combine between (rows still real)

Addresses: ``table[k, d]`` (int64, on the device) is the address of buffer ``k`` on rank ``d``
(rows ``signals.T_*``), so a kernel reaches any peer's buffer by loading one word.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_moonep.engine.planning.device_planner import place_direct
from vllm_moonep.engine.signals import (C_BAD_ID, C_WAIT_OUTPUTS, C_WAIT_ROWS, PH_COMBINE, PH_COUNTS, PH_DISPATCH,
                                        T_CW, T_CX, T_SRC, T_W, T_X, count_epoch, gave_up, last_to_arrive, report,
                                        signal, wait)


@triton.jit
def dispatch_rows_kernel(x, w, ids, dest, row, ob, cum, rb, table, board, epoch, ticket, sig, cu, seg_len, cu32,
                         rows32, ends32, real_rows, n_entries, n_move, K, H, R, E, me, G, TP, timeout_ns, n_prog,
                         PLACE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, R_PAD: tl.constexpr, G_PAD: tl.constexpr,
                         CHUNK: tl.constexpr, PCH: tl.constexpr):
    """Entry ``i`` (token ``i // K``): its hidden row, route weight and source id to row ``row[i]`` of
    rank ``dest[i]``'s receive buffers (``PLACE``: rule 5 computed here from ``ids`` and the plan's
    tables, else read from ``dest``/``row``); ids that placement rejected (``dest < 0``) go to the
    board. Only entries below ``n_move`` move (the rest are the caller's padding tokens: their rows
    keep reading 0, source -1). Also this rank's list of real rows (``real_rows[j]``: shard row of the ``j``-th real row,
    in segment order; -1 past the last) for combine, the int32 ``cu_seqlens`` and the rows of each
    segment (``rows32``, padding included: what vLLM's prepare hands the experts) and the end of each segment's
    entries (``ends32``: the padding tail after it, which the expert kernels need not look for). The last program
    to finish signals every peer (once for the launch) and waits (bounded) until every peer
    signalled that its rows landed. Once a rank gave up on the group no row moves and no signal goes."""
    pid = tl.program_id(0)
    live = gave_up(sig, R, R_PAD) == 0
    count_epoch(epoch, PH_COUNTS)  # the plan launch waited on the old value: the next step waits on this one
    # this rank's real rows, segment by segment (rows arrive from the peers meanwhile), listed by
    # the programs that move no rows when there are such (a decode step: 2 of 264 move rows on an H200), so
    # the row movers, whose stores the peers wait for, do not load and scan the E+B segments first
    n_row_prog = tl.minimum(n_prog, tl.cdiv(n_move, ROWS))
    first = tl.where(n_row_prog < n_prog, n_row_prog, 0)
    n_list = n_prog - first
    lp = pid - first
    if lp >= 0:
        g = tl.arange(0, G_PAD)
        gm = g < G
        ln = tl.load(seg_len + g, mask=gm, other=0)
        real_start = tl.cumsum(ln, axis=0) - ln  # unpadded start of each segment
        end = tl.load(cu + g, mask=gm, other=0)
        pad_start = end - tl.where(ln > 0, (ln + TP - 1) // TP * TP, 0)
        total = tl.sum(ln, axis=0).to(tl.int32)
        if lp == 0:
            tl.store(cu32 + g, end.to(tl.int32), mask=gm)
            prev = tl.load(cu + g - 1, mask=gm & (g > 0), other=0)
            tl.store(rows32 + g, (end - prev).to(tl.int32), mask=gm)
            tl.store(ends32 + g, (pad_start + ln).to(tl.int32), mask=gm)
        c = tl.arange(0, CHUNK)
        # the non-empty segments this program lists (segment q belongs to lister q % n_list): a
        # decode step has a few among E+B, and a loop over all of them cost each program 3
        # reductions per segment (a quarter of the launch's instructions at E+B=768)
        mine = (ln > 0) & (g % n_list == lp)
        rank_in = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        for jq in range(0, tl.sum(mine.to(tl.int32), axis=0)):
            sel = mine & (rank_in == jq)
            n = tl.sum(tl.where(sel, ln, 0), axis=0)
            both = tl.sum(tl.where(sel, real_start.to(tl.int64) * 4294967296 + pad_start, 0), axis=0)  # one reduction, two values
            rs = both // 4294967296
            ps = both % 4294967296
            for t0 in range(0, n, CHUNK):
                tm = t0 + c < n
                tl.store(real_rows + rs + t0 + c, (ps + t0 + c).to(tl.int32), mask=tm)
        for t0 in range(total + lp * CHUNK, n_entries, n_list * CHUNK):  # none when every rank sent S*K rows
            tl.store(real_rows + t0 + c, tl.full([CHUNK], -1, tl.int32), mask=t0 + c < n_entries)
    # the rows
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, n_move, n_prog * ROWS):
        i = t0 + j
        im = i < n_move
        if PLACE:
            d, r = place_direct(ids, i, im, ob, cum, rb, me, E, R, R_PAD, PCH)
        else:
            d = tl.load(dest + i, mask=im, other=0)
            r = tl.load(row + i, mask=im, other=0)
        # a destination outside [0, R): an id outside [0, E) (-1), or an entry past its expert's count (R: counts
        # that are not the ids' bincount); either would index the peers' address table out of bounds
        ok = im & (d >= 0) & (d < R) & live
        if tl.sum((im & live & ((d < 0) | (d >= R))).to(tl.int32), axis=0) > 0:
            report(board, C_BAD_ID, -1, 0, 0, t0, 0)
        dd = tl.where(ok, d, 0)
        tok = (i // K).to(tl.int64)
        xb = tl.load(table + T_X * R + dd, mask=ok, other=0).to(x.dtype)
        wb = tl.load(table + T_W * R + dd, mask=ok, other=0).to(tl.pointer_type(tl.float32))
        sb = tl.load(table + T_SRC * R + dd, mask=ok, other=0).to(tl.pointer_type(tl.int32))
        for h0 in range(0, H, BLOCK_H):
            m2 = ok[:, None] & (h0 + h < H)[None, :]
            v = tl.load(x + tok[:, None] * H + h0 + h[None, :], mask=m2)
            tl.store(xb[:, None] + r[:, None] * H + h0 + h[None, :], v, mask=m2)
        tl.store(wb + r, tl.load(w + i, mask=ok), mask=ok)
        tl.store(sb + r, (me * n_entries + i).to(tl.int32), mask=ok)
    if last_to_arrive(ticket, n_prog):  # every program's rows are written: one signal per peer
        # read again: a program that started after a rank gave up skipped its rows, and the ticket's acquire makes
        # what it read visible here, so the launch signals only when every program wrote all of its rows
        live = gave_up(sig, R, R_PAD) == 0
        signal(table, R, me, PH_DISPATCH, (tl.arange(0, R_PAD) >= 0) & live, R_PAD)
        ep = tl.load(epoch + PH_DISPATCH) + 1
        wait(sig, PH_DISPATCH, R, ep, ep, board, C_WAIT_ROWS, timeout_ns, table, me, R_PAD)
        tl.store(epoch + PH_DISPATCH, ep)


@triton.jit
def combine_rows_kernel(y, yw, recv_x, recv_w, recv_src, real_rows, table, board, epoch, ticket, sig, SK, H, R, me,
                        timeout_ns, n_prog, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                        R_PAD: tl.constexpr):
    """Every real row of this rank's shard back to its source's combine buffer at the source's flat
    entry index (and its route weight, when asked); the row then reads as padding again (hidden 0,
    weight 0, source -1: what the next dispatch expects of every row it does not write; ``y`` may
    be ``recv_x`` itself, each element is read before the same thread zeroes it). The last program
    to finish signals every peer (once for the launch) and waits (bounded) until every peer's
    outputs for this rank landed. A tile none of whose rows was moved (a decode step's padding
    tokens: their rows stay padding, source -1) runs no row loop (a fifth of the instructions of a
    padded 128-token step with 1 real token). Once a rank gave up on the group no row moves and no signal
    goes."""
    pid = tl.program_id(0)
    live = gave_up(sig, R, R_PAD) == 0
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, SK, n_prog * ROWS):
        jm = t0 + j < SK
        r0 = tl.load(real_rows + t0 + j, mask=jm, other=-1)
        real = jm & (r0 >= 0)
        r = tl.where(real, r0, 0).to(tl.int64)
        s = tl.load(recv_src + r, mask=real, other=-1)
        ok = real & (s >= 0) & live
        src = tl.where(ok, s // SK, 0)
        i = (s % SK).to(tl.int64)
        cb = tl.load(table + T_CX * R + src, mask=ok, other=0).to(y.dtype)
        h_end = tl.where(tl.max(ok.to(tl.int32), axis=0) > 0, H, 0)  # a loop bound, not a branch around the loop
        for h0 in range(0, h_end, BLOCK_H):
            m2 = ok[:, None] & (h0 + h < H)[None, :]
            v = tl.load(y + r[:, None] * H + h0 + h[None, :], mask=m2)
            tl.store(cb[:, None] + i[:, None] * H + h0 + h[None, :], v, mask=m2)
            tl.store(recv_x + r[:, None] * H + h0 + h[None, :], tl.zeros([ROWS, BLOCK_H], recv_x.dtype.element_ty),
                     mask=m2)
        if HAS_W:
            wb = tl.load(table + T_CW * R + src, mask=ok, other=0).to(tl.pointer_type(tl.float32))
            tl.store(wb + i, tl.load(yw + r, mask=ok), mask=ok)
        tl.store(recv_w + r, tl.zeros([ROWS], tl.float32), mask=ok)
        tl.store(recv_src + r, tl.full([ROWS], -1, tl.int32), mask=ok)
    if last_to_arrive(ticket, n_prog):  # every program's rows are written: one signal per peer
        live = gave_up(sig, R, R_PAD) == 0  # read again, as in dispatch_rows: no signal after a partial launch
        signal(table, R, me, PH_COMBINE, (tl.arange(0, R_PAD) >= 0) & live, R_PAD)
        ep = tl.load(epoch + PH_COMBINE) + 1
        wait(sig, PH_COMBINE, R, ep, ep, board, C_WAIT_OUTPUTS, timeout_ns, table, me, R_PAD)
        tl.store(epoch + PH_COMBINE, ep)


@triton.jit
def clear_rows_kernel(real_rows, recv_x, recv_w, recv_src, SK, H, n_prog, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Only for a dispatch that follows a dispatch with no combine between (combine clears the rows
    it reads), before the step's counts go out (so no peer writes yet): the rows that were real in
    the last step become hidden 0, weight 0, source -1. Every other row already is (zeroed at
    allocation, and each step clears what it wrote), so padding rows read 0."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, SK, n_prog * ROWS):
        r0 = tl.load(real_rows + t0 + j, mask=t0 + j < SK, other=-1)
        jm = r0 >= 0
        r = tl.where(jm, r0, 0).to(tl.int64)
        tl.store(recv_w + r, tl.zeros([ROWS], tl.float32), mask=jm)
        tl.store(recv_src + r, tl.full([ROWS], -1, tl.int32), mask=jm)
        for h0 in range(0, H, BLOCK_H):
            m2 = jm[:, None] & (h0 + h < H)[None, :]
            tl.store(recv_x + r[:, None] * H + h0 + h[None, :], tl.zeros([ROWS, BLOCK_H], recv_x.dtype.element_ty),
                     mask=m2)


#: programs of the reduce at most (local work: its inputs are in this rank's memory, so any count works)
REDUCE_PROGRAMS = 1056


def reduce_grid(S: int, K: int, H: int) -> tuple[int, int, int]:
    """``(programs, BLOCK_H, K_PAD)`` of ``reduce_kernel`` for ``S`` tokens of ``K`` rows of ``H`` columns: one
    work item per token and block of up to 2048 columns, enough programs to fill the GPU."""
    bh = min(triton.next_power_of_2(H), 2048)
    return max(1, min(S * triton.cdiv(H, bh), REDUCE_PROGRAMS)), bh, triton.next_power_of_2(K)


@triton.jit
def reduce_kernel(comb_x, comb_w, out, out_w, S, K, H, n_prog, HAS_W: tl.constexpr, K_PAD: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """After every peer's outputs landed (``combine_rows_kernel``'s last program): token ``t``'s
    ``out[t] = bf16(sum_k fp32(comb_x[t*K + k]))`` (k ascending), route weights back to ``[S, K]``."""
    pid = tl.program_id(0)
    k = tl.arange(0, K_PAD)
    km = k < K
    nh = tl.cdiv(H, BLOCK_H)
    for item in range(pid, S * nh, n_prog):
        t = item // nh
        hcol = (item % nh) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = hcol < H
        base = t.to(tl.int64) * K
        acc = tl.zeros([BLOCK_H], tl.float32)
        for kk in range(0, K):
            acc += tl.load(comb_x + (base + kk) * H + hcol, mask=hm, other=0.0).to(tl.float32)
        tl.store(out + t.to(tl.int64) * H + hcol, acc.to(out.dtype.element_ty), mask=hm)
        if HAS_W:
            if item % nh == 0:
                tl.store(out_w + base + k, tl.load(comb_w + base + k, mask=km), mask=km)
