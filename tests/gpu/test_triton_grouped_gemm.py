"""The fused Triton grouped GEMM on a GPU at realistic sizes: float64 reference, the
``torch._grouped_mm`` path, poisoned outputs, empty groups, one huge group, ragged segments,
several pools (pointer table), MoonEP-padded segments, and CUDA-graph capture/replay."""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.tools.timing import on_side_stream
from vllm_moonep.testing.weights import interleaved

pytestmark = pytest.mark.gpu

TOL = 1e-2  # bf16 operands, activation and output rounded once each (METHOD.md: 1e-3..1e-2)


def _triton():
    pytest.importorskip("triton")
    from vllm_moonep.common.grouped_gemm import triton_kernels

    return triton_kernels


def _rel(a, b):
    a, b = a.double(), b.double()
    d = float(b.norm())
    return float((a - b).norm()) / d if d > 0 else float((a - b).norm())


def _randn(gen, dev):
    """bf16 normal values times ``scale``, from ``gen`` (every test draws its weights in a fixed order)."""
    def r(*s, scale):
        return (torch.randn(*s, generator=gen, device=dev) * scale).to(torch.bfloat16)

    return r


def _weights(G, H, I, gen, dev="cuda"):
    from vllm_moonep.common.grouped_gemm import GroupedWeights

    r = _randn(gen, dev)
    return GroupedWeights.contiguous(r(G, I, H, scale=H**-0.5), r(G, I, H, scale=H**-0.5), r(G, H, I, scale=I**-0.5))


def _inputs(lens, H, gen, pad_to=None, extra=7, dev="cuda"):
    """x, route_w, cu for real segment lengths ``lens``; with ``pad_to`` each non-empty segment is
    padded with zero rows of weight 0 (MoonEP's dispatch layout)."""
    seg = [((n + pad_to - 1) // pad_to) * pad_to if (pad_to and n) else n for n in lens]
    cu = torch.tensor(seg, dtype=torch.int64).cumsum(0).to(torch.int32)
    total = int(cu[-1]) if len(seg) else 0
    x = (torch.randn(total + extra, H, generator=gen, device=dev)).to(torch.bfloat16)
    rw = torch.rand(total + extra, generator=gen, device=dev) + 0.05
    start = 0
    for n, s in zip(lens, seg):
        x[start + n : start + s] = 0
        rw[start + n : start + s] = 0
        start += s
    return x, rw, cu.to(dev), total


def _two_pools(gen, H, I, pools, rows, dev="cuda"):
    """Weights in several pools, as the symmetric layout's pools are (home rows, peers, slots): pool 0 a fused
    ``w13`` viewed as its halves (stride ``2*I*H`` along dim 0), pool 1 separate tensors (``interleaved`` gives the
    layout's own order of both), group ``g`` row ``rows[g]`` of pool ``pools[g]``
    (-1: no weights). Each pool has as many rows as its largest row id + 1."""
    from vllm_moonep.common.grouped_gemm import GroupedWeights

    r = _randn(gen, dev)
    n0, n1 = (1 + max(rw for p, rw in zip(pools, rows) if p == k) for k in (0, 1))
    w13 = r(n0, 2 * I, H, scale=H**-0.5)
    d0 = r(n0, H, I, scale=I**-0.5)
    g1, u1, d1 = r(n1, I, H, scale=H**-0.5), r(n1, I, H, scale=H**-0.5), r(n1, H, I, scale=I**-0.5)
    return GroupedWeights([w13[:, :I, :], g1], [w13[:, I:, :], u1], [d0, d1], torch.tensor(pools, dtype=torch.int64),
                          torch.tensor(rows, dtype=torch.int64))


def _check(x, rw, cu, w, total, impl_cmp=True):
    from vllm_moonep.common.grouped_gemm import expert_ffn
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    out = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out)
    torch.cuda.synchronize()
    got = out[:total]
    assert not torch.isnan(got).any(), "unwritten output rows inside segments"
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    err = _rel(got, ref)
    assert err < TOL, f"relative error vs float64 {err:.3e}"
    zero = ref.abs().sum(dim=1) == 0
    assert bool((got[zero] == 0).all()), "rows with weight 0 must be exactly 0"
    if impl_cmp and w.dense_groups is not None and hasattr(torch, "_grouped_mm"):
        gm = expert_ffn(x, rw, cu, w, impl="grouped_mm")[:total]
        e2 = _rel(gm, ref)
        # both are bf16 pipelines; the fused kernel must be no worse than the PoC path (+ slack)
        assert err <= max(2 * e2, 5e-3), f"triton {err:.3e} vs grouped_mm {e2:.3e}"
    return err


@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_random_ragged_realistic(H, I):
    """The Triton kernels at real model shapes drifting from float64 or skipping rows of ragged, non-tile segments."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    lens = [3, 0, 130, 1, 0, 77, 512, 0, 35, 200, 0, 0, 9, 1000, 64, 5]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen)
    _check(x, rw, cu, w, total)


def test_moonep_padded_segments_and_empty_groups():
    """Padding rows (weight 0) of 128-padded segments not exactly zero, or empty groups between segments mis-
    scheduled."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    H, I = 2048, 768
    lens = [1, 0, 0, 2, 130, 0, 900, 17, 0, 0, 64, 128, 129, 3] + [0] * 10 + [40, 1]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128)
    _check(x, rw, cu, w, total)


