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

from vllm_moonep.engine import error_board as eb

# rows of the address table (constexpr: kernels read them)
T_COUNTS, T_X, T_W, T_SRC, T_CX, T_CW, T_SIG = (tl.constexpr(i) for i in range(7))
# phases (rows of sig)
PH_COUNTS, PH_DISPATCH, PH_COMBINE = (tl.constexpr(i) for i in range(3))
# what the kernels record on the error board (codes defined in error_board)
C_WAIT_COUNTS, C_WAIT_ROWS, C_WAIT_OUTPUTS, C_BAD_ID = (
    tl.constexpr(c) for c in (eb.CODE_WAIT_COUNTS, eb.CODE_WAIT_ROWS, eb.CODE_WAIT_OUTPUTS, eb.CODE_BAD_ID))


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
def _report(board, code, peer, epoch, elapsed, seen, target):
    """First failure wins: claim the record (word 7), fill it, then raise the flag (word 0)."""
    bp = board.to(tl.pointer_type(tl.int64))
    zero = tl.cast(0, tl.int64)
    if tl.atomic_cas(bp + 7, zero, zero + 1, sem="relaxed", scope="sys") == 0:
        tl.store(bp + 1, code)
        tl.store(bp + 2, peer)
        tl.store(bp + 3, epoch)
        tl.store(bp + 4, elapsed)
        tl.store(bp + 5, seen)
        tl.store(bp + 6, target)
        tl.atomic_xchg(bp, 1, sem="release", scope="sys")


@triton.jit
def _wait(sig, phase, R, target, epoch_no, board, code, timeout_ns, R_PAD: tl.constexpr):
    """Spin until every ``sig[phase, src] >= target``, bounded; gives up at once once the board is set."""
    d = tl.arange(0, R_PAD)
    m = d < R
    bp = board.to(tl.pointer_type(tl.int64))
    ptr = sig + phase * R + d
    seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
    pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
    failed = tl.load(bp, volatile=True)
    t0 = _now_ns()
    elapsed = t0 - t0
    while (pending > 0) & (elapsed < timeout_ns) & (failed == 0):
        seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
        pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
        failed = tl.load(bp, volatile=True)
        elapsed = _now_ns() - t0
    if (pending > 0) & (failed == 0):
        late = (seen < target) & m
        first = tl.min(tl.where(late, d, R_PAD), axis=0)
        got = tl.min(tl.where(d == first, seen, target), axis=0)
        _report(board, code, first.to(tl.int64), epoch_no, elapsed, got, target)


@triton.jit
def _count_epoch(epoch, phase):
    """Program 0 of a sending kernel: this phase happens once more (read by a later kernel)."""
    if tl.program_id(0) == 0:
        tl.store(epoch + phase, tl.load(epoch + phase) + 1)


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
def wait_counts_kernel(sig, epoch, R, board, timeout_ns, R_PAD: tl.constexpr):
    """One program: wait (bounded) for every peer's counts of this step, then count the step."""
    ep = tl.load(epoch + PH_COUNTS) + 1
    _wait(sig, PH_COUNTS, R, ep, ep, board, C_WAIT_COUNTS, timeout_ns, R_PAD)
    tl.store(epoch + PH_COUNTS, ep)


