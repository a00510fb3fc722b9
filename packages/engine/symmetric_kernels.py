"""Triton kernels of the symmetric transport (GPU): one-sided writes into peers' buffers, signals,
bounded waits. ``symmetric_transport.py`` owns the buffers and the order of launches; this module
only moves bytes.

Addresses: every rank's buffers live on a symmetric heap; ``table[k, d]`` (int64, on the device)
is the address of buffer ``k`` on rank ``d`` (rows ``T_*`` below), so a kernel reaches any peer's
buffer by loading one word and casting it to a pointer.

Signals: ``sig[phase, src]`` (int64, on every rank) counts how many programs of ``src`` finished
their writes to this rank in ``phase``. A writing program stores its rows, meets the other
threads of its program at a barrier, then adds 1 to ``sig[phase, me]`` on every peer with
release semantics at system scope; the waiting rank reads with acquire semantics until every
``sig[phase, src]`` reaches ``(epoch + 1) * programs``, where ``epoch[phase]`` (on the device, so
that a replayed CUDA graph keeps counting) says how many such waits completed before. Counters
only grow, so a signal of the next step can never be mistaken for this one's. Waits are
bounded by ``%globaltimer``; on time-out the kernel writes the error board and returns.
"""

from __future__ import annotations

import triton
import triton.language as tl

# rows of the address table
T_COUNTS, T_X, T_W, T_SRC, T_CX, T_CW, T_SIG = range(7)
TABLE_ROWS = 7
# phases (rows of sig)
PH_COUNTS, PH_DISPATCH, PH_COMBINE = range(3)
PHASES = 3


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _signal(table, R, me, phase, peer_mask, R_PAD: tl.constexpr):
    """Add 1 to ``sig[phase, me]`` on every peer in ``peer_mask`` (after this program's writes)."""
    tl.debug_barrier()
    d = tl.arange(0, R_PAD)
    m = (d < R) & peer_mask
    base = tl.load(table + T_SIG * R + d, mask=m, other=0)
    ptr = base.to(tl.pointer_type(tl.int64)) + phase * R + me
    tl.atomic_add(ptr, tl.full([R_PAD], 1, tl.int64), mask=m, sem="release", scope="sys")


@triton.jit
def _wait(sig, epoch, phase, R, per_src, board, code, timeout_ns, R_PAD: tl.constexpr):
    """Spin until every ``sig[phase, src] >= (epoch[phase] + 1) * per_src``, bounded; then count the epoch."""
    d = tl.arange(0, R_PAD)
    m = d < R
    ep = tl.load(epoch + phase)
    target = (ep + 1) * per_src
    ptr = sig + phase * R + d
    seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
    pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
    t0 = _now_ns()
    elapsed = t0 - t0
    while (pending > 0) & (elapsed < timeout_ns):
        seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
        pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
        elapsed = _now_ns() - t0
    if pending > 0:
        late = (seen < target) & m
        first = tl.min(tl.where(late, d, R_PAD), axis=0)
        got = tl.min(tl.where(d == first, seen, target), axis=0)
        bp = board.to(tl.pointer_type(tl.int64))
        tl.store(bp + 1, code)
        tl.store(bp + 2, first.to(tl.int64))
        tl.store(bp + 3, ep + 1)
        tl.store(bp + 4, elapsed)
        tl.store(bp + 5, got)
        tl.store(bp + 6, target)
        tl.atomic_xchg(bp, 1, sem="release", scope="sys")
    tl.store(epoch + phase, ep + 1)


