"""Fused Triton grouped GEMM for MoonEP's expert compute (``impl="triton"``).

For each ``cu_seqlens`` group ``g`` (rows ``[cu[g-1], cu[g])`` of ``x``)::

    y[rows] = (silu(x[rows] @ gate_g^T) * (x[rows] @ up_g^T) * route_w[rows, None]) @ down_g^T

Three launches, no host synchronisation, CUDA-graph capturable (after one warm-up call that
builds the cached pointer table; the tile bodies are ``triton_tiles``'; a tile config with a
``"fused"`` entry runs the same tiles as one launch instead, ``triton_fused``, for decode):

1. ``_trim_kernel`` (grid ``[G]``): per group, the end of its last row with a non-zero routing
   weight. MoonEP pads every segment to a multiple of ``token_padding`` (128) with rows whose
   hidden state and weight are zero; a row with weight 0 has output exactly 0
   (``act = silu(.) * (.) * 0``), so the GEMMs run only over ``[start, eff_end)`` and the rest of
   the segment is written as zeros. This keeps one real row per expert from costing 128 rows of
   matrix work. (A row with weight 0 but a non-finite hidden state gets 0 here, NaN in the
   reference; the contract's padding rows are zeros.)
   A caller that knows these ends (the built-in engine's dispatch writes each segment's end of
   entries, ``Plan.live_ends``) passes them as ``row_ends`` and this launch is skipped (2-3 us of a
   CUDA graph at Qwen3-30B-A3B's 16-64 tokens).
2. ``_gate_up_kernel``: persistent grid; every program rebuilds the tile list from
   ``cu_seqlens`` and the trimmed ends in registers (prefix sum over the groups), so empty groups
   cost nothing and the grid size does not depend on the data. A tile is ``BM`` rows of one
   group times ``BN`` columns of the intermediate dimension; it runs both ``x @ gate^T`` and
   ``x @ up^T`` on the same ``x`` tile and writes ``silu(g) * u * route_w`` once, in the
   activation dtype (bf16). Within a group, tiles are ordered column-block-major so that the
   programs running at the same time share one weight slice through L2.
3. ``_down_kernel``: the same tile machinery over ``H`` output columns, ``K = I``; rows of the
   trimmed tail are written as zeros by extra "zero tiles" at the end of the schedule.

Both GEMM kernels also skip the main loop of a tile whose rows all have weight 0 (``triton_tiles.live``,
``padded=True``) and write its zeros: a padded step's padding entries land inside segments, not
only at their tails.

Weights are reached through a per-group pointer table (``int64 [G, 3]``: base address of
``gate_g``, ``up_g``, ``down_g``), built once per ``GroupedWeights`` (cached; rebuilt when a pool's
storage, the group map, or its version counter changes), so the pools may be any tensors, views
with arbitrary stride along dim 0 (``w13[:, :I, :]``), or several tensors. The inner strides of a
projection must agree across pools (non-conforming pools are copied once, with a warning), and every pool
must hold gate and up in one order (two tensors or halves, or interleaved: ``weights.py``; a source that mixes
them is refused, since the gate/up launch reads every group one way).

Operand loads, per tile config: pointer loads (the default), or with ``"tma": true`` tensor
descriptors (the Hopper bulk-copy engine): the rows ``x`` (``act``) are one descriptor per
program, and each tile describes its group's weight slice on the device from the pointer table,
so every pool layout above still works; ``"ws": true`` adds Triton's warp-specialized main loop
(loads in producer warps). A descriptor's rows past a group's end load the next group's rows
(their outputs are masked off), past ``NvS`` zeros. Where TMA cannot run (not Hopper-class, rows
not 16-byte aligned) the pointer loads do (said once). Device-built descriptors need Triton's
launch-time scratch allocator: one backed by torch is set where none is (``_ensure_scratch_allocator``).
``"streamk": true`` evens out the last tiles: a launch whose tiles do not divide into the programs
(17 busy groups x 6 column blocks = 102 gate/up tiles on 132 SMs, say: a fifth of the GPU idle, or
a second round for a few programs) runs all but its last full round of tiles round robin, then cuts
the rest into equal ranges of main-loop iterations, one per program; a tile cut between programs
is summed (float32, in program order) and finished by the piece that arrives last (``_sk_range``).
Its workspace is per device and shared by every layer (``_streamk``), so one device's expert
compute runs in stream order.
``"swap": true`` (swap-AB) puts the weights on the MMA's M side (``triton_tiles.mma``): a tile of 16-32
rows then runs Hopper's warpgroup MMA with the rows as its N, where unswapped it runs the per-warp
MMA; the sums are transposed back before the epilogue, so every schedule takes it (three launches,
one launch, stream-K). Measured within 4% either way of the same tiles unswapped (the regime is
memory-bound): it is one more candidate for ``--tune``.
Weights stored interleaved (gate row ``j`` at row ``2j`` of one ``w13``, up row ``j`` at ``2j + 1``: the symmetric
layout's order, ``weights.py``; every pool so) run each gate/up main-loop step as one ``[2BN, BK]`` weight block and
one MMA of ``2BN`` columns (``W13I``: on Hopper one warpgroup MMA of N = 2BN, the rows' block read from shared
memory once, instead of two of N = BN), every schedule; the sums are split into gate and up columns for the same
epilogue. The pointer table's gate column is then the ``w13`` row itself: no copy.
``"flat": true`` flattens a kernel's persistent tile loop into its main loop (Triton's
``tl.range(flatten=True)``: the next tile's loads are issued during this tile's epilogue), on steps
without padding (``padded=False``) and without ``ws`` (``_flat``). Same bits either way.
``"mix": true`` takes the tiles in another order (``_tile_order``, ``_tile``): the groups sorted by their rows on
the device (one ``tl.sort`` per program), then tiles from both ends of that list in turn, so that under
skewed routing the programs running at once mix memory-bound tiles (groups of few rows, each tile a weight
slice of its own) with compute-bound ones (a hot group's row tiles, sharing a slice through L2) instead of
running them in separate rounds. Same bits either way.
``"pair": true`` runs two ``BM``-row tiles of a group as one tile of ``2 BM`` rows wherever the second holds rows
(a group's odd last tile stays ``BM`` rows): each weight block is then loaded into shared memory once for both, so
at the ridge point (Kimi-K2 1024 tokens: ~170 rows per group, three 64-row tiles) the L2 serves each weight slice
twice instead of three times, while the rows computed stay those of ``BM``-row tiles (128-row tiles compute 256
there). The tile list counts pairs (``BMT``); each tile takes one of two main loops, by its rows. Measured 0.5-1.4%
(balanced) and 1.4-2.4% (skewed) faster there on an H100 and slower elsewhere (docs/PERFORMANCE.md, tile
options): a ``--tune`` candidate. Stream-K does not take it (refused).

Tile configurations come from the GPU's section of ``tuning.json`` (``policy.py``: its own, or the one
its compute capability borrows, said once), looked up by ``H``, ``I`` and the step's tokens per rank
where the caller passes them, else by the row count ``NvS`` (``max_rows``, which the buffer derives
from the token capacity); unknown shapes use a generic rule, and so does every shape when the file
cannot be read or parsed (reported once, WARNING, by ``policy.load_table``). A batch-invariant call
(``expert_ffn(batch_invariant=True)``) runs the same tiles without stream-K (``invariance.py``).
An entry with ``"fused": {"num_warps", "num_stages", "progs_per_sm"}`` runs its gate_up and down
tiles in one launch (where ``bench_experts --tune`` measured that faster than three); the options of the
three-launch loops (``ws``, ``flat``) stay in such an entry, so that its tiles time as three launches
as they were before, and the one launch does not take them.

Interpreter (CPU): the same kernels run under ``TRITON_INTERPRET=1`` on CPU tensors. Triton's
interpreter computes a bf16 ``tl.dot`` wrongly (seen with triton 3.8), so when interpreting the
kernels are instantiated with ``DOT_F32=True``: operands are loaded and stored in their own
dtype (bf16) and upcast to float32 just before each ``tl.dot``. Everything else (pointer table,
tile list, trimming, masks, epilogues) is the code the GPU runs.
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
import triton
import triton.language as tl

from vllm_moonep.common.grouped_gemm import invariance, policy
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights, check_tail_args, interleaved_views
from vllm_moonep.common.grouped_gemm.triton_fused import SYNC_WORDS, fused_kernel
from vllm_moonep.common.grouped_gemm.triton_tiles import (down_acc, down_store, down_tile, gate_up_acc, gate_up_store,
                                                          gate_up_tile, pick, tile_index, trim_end, zero_rows)
from vllm_moonep.engine.defaults import resolve_device, say_once
from vllm_moonep.engine.errors import MoonEPInputError
from vllm_moonep.engine.launch import capability, interpreting, sm_count

log = logging.getLogger(__name__)

__all__ = [
    "expert_ffn_triton",
    "prepare_weights",
    "select_config",
    "interpreting",
    "DEFAULT_CONFIGS",
]


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _trim_kernel(cu_ptr, rw_ptr, eff_ptr, BLK: tl.constexpr):
    """eff_end[g] = 1 + the last row of group g with a non-zero routing weight (start if none)."""
    g = tl.program_id(0)
    end = tl.load(cu_ptr + g).to(tl.int32)
    start = tl.load(cu_ptr + g - 1, mask=g > 0, other=0).to(tl.int32)
    tl.store(eff_ptr + g, trim_end(rw_ptr, start, end, BLK))


@triton.jit
def _group_table(cu_ptr, eff_ptr, G, GP2: tl.constexpr, BM: tl.constexpr):
    """Per-group vectors (registers): start, trimmed end, segment end, m-blocks over the trimmed rows."""
    gidx = tl.arange(0, GP2)
    gmask = gidx < G
    end = tl.load(cu_ptr + gidx, mask=gmask, other=0).to(tl.int32)
    start = tl.load(cu_ptr + gidx - 1, mask=gmask & (gidx > 0), other=0).to(tl.int32)
    eend = tl.load(eff_ptr + gidx, mask=gmask, other=0)
    eend = tl.minimum(tl.maximum(eend, start), end)  # a caller's ends (row_ends) never reach past the segment
    mb = (eend - start + BM - 1) // BM
    return gidx, start, eend, end, mb


@triton.jit
def _tile_order(gidx, mb, nt, GP2: tl.constexpr, MIX: tl.constexpr):
    """The order tiles are taken in: per position of the tile list, its group and m-blocks, and the list's
    tile counts and their running sum. Group order, or (``MIX``, a tile config's ``"mix"``) groups sorted by
    their m-blocks, fewest first, for ``_tile`` to take from both ends at once (see ``_tile``)."""
    order = gidx
    omb = mb
    if MIX:  # one sort of (m-blocks, group) keys: unique, so the order is the same in every program
        key = tl.sort(mb * GP2 + gidx)
        order = key % GP2
        omb = key // GP2
    otiles = omb * nt
    return order, omb, otiles, tl.cumsum(otiles, 0)


@triton.jit
def _tile(t, total, ocum, otiles, order, omb, gidx, start, eend, N, BM: tl.constexpr, BN: tl.constexpr,
          EVEN_N: tl.constexpr, MIX: tl.constexpr):
    """Decode persistent tile ``t`` of ``total`` in the order of ``_tile_order``: its group, the group mask, the
    end of the group's rows that need computing, the tile's rows and columns (plus clamped copies always safe
    to load), and its first row and column (where the tensor-descriptor loads start). ``MIX``: even ``t``
    take the sorted list from its start (groups of few rows: tiles that each read a weight slice of their
    own, bound by memory), odd ``t`` from its end (the hot groups: row tiles that share a slice through L2,
    bound by the tensor cores), so the programs running at once mix the two kinds instead of running
    a hot group's tiles together and then the cold groups' (under skewed routing one then waits for
    memory, the other for math). With an even program count each program stays on one end (its ``t`` keep their
    parity); programs alternating between the ends round by round measured the same or 1-2% slower (one H100,
    ``bench_levers --lever mix``). The order moves no tile's work: the outputs are the same bits."""
    p = t
    if MIX:
        p = tl.where(t % 2 == 0, t // 2, total - 1 - t // 2)
    pos = tl.sum((ocum <= p).to(tl.int32), 0)
    psel = gidx == pos
    local = p - pick(psel, ocum - otiles)
    mbg = pick(psel, omb)
    if MIX:
        g = pick(psel, order)
        sel = gidx == g
    else:
        g = pos
        sel = psel
    ntile = local // mbg
    mtile = local - ntile * mbg
    ee = pick(sel, eend)
    row0 = pick(sel, start) + mtile * BM
    col0 = ntile * BN
    rows, rows_ld, cols, cols_ld = tile_index(row0, col0, ee, N, BM, BN, EVEN_N)
    return g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0


# Stream-K (a tile config's ``"streamk"``): the last tiles are cut into pieces of the reduction
# dimension so that every program gets the same number of main-loop iterations. Tiles first go
# round robin, one tile per program per round, for all but the last full round ("data-parallel":
# programs running at once share weight slices through L2); the rest (between one and two rounds
# of tiles, or every tile when there are fewer) is one run of ``tiles x cdiv(K, BK)`` iterations,
# cut into ``nprog`` equal ranges. A tile whose iterations fall in one range is a whole tile; a
# tile cut between programs p0..p1 has each piece's float32 sums written to the workspace (slot
# ``2q + (q == p0)`` for program q: a program holds at most one piece that starts a cut tile and
# one that ends one), then a ticket (``tickets[p0]``, one per cut tile) counts the pieces in; the
# piece that arrives last adds all of them, in program order, and runs the epilogue. No program
# waits for another, so any grid runs (and the interpreter, which runs programs one by one), and
# the sum's order is fixed: the same bits every launch. The last piece puts the ticket back to 0.
@triton.jit
def _sk_range(total, nprog, pid, K, BK: tl.constexpr):
    """``(dp_total, ipt, L, it, it_end)``: the round-robin tiles, iterations per tile, iterations
    per program, and this program's range of the stream-K iterations."""
    ipt = tl.cdiv(K, BK)
    dp_total = tl.maximum(total // nprog - 1, 0) * nprog
    sk_it = (total - dp_total) * ipt
    L = tl.maximum(tl.cdiv(sk_it, nprog), 1)
    it = pid * L
    return dp_total, ipt, L, it, tl.minimum(it + L, sk_it)


@triton.jit
def _sk_piece(it, it_end, ipt, L):
    """The piece from stream-K iteration ``it`` on: its tile of the run, the tile's main-loop
    iterations it holds ``[kk0, kk1)``, and the programs ``p0..p1`` that hold the tile's pieces."""
    ts = it // ipt
    kk0 = it - ts * ipt
    kk1 = tl.minimum(ipt, kk0 + (it_end - it))
    return ts, kk0, kk1, (ts * ipt) // L, (ts * ipt + ipt - 1) // L


@triton.jit
def _sk_slot(q, p0):
    return 2 * q + (q == p0).to(tl.int32)


@triton.jit
def _sk_put(ws_ptr, slot, plane, acc, PLANES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A piece's float32 sums into its workspace slot."""
    r = tl.arange(0, BM)
    c = tl.arange(0, BN)
    base = ws_ptr + (slot * PLANES + plane).to(tl.int64) * (BM * BN)
    tl.store(base + r[:, None] * BN + c[None, :], acc)


@triton.jit
def _sk_get(ws_ptr, slot, plane, PLANES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A piece's sums from the workspace (written by other programs: past L1)."""
    r = tl.arange(0, BM)
    c = tl.arange(0, BN)
    base = ws_ptr + (slot * PLANES + plane).to(tl.int64) * (BM * BN)
    return tl.load(base + r[:, None] * BN + c[None, :], cache_modifier=".cg")


@triton.jit
def _sk_last(tk_ptr, p0, p1):
    """Count this program's piece in (its sums already stored); whether it was the tile's last."""
    tl.debug_barrier()  # every thread's stores, then one release carries them
    n = tl.atomic_add(tk_ptr + p0, 1, sem="acq_rel", scope="gpu")
    last = n == p1 - p0
    if last:
        tl.store(tk_ptr + p0, 0)  # every piece is in: the ticket at rest for the next launch
    tl.debug_barrier()  # every thread's workspace loads after the acquire
    return last


@triton.jit
def _gate_up_kernel(
    x_ptr, rw_ptr, cu_ptr, eff_ptr, tab_ptr, act_ptr, ws_ptr, tk_ptr,
    M, G, N, K, stride_xm, stride_am,
    s_gn, s_gk, s_un, s_uk,
    GP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, SKIP: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, FLAT: tl.constexpr, STREAMK: tl.constexpr, SWAP: tl.constexpr,
    W13I: tl.constexpr, MIX: tl.constexpr, PAIR: tl.constexpr, BMT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    gidx, start, eend, end, mb = _group_table(cu_ptr, eff_ptr, G, GP2, BMT)
    nt = tl.cdiv(N, BN)
    tiles = mb * nt
    total = tl.sum(tiles, 0)
    order, omb, otiles, ocum = _tile_order(gidx, mb, nt, GP2, MIX)
    wty = tl.pointer_type(x_ptr.dtype.element_ty)
    xd = x_ptr
    xd2 = x_ptr
    if TMA:  # rows past the group's end load the next group's (never stored), past M zeros
        xd = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BM, BK])
        if PAIR:  # the rows of a pair of row tiles as one block
            xd2 = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BMT, BK])
    rr_total = total
    if STREAMK:
        rr_total, ipt, L, it, it_end = _sk_range(total, nprog, pid, K, BK)
    for t in tl.range(pid, rr_total, nprog, flatten=FLAT):
        g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0 = _tile(t, total, ocum, otiles, order, omb, gidx, start,
                                                                     eend, N, BMT, BN, EVEN_N, MIX)
        wg = tl.multiple_of(tl.load(tab_ptr + g * 3).to(wty), 16)
        wu = tl.multiple_of(tl.load(tab_ptr + g * 3 + 1).to(wty), 16)
        if PAIR:
            if row0 + BM < ee:  # both row tiles hold rows: one tile of BMT rows, each weight block loaded once
                gate_up_tile(x_ptr, rw_ptr, act_ptr, wg, wu, xd2, rows, rows_ld, ee, cols, cols_ld, row0, col0,
                             N, K, stride_xm, stride_am, s_gn, s_gk, s_un, s_uk,
                             BMT, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP, W13I)
            else:  # a group's odd last row tile
                rows1, rows1_ld, _c, _cl = tile_index(row0, col0, ee, N, BM, BN, EVEN_N)
                gate_up_tile(x_ptr, rw_ptr, act_ptr, wg, wu, xd, rows1, rows1_ld, ee, cols, cols_ld, row0, col0,
                             N, K, stride_xm, stride_am, s_gn, s_gk, s_un, s_uk,
                             BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP, W13I)
        else:
            gate_up_tile(x_ptr, rw_ptr, act_ptr, wg, wu, xd, rows, rows_ld, ee, cols, cols_ld, row0, col0,
                         N, K, stride_xm, stride_am, s_gn, s_gk, s_un, s_uk,
                         BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP, W13I)
    if STREAMK:  # the rest in equal ranges of main-loop iterations (see _sk_range)
        while it < it_end:
            ts, kk0, kk1, p0, p1 = _sk_piece(it, it_end, ipt, L)
            g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0 = _tile(rr_total + ts, total, ocum, otiles, order, omb,
                                                                         gidx, start, eend, N, BM, BN, EVEN_N, MIX)
            wg = tl.multiple_of(tl.load(tab_ptr + g * 3).to(wty), 16)
            wu = tl.multiple_of(tl.load(tab_ptr + g * 3 + 1).to(wty), 16)
            acc_g, acc_u = gate_up_acc(x_ptr, rw_ptr, wg, wu, xd, rows, rows_ld, ee, cols_ld, row0, col0,
                                       kk0 * BK, kk1 * BK, N, K, stride_xm, s_gn, s_gk, s_un, s_uk,
                                       BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP, W13I)
            if (kk0 == 0) & (kk1 == ipt):
                gate_up_store(acc_g, acc_u, rw_ptr, act_ptr, rows, rows_ld, ee, cols, N, stride_am)
            else:
                slot = _sk_slot(pid, p0)
                _sk_put(ws_ptr, slot, 0, acc_g, 2, BM, BN)
                _sk_put(ws_ptr, slot, 1, acc_u, 2, BM, BN)
                if _sk_last(tk_ptr, p0, p1):
                    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
                    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
                    for q in range(p0, p1 + 1):
                        acc_g += _sk_get(ws_ptr, _sk_slot(q, p0), 0, 2, BM, BN)
                        acc_u += _sk_get(ws_ptr, _sk_slot(q, p0), 1, 2, BM, BN)
                    gate_up_store(acc_g, acc_u, rw_ptr, act_ptr, rows, rows_ld, ee, cols, N, stride_am)
            it += kk1 - kk0


@triton.jit
def _down_kernel(
    act_ptr, rw_ptr, cu_ptr, eff_ptr, tab_ptr, out_ptr, ws_ptr, tk_ptr,
    M, G, N, K, stride_am, stride_om,
    s_dn, s_dk,
    GP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ZM: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, SKIP: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, FLAT: tl.constexpr, STREAMK: tl.constexpr, SWAP: tl.constexpr,
    ZT: tl.constexpr, MIX: tl.constexpr, PAIR: tl.constexpr, BMT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    gidx, start, eend, end, mb = _group_table(cu_ptr, eff_ptr, G, GP2, BMT)
    nt = tl.cdiv(N, BN)
    tiles = mb * nt
    total = tl.sum(tiles, 0)
    order, omb, otiles, ocum = _tile_order(gidx, mb, nt, GP2, MIX)
    # zero tiles: rows [start + mb1*BM, end) of each segment (trimmed tail, all-zero output), mb1 the BM-row tiles
    # that cover its rows (with PAIR a group's odd last tile covers BM rows, not BMT)
    mb1 = (eend - start + BM - 1) // BM
    zstart = tl.minimum(start + mb1 * BM, end)
    zrows = tl.maximum(end - zstart, 0)
    ztiles = ((zrows + ZM - 1) // ZM) * nt
    zcum = tl.cumsum(ztiles, 0)
    ztotal = tl.sum(ztiles, 0)
    wty = tl.pointer_type(act_ptr.dtype.element_ty)
    ad = act_ptr
    ad2 = act_ptr
    if TMA:
        ad = tl.make_tensor_descriptor(act_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, BK])
        if PAIR:
            ad2 = tl.make_tensor_descriptor(act_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BMT, BK])
    rr_total = total
    if STREAMK:
        rr_total, ipt, L, it, it_end = _sk_range(total, nprog, pid, K, BK)
    for t in tl.range(pid, rr_total, nprog, flatten=FLAT):
        g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0 = _tile(t, total, ocum, otiles, order, omb, gidx, start,
                                                                     eend, N, BMT, BN, EVEN_N, MIX)
        wd = tl.multiple_of(tl.load(tab_ptr + g * 3 + 2).to(wty), 16)
        if PAIR:
            if row0 + BM < ee:  # both row tiles hold rows (see _gate_up_kernel)
                down_tile(act_ptr, rw_ptr, out_ptr, wd, ad2, rows, rows_ld, ee, pick(sel, end), cols, cols_ld, row0,
                          col0, N, K, stride_am, stride_om, s_dn, s_dk,
                          BMT, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP)
            else:  # a group's odd last row tile: its BM rows; the rest of the segment is the zero tiles'
                rows1, rows1_ld, _c, _cl = tile_index(row0, col0, ee, N, BM, BN, EVEN_N)
                down_tile(act_ptr, rw_ptr, out_ptr, wd, ad, rows1, rows1_ld, ee, pick(sel, end), cols, cols_ld, row0,
                          col0, N, K, stride_am, stride_om, s_dn, s_dk,
                          BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP)
        else:
            down_tile(act_ptr, rw_ptr, out_ptr, wd, ad, rows, rows_ld, ee, pick(sel, end), cols, cols_ld, row0, col0,
                      N, K, stride_am, stride_om, s_dn, s_dk,
                      BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP)
    first_z = total + (pid - total % nprog + nprog) % nprog  # continuing the same round robin
    if STREAMK:  # the rest in equal ranges of main-loop iterations (see _sk_range)
        first_z = total + pid
        while it < it_end:
            ts, kk0, kk1, p0, p1 = _sk_piece(it, it_end, ipt, L)
            g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0 = _tile(rr_total + ts, total, ocum, otiles, order, omb,
                                                                         gidx, start, eend, N, BM, BN, EVEN_N, MIX)
            wd = tl.multiple_of(tl.load(tab_ptr + g * 3 + 2).to(wty), 16)
            acc = down_acc(act_ptr, rw_ptr, wd, ad, rows, rows_ld, ee, cols_ld, row0, col0, kk0 * BK, kk1 * BK,
                           N, K, stride_am, s_dn, s_dk, BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP)
            if (kk0 == 0) & (kk1 == ipt):
                down_store(acc, out_ptr, rows, ee, pick(sel, end), cols, N, stride_om)
            else:
                _sk_put(ws_ptr, _sk_slot(pid, p0), 0, acc, 1, BM, BN)
                if _sk_last(tk_ptr, p0, p1):
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
                    for q in range(p0, p1 + 1):
                        acc += _sk_get(ws_ptr, _sk_slot(q, p0), 0, 1, BM, BN)
                    down_store(acc, out_ptr, rows, ee, pick(sel, end), cols, N, stride_om)
            it += kk1 - kk0
    # then the zero tiles, round robin over programs (ZT: the caller reads the segments' tails)
    if ZT:
        for t in range(first_z, total + ztotal, nprog):
            tz = t - total
            zg = tl.sum((zcum <= tz).to(tl.int32), 0)
            zsel = gidx == zg
            zlocal = tz - pick(zsel, zcum - ztiles)
            nzm = (pick(zsel, zrows) + ZM - 1) // ZM
            zn = zlocal // nzm
            zm = zlocal - zn * nzm
            zr = pick(zsel, zstart) + zm * ZM + tl.arange(0, ZM)
            zero_rows(out_ptr, zr, pick(zsel, end), zn * BN + tl.arange(0, BN), N, stride_om, ZM, BN)


# ----------------------------------------------------------------------------------------------
# pointer table (cached per GroupedWeights)
# ----------------------------------------------------------------------------------------------


class _Prepared:
    __slots__ = ("key", "table", "strides", "keep", "device", "sync", "w13i")

    def __init__(self, key, table, strides, keep, device, sync):
        self.key, self.table, self.strides, self.keep, self.device = key, table, strides, keep, device
        #: the one-launch kernel's counters (``triton_fused``): zero here, restored by each launch
        self.sync = sync
        #: every pool's gate and up are rows of one interleaved ``w13`` (``interleaved_views``): the gate/up tiles
        #: read them as one weight (``W13I``)
        self.w13i = False


_CACHE: dict[int, _Prepared] = {}


def _weights_key(w: GroupedWeights, device) -> tuple:
    pools = tuple(
        (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t._version) for proj in (w.gate, w.up, w.down) for t in proj
    )
    return (
        str(device),
        pools,
        w.group_pool.data_ptr(), w.group_pool._version, w.group_pool.numel(),
        w.group_row.data_ptr(), w.group_row._version,
    )


def _conform(pools, what: str) -> tuple[list[torch.Tensor], tuple[int, int], list[torch.Tensor]]:
    """Make every pool of one projection share the inner strides of pool 0 (copy the others once)."""
    inner = tuple(pools[0].stride()[1:])
    keep = []
    if inner[1] != 1:
        # K must be the contiguous dim for fast loads; copy (and keep the copy: the table points into it).
        warnings.warn(f"expert_ffn_triton: {what} pool 0 has inner strides {inner}; copying to contiguous", stacklevel=3)
        pools = [pools[0].contiguous(), *pools[1:]]
        keep.append(pools[0])
        inner = tuple(pools[0].stride()[1:])
    out = []
    for i, p in enumerate(pools):
        if tuple(p.stride()[1:]) != inner:
            warnings.warn(f"expert_ffn_triton: {what} pool {i} has inner strides {tuple(p.stride()[1:])} != {inner}; copying", stacklevel=3)
            p = p.contiguous()
            if tuple(p.stride()[1:]) != inner:
                raise MoonEPInputError(f"expert_ffn_triton: {what} pool {i} cannot be brought to inner strides {inner}")
            keep.append(p)
        out.append(p)
    return out, inner, keep


def prepare_weights(weights: GroupedWeights, device: torch.device | str | None = None) -> _Prepared:
    """Build (or fetch from the cache) the per-group pointer table of ``weights``.

    Call it once before CUDA-graph capture; ``expert_ffn_triton`` calls it too (a dictionary
    lookup and a key check once built). The table is ``int64 [G, 3]`` on ``device``.
    """
    # one name per device (resolve_device): a table prepared for "cuda" must serve the layer's x.device (cuda:0),
    # not be built again beside it (new counters under a captured graph)
    device = resolve_device(device if device is not None else weights.gate[0].device)
    key = _weights_key(weights, device)
    wid = id(weights)
    hit = _CACHE.get(wid)
    if hit is not None and hit.key == key:
        return hit
    orders = [interleaved_views(g, u) for g, u in zip(weights.gate, weights.up)]
    if len(set(orders)) > 1:
        raise MoonEPInputError("expert_ffn_triton: the pools hold gate and up in different orders (interleaved in pools "
                               f"{[p for p, o in enumerate(orders) if o]}, not in the others): store every pool one "
                               "way (interleave_gate_up converts a pool)")
    gate, gs, k1 = _conform(list(weights.gate), "gate")
    up, us, k2 = _conform(list(weights.up), "up")
    down, ds, k3 = _conform(list(weights.down), "down")
    gp = weights.group_pool.tolist()
    gr = weights.group_row.tolist()
    tab = []
    for p, r in zip(gp, gr):
        if p < 0:
            tab.append((0, 0, 0))
            continue
        row = []
        for pools in (gate, up, down):
            t = pools[p]
            if not 0 <= r < t.shape[0]:
                raise MoonEPInputError(f"expert_ffn_triton: group row {r} outside pool {p} of {t.shape[0]} rows")
            row.append(t.data_ptr() + r * t.stride(0) * t.element_size())
        tab.append(tuple(row))
    table = torch.tensor(tab, dtype=torch.int64).reshape(-1, 3).to(device)
    for t in (*gate, *up, *down):
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:2]):
            # the kernels hint 16-byte alignment of each row base; fall back to a copy
            raise MoonEPInputError("expert_ffn_triton: weight pools must be 16-byte aligned with row strides divisible by 8")
    # the counters are at rest (zero) between launches: a rebuild keeps them, so a CUDA graph captured
    # before it still points at live memory (the table it captured is replaced; the counters are not)
    if hit is not None and hit.sync.numel() == SYNC_WORDS + len(gp) and hit.device == device:
        sync = hit.sync
    else:
        sync = torch.zeros(SYNC_WORDS + len(gp), dtype=torch.int32, device=device)
    prep = _Prepared(key, table, (gs, us, ds), k1 + k2 + k3, device, sync)
    prep.w13i = all(interleaved_views(g, u) for g, u in zip(gate, up))
    _CACHE[wid] = prep
    try:
        weakref.finalize(weights, _CACHE.pop, wid, None)
    except TypeError:
        pass
    return prep


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