def test_one_huge_group():
    """A persistent tile schedule dropping or repeating rows of one group much larger than the grid."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    H, I = 2048, 768
    lens = [0] * 20 + [20000] + [0] * 11
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen)
    _check(x, rw, cu, w, total)


def test_all_groups_empty():
    """The Triton kernels faulting or hanging on a step where every group is empty."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    H, I = 512, 256
    w = _weights(8, H, I, gen)
    x = torch.randn(16, H, generator=gen, device="cuda").to(torch.bfloat16)
    rw = torch.rand(16, generator=gen, device="cuda")
    cu = torch.zeros(8, dtype=torch.int32, device="cuda")
    _triton().expert_ffn_triton(x, rw, cu, w)
    torch.cuda.synchronize()


def test_multi_pool_pointer_table():
    """Groups read rows of several tensors: a fused w13 viewed as gate/up (stride 2*I*H along
    dim 0), a separate pool, and -1 groups (no weights, empty)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    H, I = 2048, 768
    w = _two_pools(gen, H, I, [0, 1, -1, 0, 0, 1, -1, 0, 1], [5, 2, -1, 0, 3, 0, -1, 1, 1])
    lens = [33, 250, 0, 1, 700, 16, 0, 129, 64]
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128)
    _check(x, rw, cu, w, total, impl_cmp=False)


def test_one_table_for_cuda_and_its_index():
    """A table prepared for ``"cuda"`` (a caller before capture) and found again for the layer's ``x.device``
    (``cuda:0``) built twice: new counters under a graph captured with the first table."""
    tk = _triton()
    gen = torch.Generator(device="cuda").manual_seed(6)
    w = _two_pools(gen, 256, 128, [0, 1, 0], [1, 0, 2])
    first = tk.prepare_weights(w, "cuda")
    here = torch.device("cuda", torch.cuda.current_device())
    assert tk.prepare_weights(w, here) is first, "the table was built again for the indexed name"
    assert tk.prepare_weights(w, None) is first


def test_cuda_graph_capture_replay():
    """A captured expert compute that keeps the capture-time segment lengths: replays on new cu_seqlens must match
    float64."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    gen = torch.Generator(device="cuda").manual_seed(6)
    H, I = 2048, 768
    lens = [5, 0, 300, 17, 0, 64]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=1024)  # capacity for the replays
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act))  # warm-up: compile, pointer table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act)
    # new routing with different segment lengths, same buffers: the tile list follows cu on device
    for lens2 in ([0, 2, 1, 400, 33, 0], [128, 128, 0, 0, 7, 1]):
        x2, rw2, cu2, total2 = _inputs(lens2, H, gen, pad_to=128, extra=512)
        assert x2.shape[0] <= x.shape[0]
        x.zero_()
        rw.zero_()
        x[: x2.shape[0]] = x2
        rw[: x2.shape[0]] = rw2
        cu.copy_(cu2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got = out[:total2]
        assert not torch.isnan(got).any()
        ref = expert_ffn_float64(x, rw, cu, w)[:total2]
        assert _rel(got, ref) < TOL


# tiles of the shipped table: without ws a 4-warp and an 8-warp kernel; with ws 8 warps each (Triton 3.6's
# Hopper warp specialization compiles only with 8 warps here, see triton_kernels._descriptors)
_TMA_TILES = {False: {"gate_up": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 1},
                      "down": {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1}},
              True: {"gate_up": {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1},
                     "down": {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1}}}