@triton.jit
def dispatch_rows_kernel(x, w, dest, row, table, board, epoch, n_entries, K, H, R, me, n_prog,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Entry ``i`` (token ``i // K``): its hidden row, route weight and source id to row ``row[i]`` of
    rank ``dest[i]``'s receive buffers; ids that placement rejected (``dest < 0``) go to the board."""
    pid = tl.program_id(0)
    _count_epoch(epoch, PH_DISPATCH)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, n_entries, n_prog * ROWS):
        i = t0 + j
        im = i < n_entries
        d = tl.load(dest + i, mask=im, other=0)
        r = tl.load(row + i, mask=im, other=0)
        ok = im & (d >= 0)
        if tl.sum((im & (d < 0)).to(tl.int32), axis=0) > 0:
            _report(board, C_BAD_ID, -1, 0, 0, t0, 0)
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
    _signal(table, R, me, PH_DISPATCH, tl.arange(0, R_PAD) >= 0, R_PAD)


@triton.jit
def clear_rows_kernel(real_rows, recv_x, recv_w, recv_src, SK, H, n_prog, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Before a step's counts go out (so no peer writes yet): the rows that were real in the last
    step become hidden 0, weight 0, source -1. Every other row already is (zeroed at allocation,
    and each step clears what it wrote), so padding rows read 0 at the cost of S*K rows, not NvS."""
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, SK, n_prog * ROWS):
        jm = t0 + j < SK
        r = tl.load(real_rows + t0 + j, mask=jm, other=0).to(tl.int64)
        tl.store(recv_w + r, tl.zeros([ROWS], tl.float32), mask=jm)
        tl.store(recv_src + r, tl.full([ROWS], -1, tl.int32), mask=jm)
        for h0 in range(0, H, BLOCK_H):
            m2 = jm[:, None] & (h0 + h < H)[None, :]
            tl.store(recv_x + r[:, None] * H + h0 + h[None, :], tl.zeros([ROWS, BLOCK_H], recv_x.dtype.element_ty),
                     mask=m2)


@triton.jit
def finish_dispatch_kernel(cu, seg_len, cu32, real_rows, G, TP, sig, epoch, R, per_src, board, timeout_ns, n_prog,
                           G_PAD: tl.constexpr, CHUNK: tl.constexpr, R_PAD: tl.constexpr):
    """The list of this step's real rows (``real_rows[j]``: shard row of the ``j``-th real row, in
    segment order) for combine and the next step's clear; program 0 writes the int32
    ``cu_seqlens`` and waits (bounded) until every peer signalled that its rows landed."""
    pid = tl.program_id(0)
    g = tl.arange(0, G_PAD)
    gm = g < G
    ln = tl.load(seg_len + g, mask=gm, other=0)
    real_start = tl.cumsum(ln, axis=0) - ln  # unpadded start of each segment
    end = tl.load(cu + g, mask=gm, other=0)
    pad_start = end - tl.where(ln > 0, (ln + TP - 1) // TP * TP, 0)
    c = tl.arange(0, CHUNK)
    for q in range(pid, G, n_prog):
        sel = g == q
        n = tl.sum(tl.where(sel, ln, 0), axis=0)
        rs = tl.sum(tl.where(sel, real_start, 0), axis=0)
        ps = tl.sum(tl.where(sel, pad_start, 0), axis=0)
        for t0 in range(0, n, CHUNK):
            tm = t0 + c < n
            tl.store(real_rows + rs + t0 + c, (ps + t0 + c).to(tl.int32), mask=tm)
    if pid == 0:
        tl.store(cu32 + g, end.to(tl.int32), mask=gm)
        ep = tl.load(epoch + PH_DISPATCH)
        _wait(sig, PH_DISPATCH, R, ep * per_src, ep, board, C_WAIT_ROWS, timeout_ns, R_PAD)


@triton.jit
def combine_rows_kernel(y, yw, recv_src, real_rows, table, epoch, SK, H, R, me, n_prog, HAS_W: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Every real row of this rank's shard back to its source's combine buffer at the source's flat
    entry index (and its route weight, when asked); ``S*K`` rows in tiles, padding never touched."""
    pid = tl.program_id(0)
    _count_epoch(epoch, PH_COMBINE)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, ROWS)
    for t0 in range(pid * ROWS, SK, n_prog * ROWS):
        jm = t0 + j < SK
        r = tl.load(real_rows + t0 + j, mask=jm, other=0).to(tl.int64)
        s = tl.load(recv_src + r, mask=jm, other=-1)
        ok = jm & (s >= 0)
        src = tl.where(ok, s // SK, 0)
        i = (s % SK).to(tl.int64)
        cb = tl.load(table + T_CX * R + src, mask=ok, other=0).to(y.dtype)
        for h0 in range(0, H, BLOCK_H):
            m2 = ok[:, None] & (h0 + h < H)[None, :]
            v = tl.load(y + r[:, None] * H + h0 + h[None, :], mask=m2)
            tl.store(cb[:, None] + i[:, None] * H + h0 + h[None, :], v, mask=m2)
        if HAS_W:
            wb = tl.load(table + T_CW * R + src, mask=ok, other=0).to(tl.pointer_type(tl.float32))
            tl.store(wb + i, tl.load(yw + r, mask=ok), mask=ok)
    _signal(table, R, me, PH_COMBINE, tl.arange(0, R_PAD) >= 0, R_PAD)


@triton.jit
def wait_combine_kernel(sig, epoch, R, per_src, board, timeout_ns, R_PAD: tl.constexpr):
    """One program (thousands of spinning programs would contend with the peers' signal atomics):
    wait (bounded) until every peer's expert outputs landed."""
    ep = tl.load(epoch + PH_COMBINE)
    _wait(sig, PH_COMBINE, R, ep * per_src, ep, board, C_WAIT_OUTPUTS, timeout_ns, R_PAD)


@triton.jit
def reduce_kernel(comb_x, comb_w, out, out_w, S, K, H, n_prog, HAS_W: tl.constexpr, K_PAD: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """After every peer's outputs landed (``wait_combine_kernel``): token ``t``'s
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
