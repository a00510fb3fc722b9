"""The tile bodies both Triton launch schedules run (``@triton.jit`` helpers, no kernels).

One tile is ``BM`` rows of one group times ``BN`` output columns::

    _gate_up_tile:  x[rows, :H] @ gate_g^T, @ up_g^T  ->  silu(g) * u * route_w  ->  act[rows, cols]
    _down_tile:     act[rows, :I] @ down_g^T                                    ->  out[rows, cols]

``triton_kernels`` runs them as three launches (trim, every gate/up tile, every down tile);
``triton_fused`` runs the same tiles in one launch. Each tile is a main loop (``*_acc``: float32 sums
over a range of the reduction dimension) and an epilogue (``*_store``): a stream-K schedule
(``triton_kernels``, ``"streamk"``) runs a tile's main loop in pieces on several programs and the
epilogue once, on the sum of the pieces. A main loop returns ``[BM, BN]`` sums whatever its ``SWAP``
(swap-AB: the MMA runs on the transposed tile, ``mma``, and ``acc_out`` turns it back), so the
epilogues and the stream-K workspace never see a swapped tile. Both reach a group's weights through the
pointer table (``wg``, ``wu``, ``wd``: the group's base addresses), so the tiles do not know where
the pools live. The row masks are the tile's: ``ee`` is the group's trimmed end (rows at or past it
are never loaded past it, and their activations or outputs are written as 0 or not at all).
``W13I`` (weights stored interleaved, ``weights.py``; every schedule): gate and up interleaved row by row in
one weight (``wg``), one ``[2BN, BK]`` block and one MMA of ``2BN`` columns per main-loop step instead of two
of ``BN``; its sums are split into gate and up before the epilogue, so the epilogues and the stream-K
workspace see the same two ``[BM, BN]`` tiles either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["trim_end", "rows_end", "pick", "live", "tile_index", "load_k", "acc_zeros", "mma", "acc_out", "gate_up_acc",
           "gate_up_store", "gate_up_tile", "down_acc", "down_store", "down_tile", "zero_rows"]


@triton.jit
def trim_end(rw_ptr, start, end, BLK: tl.constexpr):
    """1 + the last row of ``[start, end)`` with a non-zero routing weight (``start`` if none):
    MoonEP pads segments with weight-0 rows, whose output is exactly 0, so no tile computes them.
    Scans blocks of ``BLK`` rows from the end and stops at the first block with such a row: a
    segment's padding tail is shorter than its padding multiple (128), so one or two blocks
    almost always decide it, however long the segment (a forward scan reads all of it, one
    dependent block after another: 3-6 us for the hot segments of a 1024-token step)."""
    last = start
    hi = end
    while (hi > start) & (last == start):
        lo = tl.maximum(hi - BLK, start)
        rows = lo + tl.arange(0, BLK)
        v = tl.load(rw_ptr + rows, mask=rows < hi, other=0.0)
        last = tl.maximum(last, tl.max(tl.where(v != 0.0, rows + 1, 0), 0))
        hi = lo
    return last


@triton.jit
def rows_end(rw_ptr, ends_ptr, g, start, end, BLK: tl.constexpr, HAS_ENDS: tl.constexpr):
    """Where group ``g``'s rows to compute end: the caller's end of its entries (``HAS_ENDS``: the engine's,
    clamped into the segment; rows past it are the padding tail) or the trim scan's (``trim_end``)."""
    if HAS_ENDS:
        e = tl.minimum(tl.maximum(tl.load(ends_ptr + g), start), end)
    else:
        e = trim_end(rw_ptr, start, end, BLK)
    return e


@triton.jit
def pick(sel, v):
    """``v[g]`` for the one ``g`` where ``sel`` holds (a register vector read without a branch)."""
    return tl.sum(tl.where(sel, v, 0), 0)