@pytest.mark.parametrize("ws", [False, True])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_tensor_descriptor_loads(H, I, ws):
    """Tensor-descriptor (TMA) loads reading other operands than the pointer loads: a wrong row or column
    start, a descriptor of the wrong group or pool (a fused w13 viewed as gate/up, a second pool, -1 groups),
    rows of the next group leaking into a tile's stored rows, or a captured launch losing its device-built
    descriptors. Same tiles with and without TMA must give the same bits; both within TOL of float64."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = _two_pools(gen, H, I, [0, 1, -1, 0, 0, 1, 0, 1], [4, 2, -1, 0, 3, 0, 1, 1])
    lens = [33, 250, 0, 1, 700, 16, 129, 64]
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128)
    tiles = _TMA_TILES[ws]
    tma = {k: {**v, "tma": True, "ws": ws} for k, v in tiles.items()}
    # the launches take the descriptor path (a silent fallback would make the comparisons vacuous)
    (s_gn, _), (s_un, _), (s_dn, _) = tk.prepare_weights(w).strides
    assert tk._descriptors(tma["gate_up"], x, (s_gn, s_un)) == (True, ws)
    assert tk._descriptors(tma["down"], torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda"), (s_dn,)) == (True, ws)
    out_ptr = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out_ptr, config=tiles)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=tma))
    assert torch.equal(out[:total], out_ptr[:total]), "TMA loads changed the output of the same tiles"
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    assert _rel(out[:total], ref) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=tma)
    x.mul_(-1)  # new values behind the same addresses
    out.fill_(float("nan"))
    graph.replay()
    tk.expert_ffn_triton(x, rw, cu, w, out=out_ptr, config=tiles)
    torch.cuda.synchronize()
    assert torch.equal(out[:total], out_ptr[:total]), "a replayed TMA launch differs from the pointer loads"


# decode tiles of the shipped table (Kimi-K2 at 1 token), run as one launch at 1 and 3 programs per SM
_DECODE_TILES = {"gate_up": {"BM": 16, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
                 "down": {"BM": 16, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2}}


def _refill(x, rw, cu, lens, H, gen) -> int:
    """New rows for a captured graph, written into its input tensors in place (padded to 128 as
    MoonEP's dispatch pads); returns the rows the segments hold."""
    x2, rw2, cu2, total = _inputs(lens, H, gen, pad_to=128)
    x.zero_()
    rw.zero_()
    x[: x2.shape[0]] = x2
    rw[: x2.shape[0]] = rw2
    cu.copy_(cu2)
    return total


@pytest.mark.parametrize("progs_per_sm", [1, 3])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_one_launch_kernel(H, I, tma, progs_per_sm):
    """The one-launch kernel (triton_fused) against the three launches with the same tiles, bit for bit:
    a down item that reads act before its group's gate/up items stored it (a missing wait or release),
    an item taken twice or never (the work counter), groups of more rows than one tile (the row loop),
    padding-only segments and empty groups, the trimmed tail's zeros, counters not restored after a
    launch (the next launch or a graph replay would skip or hang), and a replay on new rows. With ``tma`` the
    down items read act through a tensor descriptor: a missing proxy fence reads the NaN act is filled with."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    gen = torch.Generator(device="cuda").manual_seed(8)
    # two pools and -1 groups, as the symmetric layout has
    w = _two_pools(gen, H, I, [0, 0, -1, 1, 0, 0, 1, 0, 0, -1, 1, 0, 0, 0], [0, 1, -1, 0, 2, 3, 1, 4, 5, -1, 2, 6, 7, 8])
    lens = [1, 2, 0, 1, 40, 0, 8, 1, 17, 0, 1, 3, 0, 5]  # 40 and 17 rows: more than one BM=16 tile
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    start = int(cu[10 - 1])  # group 10's only row: weight 0, a padding-only segment
    rw[start] = 0.0
    x[start] = 0
    tiles = {k: {**v, "tma": tma} for k, v in _DECODE_TILES.items()}
    fused = {**tiles, "fused": {"num_warps": 4, "num_stages": 4, "progs_per_sm": progs_per_sm}}
    out3 = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out3, config=tiles)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    def three_launches():  # a counter left set by one launch shows in the next
        for _ in range(3):
            out.fill_(float("nan"))
            act.fill_(float("nan"))  # a down item that reads act before it is written reads NaN, not old values
            tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=fused)

    on_side_stream(three_launches)
    sync = tk.prepare_weights(w).sync
    assert int(sync.abs().sum()) == 0, f"counters not restored: {sync.tolist()}"
    assert torch.equal(out[:total], out3[:total]), "one launch differs from three launches with the same tiles"
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    assert _rel(out[:total], ref) < TOL
    assert bool((out[start:start + 128] == 0).all()), "a padding-only segment's rows must be 0"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=fused)
    for lens2 in ([0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [3, 129, 0, 7, 0, 0, 1, 0, 0, 0, 2, 0, 16, 0]):
        total2 = _refill(x, rw, cu, lens2, H, gen)
        out.fill_(float("nan"))
        act.fill_(float("nan"))
        graph.replay()
        tk.expert_ffn_triton(x, rw, cu, w, out=out3, config=tiles)
        torch.cuda.synchronize()
        assert torch.equal(out[:total2], out3[:total2]), "a replayed one-launch kernel differs from three launches"
        assert int(sync.abs().sum()) == 0


# Qwen3-30B-A3B's 1024- and 4096-token tiles (tuning.json; test_graph_replays_in_turn.py uses them too): 128 rows,
# 8 warps, both kernels' row operands through tensor descriptors, the down loop flattened; as one launch, the same
# tiles without "flat" (which it does not take)
Q_BIG_TILES = {
    "gate_up": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True},
    "down": {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True,
             "flat": True},
}
Q_BIG_ONE_TILES = {"gate_up": Q_BIG_TILES["gate_up"],
                   "down": {k: v for k, v in Q_BIG_TILES["down"].items() if k != "flat"}}

# one-launch tile sets of bench_experts' FUSED_TILES: 16-column gate/up items (decode) and 64-row tiles (the middle);
# and Qwen3's 128-row TMA tiles
_ROW_TILE_SETS = {
    "rows128_tma": Q_BIG_ONE_TILES,
    "decode16": {"gate_up": {"BM": 16, "BN": 16, "BK": 256, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
                 "down": {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2}},
    "rows64": {"gate_up": {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2},
               "down": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2}},
}


@pytest.mark.parametrize("tiles", sorted(_ROW_TILE_SETS))
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_one_launch_row_tiles(H, I, tiles):
    """The one launch given the engine's ends, where every item is one row tile: a hot group of 700 rows is
    spread over many programs, and its down items must wait for every row tile's gate/up items (a wait that
    counts column blocks only reads act rows not yet written: NaN, since act starts as NaN; so does a down
    tensor-descriptor load not fenced after the acquire, or not fenced after the writer's stores). Against the three
    launches with the same tiles and ends, bit for bit, with and without the tails' zeros, three launches in a
    row and a graph replay on new rows (counters left set skip or hang the next), counters back at 0."""
    tk = _triton()
    gen = torch.Generator(device="cuda").manual_seed(21)
    lens = [1, 700, 0, 3, 129, 0, 17, 64, 1, 0, 65, 2]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=200)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])

    def ends_of(lens_):
        return (starts + torch.tensor(lens_, dtype=torch.int32, device="cuda")).to(torch.int32)

    ends = ends_of(lens)
    three = _ROW_TILE_SETS[tiles]
    one = {**three, "fused": {"num_warps": three["gate_up"]["num_warps"], "num_stages": three["gate_up"]["num_stages"],
                              "progs_per_sm": 2}}
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    sync = tk.prepare_weights(w).sync
    for zero_tail in (True, False):
        want = torch.full_like(x, float("nan"))
        tk.expert_ffn_triton(x, rw, cu, w, out=want, config=three, row_ends=ends, zero_tail=zero_tail)
        out = torch.full_like(x, float("nan"))
        for _ in range(3):
            out.fill_(float("nan"))
            act.fill_(float("nan"))
            tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=one, row_ends=ends, zero_tail=zero_tail)
        torch.cuda.synchronize()
        same = torch.equal(out[:total].nan_to_num(7.0), want[:total].nan_to_num(7.0))
        assert same, f"one launch of row tiles differs from three launches (zero_tail={zero_tail})"
        assert int(sync.abs().sum()) == 0, f"counters not restored: {sync.nonzero().flatten().tolist()}"
        if zero_tail:  # every row written (the tails as zeros): against float64 too
            from vllm_moonep.testing.reference import expert_ffn_float64

            assert _rel(out[:total], expert_ffn_float64(x, rw, cu, w)[:total]) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=one, row_ends=ends)
    lens2 = [0, 5, 0, 300, 1, 0, 0, 0, 0, 0, 128, 0]
    total2 = _refill(x, rw, cu, lens2, H, gen)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    ends.copy_(ends_of(lens2))
    out.fill_(float("nan"))
    act.fill_(float("nan"))
    graph.replay()
    want = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=want, config=three, row_ends=ends)
    torch.cuda.synchronize()
    assert torch.equal(out[:total2], want[:total2]), "a replayed one launch of row tiles differs from three launches"
    assert int(sync.abs().sum()) == 0


@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_flattened_tile_loop(H, I):
    """The persistent loop flattened into the main loop ("flat": next tile's loads during this tile's epilogue)
    must compute the same tiles: a tile skipped or run twice at the seam, the zero tiles (a loop of their
    own) missing a segment's tail, or a replay that differs. Same bits as the loop not flattened. Steps
    without padding (padded=False) only: with the tile skip the loops stay nested (triton_kernels._flat)."""
    tk = _triton()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the shipped flattened tiles load through tensor descriptors (Hopper-class GPU)")
    gen = torch.Generator(device="cuda").manual_seed(9)
    lens = [3, 0, 130, 1, 0, 77, 512, 0, 35, 200, 0, 0, 9, 1000, 64, 5]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128)
    tiles = {"gate_up": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 1, "tma": True},
             "down": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True}}
    flat = {k: {**v, "flat": True} for k, v in tiles.items()}
    assert tk._flat(flat["down"], False, skip=False) and not tk._flat(flat["down"], False, skip=True)
    ref = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=ref, config=tiles, padded=False)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=flat, padded=False))
    assert torch.equal(out[:total], ref[:total]), "the flattened loop changed the output of the same tiles"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=flat, padded=False)
    x.mul_(-1)
    out.fill_(float("nan"))
    graph.replay()
    tk.expert_ffn_triton(x, rw, cu, w, out=ref, config=tiles, padded=False)
    torch.cuda.synchronize()
    assert torch.equal(out[:total], ref[:total]), "a replayed flattened launch differs"


@pytest.mark.parametrize("progs_per_sm", [1, 3])
@pytest.mark.parametrize("tiles", ["decode", "mid-tma"])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_stream_k_tiles(H, I, tiles, progs_per_sm):
    """Stream-K ("streamk": the last tiles cut between programs, the pieces summed by the one that
    arrives last) at realistic sizes, where pieces of one tile run at the same time on several SMs:
    a piece lost or summed twice, two pieces sharing a workspace slot (a race the interpreter, which
    runs programs one by one, cannot show), a sum read before a piece's stores landed (a missing
    release or acquire), a ticket left set (the next launch sums too early), a sum in arrival order
    (other bits from launch to launch), and a graph replay on new rows. Against the float64
    reference, and close to the same tiles uncut (the sums are the same, in another order)."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    tma = tiles == "mid-tma"
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    gen = torch.Generator(device="cuda").manual_seed(10)
    lens = [3, 0, 130, 1, 0, 77, 40, 0, 35, 200, 0, 0, 9, 300, 64, 5, 17, 1, 0, 90]
    w = _weights(len(lens), H, I, gen)
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128)
    if tma:
        base = {"gate_up": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "tma": True},
                "down": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "tma": True}}
    else:
        base = {k: dict(v) for k, v in _DECODE_TILES.items()}
    whole = {k: {**v, "progs_per_sm": progs_per_sm} for k, v in base.items()}
    cut = {k: {**v, "streamk": True} for k, v in whole.items()}
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    out_whole = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out_whole, config=whole)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    outs = []

    def launches():
        for _ in range(3):
            out.fill_(float("nan"))
            act.fill_(float("nan"))
            tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=cut)
            outs.append(out[:total].clone())

    on_side_stream(launches)
    assert all(torch.equal(o, outs[0]) for o in outs), "stream-K gave other bits from one launch to the next"
    assert _rel(outs[0], ref) < TOL, f"stream-K: {_rel(outs[0], ref):.3e} from the float64 reference"
    assert _rel(outs[0], out_whole[:total]) < 2e-3, "stream-K and the same tiles uncut differ by more than rounding"
    assert all(int(t.abs().sum()) == 0 for _, t in tk._STREAMK_WS.values()), "a stream-K ticket was left set"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=cut)
    for lens2 in ([0, 0, 0, 1, 1] + [0] * 15, [3, 129, 0, 7, 0, 0, 1, 0, 0, 0, 2, 0, 16, 0, 300, 0, 0, 0, 0, 1]):
        total2 = _refill(x, rw, cu, lens2, H, gen)
        out.fill_(float("nan"))
        graph.replay()
        again = torch.full_like(x, float("nan"))
        tk.expert_ffn_triton(x, rw, cu, w, out=again, config=cut)
        torch.cuda.synchronize()
        assert torch.equal(out[:total2], again[:total2]), "a replayed stream-K launch differs from an eager one"
        assert _rel(out[:total2], expert_ffn_float64(x, rw, cu, w)[:total2]) < TOL


