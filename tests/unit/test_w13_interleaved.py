"""Weights stored interleaved (gate row ``j`` at row ``2j`` of one ``w13``, up row ``j`` at ``2j + 1``: the
symmetric layout's order) and the gate/up tiles that read them as one weight (``W13I``: one ``[2BN, BK]`` block and
one MMA of ``2BN`` columns): under Triton's CPU interpreter against the float64 reference and against the same
weights stored in halves, compiled for Hopper, and the plumbing (``interleave_gate_up``, the detection of the order
from strides, the pointer table that reads the ``w13`` rows in place).

The kernel checks run in a child process with ``TRITON_INTERPRET=1`` (``tests.interpreter_child``: Triton may
already be imported here); each test asserts one entry of its report. Tolerance as in
``test_triton_interpreter``: 2e-2 against float64 (the interpreter truncates to bf16), and the interleaved
output within ``SAME_TOL`` of the halves' (the same sums over a wider MMA: equal up to float32 order).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.interpreter_child import interpreter_report

TOL = 2e-2
#: interleaved against halves (same operands, same sums; a bf16 rounding at most here and there)
SAME_TOL = 2e-3
#: cases of ``test_triton_interpreter._case_data``: several groups with empty ones, H and I off the tile sizes
#: (masked K, clamped columns), pools with -1 groups, segments padded with weight-0 rows
CASES = ["random_ragged", "odd_dims", "multi_pool", "padded_segments"]
#: ``(name, gate_up options, fused)``: the schedules and loads that read interleaved weights (one launch: ``fused``)
RUNS = [
    ("pointer", {}, False),
    ("tma", {"tma": True}, False),
    ("swap", {"tma": True, "swap": True}, False),
    ("streamk", {"streamk": True, "progs_per_sm": 40}, False),
    ("fused_pointer", {}, True),
    ("fused_tma", {"tma": True}, True),
]


def _child_main() -> None:
    import json

    from tests.unit.test_triton_interpreter import _case_data
    from vllm_moonep.common.grouped_gemm.triton_kernels import (_INTERP_CONFIG, _descriptors, _w13i, expert_ffn_triton,
                                                                interpreting, prepare_weights)
    from vllm_moonep.testing.reference import expert_ffn_float64
    from vllm_moonep.testing.weights import interleaved

    assert interpreting()
    one = {"num_warps": 4, "num_stages": 1, "progs_per_sm": 1}

    def cfg_of(opts: dict, fused: bool) -> dict:
        c = {"gate_up": {**_INTERP_CONFIG["gate_up"], **opts}, "down": dict(_INTERP_CONFIG["down"])}
        return {**c, "fused": one} if fused else c

    report: dict = {}
    for name in CASES:
        try:
            x, rw, cu, w, n = _case_data(name)
            wi = interleaved(w)
            ref = expert_ffn_float64(x, rw, cu, w)
            denom = float(ref[:n].norm())
            zero_rows = ref[:n].abs().sum(dim=1) == 0
            r: dict = {"w13i": [prepare_weights(w, x.device).w13i, prepare_weights(wi, x.device).w13i]}
            for run, opts, fused in RUNS:
                base = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=base, config=cfg_of(opts, fused))
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, wi, out=o, config=cfg_of(opts, fused))
                got = o[:n].double()
                r[run] = {"err": float((got - ref[:n]).norm()) / denom,
                          "vs_halves": float((got - base[:n].double()).norm()) / denom,
                          "unwritten": int(torch.isnan(got).sum()),
                          "zero_ok": bool((got[zero_rows] == 0).all())}
            # the TMA runs loaded through descriptors (a fallback to pointer loads would pass them unseen)
            _, ((s_gn, _), (s_un, _)) = _w13i(prepare_weights(wi, x.device))
            r["tma_used"] = _descriptors({"tma": True, "ws": True, "num_warps": 4}, x, (s_gn, s_un)) == (True, True)
            # the rows are read in place: a write to the stored w13 (version bump) is what the next call computes
            wi.gate[0].mul_(-1)
            o = torch.full_like(x, float("nan"))
            expert_ffn_triton(x, rw, cu, wi, out=o, config=cfg_of({}, False))
            ref2 = expert_ffn_float64(x, rw, cu, wi)
            r["after_write_err"] = float((o[:n].double() - ref2[:n]).norm()) / max(float(ref2[:n].norm()), 1e-30)
            report[name] = r
        except Exception as e:  # report, don't hide
            report[name] = {"error": f"{type(e).__name__}: {e}"}
    print("REPORT " + json.dumps(report))


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("run", [r[0] for r in RUNS])
def test_interleaved_against_float64_and_halves(report, case, run):
    """Interleaved tiles with gate and up swapped in the split, the interleaved rows misaddressed (pointer table,
    TMA row offset, row stride, clamp), a padding row not exactly 0, or a row left unwritten, in one schedule and
    load path; or the halves run taking the interleaved tiles (or the interleaved run not: the check vacuous)."""
    r = report[case]
    assert "error" not in r, r.get("error")
    assert r["w13i"] == [False, True], f"{case}: W13I taken (halves, interleaved) = {r['w13i']}, want [False, True]"
    d = r[run]
    assert d["unwritten"] == 0, f"{case}/{run}: {d['unwritten']} output elements inside segments not written"
    assert d["zero_ok"], f"{case}/{run}: rows with a zero reference (weight 0, padding) are not exactly 0"
    assert d["err"] < TOL, f"{case}/{run}: relative error {d['err']:.3e} against float64 >= {TOL}"
    assert d["vs_halves"] < SAME_TOL, (f"{case}/{run}: interleaved differs from the same weights in halves by "
                                       f"{d['vs_halves']:.3e} (>= {SAME_TOL})")


@pytest.mark.parametrize("case", CASES)
def test_interleaved_rows_read_in_place_and_tma_ran(report, case):
    """A stale copy of the interleaved rows read after the stored w13 was written in place, or TMA runs that
    silently fell back to pointer loads."""
    r = report[case]
    assert "error" not in r, r.get("error")
    assert r["tma_used"], f"{case}: the interleaved TMA tiles fell back to pointer loads (the tma checks would be vacuous)"
    assert r["after_write_err"] < TOL, (f"{case}: after gate was written in place the tiles read old weights "
                                        f"(relative error {r['after_write_err']:.3e})")


# ---- plumbing on CPU tensors (no kernel runs) ----------------------------------------------------------------


def _weights(G=4, I=8, H=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(G, I, H, generator=g)).to(torch.bfloat16),
            (torch.randn(G, I, H, generator=g)).to(torch.bfloat16),
            (torch.randn(G, H, I, generator=g)).to(torch.bfloat16)]


def test_interleave_gate_up_rows():
    """Interleaving that puts up at even rows, or gate and up in two halves (the kernel reads row 2j as gate j)."""
    from vllm_moonep.common.grouped_gemm import interleave_gate_up

    gate, up, _ = _weights()
    w = interleave_gate_up(gate, up)
    assert w.shape == (4, 16, 32)
    assert torch.equal(w[:, 0::2], gate) and torch.equal(w[:, 1::2], up)
    out = torch.empty_like(w)
    assert interleave_gate_up(gate, up, out=out) is out and torch.equal(out, w)
    # a w13 in halves (vLLM's order) the same way, into the heap's rows when given
    from vllm_moonep.common.grouped_gemm import interleave_w13

    out2 = torch.empty_like(w)
    assert interleave_w13(torch.cat([gate, up], dim=1), out=out2) is out2 and torch.equal(out2, w)


def test_interleave_gate_up_refuses_bad_shapes():
    """Mismatched gate/up or a wrong ``out`` accepted (a silent partial copy) instead of a clear error."""
    from vllm_moonep.common.grouped_gemm import interleave_gate_up
    from vllm_moonep.engine.errors import MoonEPInputError

    gate, up, _ = _weights()
    with pytest.raises(MoonEPInputError, match="gate and up must be"):
        interleave_gate_up(gate, up[:, :4])
    with pytest.raises(MoonEPInputError, match="out must be"):
        interleave_gate_up(gate, up, out=torch.empty(4, 8, 32, dtype=torch.bfloat16))
    from vllm_moonep.common.grouped_gemm import interleave_w13

    with pytest.raises(MoonEPInputError, match=r"interleave_w13: w13 must be \[N, 2I, H\]"):
        interleave_w13(torch.empty(4, 7, 32, dtype=torch.bfloat16))


def test_order_found_from_strides():
    """Halves, separate tensors, a gate/up pair swapped (up at the even rows), a sliced interleaved w13 (rows of a
    larger one, as the heap's home rows are) or views of two different tensors taken for interleaved, or one
    interleaved pool among halves ones making the whole source interleaved (the kernel would read a pool's
    halves as pairs)."""
    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up

    gate, up, down = _weights()
    w13 = interleave_gate_up(gate, up)
    halves = torch.cat([gate, up], dim=1)
    inter = GroupedWeights.of_w13(w13, down, interleaved=True)
    assert inter.interleaved and torch.equal(inter.gate[0], gate) and torch.equal(inter.up[0], up)
    assert inter.gate_up_interleaved().data_ptr() == w13.data_ptr() and torch.equal(inter.gate_up_interleaved(), w13)
    assert inter.gate_up_as_one() is None
    h = GroupedWeights.of_w13(halves, down, interleaved=False)
    assert not h.interleaved and h.gate_up_interleaved() is None and torch.equal(h.gate_up_as_one(), halves)
    assert not GroupedWeights.contiguous(gate, up, down).interleaved
    swapped = GroupedWeights.contiguous(w13[:, 1::2], w13[:, 0::2], down)
    assert not swapped.interleaved and swapped.gate_up_interleaved() is None
    big = torch.cat([w13, w13.clone()], dim=0)  # home rows then slots, one storage
    assert GroupedWeights.of_w13(big[1:3], down[1:3], interleaved=True).interleaved
    other = interleave_gate_up(gate, up)
    assert not GroupedWeights.contiguous(w13[:, 0::2], other[:, 1::2], down).interleaved
    mixed = GroupedWeights([w13[:, 0::2], gate], [w13[:, 1::2], up], [down, down], torch.tensor([0, 1, 0, 1]),
                           torch.tensor([0, 1, 2, 3]))
    assert not mixed.interleaved


def test_table_reads_w13_rows_in_place():
    """The pointer table of interleaved weights pointing anywhere but each group's w13 row (a copy, another group's
    row), or strides that are not the interleaved rows' (the kernel would read every other row)."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up

    gate, up, down = _weights()
    w13 = interleave_gate_up(gate, up)
    # groups 0 and 2 read row 1, group 1 row 3, group 3 has no weights
    w = GroupedWeights([w13[:, 0::2]], [w13[:, 1::2]], [down], torch.tensor([0, 0, 0, -1]), torch.tensor([1, 3, 1, -1]))
    prep = tk.prepare_weights(w, "cpu")
    assert prep.w13i is True
    row = w13.stride(0) * w13.element_size()
    tab = prep.table.tolist()
    assert [t[0] for t in tab] == [w13.data_ptr() + r * row for r in (1, 3, 1)] + [0]
    w13i, ((s_gn, s_gk), _) = tk._w13i(prep)
    assert w13i and (s_gn, s_gk) == (32, 1), (s_gn, s_gk)
    assert tk._w13i(tk.prepare_weights(GroupedWeights.contiguous(gate, up, down), "cpu"))[0] is False