@triton.jit
def live(rw, rows, ee):
    """Whether any row of a tile (below the group's trimmed end) has a non-zero routing weight.
    A tile of weight-0 rows has output exactly 0: with ``SKIP`` both kernels give it no main loop
    (a loop bound, not a branch around the loop: a branch cost the software pipeline 4-17% on an
    H200). Such tiles sit inside segments, not only in the trimmed tail, once a step was padded:
    a rank's padding entries all go to one expert of its own, and other ranks' real rows of that
    expert come after them. ``SKIP`` off compiles the loop as it was (steps with no padding)."""
    return tl.max(tl.where(rows < ee, tl.abs(rw), 0.0), 0) > 0.0


@triton.jit
def tile_index(row0, col0, ee, N, BM: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr):
    """A tile's rows and columns from its first row and column, plus clamped copies that are
    always safe to load (rows below the trimmed end ``ee``, columns below ``N``)."""
    rows = row0 + tl.arange(0, BM)
    rows_ld = tl.minimum(rows, ee - 1).to(tl.int64)
    cols = col0 + tl.arange(0, BN)
    if EVEN_N:
        cols_ld = cols
    else:
        cols_ld = tl.minimum(cols, N - 1)
    return rows, rows_ld, cols, cols_ld


@triton.jit
def load_k(ptrs, k, offs_k, K, EVEN_K: tl.constexpr):
    """A ``[rows, BK]`` operand block at ``k`` of the reduction dimension (pointer loads): columns
    past ``K`` read 0 (no mask when ``BK`` divides ``K``)."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=((k + offs_k) < K)[None, :], other=0.0)


@triton.jit
def acc_zeros(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """A tile's float32 sums at zero, in the shape its MMA accumulates: ``[BM, BN]``, or ``[BN, BM]`` when
    ``SWAP`` (see ``mma``)."""
    if SWAP:
        z = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        z = tl.zeros((BM, BN), dtype=tl.float32)
    return z


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr, SWAP: tl.constexpr):
    """``acc += a @ b^T`` for rows ``a [BM, BK]`` and weights ``b [BN, BK]``. ``SWAP`` (swap-AB) puts
    the weights on the M side, ``acc^T += b @ a^T``: the tensor cores' M is then the weight columns
    (64 or more: Hopper's warpgroup MMA) and their N the few rows of a decode tile (16), where a
    16-row tile on the M side runs the older per-warp MMA. ``DOT_F32``: operands upcast to float32 and
    summed in IEEE float32 (the interpreter, whose bf16 dot is wrong, and float32 inputs on a GPU)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if SWAP:
            r = tl.dot(b, tl.trans(a), acc, input_precision="ieee")
        else:
            r = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        if SWAP:
            r = tl.dot(b, tl.trans(a), acc)
        else:
            r = tl.dot(a, tl.trans(b), acc)
    return r


@triton.jit
def acc_out(acc, SWAP: tl.constexpr):
    """A tile's sums as ``[BM, BN]`` (a swapped tile's transposed back for the epilogue)."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def gate_up_acc(
    x_ptr, rw_ptr, wg, wu, xd, rows, rows_ld, ee, cols_ld, row0, col0, k0, k1,
    N, K, stride_xm, s_gn, s_gk, s_un, s_uk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SKIP: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, SWAP: tl.constexpr, W13I: tl.constexpr,
):
    """The float32 sums ``x @ gate^T`` and ``x @ up^T`` of a tile over ``k`` in ``[k0, k1)`` (a whole
    tile: ``[0, K)``; a stream-K piece: part of it); ``xd``: the rows' tensor descriptor when ``TMA``
    (then the group's gate and up are described here). ``W13I``: gate and up interleaved row by row
    in one ``[2N, K]`` weight at ``wg`` (row ``2j`` gate row ``j``, ``2j + 1`` up row ``j``; ``wu``,
    ``s_un``, ``s_uk`` unused): one ``[2BN, BK]`` block and one MMA twice as wide per step (the rows'
    block read once), its ``[BM, 2BN]`` sums split into gate and up columns after the loop."""
    offs_k = tl.arange(0, BK)
    if TMA:  # this group's gate and up, described on the device (columns past N load zeros)
        if W13I:
            gd = tl.make_tensor_descriptor(wg, shape=[2 * N, K], strides=[s_gn, 1], block_shape=[2 * BN, BK])
        else:
            gd = tl.make_tensor_descriptor(wg, shape=[N, K], strides=[s_gn, 1], block_shape=[BN, BK])
            ud = tl.make_tensor_descriptor(wu, shape=[N, K], strides=[s_un, 1], block_shape=[BN, BK])
    a_ptrs = x_ptr + rows_ld[:, None] * stride_xm + (k0 + offs_k)[None, :]
    if W13I:  # the tile's 2*BN weight rows, gate and up alternating (clamped below 2N: always safe to load)
        w_rows = tl.minimum(2 * col0 + tl.arange(0, 2 * BN), 2 * N - 1)
        g_ptrs = wg + w_rows[:, None] * s_gn + (k0 + offs_k)[None, :] * s_gk
        acc = acc_zeros(BM, 2 * BN, SWAP)
    else:
        g_ptrs = wg + cols_ld[:, None] * s_gn + (k0 + offs_k)[None, :] * s_gk
        u_ptrs = wu + cols_ld[:, None] * s_un + (k0 + offs_k)[None, :] * s_uk
        acc_g = acc_zeros(BM, BN, SWAP)
        acc_u = acc_zeros(BM, BN, SWAP)
    k_end = k1
    if SKIP:  # every row of the tile has weight 0: no main loop, act = 0 (see live)
        k_end = tl.where(live(tl.load(rw_ptr + rows_ld), rows, ee), k1, k0)
    for k in tl.range(k0, k_end, BK, warp_specialize=WS):
        if TMA:
            a = xd.load([row0, k])
        else:
            a = load_k(a_ptrs, k, offs_k, K, EVEN_K)
        if W13I:
            if TMA:
                b = gd.load([2 * col0, k])
            else:
                b = load_k(g_ptrs, k, offs_k, K, EVEN_K)
            acc = mma(a, b, acc, DOT_F32, SWAP)
        else:
            if TMA:
                bg = gd.load([col0, k])
                bu = ud.load([col0, k])
            else:
                bg = load_k(g_ptrs, k, offs_k, K, EVEN_K)
                bu = load_k(u_ptrs, k, offs_k, K, EVEN_K)
            acc_g = mma(a, bg, acc_g, DOT_F32, SWAP)
            acc_u = mma(a, bu, acc_u, DOT_F32, SWAP)
        if not TMA:
            a_ptrs += BK
            g_ptrs += BK * s_gk
            if not W13I:
                u_ptrs += BK * s_uk
    if W13I:  # column 2c holds gate column c, 2c + 1 up column c
        acc_g, acc_u = tl.split(tl.reshape(acc_out(acc, SWAP), (BM, BN, 2)))
    else:
        acc_g, acc_u = acc_out(acc_g, SWAP), acc_out(acc_u, SWAP)
    return acc_g, acc_u


@triton.jit
def gate_up_store(acc_g, acc_u, rw_ptr, act_ptr, rows, rows_ld, ee, cols, N, stride_am):
    """A tile's epilogue: ``act[rows, cols] = silu(g) * u * route_w`` in the activation dtype."""
    rw = tl.load(rw_ptr + rows_ld)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * rw[:, None]
    a_out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :]
    tl.store(a_out, act.to(act_ptr.dtype.element_ty), mask=(rows < ee)[:, None] & (cols < N)[None, :])


@triton.jit
def gate_up_tile(
    x_ptr, rw_ptr, act_ptr, wg, wu, xd, rows, rows_ld, ee, cols, cols_ld, row0, col0,
    N, K, stride_xm, stride_am, s_gn, s_gk, s_un, s_uk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SKIP: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, SWAP: tl.constexpr, W13I: tl.constexpr,
):
    """``act[rows, cols] = silu(x @ gate^T) * (x @ up^T) * route_w`` over ``K = H``."""
    acc_g, acc_u = gate_up_acc(x_ptr, rw_ptr, wg, wu, xd, rows, rows_ld, ee, cols_ld, row0, col0, 0, K,
                               N, K, stride_xm, s_gn, s_gk, s_un, s_uk, BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS,
                               SWAP, W13I)
    gate_up_store(acc_g, acc_u, rw_ptr, act_ptr, rows, rows_ld, ee, cols, N, stride_am)


@triton.jit
def down_acc(
    act_ptr, rw_ptr, wd, ad, rows, rows_ld, ee, cols_ld, row0, col0, k0, k1,
    N, K, stride_am, s_dn, s_dk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SKIP: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, SWAP: tl.constexpr,
):
    """The float32 sum ``act @ down^T`` of a tile over ``k`` in ``[k0, k1)``; ``ad``: the
    activations' descriptor when ``TMA``."""
    offs_k = tl.arange(0, BK)
    if TMA:
        dd = tl.make_tensor_descriptor(wd, shape=[N, K], strides=[s_dn, 1], block_shape=[BN, BK])
    a_ptrs = act_ptr + rows_ld[:, None] * stride_am + (k0 + offs_k)[None, :]
    d_ptrs = wd + cols_ld[:, None] * s_dn + (k0 + offs_k)[None, :] * s_dk
    acc = acc_zeros(BM, BN, SWAP)
    k_end = k1
    if SKIP:  # act is 0 on every row of the tile: no main loop, out = 0
        k_end = tl.where(live(tl.load(rw_ptr + rows_ld), rows, ee), k1, k0)
    for k in tl.range(k0, k_end, BK, warp_specialize=WS):
        if TMA:
            a = ad.load([row0, k])
            b = dd.load([col0, k])
        else:
            a = load_k(a_ptrs, k, offs_k, K, EVEN_K)
            b = load_k(d_ptrs, k, offs_k, K, EVEN_K)
        acc = mma(a, b, acc, DOT_F32, SWAP)
        if not TMA:
            a_ptrs += BK
            d_ptrs += BK * s_dk
    return acc_out(acc, SWAP)


@triton.jit
def down_store(acc, out_ptr, rows, ee, en, cols, N, stride_om):
    """A tile's epilogue: ``out[rows, cols]``, rows at or past the trimmed end ``ee`` (and below the
    segment's end ``en``) written as 0."""
    acc = tl.where((rows < ee)[:, None], acc, 0.0)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < en)[:, None] & (cols < N)[None, :])