# swapped tiles (weights on the MMA's M side): decode-sized row blocks (16, 32) under wide weight blocks
_SWAP_TILES = {"gate_up": {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
               "down": {"BM": 32, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2}}


@pytest.mark.parametrize("schedule", ["three", "one", "streamk"])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048), (1032, 720)])
def test_swapped_tiles(H, I, tma, schedule):
    """Swap-AB tiles (``"swap"``: acc^T = W x^T, transposed back for the epilogue): a transpose lost or
    doubled (rows and weight columns exchanged: wrong values, or written to the wrong place), the route
    weight or the trimmed tail applied along the wrong axis, row and column masks exchanged (a group's
    last tile of 1-15 rows; with H=1032, I=720 the last weight block is partial in N and K), under every
    schedule that takes tiles (three launches, one launch, stream-K) and both loads; then a captured graph
    replayed on new rows. Against float64 and the unswapped tiles within TOL (an H200 gave the same bits
    swapped and unswapped; the MMAs' summation order inside a step is not specified, so not asserted)."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = _two_pools(gen, H, I, [0, 0, -1, 1, 0, 0, 1, 0], [0, 1, -1, 0, 2, 3, 1, 4])
    lens = [1, 37, 0, 3, 130, 0, 16, 9]  # 1-15 row tails, whole 16- and 32-row tiles, one of 130 rows
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    tiles = {k: {**v, "tma": tma, "swap": True} for k, v in _SWAP_TILES.items()}
    if schedule == "one":
        tiles["fused"] = {"num_warps": 4, "num_stages": 4, "progs_per_sm": 2}
    elif schedule == "streamk":
        tiles = {k: {**v, "streamk": True} for k, v in tiles.items()}
    plain = {k: dict(v) for k, v in _SWAP_TILES.items()}
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=tiles))
    out_plain = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out_plain, config=plain)
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    assert not bool(torch.isnan(out[:total]).any()), "swapped tiles left output rows unwritten"
    zero = ref.abs().sum(dim=1) == 0  # padding rows: exactly 0
    assert bool((out[:total][zero] == 0).all()), "swapped tiles wrote non-zero padding rows"
    assert _rel(out[:total], ref) < TOL, _rel(out[:total], ref)
    assert _rel(out[:total], out_plain[:total]) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=tiles)
    total2 = _refill(x, rw, cu, [2, 0, 0, 64, 1, 0, 31, 0], H, gen)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out[:total2], expert_ffn_float64(x, rw, cu, w)[:total2]) < TOL, "a replayed swapped launch drifted"


@pytest.mark.parametrize("schedule", ["three launches", "one launch"])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_segment_ends_and_tails_left(H, I, schedule):
    """The engine's segment ends (``row_ends``, no trim launch) and padding tails left unwritten
    (``zero_tail=False``), as the MoE step runs the built-in engine: an entry row that changed (an end
    read wrong, a tile dropped, or a weight-0 entry past the last live row left unwritten: combine reads
    it, as it reads a sanitized invalid id's), a tail row written with anything but 0 (a stray store),
    or every tail row written anyway (the flag not reaching the kernels); ends past a segment must not
    reach into the next one. Against the default call's outputs, bit for bit."""
    tk = _triton()
    gen = torch.Generator(device="cuda").manual_seed(13)
    w = _weights(14, H, I, gen)
    lens = [1, 2, 0, 1, 40, 0, 8, 1, 17, 0, 1, 3, 0, 5]
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    for s0, n in zip(starts.tolist(), lens):  # the last entry of the longer segments: weight 0, hidden kept
        if n >= 2:
            rw[s0 + n - 1] = 0.0
    ends = (starts + torch.tensor(lens, device="cuda", dtype=torch.int32)).to(torch.int32)
    head = torch.zeros(x.shape[0], dtype=torch.bool, device="cuda")
    for s0, n in zip(starts.tolist(), lens):
        head[s0:s0 + n] = True
    tail = ~head
    tail[total:] = False
    tiles = dict(_DECODE_TILES)
    if schedule == "one launch":
        tiles["fused"] = {"num_warps": 4, "num_stages": 4, "progs_per_sm": 2}
    want = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=want, config=tiles)
    for row_ends in (ends, cu.clone(), cu + 300):  # the engine's ends, the segments' ends (no tail known), past them
        out = torch.full_like(x, float("nan"))
        tk.expert_ffn_triton(x, rw, cu, w, out=out, config=tiles, row_ends=row_ends)
        assert torch.equal(out[:total], want[:total]), f"row_ends {row_ends.tolist()[:6]}...: other outputs"
        out.fill_(float("nan"))
        tk.expert_ffn_triton(x, rw, cu, w, out=out, config=tiles, row_ends=row_ends, zero_tail=False)
        assert torch.equal(out[head], want[head]), "a row before its segment's tail changed with zero_tail=False"
        t = out[tail]
        assert bool((torch.isnan(t) | (t == 0)).all()), "a tail row got a value other than 0"
        if row_ends is ends:  # with the segments' ends (or past them) there is no tail to leave
            assert int(torch.isnan(t).all(dim=1).sum()) > 0, "zero_tail=False wrote every tail row anyway"


