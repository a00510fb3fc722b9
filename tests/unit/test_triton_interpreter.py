"""The Triton grouped-GEMM kernels under Triton's CPU interpreter, against the float64 reference.

``TRITON_INTERPRET`` must be set before Triton is imported, and other tests in this pytest
process may already have imported it, so the checks run in one child process (this file run as
a script with the variable set); each test asserts one case of the child's JSON report.

Tolerance: the interpreter rounds float32 to bf16 by truncation (the GPU rounds to nearest), so
the two bf16 roundings (activation, output) give ~6e-3 relative error against float64; 2e-2 is
the bar here, 1e-2 on the GPU.
"""

from __future__ import annotations

import itertools
import json
import zlib

import pytest

from tests.interpreter_child import interpreter_report

TOL = 2e-2


def _case_data(name: str):
    import torch

    from vllm_moonep.common.grouped_gemm import GroupedWeights

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def segs(lens):
        return torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)

    def contiguous(G, H, I, dtype=torch.bfloat16):
        return GroupedWeights.contiguous(
            rnd(G, I, H, scale=H**-0.5, dtype=dtype), rnd(G, I, H, scale=H**-0.5, dtype=dtype), rnd(G, H, I, scale=I**-0.5, dtype=dtype)
        )

    dtype = torch.bfloat16
    if name == "random_ragged":
        H, I = 64, 48
        lens = [5, 0, 37, 1, 0, 20, 16, 3]
        w = contiguous(len(lens), H, I)
    elif name == "odd_dims":
        # H, I not multiples of the tile sizes (masked K and N paths)
        H, I = 72, 40
        lens = [7, 19, 0, 33]
        w = contiguous(len(lens), H, I)
    elif name == "huge_group":
        H, I = 32, 32
        lens = [0, 0, 301, 0, 0]
        w = contiguous(len(lens), H, I)
    elif name == "all_empty":
        H, I = 32, 32
        lens = [0, 0, 0]
        w = contiguous(len(lens), H, I)
    elif name == "multi_pool":
        # pool 0: a fused w13 [N, 2I, H] viewed as gate/up (stride along dim 0 is 2*I*H);
        # pool 1: separate tensors; groups map to rows of either, -1 groups are empty
        H, I = 48, 32
        w13 = rnd(3, 2 * I, H, scale=H**-0.5)
        d0 = rnd(3, H, I, scale=I**-0.5)
        g1, u1, d1 = rnd(4, I, H, scale=H**-0.5), rnd(4, I, H, scale=H**-0.5), rnd(4, H, I, scale=I**-0.5)
        pools = torch.tensor([1, 0, -1, 1, 0, 1, -1, 0], dtype=torch.int64)
        rows = torch.tensor([2, 1, -1, 0, 2, 3, -1, 0], dtype=torch.int64)
        lens = [9, 17, 0, 1, 40, 0, 0, 6]
        w = GroupedWeights([w13[:, :I, :], g1], [w13[:, I:, :], u1], [d0, d1], pools, rows)
    elif name == "padded_segments":
        # MoonEP's layout: each segment padded to a multiple of 48 with zero rows of weight 0
        # (tails longer than a tile: zero tiles), a real row with weight 0 in the middle, and a
        # segment whose only row has weight 0 (nothing to compute, all zeros)
        H, I = 64, 32
        real = [3, 0, 21, 1, 50, 48]
        lens = [((r + 47) // 48) * 48 for r in real]
        w = contiguous(len(lens), H, I)
    elif name == "weight0_block_inside":
        # a decode step's padding entries (weight 0, hidden not necessarily 0) in the middle of a
        # segment, real rows on both sides: whole tiles of weight 0 skip their GEMM and must still
        # be written (as zeros), and the real rows next to them must not be dropped
        H, I = 64, 32
        lens = [70, 9]
        w = contiguous(len(lens), H, I)
    elif name == "float32":
        H, I = 32, 48
        lens = [4, 0, 29]
        dtype = torch.float32
        w = contiguous(len(lens), H, I, dtype=torch.float32)
    else:
        raise KeyError(name)
    cu = segs(lens)
    n = int(cu[-1]) if cu.numel() else 0
    nvs = n + 5  # rows past the end exist and are not computed
    x = rnd(nvs, H, dtype=dtype)
    rw = torch.rand(nvs, generator=g) + 0.05
    if name == "padded_segments":
        start = 0
        for r, L in zip(real, lens):
            x[start + r : start + L] = 0
            rw[start + r : start + L] = 0
            start += L
        rw[48 + 5] = 0.0  # weight 0 on a real row inside segment 2
        rw[96] = 0.0  # segment 3's only real row
    if name == "weight0_block_inside":
        rw[10:50] = 0.0  # rows 16-47 are two whole interpreter tiles (BM=16), 10-15 and 48-49 share tiles with real rows
    return x, rw, cu, w, n


TMA_CONFIG: dict = {}  # the interpreter's tiles with "tma" (and "ws") on, set in the child
#: the stream-K runs: programs per SM (2 "SMs" off CUDA: 2, 6 and 80 programs), operand loads, launches,
#: swapped tiles (the workspace holds a swapped tile's sums after they are turned back)
STREAMK_RUNS = ((1, "pointer", 3, False), (3, "tma", 1, False), (40, "pointer", 1, False), (40, "tma", 1, True))
#: cases a run leaves out, each run costing one interpreted program per "SM" and piece: all_empty has no tile
#: to cut at 80 programs (the 2- and 6-program runs check it writes nothing); the swapped 80-program run, the
#: costliest, checks the cut swapped tiles on the cases with fewer rows (the weights' pools and the segments'
#: padding do not change how a cut tile's pieces are summed and turned back)
STREAMK_SKIP = {(40, "pointer", 1, False): {"all_empty"},
                (40, "tma", 1, True): {"all_empty", "multi_pool", "padded_segments"}}


def _trimmed_ends(rw, cu):
    """1 + each segment's last row with a non-zero weight (its start if none): the trim launch's ends."""
    import torch

    ends, s0 = [], 0
    for e0 in cu.tolist():
        live = (rw[s0:e0] != 0).nonzero()
        ends.append(s0 + int(live.max()) + 1 if live.numel() else s0)
        s0 = e0
    return torch.tensor(ends, dtype=torch.int32)


def _head_rows(ends, cu, nvs: int):
    """``[nvs]`` bool: the rows of each segment before its end of entries ``ends`` (the rest of a segment is
    its padding tail)."""
    import torch

    head = torch.zeros(nvs, dtype=torch.bool)
    for s0, e0 in zip([0] + cu.tolist()[:-1], ends.tolist()):
        head[s0:e0] = True
    return head


def _worst(a: float, b: float) -> float:
    """The larger error, NaN if either is (``max`` would keep 0.0 against a NaN and hide it)."""
    return b if (b != b or b > a) else a

CASES = ["random_ragged", "odd_dims", "huge_group", "all_empty", "multi_pool", "padded_segments", "weight0_block_inside",
         "float32"]


def _child_main() -> None:
    import torch

    from vllm_moonep.common.grouped_gemm.triton_kernels import (_INTERP_CONFIG, _STREAMK_WS, _descriptors, _streamk,
                                                                expert_ffn_triton, interpreting, prepare_weights)
    from vllm_moonep.engine.launch import sm_count

    global TMA_CONFIG
    TMA_CONFIG = {k: {**v, "tma": True, "ws": True} for k, v in _INTERP_CONFIG.items()}
    from vllm_moonep.testing.reference import expert_ffn_float64

    assert interpreting()
    import logging

    said: list[str] = []  # what the kernels' module says (INFO and up), to check it says each choice once
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    kernels_log = logging.getLogger("vllm_moonep.common.grouped_gemm.triton_kernels")
    kernels_log.addHandler(handler)
    kernels_log.setLevel(logging.INFO)
    report: dict = {}
    for name in CASES:
        try:
            x, rw, cu, w, n = _case_data(name)
            out = torch.full_like(x, float("nan"))
            expert_ffn_triton(x, rw, cu, w, out=out)  # padded=True: tiles of weight-0 rows skipped
            out_dense = torch.full_like(x, float("nan"))
            expert_ffn_triton(x, rw, cu, w, out=out_dense, padded=False)  # every tile runs its main loop
            ref = expert_ffn_float64(x, rw, cu, w)
            got = out[:n].double()
            unwritten = int(torch.isnan(got).sum())
            denom = float(ref[:n].norm())

            def rel(a):  # relative error against float64 (absolute where the reference is all zero)
                e = float((a - ref[:n]).norm())
                return e / denom if denom > 0 else e

            err = rel(got)
            # rows whose reference is exactly zero (weight-0 rows, padding) must be exactly zero
            zero_rows = (ref[:n].abs().sum(dim=1) == 0) if n else torch.zeros(0, dtype=torch.bool)
            zero_ok = bool((got[zero_rows] == 0).all()) if n else True
            same = bool(torch.equal(out[:n], out_dense[:n]))
            # the tensor-descriptor loads (and the warp-specialized loop, a no-op here) read the
            # same operands as the pointer loads: a wrong row or column offset changes the output
            out_tma = torch.full_like(x, float("nan"))
            expert_ffn_triton(x, rw, cu, w, out=out_tma, config=TMA_CONFIG)
            tma_same = bool(torch.equal(out_tma[:n], out[:n]))
            # the engine's ends of each segment's entries instead of the trim launch: its own ends (the
            # trimmed ones), the segments' ends (no tail known) and ends past them (clamped to the
            # segment): the same bits every time; and in one launch, whose items are then one row tile each
            # (a row tile taken twice or never, a down item not waiting for every row tile of its group, the
            # tail's zeros missing or written by the wrong item: other bits, or NaN)
            ends_same = True
            one_launch = {**_INTERP_CONFIG, "fused": {"num_warps": 4, "num_stages": 1, "progs_per_sm": 1}}
            for ends in (_trimmed_ends(rw, cu), cu.clone(), cu + 7):
                for cfg in (None, one_launch):
                    o = torch.full_like(x, float("nan"))
                    expert_ffn_triton(x, rw, cu, w, out=o, config=cfg, row_ends=ends.to(torch.int32))
                    ends_same &= bool(torch.equal(o[:n], out[:n]))
            # the padding tails left as they were (zero_tail=False, with the entries' ends), three launches and
            # one. The entries end 3 rows past each segment's last live row: weight-0 entries with non-zero
            # hidden states, as a sanitized invalid id leaves them (combine reads them: they must come out
            # 0, not be left as tail). Every row before the ends the same bits as the default call; the tail
            # NaN (untouched) or 0 (inside a tile that also holds entries); some tail row untouched, per
            # schedule, where a tail is longer than a tile
            ends_e = torch.minimum(_trimmed_ends(rw, cu) + 3, cu)
            head = _head_rows(ends_e, cu, x.shape[0])
            tail = ~head
            tail[n:] = False
            xe = x.clone()
            xe[head & (rw == 0)] = 1.0
            want = torch.full_like(x, float("nan"))
            expert_ffn_triton(xe, rw, cu, w, out=want)
            tails = {"same": True, "clean": True, "left": []}
            for cfg in (_INTERP_CONFIG, {**_INTERP_CONFIG, "fused": {"num_warps": 4, "num_stages": 1,
                                                                      "progs_per_sm": 1}}):
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(xe, rw, cu, w, out=o, config=cfg, row_ends=ends_e, zero_tail=False)
                tails["same"] &= bool(torch.equal(o[head], want[head]))
                t_rows = o[tail]
                tails["clean"] &= bool((torch.isnan(t_rows) | (t_rows == 0)).all())
                tails["left"].append(int(torch.isnan(t_rows).all(dim=1).sum()))
            # and they ran: a launch that fell back to the pointer loads would pass tma_same unseen
            (s_gn, _), (s_un, _), (s_dn, _) = prepare_weights(w, x.device).strides
            act = torch.empty(x.shape[0], w.intermediate, dtype=x.dtype)
            tma_used = (_descriptors(TMA_CONFIG["gate_up"], x, (s_gn, s_un)) == (True, True)
                        and _descriptors(TMA_CONFIG["down"], act, (s_dn,)) == (True, True))
            # the same tiles in one launch (triton_fused), pointer and TMA loads (gate/up and down): the same bits,
            # and its counters back at zero (a launch that left them set would skip work in the next)
            one = {"num_warps": 4, "num_stages": 1, "progs_per_sm": 1}
            fused_same = True
            for cfg, want in (({**_INTERP_CONFIG, "fused": one}, out), ({**TMA_CONFIG, "fused": one}, out)):
                for _ in range(2):
                    out_f = torch.full_like(x, float("nan"))
                    expert_ffn_triton(x, rw, cu, w, out=out_f, config=cfg)
                    fused_same &= bool(torch.equal(out_f[:n], want[:n]))
            fused_reset = int(prepare_weights(w, x.device).sync.abs().sum()) == 0
            # swapped tiles (weights on the MMA's M side, sums transposed back): three launches with TMA
            # loads, one launch with pointer loads; the interpreter's gate/up tile is square (16 x 16), so
            # a transpose lost there gives wrong values, not a shape error
            swap = {"err": 0.0, "unwritten": 0, "zero_ok": True}
            for cfg in ({k: {**v, "swap": True} for k, v in TMA_CONFIG.items()},
                        {**{k: {**v, "swap": True} for k, v in _INTERP_CONFIG.items()}, "fused": one}):
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=o, config=cfg)
                g64 = o[:n].double()
                swap["unwritten"] += int(torch.isnan(g64).sum())
                swap["err"] = _worst(swap["err"], rel(g64))
                swap["zero_ok"] &= bool((g64[zero_rows] == 0).all()) if n else True
            # the tiles taken from both ends of the groups sorted by rows ("mix"), three launches with pointer and
            # TMA loads and with stream-K over 2 programs: only the order moves, so the same bits (a tile taken
            # twice or never, or another group's rows or weights: other bits, or NaN)
            mix_same = True
            for cfg in ({k: {**v, "mix": True} for k, v in _INTERP_CONFIG.items()},
                        {k: {**v, "mix": True} for k, v in TMA_CONFIG.items()},
                        {k: {**v, "mix": True, "streamk": True, "progs_per_sm": 1} for k, v in _INTERP_CONFIG.items()}):
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=o, config=cfg)
                mix_same &= bool(torch.equal(o[:n], out[:n]))
            # two row tiles of a group as one tile of twice the rows where both hold rows ("pair"), pointer loads
            # with the tile skip, TMA loads without, and with the engine's ends and the tails left: each row's sums
            # the same, so the same bits (a pair's second half dropped, or the zero tiles starting past a pair's rows
            # where the group ends in an odd tile: rows left NaN; a stray write into a tail). An odd last tile run as
            # a pair is not seen here: its extra rows are clamped loads and masked stores, work but not bits
            pair_same = True
            pair_cfgs = [{k: {**v, "pair": True} for k, v in base.items()} for base in (_INTERP_CONFIG, TMA_CONFIG)]
            for cfg, padded in zip(pair_cfgs, (True, False)):
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=o, config=cfg, padded=padded)
                pair_same &= bool(torch.equal(o[:n], out[:n]))
            o = torch.full_like(x, float("nan"))
            expert_ffn_triton(xe, rw, cu, w, out=o, config=pair_cfgs[0], row_ends=ends_e, zero_tail=False)
            t_rows = o[tail]
            pair_same &= bool(torch.equal(o[head], want[head])) and bool((torch.isnan(t_rows) | (t_rows == 0)).all())
            # stream-K: the last tiles cut between programs. 2 programs (pieces of one tile on two),
            # launched three times: against the float64 reference, the same bits on the second launch
            # (pieces summed in a fixed order), the tile skip off on the third. 6 programs with TMA
            # loads, and 80 programs (one main-loop iteration each: tiles in two or three pieces in
            # every case) with pointer loads and with swapped TMA tiles, one launch each (the
            # interpreter runs programs one by one)
            sk = {"err": 0.0, "unwritten": 0, "zero_ok": True, "same_twice": True, "skip_same": True, "cut": False}
            for pps, loads, launches, swapped in STREAMK_RUNS:
                if name in STREAMK_SKIP.get((pps, loads, launches, swapped), ()):
                    continue
                base = TMA_CONFIG if loads == "tma" else _INTERP_CONFIG
                cfg = {k: {**v, "streamk": True, "progs_per_sm": pps, "swap": swapped} for k, v in base.items()}
                nprog = sm_count(x.device) * pps
                for kind, planes in (("gate_up", 2), ("down", 1)):  # made now, so that NaN can mark them
                    _streamk(cfg[kind], x.device, nprog, planes, ())
                for wsp, _ in _STREAMK_WS.values():  # a written piece replaces NaN with its sums
                    wsp.fill_(float("nan"))
                outs = []
                for padded in (True, True, False)[:launches]:
                    o = torch.full_like(x, float("nan"))
                    expert_ffn_triton(x, rw, cu, w, out=o, config=cfg, padded=padded)
                    outs.append(o[:n])
                    sk["cut"] |= any(bool(torch.isfinite(wsp).any()) for wsp, _ in _STREAMK_WS.values())
                g64 = outs[0].double()
                sk["unwritten"] += int(torch.isnan(g64).sum())
                sk["err"] = _worst(sk["err"], rel(g64))
                sk["zero_ok"] &= bool((g64[zero_rows] == 0).all()) if n else True
                if launches == 3:
                    sk["same_twice"] &= bool(torch.equal(outs[0], outs[1]))
                    sk["skip_same"] &= bool(torch.equal(outs[0], outs[2]))
            sk["tickets_reset"] = all(int(t.abs().sum()) == 0 for _, t in _STREAMK_WS.values())
            sk["workspaces"] = len(_STREAMK_WS)
            report[name] = {"err": err, "unwritten": unwritten, "zero_ok": zero_ok, "rows": n, "skip_same": same,
                            "tma_same": tma_same, "tma_used": tma_used, "fused_same": fused_same, "ends_same": ends_same,
                            "tails": tails,
                            "fused_reset": fused_reset, "streamk": sk, "swap": swap, "mix_same": mix_same,
                            "pair_same": pair_same}
        except Exception as e:  # report, don't hide
            report[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        report["_order"] = _order_report()
    except Exception as e:  # report, don't hide
        report["_order"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        report["_trim"] = _trim_report()
    except Exception as e:  # report, don't hide
        report["_trim"] = {"error": f"{type(e).__name__}: {e}"}
    report["_said"] = said
    print("REPORT " + json.dumps(report))


#: rows per group for the tile order (BM = 16: m-blocks 0, 3, 1, 0, 7, 2, 1, 5), 2 column blocks each
ORDER_ROWS = [0, 40, 9, 0, 100, 17, 16, 70]
ORDER_BM, ORDER_BN, ORDER_N = 16, 8, 16


def _order_report() -> dict:
    """Every tile index ``t`` decoded as the kernels decode it (``_tile_order``, ``_tile``), in group order and
    with ``MIX``: ``[(group, first row, first column)]`` per order, one program decoding the whole list."""
    import torch
    import triton
    import triton.language as tl

    from vllm_moonep.common.grouped_gemm import triton_kernels

    global _group_table, _tile, _tile_order  # a jitted function resolves the helpers it calls in its module's globals
    _group_table, _tile, _tile_order = triton_kernels._group_table, triton_kernels._tile, triton_kernels._tile_order

    @triton.jit
    def order_kernel(cu_ptr, out_ptr, G, N, GP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     MIX: tl.constexpr):
        gidx, start, eend, end, mb = _group_table(cu_ptr, cu_ptr, G, GP2, BM)
        nt = tl.cdiv(N, BN)
        total = tl.sum(mb * nt, 0)
        order, omb, otiles, ocum = _tile_order(gidx, mb, nt, GP2, MIX)
        for t in range(0, total):  # every program's tiles, decoded by one (the order is the same in all)
            g, sel, ee, rows, rows_ld, cols, cols_ld, row0, col0 = _tile(t, total, ocum, otiles, order, omb, gidx,
                                                                         start, eend, N, BM, BN, True, MIX)
            tl.store(out_ptr + 3 * t, g)
            tl.store(out_ptr + 3 * t + 1, row0)
            tl.store(out_ptr + 3 * t + 2, col0)

    cu = torch.tensor(ORDER_ROWS, dtype=torch.int64).cumsum(0).to(torch.int32)
    got = {}
    for mix in (False, True):
        out = torch.full((3 * 64,), -1, dtype=torch.int32)
        order_kernel[(1,)](cu, out, len(ORDER_ROWS), ORDER_N, GP2=16, BM=ORDER_BM, BN=ORDER_BN, MIX=mix)
        got["mix" if mix else "group"] = [tuple(out[3 * i : 3 * i + 3].tolist()) for i in range(64)]
    return got


#: segments for the trim scan, ``(length, rows with a non-zero weight)``; the kernel scans 256-row blocks
#: from the segment's end and stops at the first block holding such a row
TRIM_SEGMENTS = [
    (600, [10]),  # the last live row three blocks back from the end: the scan must not stop before it
    (600, [0]),  # only the segment's first row: the last block the scan reads (clamped at the start)
    (600, []),  # nothing live in a long segment: every block read, the end is the start
    (256, [255]),  # the last row, a segment of exactly one block
    (257, [0, 1]),  # one row past a block: the first block holds a single row
    (0, []),  # empty
    (128, [3, 70]),  # a decode segment, padded to 128
    (513, [5, 300, 512]),  # live rows in several blocks: the last one counts
]


def _trim_report() -> dict:
    """The trim kernel's ends against a scan in Python, on ``TRIM_SEGMENTS`` (one launch, all segments)."""
    import torch

    from vllm_moonep.common.grouped_gemm.triton_kernels import _launch_trim

    lens = [n for n, _ in TRIM_SEGMENTS]
    cu = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    rw = torch.zeros(int(cu[-1]) + 3)
    rw[-3:] = 1.0  # rows past the last segment: never read into it
    want = []
    start = 0
    for (n, live), end in zip(TRIM_SEGMENTS, cu.tolist()):
        for r in live:
            rw[start + r] = 0.5
        want.append(start + max(live) + 1 if live else start)
        start = end
    eff = torch.full((len(lens),), -1, dtype=torch.int32)
    _launch_trim(cu, rw, eff)
    return {"got": eff.tolist(), "want": want}


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


def test_one_launch_is_said_once_per_shape(report):
    """The one-launch path (a choice the tile table makes, with a stream-order constraint for the user)
    running unsaid, or said on every call."""
    lines = [m for m in report["_said"] if "run as one launch" in m]
    assert lines, "the one-launch path ran (every case, two launches each) but nothing was said"
    assert len(lines) == len(set(lines)), f"said more than once: {lines}"
    # one line per shape that ran it: random_ragged (64 x 48) and odd_dims (72 x 40) among them
    assert any("H=64, I=48" in m for m in lines) and any("H=72, I=40" in m for m in lines), lines
    # the TMA configs ask for ws (both kernels), which the one launch does not take; their TMA loads it takes
    dropped = [m for m in report["_said"] if "one launch does not take the tile options" in m]
    assert len(dropped) == 1 and "down:ws" in dropped[0] and "gate_up:ws" in dropped[0], dropped
    assert "tma" not in dropped[0], f"the one launch said it drops TMA loads, which it runs: {dropped}"


def test_trim_scan(report):
    """The trim scan (from the end, stopping at the first block with a live row) stopping too early (a live
    row blocks back from the end dropped: its output would be zeros), too late, or reading past a segment."""
    t = report["_trim"]
    assert "error" not in t, t.get("error")
    bad = [(seg, g, w) for seg, g, w in zip(TRIM_SEGMENTS, t["got"], t["want"]) if g != w]
    assert not bad, f"trimmed ends wrong for (length, live rows) -> got, want: {bad}"


def _assert_outputs(d: dict, what: str, hint: str) -> None:
    """One run's outputs against float64: every element inside the segments written, rows whose reference
    is zero exactly zero, relative error under TOL (``hint``: the bug a failure points to)."""
    assert d["unwritten"] == 0, f"{what}: {d['unwritten']} output elements inside segments were not written{hint}"
    assert d["zero_ok"], f"{what}: rows with a zero reference are not exactly zero{hint}"
    assert d["err"] < TOL, f"{what}: relative error {d['err']:.3e} >= {TOL}{hint}"


def _order_tiles(groups, mb: list) -> list:
    """``[(group, first row, first column)]`` of ``ORDER_ROWS``' tiles, group by group in the order ``groups``,
    column block by column block within a group."""
    starts = [0, *itertools.accumulate(ORDER_ROWS)]
    return [(g, starts[g] + m * ORDER_BM, n * ORDER_BN) for g in groups for n in range(ORDER_N // ORDER_BN)
            for m in range(mb[g])]


def _mixed_order_model(mb: list) -> list:
    """``[(group, first row, first column)]`` per tile index in the mixed order, counted tile by tile: the tiles
    of the groups sorted by (m-blocks, group); tile ``t`` takes the next from that list's start where ``t`` is
    even, else the next from its end."""
    tiles = _order_tiles([g for _, g in sorted((b, g) for g, b in enumerate(mb))], mb)
    front, back, out = 0, len(tiles) - 1, []
    for t in range(len(tiles)):
        if t % 2 == 0:
            out.append(tiles[front])
            front += 1
        else:
            out.append(tiles[back])
            back -= 1
    return out


def test_mixed_tile_order(report):
    """The tile order "mix" as the kernels decode it (``_tile_order``, ``_tile``), against a model that counts the
    tiles one by one: a wrong index from either end (a tile twice, one never), a sort by
    group instead of rows, or one end only fail here, where the outputs cannot tell an order. The group order is
    checked too (unchanged by the option)."""
    r = report["_order"]
    assert "error" not in r, r.get("error")
    mb = [-(-n // ORDER_BM) for n in ORDER_ROWS]
    total = sum(mb) * (ORDER_N // ORDER_BN)
    group = _order_tiles(range(len(mb)), mb)
    for key, got in r.items():
        got = [tuple(e) for e in got]  # JSON brought them back as lists
        assert all(e == (-1, -1, -1) for e in got[total:]), f"{key}: a tile decoded past the list"
        got = got[:total]
        if key == "group":
            assert got == group, "group order: the tiles are not group by group, column block by column block"
            continue
        want = _mixed_order_model(mb)
        assert sorted(got) == sorted(group), f"{key}: not every tile exactly once"
        assert got == want, f"{key}: first difference at tile {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    # the model itself: the coldest busy group's tile first, the hottest's second
    model = _mixed_order_model(mb)
    assert mb[model[0][0]] == min(b for b in mb if b) and mb[model[1][0]] == max(mb), model[:2]


@pytest.mark.parametrize("case", CASES)
def test_interpreter_case(report, case):
    """Triton kernel logic (unwritten rows, non-zero padding rows, drift from float64) wrong where only the CPU
    interpreter runs it."""
    r = report[case]
    assert "error" not in r, r.get("error")
    _assert_outputs(r, f"{case}", "")
    assert r["skip_same"], f"{case}: skipping the tiles of weight-0 rows (padded=True) changed the output"
    assert r["tma_used"], f"{case}: the TMA tiles fell back to pointer loads (the check below would be vacuous)"
    assert r["tma_same"], f"{case}: the tensor-descriptor (TMA) loads gave other outputs than the pointer loads"
    assert r["ends_same"], (f"{case}: the engine's segment ends (row_ends) in place of the trim launch gave other "
                            "outputs (ends past a segment not clamped, a tail row computed from the next group, or "
                            "one launch's row-tile items missing or misplaced)")
    t = r["tails"]
    assert t["same"], (f"{case}: with the padding tails left (zero_tail=False) an entry row changed (a weight-0 "
                       "entry left unwritten: combine would read leftover memory)")
    assert t["clean"], f"{case}: with the padding tails left, a tail row got a value other than 0 (a stray write)"
    if case == "padded_segments":  # tails of 24-44 rows: longer than a 16-row tile
        assert all(k > 0 for k in t["left"]), (f"{case}: zero_tail=False wrote every tail row anyway (three launches, "
                                               f"one launch: {t['left']} untouched rows; the checks above are vacuous)")
    assert r["fused_same"], f"{case}: the one-launch kernel gave other outputs than the three launches' same tiles"
    assert r["fused_reset"], f"{case}: the one-launch kernel left its counters set (the next launch would skip work)"
    assert r["mix_same"], (f"{case}: the tiles in the mixed order (\"mix\") gave other outputs than in group order "
                           "(a tile taken twice or never, or with another group's rows)")
    assert r["pair_same"], (f"{case}: two row tiles run as one (\"pair\") gave other outputs than the tiles one by one "
                            "(an odd last tile run as a pair, a pair's second half dropped, or the zero tiles misplaced)")
    _assert_outputs(r["swap"], f"{case}: swapped tiles", " (a transpose lost or doubled)")
    k = r["streamk"]
    _assert_outputs(k, f"{case}: stream-K", " (a piece never summed, summed twice or lost)")
    assert k["same_twice"], f"{case}: stream-K gave other bits on a second launch (pieces summed in arrival order)"
    assert k["skip_same"], f"{case}: stream-K with the tile skip gave other outputs than without"
    assert k["tickets_reset"], f"{case}: stream-K left a ticket set (the next launch would sum too early)"
    if case != "all_empty":
        assert k["cut"], f"{case}: no tile was cut between programs (the stream-K checks above would be vacuous)"


if __name__ == "__main__":
    _child_main()
