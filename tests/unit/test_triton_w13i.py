"""The ``"w13i"`` gate/up tiles (gate and up interleaved row by row in one weight, one MMA of ``2BN`` columns):
under Triton's CPU interpreter against the float64 reference, compiled for Hopper, and the plumbing around them
(``interleave_gate_up``, the interleaved copy beside the pointer table, the errors).

The kernel checks run in a child process with ``TRITON_INTERPRET=1`` (``tests.interpreter_child``: Triton may
already be imported here); each test asserts one entry of its report. Tolerance as in
``test_triton_interpreter``: 2e-2 against float64 (the interpreter truncates to bf16), and the w13i output
within ``SAME_TOL`` of the same tiles without it (the same sums over a wider MMA: equal up to float32 order).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.interpreter_child import interpreter_report

TOL = 2e-2
#: w13i against the committed two-MMA tiles (same operands, same sums; a bf16 rounding at most here and there)
SAME_TOL = 2e-3
#: cases of ``test_triton_interpreter._case_data``: several groups with empty ones, H and I off the tile sizes
#: (masked K, clamped columns), pools with -1 groups and a strided w13 view, segments padded with weight-0 rows
CASES = ["random_ragged", "odd_dims", "multi_pool", "padded_segments"]
#: ``(name, gate_up options, fused)``: the schedules and loads that take w13i (one launch: ``fused``)
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
    from vllm_moonep.common.grouped_gemm.triton_kernels import (_INTERP_CONFIG, _descriptors, expert_ffn_triton,
                                                                interpreting, prepare_weights)
    from vllm_moonep.testing.reference import expert_ffn_float64

    assert interpreting()
    one = {"num_warps": 4, "num_stages": 1, "progs_per_sm": 1}

    def cfg_of(opts: dict, fused: bool, w13i: bool) -> dict:
        c = {"gate_up": {**_INTERP_CONFIG["gate_up"], **opts, "w13i": w13i}, "down": dict(_INTERP_CONFIG["down"])}
        return {**c, "fused": one} if fused else c

    report: dict = {}
    for name in CASES:
        try:
            x, rw, cu, w, n = _case_data(name)
            ref = expert_ffn_float64(x, rw, cu, w)
            denom = float(ref[:n].norm())
            zero_rows = ref[:n].abs().sum(dim=1) == 0
            r: dict = {}
            for run, opts, fused in RUNS:
                base = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=base, config=cfg_of(opts, fused, False))
                o = torch.full_like(x, float("nan"))
                expert_ffn_triton(x, rw, cu, w, out=o, config=cfg_of(opts, fused, True))
                got = o[:n].double()
                r[run] = {"err": float((got - ref[:n]).norm()) / denom,
                          "vs_two_mma": float((got - base[:n].double()).norm()) / denom,
                          "unwritten": int(torch.isnan(got).sum()),
                          "zero_ok": bool((got[zero_rows] == 0).all())}
            # the TMA runs loaded through descriptors (a fallback to pointer loads would pass them unseen)
            prep = prepare_weights(w, x.device)
            (s_gn, _), (s_un, _) = prep.w13i.strides
            r["tma_used"] = _descriptors({"tma": True, "ws": True, "num_warps": 4}, x, (s_gn, s_un)) == (True, True)
            # the copy follows the weights: a pool written in place (version bump) is interleaved again
            w.gate[0].mul_(-1)
            o = torch.full_like(x, float("nan"))
            expert_ffn_triton(x, rw, cu, w, out=o, config=cfg_of({}, False, True))
            ref2 = expert_ffn_float64(x, rw, cu, w)
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
def test_w13i_against_float64(report, case, run):
    """w13i tiles with gate and up swapped in the split, the interleaved rows misaddressed (pointer table, TMA row
    offset, clamp), a padding row not exactly 0, or a row left unwritten, in one schedule and load path."""
    r = report[case]
    assert "error" not in r, r.get("error")
    d = r[run]
    assert d["unwritten"] == 0, f"{case}/{run}: {d['unwritten']} output elements inside segments not written"
    assert d["zero_ok"], f"{case}/{run}: rows with a zero reference (weight 0, padding) are not exactly 0"
    assert d["err"] < TOL, f"{case}/{run}: relative error {d['err']:.3e} against float64 >= {TOL}"
    assert d["vs_two_mma"] < SAME_TOL, (f"{case}/{run}: w13i differs from the same tiles without it by "
                                        f"{d['vs_two_mma']:.3e} (>= {SAME_TOL})")


@pytest.mark.parametrize("case", CASES)
def test_w13i_copy_follows_weights_and_tma_ran(report, case):
    """A stale interleaved copy after the weights were written in place (the pointer table rebuilt, the copy not),
    or TMA runs that silently fell back to pointer loads."""
    r = report[case]
    assert "error" not in r, r.get("error")
    assert r["tma_used"], f"{case}: the w13i TMA tiles fell back to pointer loads (the tma checks would be vacuous)"
    assert r["after_write_err"] < TOL, (f"{case}: after gate was written in place the w13i tiles read old weights "
                                        f"(relative error {r['after_write_err']:.3e})")


# ---- plumbing on CPU tensors (no kernel runs) ----------------------------------------------------------------


def _weights(G=4, I=8, H=32, seed=0):
    from vllm_moonep.common.grouped_gemm import GroupedWeights

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(G, I, H, generator=g)).to(torch.bfloat16),
            (torch.randn(G, I, H, generator=g)).to(torch.bfloat16),
            (torch.randn(G, H, I, generator=g)).to(torch.bfloat16)], GroupedWeights


def test_interleave_gate_up_rows():
    """Interleaving that puts up at even rows, or gate and up in two halves (the kernel reads row 2j as gate j)."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    (gate, up, _), _ = _weights()
    w = tk.interleave_gate_up(gate, up)
    assert w.shape == (4, 16, 32)
    assert torch.equal(w[:, 0::2], gate) and torch.equal(w[:, 1::2], up)
    out = torch.empty_like(w)
    assert tk.interleave_gate_up(gate, up, out=out) is out and torch.equal(out, w)