#: Kimi-K2's 4096-token gate/up tiles (tuning.json): TMA loads, 8 warps (the table adds the warp-specialized
#: loop, "ws": the "big ws" schedule below)
_BIG_GU = {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True}
_BIG_DOWN = {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True,
            "flat": True}
#: the weights stored interleaved against the same tiles over two tensors: the same sums over one MMA twice as wide
#: (an H200 gave the same bits)
_W13I_SAME_TOL = 2e-3


@pytest.mark.parametrize("schedule", ["pointer", "tma", "big", "big bn128", "big ws", "streamk", "one launch"])
@pytest.mark.parametrize("H,I", [(2048, 768), (7168, 2048)])
def test_w13i_tiles(H, I, schedule):
    """Weights stored interleaved (gate and up row by row in one ``w13``: the gate/up tiles read one weight, one MMA
    of 2·BN columns, ``W13I``) on a GPU under every schedule, Kimi-K2's large-row tiles among them ("big": 8 warps,
    a TMA box of 2·BN = 512 weight rows; "big bn128": the same MMA width as two tensors' tiles). What each check
    catches: gate and up read from the wrong rows of the interleaved w13, or the sums split into the wrong columns
    (against float64 and against the same tiles over the weights as two tensors); the table pointing at another
    group's rows (the pools and -1 groups of the symmetric layout); a descriptor box of 2·BN rows reaching past a
    pool's last row (the last group's weights end it) with TMA; the storage not found interleaved (W13I not taken:
    the check vacuous); then a captured graph replayed on new rows (rows unwritten: NaN)."""
    from vllm_moonep.testing.reference import expert_ffn_float64

    tk = _triton()
    if schedule != "pointer" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    gen = torch.Generator(device="cuda").manual_seed(13)
    w = _two_pools(gen, H, I, [0, 0, -1, 1, 0, 0, 1, 0], [0, 1, -1, 0, 2, 3, 1, 4])
    lens = [1, 37, 0, 3, 700, 0, 16, 130]  # 1-15 row tails, whole tiles, one hot group of 700 rows
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    plain = {k: dict(v) for k, v in _SWAP_TILES.items()}
    if schedule == "tma":
        plain = {k: {**v, "tma": True} for k, v in plain.items()}
    elif schedule.startswith("big"):
        plain = {"gate_up": dict(_BIG_GU), "down": dict(_BIG_DOWN)}
        if schedule == "big bn128":
            plain["gate_up"]["BN"] = 128
        if schedule == "big ws":  # the warp-specialized loop over the interleaved weights
            plain["gate_up"]["ws"] = True
    elif schedule == "streamk":
        plain = {k: {**v, "streamk": True} for k, v in plain.items()}
    elif schedule == "one launch":
        plain["fused"] = {"num_warps": 4, "num_stages": 4, "progs_per_sm": 2}
    wi = interleaved(w)
    out_plain = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out_plain, config=plain)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, wi, out=out, act=act, config=plain))
    torch.cuda.synchronize()
    assert tk.prepare_weights(wi).w13i and not tk.prepare_weights(w).w13i, "W13I not taken by the storage's order"
    assert not bool(torch.isnan(out[:total]).any()), "interleaved weights left output rows unwritten"
    ref = expert_ffn_float64(x, rw, cu, w)[:total]
    assert _rel(out[:total], ref) < TOL, _rel(out[:total], ref)
    same = _rel(out[:total], out_plain[:total])
    assert same < _W13I_SAME_TOL, f"interleaved against two tensors, the same tiles: {same:.2e}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, wi, out=out, act=act, config=plain)
    total2 = _refill(x, rw, cu, [2, 0, 0, 64, 1, 0, 31, 300], H, gen)
    out.fill_(float("nan"))
    graph.replay()
    tk.expert_ffn_triton(x, rw, cu, w, out=out_plain, config=plain)
    torch.cuda.synchronize()
    assert _rel(out[:total2], out_plain[:total2]) < _W13I_SAME_TOL, "a replayed interleaved launch drifted"