# Generic configs (used where tuning.json has no entry for the shape), by the step's tokens per rank
# (GENERIC_BY_TOKENS) where the caller knows them, else by the rows per group the buffer implies. "stream" runs
# 3 stages so that its two programs per SM fit one SM's shared memory (80 KB each); "mid" asks for two programs
# of 192 KB, one of which resides at a time, the rest running as a second wave: one program per SM measured
# 0.98-1.07x of that (docs/PERFORMANCE.md, shapes without a tile entry).
DEFAULT_CONFIGS = {
    "stream": {
        "gate_up": {"BM": 16, "BN": 32, "BK": 256, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2},
        "down": {"BM": 16, "BN": 64, "BK": 256, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2},
    },
    "mid": {
        "gate_up": {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
        "down": {"BM": 64, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    },
    "compute": {
        "gate_up": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
        "down": {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
    },
}

#: the generic config by tokens per rank: ``(up to tokens, DEFAULT_CONFIGS key)``, the first that covers the step
#: (``None``: no upper end); measured at H=4096, I=1536 (Qwen3-235B-A22B's experts), rank 0 of EP=8
#: (``bench_levers --lever generic --shapes untuned``), where the rows-per-group rule (the fallback without the
#: step's tokens), which counts the buffer's padding slack as rows, takes "mid" from 1 to 1024 tokens
GENERIC_BY_TOKENS = ((16, "stream"), (64, "mid"), (None, "compute"))
_GENERIC_RULE = ", ".join(f"{name} up to {upto}" if upto is not None else f"{name} above"
                          for upto, name in GENERIC_BY_TOKENS)

_INTERP_CONFIG = {
    "gate_up": {"BM": 16, "BN": 16, "BK": 32, "num_warps": 4, "num_stages": 1, "progs_per_sm": 1},
    "down": {"BM": 16, "BN": 32, "BK": 16, "num_warps": 4, "num_stages": 1, "progs_per_sm": 1, "ZM": 32},
}

def select_config(H: int, I: int, nvs: int, n_groups: int, entries: list | None = None,
                  tokens: int | None = None) -> dict:
    """Tile configs for ``(gate_up, down)``: the tile entry for ``(H, I)`` with the smallest
    ``tokens_per_rank >= tokens`` when the caller knows the step's tokens per rank (the rows a
    rank computes follow them, whatever the buffer's slack), else the smallest ``max_rows >= NvS``
    (``NvS`` = ``S*K`` plus ``2*(tp-1)*E/R`` rows of slack: at world size 1 the slack alone
    passes every entry tuned at EP=8); with no entry for the shape, a generic regime
    (``DEFAULT_CONFIGS``) by the step's tokens per rank (``GENERIC_BY_TOKENS``), else by the rows per group
    the buffer implies (said once). ``entries``: tile entries (a ``policy.DevicePolicy``'s ``tiles``); ``None``:
    those of the current CUDA device's policy (``policy.py``: its own section of ``tuning.json``, or the
    one it borrows)."""
    if interpreting():
        return _INTERP_CONFIG
    if entries is None:
        x = torch.empty(0, device=torch.cuda.current_device()) if torch.cuda.is_available() else torch.empty(0)
        entries = list(policy.policy_of(x).tiles)
    table = entries
    best = None
    if tokens is not None:
        for e in table:
            if e.get("H") == H and e.get("I") == I and tokens <= e.get("tokens_per_rank", -1):
                if best is None or e["tokens_per_rank"] < best["tokens_per_rank"]:
                    best = e
    for e in table if best is None else ():
        if e.get("H") == H and e.get("I") == I and nvs <= e.get("max_rows", 0):
            if best is None or e["max_rows"] < best["max_rows"]:
                best = e
    if best is None:
        cands = [e for e in table if e.get("H") == H and e.get("I") == I]
        if cands:
            best = max(cands, key=lambda e: e.get("max_rows", 0))
    if best is not None:
        cfg = {"gate_up": best["gate_up"], "down": best["down"]}
        if best.get("fused"):
            cfg["fused"] = best["fused"]
        return cfg
    say_once(f"MoonEP expert kernels: no tile entry for H={H}, I={I} on this GPU (tuning.json); generic tiles by "
             f"tokens per rank ({_GENERIC_RULE}), or by rows per group where the step's tokens are not known", __name__)
    if tokens is not None:
        return DEFAULT_CONFIGS[next(name for upto, name in GENERIC_BY_TOKENS if upto is None or tokens <= upto)]
    per_group = nvs / max(1, min(n_groups, 64))
    if per_group < 48:
        return DEFAULT_CONFIGS["stream"]
    if per_group < 192:
        return DEFAULT_CONFIGS["mid"]
    return DEFAULT_CONFIGS["compute"]


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory Triton asks for at launch (the tensor descriptors a kernel builds on the device)."""
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _ensure_scratch_allocator() -> None:
    """Kernels that build tensor descriptors on the device need Triton's launch-time allocator;
    none is set by default (a ContextVar: each thread's context starts without one). Ours is set
    only where none is, so a caller's own allocator (vLLM's, for one) stays."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


#: warps the warp-specialized loop (``"ws"``) needs: Triton 3.6 on an H200 failed to compile it with 4
#: (``PassManager::run failed`` in its warp-specialization pass) and compiled it with 8
WS_MIN_WARPS = 8


def _descriptors(c: dict, a: torch.Tensor, w_row_strides: tuple) -> tuple[bool, bool]:
    """``(TMA, WS)`` for one launch: a tile config's ``tma`` (operands loaded through tensor
    descriptors: the rows ``a`` as one, each group's weights as one built on the device) and ``ws``
    (warp-specialized main loop, with ``tma`` only), where the hardware and the layout allow it:
    TMA needs a Hopper-class GPU (or the interpreter), 16-byte aligned bases and row strides. A
    config that asks for it elsewhere runs the pointer loads (said once)."""
    if not c.get("tma", False):
        return False, False
    esize = a.element_size()
    ok = a.data_ptr() % 16 == 0 and all((s * esize) % 16 == 0 for s in (a.stride(0), *w_row_strides))
    if ok and not interpreting():
        ok = a.is_cuda and capability(a.device)[0] >= 9
        if ok:
            _ensure_scratch_allocator()
    if not ok:
        say_once("MoonEP expert kernels: tiles with tensor-descriptor (TMA) loads need a Hopper-class GPU and "
                 f"16-byte aligned rows (here: {a.device}, row stride {a.stride(0)} x {esize} B, weight row strides "
                 f"{tuple(w_row_strides)}); using pointer loads", __name__)
        return False, False
    return True, _ws(c)


def _ws(c: dict) -> bool:
    """A TMA tile config's ``ws`` where Triton can compile it: with at least ``WS_MIN_WARPS`` warps."""
    ws = bool(c.get("ws", False))
    if ws and c["num_warps"] < WS_MIN_WARPS and not interpreting():
        say_once(f"MoonEP expert kernels: a tile config asks for the warp-specialized loop with {c['num_warps']} warps; "
                 f"Triton's Hopper warp specialization needs {WS_MIN_WARPS} (it fails to compile with fewer): "
                 "running that loop without it", __name__)
        ws = False
    return ws


def _w13i(prep: _Prepared) -> tuple[bool, tuple]:
    """``(W13I, gate/up strides)`` of a gate/up launch: weights stored interleaved (``prep.w13i``) are read as one
    ``[2I, H]`` weight per group at the table's gate column, whose rows are half the gate view's row stride apart
    (``triton_tiles.gate_up_acc``; the up column and strides are then unused); halves as two."""
    if not prep.w13i:
        return False, prep.strides[:2]
    s_gn, s_gk = prep.strides[0]
    return True, ((s_gn // 2, s_gk), (s_gn // 2, s_gk))


def _swap(c: dict) -> bool:
    """A tile config's ``swap`` (swap-AB, ``triton_tiles.mma``): off unless the config asks; every
    schedule and both operand loads take it, so no kernel option drops it (a batch-invariant call keeps it
    too: its rows' sums measured bit-equal to the other tiles', ``invariance.py``)."""
    return bool(c.get("swap", False))


def _mix(c: dict) -> bool:
    """A tile config's ``mix`` (``_tile``: cold groups' tiles and hot groups' taken side by side): off unless the
    config asks; both kernels of three launches take it with every other option."""
    return bool(c.get("mix", False))


def _pair(c: dict) -> bool:
    """A tile config's ``pair`` (two ``BM``-row tiles of a group run as one tile of ``2 BM`` rows where both hold
    rows: each weight block loaded once for both): off unless the config asks. Stream-K cuts whole tiles of one
    size, so it does not take ``pair``: a config asking for both is refused."""
    pair = bool(c.get("pair", False))
    if pair and c.get("streamk", False):
        raise MoonEPInputError("expert_ffn_triton: a tile config asks for both \"pair\" and \"streamk\"; stream-K "
                               "cuts tiles of one size: drop one of them")
    return pair


def _flat(c: dict, ws: bool, skip: bool) -> bool:
    """A tile config's ``flat`` where Triton can flatten the tile loop: not with ``ws``, and not when
    tiles of weight-0 rows are skipped (``skip``: the main loop's bound then varies by tile, and
    Triton fuses only loops whose inner bound does not; it would leave the loops nested anyway)."""
    if not c.get("flat", False):
        return False
    if ws or skip:
        say_once("MoonEP expert kernels: a tile config asks for the flattened tile loop (\"flat\"); it runs nested "
                 + ("with the warp-specialized loop" if ws else "on steps with padding (the tile skip)")
                 + ", where Triton cannot flatten it", __name__)
        return False
    return True


#: stream-K workspaces (float32 piece sums, int32 tickets at rest at zero), by device and size:
#: shared by every layer's launches on that device, which therefore run in stream order
_STREAMK_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _streamk(c: dict, device, nprog: int, planes: int, fallback: tuple) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """``(STREAMK, workspace, tickets)`` for one launch of tile config ``c`` (``"streamk"``: see
    ``_sk_range``). The workspace holds two pieces per program; made once per device and size (before
    a CUDA graph is captured, by the warm-up call), so graphs keep pointing at live memory."""
    if not c.get("streamk", False):
        return (False, *fallback)
    n = 2 * nprog * planes * c["BM"] * c["BN"]
    key = (str(device), nprog, n)
    hit = _STREAMK_WS.get(key)
    if hit is None:
        say_once("MoonEP expert kernels: tiles with \"streamk\" cut the last tiles between programs; their "
                 "workspace is per device, so the expert compute of one device runs in stream order "
                 "(not on two CUDA streams at once)", __name__)
        hit = (torch.empty(n, dtype=torch.float32, device=device), torch.zeros(nprog, dtype=torch.int32, device=device))
        _STREAMK_WS[key] = hit
    return (True, *hit)


def _launch_trim(cu, route_w, eff):
    return _trim_kernel[(int(cu.numel()),)](cu, route_w, eff, BLK=256, num_warps=4)


def _launch_gate_up(x, route_w, cu, eff, prep, act, c, dot_f32, skip=False):
    I, H = act.shape[1], x.shape[1]
    G = int(cu.numel())
    w13i, ((s_gn, s_gk), (s_un, s_uk)) = _w13i(prep)
    tma, ws = _descriptors(c, x, (s_gn, s_un))
    flat = _flat(c, ws, skip)
    grid = (max(1, sm_count(x.device) * int(c.get("progs_per_sm", 1))),)
    sk, wsp, tks = _streamk(c, x.device, grid[0], 2, (act, eff))
    return _gate_up_kernel[grid](
        x, route_w, cu, eff, prep.table, act, wsp, tks,
        x.shape[0], G, I, H, x.stride(0), act.stride(0),
        s_gn, s_gk, s_un, s_uk,
        **gate_up_meta(c, H, I, G, dot_f32=dot_f32, skip=skip, tma=tma, ws=ws, flat=flat, streamk=sk, w13i=w13i),
    )


def _tile_meta(c: dict, K: int, N: int, G: int, *, dot_f32: bool, skip: bool, tma: bool, ws: bool, flat: bool,
               streamk: bool) -> dict:
    """The compile-time arguments the two persistent GEMM kernels share, for tile config ``c`` over a ``K``-deep
    reduction into ``N`` columns (gate/up: ``K = H``, ``N = I``; down: the other way round)."""
    pair = _pair(c)
    return dict(GP2=max(16, triton.next_power_of_2(G)), BM=c["BM"], BN=c["BN"], BK=c["BK"],
                EVEN_K=(K % c["BK"] == 0), EVEN_N=(N % c["BN"] == 0), DOT_F32=dot_f32, SKIP=skip, TMA=tma, WS=ws,
                FLAT=flat, STREAMK=streamk, SWAP=_swap(c), MIX=_mix(c), PAIR=pair, BMT=c["BM"] * (2 if pair else 1),
                num_warps=c["num_warps"], num_stages=c["num_stages"])


def gate_up_meta(c: dict, H: int, I: int, G: int, *, dot_f32: bool, skip: bool, tma: bool, ws: bool, flat: bool,
                 streamk: bool, w13i: bool) -> dict:
    """The gate/up kernel's compile-time arguments for tile config ``c`` with its options resolved (the launch's;
    ``test_kernels_compile`` compiles every shipped entry from them)."""
    return dict(_tile_meta(c, H, I, G, dot_f32=dot_f32, skip=skip, tma=tma, ws=ws, flat=flat, streamk=streamk),
                W13I=w13i)


def _launch_down(act, route_w, cu, eff, prep, dst, c, dot_f32, skip=False, zero_tail=True):
    I, H = act.shape[1], dst.shape[1]
    G = int(cu.numel())
    s_dn, s_dk = prep.strides[2]
    tma, ws = _descriptors(c, act, (s_dn,))
    flat = _flat(c, ws, skip)
    grid = (max(1, sm_count(act.device) * int(c.get("progs_per_sm", 1))),)
    sk, wsp, tks = _streamk(c, act.device, grid[0], 1, (dst, eff))
    return _down_kernel[grid](
        act, route_w, cu, eff, prep.table, dst, wsp, tks,
        act.shape[0], G, H, I, act.stride(0), dst.stride(0),
        s_dn, s_dk,
        **down_meta(c, H, I, G, dot_f32=dot_f32, skip=skip, tma=tma, ws=ws, flat=flat, streamk=sk,
                    zero_tail=zero_tail),
    )


def down_meta(c: dict, H: int, I: int, G: int, *, dot_f32: bool, skip: bool, tma: bool, ws: bool, flat: bool,
              streamk: bool, zero_tail: bool) -> dict:
    """The down kernel's compile-time arguments for tile config ``c`` with its options resolved (as
    ``gate_up_meta``)."""
    return dict(_tile_meta(c, I, H, G, dot_f32=dot_f32, skip=skip, tma=tma, ws=ws, flat=flat, streamk=streamk),
                ZM=c.get("ZM", 64), ZT=zero_tail)


def _launch_fused(x, route_w, cu, prep, act, dst, cfg, dot_f32, skip=False, zero_tail=True, row_ends=None):
    """The whole compute in one launch (``triton_fused``): ``cfg``'s gate_up and down tiles, its
    ``fused`` entry's warps, stages and programs per SM."""
    I, H = act.shape[1], x.shape[1]
    G = int(cu.numel())
    if prep.sync.numel() < SYNC_WORDS + G:
        raise MoonEPInputError(f"expert_ffn_triton: cu_seqlens has {G} groups, the weights {prep.table.shape[0]}")
    gu, dn, f = cfg["gate_up"], cfg["down"], cfg["fused"]
    say_once(f"MoonEP expert kernels: steps whose tile entry says so (H={H}, I={I}: decode, tuning.json) run as "
             "one launch instead of three; its work counters belong to the layer's weights, so one layer's "
             "expert compute must run in stream order (not on two CUDA streams at once)", __name__)
    unused = [f"{kind}:{opt}" for kind, c in (("gate_up", gu), ("down", dn))
              for opt in ("ws", "flat", "streamk", "mix", "pair") if c.get(opt)]
    if unused:
        say_once(f"MoonEP expert kernels: one launch does not take the tile options {unused} (its loops are neither "
                 "warp-specialized nor flattened, its tiles whole); it runs without them", __name__)
    w13i, ((s_gn, s_gk), (s_un, s_uk)) = _w13i(prep)
    s_dn, s_dk = prep.strides[2]
    tma1, _ = _descriptors({**gu, "ws": False}, x, (s_gn, s_un))
    tma2, _ = _descriptors({**dn, "ws": False}, act, (s_dn,))
    grid = (max(1, sm_count(x.device) * int(f.get("progs_per_sm", 1))),)
    return fused_kernel[grid](
        x, route_w, cu, cu if row_ends is None else row_ends, prep.table, act, dst, prep.sync,
        x.shape[0], G, I, H, x.stride(0), act.stride(0), dst.stride(0),
        s_gn, s_gk, s_un, s_uk, s_dn, s_dk,
        **fused_meta(cfg, H, I, G, dot_f32=dot_f32, skip=skip, tma1=tma1, tma2=tma2, w13i=w13i, zero_tail=zero_tail,
                     has_ends=row_ends is not None),
    )


def fused_meta(cfg: dict, H: int, I: int, G: int, *, dot_f32: bool, skip: bool, tma1: bool, tma2: bool, w13i: bool,
               zero_tail: bool, has_ends: bool) -> dict:
    """The one launch's compile-time arguments for tile entry ``cfg`` (its gate_up, down and fused configs) with
    its options resolved (as ``gate_up_meta``)."""
    gu, dn, f = cfg["gate_up"], cfg["down"], cfg["fused"]
    return dict(GP2=max(16, triton.next_power_of_2(G)), TB=128, ZM=dn.get("ZM", 64),
                BM1=gu["BM"], BN1=gu["BN"], BK1=gu["BK"], EVEN_K1=(H % gu["BK"] == 0), EVEN_N1=(I % gu["BN"] == 0),
                BM2=dn["BM"], BN2=dn["BN"], BK2=dn["BK"], EVEN_K2=(I % dn["BK"] == 0), EVEN_N2=(H % dn["BN"] == 0),
                DOT_F32=dot_f32, SKIP=skip, TMA1=tma1, SWAP1=_swap(gu), SWAP2=_swap(dn), ZT=zero_tail,
                HAS_ENDS=has_ends, W13I1=w13i, TMA2=tma2, FENCE2=tma2 and not interpreting(),
                num_warps=f["num_warps"], num_stages=f["num_stages"])


def expert_ffn_triton(
    x: torch.Tensor,
    route_w: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weights: GroupedWeights,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    act: torch.Tensor | None = None,
    tokens: int | None = None,
    padded: bool = True,
    row_ends: torch.Tensor | None = None,
    zero_tail: bool = True,
    batch_invariant: bool = False,
    down_gemm=None,
) -> torch.Tensor:
    """The fused expert compute (see the module doc). ``config`` overrides the tile configs
    (``{"gate_up": {...}, "down": {...}}``); ``act`` is an optional ``[NvS, I]`` scratch;
    ``tokens``: the step's tokens per rank, which picks the tiles (``select_config``);
    ``padded``: the step may hold padding entries (weight-0 rows inside segments), whose tiles
    are then skipped (``triton_tiles.live``); ``False`` for rows that have none. ``row_ends``: ``[G]``
    int32, the end of each group's rows that may be live (``expert_ffn``): the three launches become
    two (no trim launch), and the one launch reads them instead of scanning. ``zero_tail=False`` (only with
    ``row_ends``): the rows past them, the segments' padding tails, are not written (``expert_ffn``).
    ``batch_invariant``: the tiles without stream-K (``invariance.py``). ``down_gemm``: another down GEMM
    (``impl="deepgemm_down"``), called as ``down_gemm(act, ends, out)`` after the gate/up tiles, which write
    every row of ``act`` up to ``ends`` (a skipped weight-0 tile writes zeros); the rows past them are the
    callee's."""
    NvS, H = x.shape
    I = weights.intermediate
    G = int(cu_seqlens.numel())
    if out is None:
        out = torch.empty_like(x)
    if G == 0 or NvS == 0:
        return out
    dev = x.device
    prep = prepare_weights(weights, dev)
    if x.stride(1) != 1:
        x = x.contiguous()
    route_w = route_w.contiguous()
    if route_w.dtype != torch.float32:
        route_w = route_w.float()
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    cu = cu.contiguous()
    dst = out if out.stride(1) == 1 else torch.empty_like(x)
    if act is None or act.shape != (NvS, I) or act.dtype != x.dtype or act.stride(1) != 1:
        act = torch.empty((NvS, I), dtype=x.dtype, device=dev)
    cfg = config or select_config(H, I, NvS, G, entries=list(policy.policy_of(x).tiles), tokens=tokens)
    if batch_invariant:
        kept, cfg = cfg, invariance.invariant_tiles(cfg)
        if kept != cfg:
            say_once(f"MoonEP expert kernels: batch invariant: the tile entry for H={H}, I={I} runs without "
                     f"{', '.join(o for o in invariance.DROPPED if any(c.get(o) for c in kept.values()))} "
                     "(it cuts a row's K sum between programs)", __name__)
    check_tail_args(row_ends, zero_tail, "expert_ffn_triton")
    ends = None if row_ends is None else row_ends.contiguous()  # no copy when it is already
    dot_f32 = interpreting() or x.dtype == torch.float32
    if cfg.get("fused") and down_gemm is None:
        _launch_fused(x, route_w, cu, prep, act, dst, cfg, dot_f32, padded, zero_tail, ends)
        if dst is not out:
            out.copy_(dst)
        return out
    if ends is not None:
        eff = ends
    else:
        eff = torch.empty(G, dtype=torch.int32, device=dev)
        _launch_trim(cu, route_w, eff)
    _launch_gate_up(x, route_w, cu, eff, prep, act, cfg["gate_up"], dot_f32, padded)
    if down_gemm is not None:
        down_gemm(act, eff, dst)
    else:
        _launch_down(act, route_w, cu, eff, prep, dst, cfg["down"], dot_f32, padded, zero_tail)
    if dst is not out:
        out.copy_(dst)
    return out
