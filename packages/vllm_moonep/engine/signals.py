"""Device-side signalling of the symmetric transport (Triton ``@jit`` helpers, no kernels).

Used by ``symmetric_kernels`` (rows and outputs) and by the device planner's plan kernel when it
also exchanges the step's token counts (``device_planner``, ``EXCHANGE``)::

    table [7, R] i64   address of buffer T_* on rank d (rows below), loaded and cast to a pointer
    sig [5, R] i64     sig[phase, src] on this rank: launches of src that finished writing here;
                       sig[GAVE_UP, src]: nonzero once rank src gave up on the group (error_board.GAVE_UP_*:
                       a wait of its timed out, or it refused its input to a dispatch);
                       sig[4, src]: the host's refusal marks (symmetric.py), which no kernel reads

    every program:   its stores -> barrier -> +1 on a launch-local ticket (acq_rel, sys: carries
                     its stores, to any GPU, to whoever reads the ticket after it)
    last program:    the one that finds the ticket at programs - 1: atomic +1 on sig[phase, me] of
                     each peer (release, sys), once for the whole launch, then waits for the peers
    waiter:          acquire-reads sig[phase, :] and sig[GAVE_UP, :] until every source reached its
                     target, bounded by %globaltimer. A time-out writes the error board (first failure
                     wins) and sets sig[GAVE_UP, me] on every rank, itself included; a wait that finds a
                     rank's GAVE_UP set leaves at once and writes the board too.

One signal per launch and peer, not per program: R atomics on peers' counters per launch instead
of R per program, and ranks need not agree on how many programs a launch has. (Measured on an
H200, the signalling of a 128-program launch costs ~2-3 us either way; see
docs/PERFORMANCE.md#engine-defaults.) Counters only grow (targets are ``epoch``, on the device so replayed CUDA graphs
keep counting), so a signal of the next step is never taken for this one's.

A buffer whose group lost a rank stays quiet: every launch that writes into peers reads its own GAVE_UP
row first (``gave_up``) and, once any entry is set, writes and signals nothing; its last program reads
the row again before signalling, so a launch whose later programs skipped their rows never signals
(a launch already past that point when the row is set still completes). Without that, a rank
whose wait timed out went on to its next step (under a replayed CUDA graph no host check stops it)
and wrote that step's counts and rows into a slow peer still reading this one's, whose waits its
signals then satisfied: wrong rows on a rank whose board stayed clean. Waits never read the error
board (pinned host memory: one read from an H200 program costs ~7 us, a device-memory poll 0.2 us),
so a board set by a bad expert id, which breaks no step, stops no wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_moonep.engine.faults import error_board as eb

__all__ = ["T_COUNTS", "T_X", "T_W", "T_SRC", "T_CX", "T_CW", "T_SIG", "PH_COUNTS", "PH_DISPATCH", "PH_COMBINE",
           "GAVE_UP"]

# rows of the address table (constexpr: kernels read them)
T_COUNTS, T_X, T_W, T_SRC, T_CX, T_CW, T_SIG = (tl.constexpr(i) for i in range(7))
# phases (rows of sig), then the row of ranks that gave up on the group (symmetric.SIG_ROWS: the same order)
PH_COUNTS, PH_DISPATCH, PH_COMBINE, GAVE_UP = (tl.constexpr(i) for i in range(4))
# what the kernels record on the error board (codes defined in error_board)
C_WAIT_COUNTS, C_WAIT_ROWS, C_WAIT_OUTPUTS, C_BAD_ID, C_GAVE_UP = (
    tl.constexpr(c) for c in (eb.CODE_WAIT_COUNTS, eb.CODE_WAIT_ROWS, eb.CODE_WAIT_OUTPUTS, eb.CODE_BAD_ID,
                              eb.CODE_PEER_GAVE_UP))
GAVE_UP_TIMED_OUT = tl.constexpr(eb.GAVE_UP_TIMED_OUT)


@triton.jit
def now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def signal(table, R, me, phase, peer_mask, R_PAD: tl.constexpr):
    """Add 1 to ``sig[phase, me]`` on every peer in ``peer_mask`` (after this program's writes)."""
    tl.debug_barrier()
    d = tl.arange(0, R_PAD)
    m = (d < R) & peer_mask
    base = tl.load(table + T_SIG * R + d, mask=m, other=0)
    ptr = base.to(tl.pointer_type(tl.int64)) + phase * R + me
    tl.atomic_add(ptr, tl.full([R_PAD], 1, tl.int64), mask=m, sem="release", scope="sys")


@triton.jit
def report(board, code, peer, epoch, elapsed, seen, target):
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
def gave_up(sig, R, R_PAD: tl.constexpr):
    """1 + the lowest rank whose GAVE_UP entry is set on this rank, 0 while none is (read through to
    memory: peers write it)."""
    d = tl.arange(0, R_PAD)
    v = tl.load(sig + GAVE_UP * R + d, mask=d < R, other=0, volatile=True)
    return tl.min(tl.where(v != 0, d + 1, R_PAD + 1), axis=0) % (R_PAD + 1)


@triton.jit
def give_up(table, R, me, R_PAD: tl.constexpr):
    """Set ``sig[GAVE_UP, me]`` on every rank, this one included: their waits leave and their launches stop
    writing."""
    d = tl.arange(0, R_PAD)
    m = d < R
    base = tl.load(table + T_SIG * R + d, mask=m, other=0)
    ptr = base.to(tl.pointer_type(tl.int64)) + GAVE_UP * R + me
    tl.atomic_xchg(ptr, tl.full([R_PAD], GAVE_UP_TIMED_OUT, tl.int64), mask=m, sem="release", scope="sys")


@triton.jit
def wait(sig, phase, R, target, epoch_no, board, code, timeout_ns, table, me, R_PAD: tl.constexpr):
    """Spin until every ``sig[phase, src] >= target``, bounded. A time-out reports ``code`` and gives up on
    the group (``give_up``); a rank that gave up (its GAVE_UP entry here) ends the wait at once, reported as
    ``C_GAVE_UP`` naming it, unless every signal had arrived by the poll before (the group is given up either
    way: a step completing just then is reported too). Ends with a barrier, so every thread of the
    program may read what the peers wrote."""
    d = tl.arange(0, R_PAD)
    m = d < R
    ptr = sig + phase * R + d
    gptr = sig + GAVE_UP * R + d
    seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
    gone = tl.atomic_add(gptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="relaxed", scope="sys")
    pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
    quit = tl.sum(((gone != 0) & m).to(tl.int32), axis=0)
    t0 = now_ns()
    elapsed = t0 - t0
    while (pending > 0) & (elapsed < timeout_ns) & (quit == 0):
        seen = tl.atomic_add(ptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="acquire", scope="sys")
        gone = tl.atomic_add(gptr, tl.zeros([R_PAD], tl.int64), mask=m, sem="relaxed", scope="sys")
        pending = tl.sum(((seen < target) & m).to(tl.int32), axis=0)
        quit = tl.sum(((gone != 0) & m).to(tl.int32), axis=0)
        elapsed = now_ns() - t0
    if pending > 0:
        if quit > 0:
            who = tl.min(tl.where((gone != 0) & m, d, R_PAD), axis=0)
            why = tl.max(tl.where(d == who, gone, 0), axis=0)  # what that rank wrote: why it gave up
            report(board, C_GAVE_UP, who.to(tl.int64), epoch_no, elapsed, code, why)
        else:
            late = (seen < target) & m
            first = tl.min(tl.where(late, d, R_PAD), axis=0)
            got = tl.min(tl.where(d == first, seen, target), axis=0)
            report(board, code, first.to(tl.int64), epoch_no, elapsed, got, target)
            give_up(table, R, me, R_PAD)
    tl.debug_barrier()


@triton.jit
def last_to_arrive(ticket, n_prog):
    """True in exactly one program of the launch: the last to get here (after its own writes). The
    ticket's release/acquire are system-scoped, so every program's writes (also those into peers'
    memory) happen before whatever the last program does next, such as signalling the peers. It
    resets the ticket for the next launch that uses it."""
    tl.debug_barrier()
    t = tl.atomic_add(ticket, 1, sem="acq_rel", scope="sys")
    last = t == n_prog - 1
    if last:
        tl.store(ticket, 0)
    return last


@triton.jit
def exchange_counts(tpe, offs, mask, table, sig, epoch, board, timeout_ns, R, E, me, R_PAD: tl.constexpr):
    """Program ``d`` of a launch of ``R`` programs: this rank's ``tpe[offs]`` (expert ids) into row
    ``me`` of rank ``d``'s counts ``[R, E]``, signal ``d``; then wait (bounded) until every peer's
    counts of this step arrived here. Every program waits on ``epoch[PH_COUNTS] + 1`` and leaves the
    epoch alone: a later launch of the step advances it (``count_epoch``), after all have read it.
    Nothing is put or signalled once a rank gave up on the group (the wait then reports it)."""
    d = tl.program_id(0)
    live = gave_up(sig, R, R_PAD) == 0
    v = tl.load(tpe + offs, mask=mask, other=0)
    dst = tl.load(table + T_COUNTS * R + d).to(tl.pointer_type(tl.int32))
    tl.store(dst + me * E + offs, v.to(tl.int32), mask=mask & live)
    signal(table, R, me, PH_COUNTS, (tl.arange(0, R_PAD) == d) & live, R_PAD)
    ep = tl.load(epoch + PH_COUNTS) + 1
    wait(sig, PH_COUNTS, R, ep, ep, board, C_WAIT_COUNTS, timeout_ns, table, me, R_PAD)


@triton.jit
def count_epoch(epoch, phase):
    """Program 0: this phase happened once more (every reader of the old value ran in an earlier launch)."""
    if tl.program_id(0) == 0:
        tl.store(epoch + phase, tl.load(epoch + phase) + 1)