@pytest.mark.parametrize("ws", [False, True])
def test_w13i_at_kimi_k2_scale(ws):
    """Interleaved weights at Kimi-K2's size, as ``bench_experts`` times them: Kimi-K2's dimensions, 48 groups (a
    rank's 24 experts and 24 slots) and ~8000 rows in segments padded to 128, the 4096-token tiles (BN 256; with and
    without the warp-specialized loop, "ws", as the table runs them), three launches in a row, without the tile skip
    (``padded=False``, where the down loop is flattened) and a graph replay: rows left unwritten, or a drift from the
    same tiles over two tensors (each checked against float64 in ``test_w13i_tiles``)."""
    tk = _triton()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    H, I, G = 7168, 2048, 48
    gen = torch.Generator(device="cuda").manual_seed(14)
    w = _weights(G, H, I, gen)
    lens = torch.randint(0, 330, (G,), generator=torch.Generator().manual_seed(14)).tolist()
    lens[5], lens[17], lens[G - 1] = 0, 1100, 257  # an empty group, a hot one, the last group's rows end the pool
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=64)
    plain = {"gate_up": {**_BIG_GU, "ws": ws}, "down": dict(_BIG_DOWN)}
    out_plain = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=out_plain, config=plain, padded=False)
    wi = interleaved(w)
    del w  # Kimi-K2's 48 experts: one copy of gate and up at a time besides the interleaved one
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], I, dtype=x.dtype, device="cuda")
    for _ in range(3):
        out.fill_(float("nan"))
        tk.expert_ffn_triton(x, rw, cu, wi, out=out, act=act, config=plain, padded=False)
    torch.cuda.synchronize()
    assert tk.prepare_weights(wi).w13i, "W13I not taken over interleaved weights"
    assert not bool(torch.isnan(out[:total]).any()), "interleaved weights left output rows unwritten"
    assert _rel(out[:total], out_plain[:total]) < _W13I_SAME_TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, wi, out=out, act=act, config=plain, padded=False)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out[:total], out_plain[:total]) < _W13I_SAME_TOL, "a replayed interleaved launch drifted"