@triton.jit
def down_tile(
    act_ptr, rw_ptr, out_ptr, wd, ad, rows, rows_ld, ee, en, cols, cols_ld, row0, col0,
    N, K, stride_am, stride_om, s_dn, s_dk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SKIP: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, SWAP: tl.constexpr,
):
    """``out[rows, cols] = act @ down^T`` over ``K = I``."""
    acc = down_acc(act_ptr, rw_ptr, wd, ad, rows, rows_ld, ee, cols_ld, row0, col0, 0, K,
                   N, K, stride_am, s_dn, s_dk, BM, BN, BK, EVEN_K, DOT_F32, SKIP, TMA, WS, SWAP)
    down_store(acc, out_ptr, rows, ee, en, cols, N, stride_om)


@triton.jit
def zero_rows(out_ptr, zr, zen, zc, N, stride_om, ZM: tl.constexpr, BN: tl.constexpr):
    """Write 0 to ``out[zr, zc]`` (rows below ``zen``, columns below ``N``): a segment's trimmed tail."""
    z_ptrs = out_ptr + zr.to(tl.int64)[:, None] * stride_om + zc[None, :]
    tl.store(z_ptrs, tl.zeros((ZM, BN), dtype=out_ptr.dtype.element_ty), mask=(zr < zen)[:, None] & (zc < N)[None, :])