def test_interleave_gate_up_refuses_bad_shapes():
    """Mismatched gate/up or a wrong ``out`` accepted (a silent partial copy) instead of a clear error."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.engine.errors import MoonEPInputError

    (gate, up, _), _ = _weights()
    with pytest.raises(MoonEPInputError, match="gate and up must be"):
        tk.interleave_gate_up(gate, up[:, :4])
    with pytest.raises(MoonEPInputError, match="out must be"):
        tk.interleave_gate_up(gate, up, out=torch.empty(4, 8, 32, dtype=torch.bfloat16))


def test_interleaved_copy_only_when_asked_and_once_per_row():
    """The interleaved copy built without a w13i config (memory spent by default), built twice for one weights
    object, copying a (pool, row) once per group that reads it, or a table row pointing at another group's rows."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    (gate, up, down), GW = _weights()
    # groups 0 and 2 read row 1, group 1 row 3, group 3 has no weights
    w = GW([gate], [up], [down], torch.tensor([0, 0, 0, -1]), torch.tensor([1, 3, 1, -1]))
    prep = tk.prepare_weights(w, "cpu")
    assert prep.w13i is None, "prepare_weights built the interleaved copy without being asked"
    again = tk.prepare_weights(w, "cpu", w13i=True)
    assert again is prep and prep.w13i is not None
    copy = prep.w13i.copy
    assert tk.prepare_weights(w, "cpu", w13i=True).w13i.copy is copy, "the copy was built again"
    assert copy.shape == (2, 16, 32), f"one interleaved row per distinct (pool, row) read: got {tuple(copy.shape)}"
    tab, base = prep.w13i.table.tolist(), prep.table.tolist()
    assert tab[0][0] == tab[2][0] == tab[0][1] and tab[0][0] != tab[1][0] and tab[3] == [0, 0, 0]
    assert [t[2] for t in tab] == [b[2] for b in base], "the w13i table's down column is not the groups' down"
    row = {tab[1][0]: 3, tab[0][0]: 1}
    for ptr, r in row.items():
        i = (ptr - copy.data_ptr()) // (copy.stride(0) * copy.element_size())
        assert torch.equal(copy[i], tk.interleave_gate_up(gate[r:r + 1], up[r:r + 1])[0])


def test_w13i_refused_in_down_tiles_and_without_copy():
    """``"w13i"`` in the down tiles silently ignored, or a gate/up launch asking for it without the interleaved
    copy reading a null table: both a clear error before anything runs."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.engine.errors import MoonEPInputError

    (gate, up, down), GW = _weights()
    w = GW.contiguous(gate, up, down)
    x = torch.randn(6, 32).to(torch.bfloat16)
    cu = torch.tensor([2, 2, 6, 6], dtype=torch.int32)
    cfg = {"gate_up": {"BM": 16, "BN": 16, "BK": 32, "num_warps": 4, "num_stages": 1},
           "down": {"BM": 16, "BN": 32, "BK": 16, "num_warps": 4, "num_stages": 1, "w13i": True}}
    with pytest.raises(MoonEPInputError, match="gate_up tile option"):
        tk.expert_ffn_triton(x, torch.rand(6), cu, w, config=cfg)
    prep = tk.prepare_weights(w, "cpu")
    assert prep.w13i is None
    with pytest.raises(MoonEPInputError, match="no interleaved copy"):
        tk._w13i(prep, {"w13i": True})
    assert tk._w13i(prep, {})[0] is False


# ---- compiled for Hopper (sm_90, no GPU needed) ----------------------------------------------------------------

#: ``(name, kernel, constexprs, warps, wgmma shape the PTX must hold)``: the one MMA twice as wide is the lever's
#: point: 128 x 128 tiles of 8 warps run m64n256 (two m64n128 without w13i)
_FLAGS = dict(EVEN_K=True, EVEN_N=True, DOT_F32=False, SKIP=True, GP2=512)
COMPILE_CASES = [
    ("gate_up(TMA, 128x128, w13i)", "gate_up",
     dict(_FLAGS, BM=128, BN=128, BK=64, TMA=True, WS=False, FLAT=False, STREAMK=False, SWAP=False, W13I=True, MIX=False), 8,
     "m64n256k16"),
    ("gate_up(TMA, warp-specialized, w13i)", "gate_up",
     dict(_FLAGS, BM=64, BN=128, BK=64, TMA=True, WS=True, FLAT=False, STREAMK=False, SWAP=False, W13I=True, MIX=False), 8, None),
    ("gate_up(pointer, swapped, stream-K, w13i)", "gate_up",
     dict(_FLAGS, BM=32, BN=64, BK=128, TMA=False, WS=False, FLAT=False, STREAMK=True, SWAP=True, W13I=True, MIX=False), 4, None),
    ("fused(TMA gate/up, w13i)", "fused",
     dict(GP2=512, TB=128, ZM=64, BM1=16, BN1=32, BK1=128, EVEN_K1=True, EVEN_N1=True, BM2=16, BN2=128, BK2=128,
          EVEN_K2=True, EVEN_N2=True, DOT_F32=False, SKIP=True, TMA1=True, SWAP1=False, SWAP2=False, ZT=True,
          HAS_ENDS=True, W13I1=True, TMA2=False, FENCE2=False), 4, None),
]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_w13i_compiles_for_sm90(case):
    """w13i code the interpreter takes but the compiler refuses (the reshape and split of an MMA accumulator, a
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