@pytest.mark.parametrize("schedule", ["pointer", "tma", "big ws", "big flat", "streamk"])
def test_mixed_tile_order_same_bits(schedule):
    """The ``"mix"`` tile order (groups sorted by rows on the device, tiles taken from both ends in turn) on a GPU,
    under every three-launch schedule that takes it, on skewed groups (a hot group beside one-row ones, empty and
    weightless groups, two pools): only the order moves, so the outputs must be the same bits as the same tiles in
    group order. A tile taken twice or never (rows NaN or other bits), the sort's keys colliding across programs
    (programs disagreeing on the order: tiles lost), or another group's weights; then a captured graph replayed on
    rows of another skew (the order is decided on the device at every launch)."""
    tk = _triton()
    if schedule != "pointer" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    H, I = 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(15)
    w = _two_pools(gen, H, I, [0, 0, -1, 1, 0, 0, 1, 0], [0, 1, -1, 0, 2, 3, 1, 4])
    lens = [1, 37, 0, 3, 900, 0, 16, 130]
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    plain = {k: dict(v) for k, v in _SWAP_TILES.items()}
    padded = True
    if schedule == "tma":
        plain = {k: {**v, "tma": True} for k, v in plain.items()}
    elif schedule.startswith("big"):
        plain = {"gate_up": {**_BIG_GU, "ws": schedule == "big ws"}, "down": {**_BIG_DOWN, "flat": schedule == "big flat"}}
        padded = schedule != "big flat"  # the flattened loop only without the tile skip
    elif schedule == "streamk":
        plain = {k: {**v, "streamk": True} for k, v in plain.items()}
    mix = {k: {**v, "mix": True} for k, v in plain.items()}
    same = torch.equal if schedule != "streamk" else (lambda a, b: _rel(a, b) < _W13I_SAME_TOL)  # stream-K cuts other
    # tiles in another order: a cut tile's pieces are summed in another grouping (float32), so not the same bits
    _as_plain_then_replayed(tk, x, rw, cu, w, total, H, gen, plain, mix, padded, same, "the mixed order")