def test_mixed_orders_refused_by_the_triton_kernels():
    """A source that mixes an interleaved pool with two-tensor ones run anyway (the gate/up launch reads every group
    one way: one kind of pool's gate and up misread) or refused without naming the pool, or a refusal that leaves
    the weights unusable in one order."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up
    from vllm_moonep.engine.errors import MoonEPInputError

    gate, up, down = _weights()
    w13 = interleave_gate_up(gate, up)
    mixed = GroupedWeights([gate, w13[:, 0::2]], [up, w13[:, 1::2]], [down, down], torch.tensor([0, 1, 0, 1]),
                           torch.tensor([0, 1, 2, 3]))
    with pytest.raises(MoonEPInputError, match=r"different orders \(interleaved in pools \[1\]"):
        tk.prepare_weights(mixed, "cpu")
    one = GroupedWeights([w13[:, 0::2], w13[:, 0::2]], [w13[:, 1::2], w13[:, 1::2]], [down, down],
                         torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 2, 3]))
    assert tk.prepare_weights(one, "cpu").w13i

# ---- compiled for Hopper (sm_90, no GPU needed) ----------------------------------------------------------------

#: ``(name, kernel, constexprs, warps, wgmma shape the PTX must hold)``: the one MMA twice as wide is the point of
#: the interleaved order: 128 x 128 tiles of 8 warps run m64n256 (two m64n128 on halves)
_FLAGS = dict(EVEN_K=True, EVEN_N=True, DOT_F32=False, SKIP=True, GP2=512)
COMPILE_CASES = [
    ("gate_up(TMA, 128x128, w13i)", "gate_up",
     dict(_FLAGS, BM=128, BN=128, BK=64, TMA=True, WS=False, FLAT=False, STREAMK=False, SWAP=False, W13I=True, MIX=False,
          PAIR=False, BMT=128), 8,
     "m64n256k16"),
    ("gate_up(TMA, warp-specialized, w13i)", "gate_up",
     dict(_FLAGS, BM=64, BN=128, BK=64, TMA=True, WS=True, FLAT=False, STREAMK=False, SWAP=False, W13I=True, MIX=False,
          PAIR=False, BMT=64), 8, None),
    ("gate_up(pointer, swapped, stream-K, w13i)", "gate_up",
     dict(_FLAGS, BM=32, BN=64, BK=128, TMA=False, WS=False, FLAT=False, STREAMK=True, SWAP=True, W13I=True, MIX=False,
          PAIR=False, BMT=32), 4, None),
    ("fused(TMA gate/up, w13i)", "fused",
     dict(GP2=512, TB=128, ZM=64, BM1=16, BN1=32, BK1=128, EVEN_K1=True, EVEN_N1=True, BM2=16, BN2=128, BK2=128,
          EVEN_K2=True, EVEN_N2=True, DOT_F32=False, SKIP=True, TMA1=True, SWAP1=False, SWAP2=False, ZT=True,
          HAS_ENDS=True, W13I1=True, TMA2=False, FENCE2=False), 4, None),
]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_interleaved_tiles_compile_for_sm90(case):
    """W13I code the interpreter takes but the compiler refuses (the reshape and split of an MMA accumulator, a
    [2BN, BK] descriptor), or a 128 x 128 tile whose gate/up MMA is not one warpgroup MMA of N = 256."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_moonep.common.grouped_gemm import triton_fused, triton_kernels as gk

    name, kind, constexprs, warps, wgmma = case
    i32, bf16 = "i32", "*bf16"
    if kind == "gate_up":
        fn = gk._gate_up_kernel
        sig = dict(x_ptr=bf16, rw_ptr="*fp32", cu_ptr="*i32", eff_ptr="*i32", tab_ptr="*i64", act_ptr=bf16,
                   ws_ptr="*fp32", tk_ptr="*i32", M=i32, G=i32, N=i32, K=i32, stride_xm=i32, stride_am=i32, s_gn=i32,
                   s_gk=i32, s_un=i32, s_uk=i32)
    else:
        fn = triton_fused.fused_kernel
        sig = dict(x_ptr=bf16, rw_ptr="*fp32", cu_ptr="*i32", ends_ptr="*i32", tab_ptr="*i64", act_ptr=bf16,
                   out_ptr=bf16, sync_ptr="*i32", M=i32, G=i32, I=i32, H=i32, stride_xm=i32, stride_am=i32,
                   stride_om=i32, s_gn=i32, s_gk=i32, s_un=i32, s_uk=i32, s_dn=i32, s_dk=i32)
    sig.update({k: "constexpr" for k in constexprs})
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = compiled.asm["ptx"]
    assert ".entry" in ptx
    if wgmma is not None:
        shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
        assert shapes == [wgmma], f"{name}: warpgroup MMAs {shapes}, want one {wgmma} per step"


if __name__ == "__main__":
    _child_main()