@triton.jit
def put_counts_kernel(tpe, table, R, me, E, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Program ``d``: this rank's ``tokens_per_expert`` into row ``me`` of rank ``d``'s counts, then signal ``d``."""
    d = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    v = tl.load(tpe + e, mask=e < E, other=0)
    dst = tl.load(table + T_COUNTS * R + d).to(tl.pointer_type(tl.int32))
    tl.store(dst + me * E + e, v.to(tl.int32), mask=e < E)
    _signal(table, R, me, PH_COUNTS, tl.arange(0, R_PAD) == d, R_PAD)


@triton.jit
def wait_kernel(sig, epoch, phase, R, per_src, board, code, timeout_ns, R_PAD: tl.constexpr):
    """One program: the bounded wait of ``phase`` (see the module doc)."""
    _wait(sig, epoch, phase, R, per_src, board, code, timeout_ns, R_PAD)


@triton.jit
def dispatch_rows_kernel(x, w, dest, row, table, board, n_entries, K, H, R, me, n_prog,
                         BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Entry ``i`` (token ``i // K``): its hidden row, route weight and source id to row ``row[i]`` of
    rank ``dest[i]``'s receive buffers; ids that placement rejected (``dest < 0``) go to the board."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    for i in range(pid, n_entries, n_prog):
        d = tl.load(dest + i)
        r = tl.load(row + i)
        if d >= 0:
            tok = i // K
            xb = tl.load(table + T_X * R + d).to(x.dtype)
            wb = tl.load(table + T_W * R + d).to(tl.pointer_type(tl.float32))
            sb = tl.load(table + T_SRC * R + d).to(tl.pointer_type(tl.int32))
            for h0 in range(0, H, BLOCK_H):
                hm = h0 + h < H
                v = tl.load(x + tok * H + h0 + h, mask=hm)
                tl.store(xb + r * H + h0 + h, v, mask=hm)
            tl.store(wb + r, tl.load(w + i))
            tl.store(sb + r, (me * n_entries + i).to(tl.int32))
        else:
            bp = board.to(tl.pointer_type(tl.int64))
            tl.store(bp + 1, 16)
            tl.atomic_xchg(bp, 1, sem="release", scope="sys")
    _signal(table, R, me, PH_DISPATCH, tl.arange(0, R_PAD) >= 0, R_PAD)


@triton.jit
def finish_dispatch_kernel(cu, seg_len, recv_x, recv_w, recv_src, G, H, sig, epoch, R, per_src, board, timeout_ns,
                           n_prog, TP_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Padding rows of this rank's segments become hidden 0, weight 0, source -1; program 0 then
    waits (bounded) until every peer signalled that its rows landed."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, TP_ROWS)
    for g in range(pid, G, n_prog):
        end = tl.load(cu + g)
        start = tl.load(cu + g - 1, mask=g > 0, other=0)
        first = start + tl.load(seg_len + g)
        for r0 in range(first, end, TP_ROWS):
            rm = r0 + j < end
            rows = (r0 + j).to(tl.int64)
            tl.store(recv_w + rows, tl.zeros([TP_ROWS], tl.float32), mask=rm)
            tl.store(recv_src + rows, tl.full([TP_ROWS], -1, tl.int32), mask=rm)
            for h0 in range(0, H, BLOCK_H):
                hm = h0 + h < H
                z = tl.zeros([TP_ROWS, BLOCK_H], recv_x.dtype.element_ty)
                tl.store(recv_x + rows[:, None] * H + h0 + h[None, :], z, mask=rm[:, None] & hm[None, :])
    if pid == 0:
        _wait(sig, epoch, PH_DISPATCH, R, per_src, board, 2, timeout_ns, R_PAD)


@triton.jit
def combine_rows_kernel(y, yw, recv_src, cu_last, table, SK, H, R, me, n_prog, HAS_W: tl.constexpr,
                        BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Every real row of this rank's shard (``recv_src >= 0``) back to its source's combine
    buffer at the source's flat entry index (and its route weight, when asked)."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    n = tl.load(cu_last)
    for r in range(pid, n, n_prog):
        s = tl.load(recv_src + r)
        if s >= 0:
            src = s // SK
            i = (s % SK).to(tl.int64)
            cb = tl.load(table + T_CX * R + src).to(y.dtype)
            for h0 in range(0, H, BLOCK_H):
                hm = h0 + h < H
                tl.store(cb + i * H + h0 + h, tl.load(y + r.to(tl.int64) * H + h0 + h, mask=hm), mask=hm)
            if HAS_W:
                wb = tl.load(table + T_CW * R + src).to(tl.pointer_type(tl.float32))
                tl.store(wb + i, tl.load(yw + r))
    _signal(table, R, me, PH_COMBINE, tl.arange(0, R_PAD) >= 0, R_PAD)


@triton.jit
def reduce_kernel(comb_x, comb_w, out, out_w, K, H, HAS_W: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token ``t``: ``out[t] = bf16(sum_k fp32(comb_x[t*K + k]))`` (k ascending), route weights back to ``[S, K]``."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    k = tl.arange(0, K_PAD)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    km = k < K
    hm = h < H
    base = t.to(tl.int64) * K
    acc = tl.zeros([BLOCK_H], tl.float32)
    for kk in range(0, K):
        acc += tl.load(comb_x + (base + kk) * H + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(out + t.to(tl.int64) * H + h, acc.to(out.dtype.element_ty), mask=hm)
    if HAS_W:
        if hb == 0:
            tl.store(out_w + base + k, tl.load(comb_w + base + k, mask=km), mask=km)