def _as_plain_then_replayed(tk, x, rw, cu, w, total, H, gen, plain, option, padded, same, what):
    """Tiles ``option`` (``plain`` with one option set) against ``plain`` on the same rows: every row written and
    ``same`` as plain's, run on a side stream; then captured in a graph, replayed on other rows written into the
    graph's inputs (``_refill``), ``same`` again. ``what`` names the option in the messages."""
    want = torch.full_like(x, float("nan"))
    tk.expert_ffn_triton(x, rw, cu, w, out=want, config=plain, padded=padded)
    out = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], w.intermediate, dtype=x.dtype, device="cuda")
    on_side_stream(lambda: tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=option, padded=padded))
    torch.cuda.synchronize()
    assert not bool(torch.isnan(out[:total]).any()), f"{what} left output rows unwritten"
    assert same(out[:total], want[:total]), f"{what} changed the outputs: {_rel(out[:total], want[:total]):.2e}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.expert_ffn_triton(x, rw, cu, w, out=out, act=act, config=option, padded=padded)
    total2 = _refill(x, rw, cu, [300, 0, 0, 64, 1, 0, 31, 2], H, gen)
    out.fill_(float("nan"))
    graph.replay()
    tk.expert_ffn_triton(x, rw, cu, w, out=want, config=plain, padded=padded)
    torch.cuda.synchronize()
    assert same(out[:total2], want[:total2]), f"a replayed launch of {what} drifted"


#: the tiles at Kimi-K2's 1024-token entry, as the pair lever runs them (``bench_levers.pair_tiles``)
_PAIR_TILES = {"gate_up": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True},
               "down": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True,
                        "flat": True}}


@pytest.mark.parametrize("schedule", ["pointer", "tma", "tma padded", "swap"])
def test_paired_row_tiles(schedule):
    """Two row tiles of a group run as one tile of twice the rows where both hold rows (``"pair"``) on a GPU, over
    weights stored interleaved, on groups whose rows end inside a first row tile, exactly at a pair's end, one row
    into an odd last tile and past many pairs, with empty and weightless groups: against the same tiles one by one.
    A pair's second half dropped, or the zero tiles starting past a pair's rows where a group ends in an odd tile
    (rows left NaN), or rows summed in another order than the tiles one by one (beyond the interleaved
    tolerance); then a captured graph replayed on other rows (the pairs are decided on the device)."""
    tk = _triton()
    if schedule != "pointer" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")
    H, I = 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(16)
    wg = _weights(8, H, I, gen)
    w = interleaved(wg)
    lens = [1, 128, 0, 129, 900, 0, 64, 65]
    x, rw, cu, total = _inputs(lens, H, gen, pad_to=128, extra=300)
    plain = {k: dict(v) for k, v in _PAIR_TILES.items()}
    padded = schedule == "tma padded"
    if schedule == "pointer":
        plain = {k: {kk: vv for kk, vv in v.items() if kk != "tma"} for k, v in plain.items()}
    elif schedule == "swap":
        plain = {"gate_up": {**plain["gate_up"], "BM": 16, "BN": 64, "swap": True},
                 "down": {**plain["down"], "BM": 16, "swap": True}}
    pair = {k: {**v, "pair": True} for k, v in plain.items()}
    _as_plain_then_replayed(tk, x, rw, cu, w, total, H, gen, plain, pair, padded,
                            lambda a, b: _rel(a, b) < _W13I_SAME_TOL, "paired row tiles")
