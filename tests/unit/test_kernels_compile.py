"""Every Triton kernel of the engine compiles for Hopper (sm_90) on a machine without a GPU.

The interpreter runs kernels as Python, so it accepts code the compiler refuses (non-constexpr
globals, wrong pointer casts, inline PTX, atomics with memory semantics): a kernel that only ever
ran under TRITON_INTERPRET=1 can still fail at its first launch on a GPU. Compiling each one to
PTX here (Triton ships the compiler and ptxas) catches that in CPU CI.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


# the expert kernels' runtime arguments (everything but their constexprs)
_GEMM_PTRS = dict(x_ptr="*bf16", rw_ptr="*fp32", cu_ptr="*i32")
_GEMM_DIMS = dict(M="i32", G="i32", N="i32", K="i32")
_SK_PTRS = dict(ws_ptr="*fp32", tk_ptr="*i32")  # the stream-K workspace and tickets
GATE_UP_SIG = dict(_GEMM_PTRS, eff_ptr="*i32", tab_ptr="*i64", act_ptr="*bf16", **_SK_PTRS, **_GEMM_DIMS,
                   stride_xm="i32", stride_am="i32", s_gn="i32", s_gk="i32", s_un="i32", s_uk="i32")
DOWN_SIG = dict(act_ptr="*bf16", rw_ptr="*fp32", cu_ptr="*i32", eff_ptr="*i32", tab_ptr="*i64", out_ptr="*bf16",
                **_SK_PTRS, **_GEMM_DIMS, stride_am="i32", stride_om="i32", s_dn="i32", s_dk="i32")
FUSED_SIG = dict(_GEMM_PTRS, ends_ptr="*i32", tab_ptr="*i64", act_ptr="*bf16", out_ptr="*bf16", sync_ptr="*i32",
                 M="i32", G="i32", I="i32", H="i32", stride_xm="i32", stride_am="i32", stride_om="i32", s_gn="i32",
                 s_gk="i32", s_un="i32", s_uk="i32", s_dn="i32", s_dk="i32")


def _kernels():
    from vllm_moonep.common import pad_kernel
    from vllm_moonep.engine.planning import device_planner as dp
    from vllm_moonep.engine import row_copy
    from vllm_moonep.engine.transports import symmetric_kernels as k

    i32, i64, bf16 = "i32", "i64", "*bf16"
    rows_sig = dict(x=bf16, w="*fp32", ids="*i32", dest="*i64", row="*i64", ob="*i64", cum="*i64", rb="*i64",
                    table="*i64", board=i64, epoch="*i64", ticket="*i32", sig="*i64", cu="*i64", seg_len="*i64",
                    cu32="*i32", rows32="*i32", ends32="*i32", real_rows="*i32", n_entries=i32, n_move=i32, K=i32, H=i32, R=i32,
                    E=i32, me=i32, G=i32, TP=i32, timeout_ns=i64, n_prog=i32)
    rows_cx = dict(ROWS=4, BLOCK_H=4096, R_PAD=8, G_PAD=1024, CHUNK=1024, PCH=256)

    def copy_sig(table, w):
        planes = {f"{k}{p}": t for k, t in (("dst", bf16), ("src", bf16), ("tab", table), ("elems", i64),
                                             ("chunks", i32)) for p in range(3)}
        return dict(ids="*i32", **planes, rows_per_source=i32, B=i32, cu="*i32", w=w, E=i32, n_prog=i32)
    cases = [
        ("dispatch_rows(place inline)", k.dispatch_rows_kernel, rows_sig, dict(rows_cx, PLACE=True)),
        ("dispatch_rows(placed before)", k.dispatch_rows_kernel, rows_sig, dict(rows_cx, PLACE=False)),
        ("clear_rows", k.clear_rows_kernel,
         dict(real_rows="*i32", recv_x=bf16, recv_w="*fp32", recv_src="*i32", SK=i32, H=i32, n_prog=i32),
         dict(ROWS=4, BLOCK_H=4096)),
        ("combine_rows", k.combine_rows_kernel,
         dict(y=bf16, yw="*fp32", recv_x=bf16, recv_w="*fp32", recv_src="*i32", real_rows="*i32", table="*i64",
              board=i64, epoch="*i64", ticket="*i32", sig="*i64", SK=i32, H=i32, R=i32, me=i32, timeout_ns=i64,
              n_prog=i32), dict(HAS_W=True, ROWS=4, BLOCK_H=4096, R_PAD=8)),
        ("reduce", k.reduce_kernel,
         dict(comb_x=bf16, comb_w="*fp32", out=bf16, out_w="*fp32", S=i32, K=i32, H=i32, n_prog=i32),
         dict(HAS_W=True, K_PAD=8, BLOCK_H=2048)),
        ("copy_rows(table, two planes)", row_copy._kernel().fn, copy_sig("*i64", "*fp32"),
         dict(PLANES=2, TABLE=True, LIVE=True, B_PAD=256, CHUNK=65536, BLOCK=4096)),
        ("pad_and_count", pad_kernel._kernel().fn,
         dict(x=bf16, sx0=i32, sx1=i32, ids="*i64", si0=i32, si1=i32, w="*fp32", sw0=i32, sw1=i32, xo=bf16, io="*i32",
              wo="*fp32", tpe="*i32", s=i32, cap=i32, H=i32, K=i32, E=i32, pad_expert=i32),
         dict(ROWS=4, K_P=8, E_P=512, BLOCK_H=2048)),
        ("copy_rows(tensor, three planes)", row_copy._kernel().fn, copy_sig("*i32", bf16),
         dict(PLANES=3, TABLE=False, LIVE=False, B_PAD=256, CHUNK=65536, BLOCK=4096)),
    ]
    # the expert kernels at Kimi-K2 shape, decode and prefill tiles (tuning.json's), and the one-launch kernel
    from vllm_moonep.common.grouped_gemm import triton_fused, triton_kernels as gk

    gu_sig, dn_sig, fused_sig = GATE_UP_SIG, DOWN_SIG, FUSED_SIG
    flags = dict(EVEN_K=True, EVEN_N=True, DOT_F32=False, SKIP=True)
    fused_cx = dict(GP2=512, TB=128, ZM=64, BM1=16, BN1=32, BK1=128, EVEN_K1=True, EVEN_N1=True, BM2=16, BN2=128,
                    BK2=128, EVEN_K2=True, EVEN_N2=True, DOT_F32=False, SKIP=True, SWAP1=False, SWAP2=False, ZT=True,
                    HAS_ENDS=False, W13I1=False, TMA2=False, FENCE2=False)
    cases += [
        ("gate_up(decode tiles)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=16, BN=32, BK=128, TMA=False, WS=False, FLAT=False, STREAMK=False, SWAP=False, W13I=False, MIX=False)),
        ("gate_up(TMA, warp-specialized, 8 warps)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=64, BN=256, BK=64, TMA=True, WS=True, FLAT=False, STREAMK=False, SWAP=False, W13I=False, MIX=False), 8),
        ("gate_up(stream-K, decode tiles)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=16, BN=32, BK=128, TMA=False, WS=False, FLAT=False, STREAMK=True, SWAP=False, W13I=False, MIX=False)),
        ("gate_up(stream-K, TMA, 8 warps)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=64, BN=128, BK=64, TMA=True, WS=False, FLAT=False, STREAMK=True, SWAP=False, W13I=False, MIX=False), 8),
        ("down(TMA, tile loop flattened)", gk._down_kernel, dn_sig,
         dict(flags, SKIP=False, GP2=512, BM=128, BN=256, BK=64, ZM=64, TMA=True, WS=False, FLAT=True, STREAMK=False, SWAP=False,
              ZT=True, MIX=False), 8),
        ("down(stream-K, TMA, round robin flattened)", gk._down_kernel, dn_sig,
         dict(flags, SKIP=False, GP2=512, BM=64, BN=128, BK=64, ZM=64, TMA=True, WS=False, FLAT=True, STREAMK=True, SWAP=False,
              ZT=True, MIX=False)),
        # the padding tails left unwritten (zero_tail=False: a caller whose combine never reads them)
        ("down(tails left)", gk._down_kernel, dn_sig,
         dict(flags, GP2=512, BM=16, BN=128, BK=64, ZM=64, TMA=False, WS=False, FLAT=False, STREAMK=False, SWAP=False,
              ZT=False, MIX=False)),
        # the tiles taken from both ends of the groups sorted by rows ("mix": one tl.sort per program)
        ("gate_up(mix, TMA, 8 warps)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=64, BN=128, BK=64, TMA=True, WS=False, FLAT=False, STREAMK=False, SWAP=False, W13I=False,
              MIX=True), 8),
        ("down(mix, TMA, stream-K)", gk._down_kernel, dn_sig,
         dict(flags, GP2=512, BM=64, BN=128, BK=64, ZM=64, TMA=True, WS=False, FLAT=False, STREAMK=True, SWAP=False,
              ZT=True, MIX=True)),
        # swapped tiles (weights on the MMA's M side): the rows as the warpgroup MMA's N (16, 32)
        ("gate_up(swapped, decode tiles)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=32, BN=64, BK=128, TMA=False, WS=False, FLAT=False, STREAMK=False, SWAP=True, W13I=False, MIX=False)),
        ("down(swapped, TMA, stream-K)", gk._down_kernel, dn_sig,
         dict(flags, GP2=512, BM=16, BN=128, BK=64, ZM=64, TMA=True, WS=False, FLAT=False, STREAMK=True, SWAP=True,
              ZT=True, MIX=False)),
        # two row tiles as one of twice the rows where both hold rows ("pair"): a loop per tile size in one kernel
        ("gate_up(pair, TMA, 8 warps)", gk._gate_up_kernel, gu_sig,
         dict(flags, GP2=512, BM=64, BN=128, BK=64, TMA=True, WS=False, FLAT=False, STREAMK=False, SWAP=False, W13I=True,
              MIX=False, PAIR=True, BMT=128), 8),
        ("down(pair, TMA, tile loop flattened)", gk._down_kernel, dn_sig,
         dict(flags, SKIP=False, GP2=512, BM=64, BN=128, BK=64, ZM=64, TMA=True, WS=False, FLAT=True, STREAMK=False,
              SWAP=False, ZT=True, MIX=False, PAIR=True, BMT=128), 8),
        ("trim", gk._trim_kernel, dict(cu_ptr="*i32", rw_ptr="*fp32", eff_ptr="*i32"), dict(BLK=256)),
        ("fused(one launch)", triton_fused.fused_kernel, fused_sig, dict(fused_cx, TMA1=False)),
        ("fused(one launch, TMA gate/up)", triton_fused.fused_kernel, fused_sig, dict(fused_cx, TMA1=True)),
        ("fused(one launch, the engine's ends, tails left)", triton_fused.fused_kernel, fused_sig,
         dict(fused_cx, TMA1=False, ZT=False, HAS_ENDS=True)),
        ("fused(one launch, swapped tiles)", triton_fused.fused_kernel, fused_sig,
         dict(fused_cx, BN1=64, TMA1=True, SWAP1=True, SWAP2=True)),
        ("fused(one launch, TMA down operands)", triton_fused.fused_kernel, fused_sig,
         dict(fused_cx, BN2=64, TMA1=True, TMA2=True, FENCE2=True, HAS_ENDS=True, ZT=False)),
    ]
    for case in cases:  # the GEMM kernels' row tiles one by one where a case does not say ("pair" off)
        if case[1] in (gk._gate_up_kernel, gk._down_kernel) and "PAIR" not in case[3]:
            case[3].update(PAIR=False, BMT=case[3]["BM"])
    # the device planner at Kimi-K2 shape (R=8, E=384, S*K = 65536 entries), with the constexprs
    # the planner itself chooses
    import torch

    planner = dp.DevicePlanner(8, 384, 8192, 8, 48, 128, torch.device("cpu"))
    small = dp.DevicePlanner(2, 384, 128, 8, 192, 128, torch.device("cpu"))  # E/R=192, 8 sub-blocks
    chunked = dp.DevicePlanner(2, 384, 128, 8, 192, 128, torch.device("cpu"), rule4="pairwise")
    assert small._place_consts["DIRECT"] and not planner._place_consts["DIRECT"]
    assert small._plan_consts["SORT"] and planner._plan_consts["SORT"] and not chunked._plan_consts["SORT"]
    pairwise = dp.DevicePlanner(8, 384, 128, 8, 48, 128, torch.device("cpu"), rule4="pairwise")  # the whole row at once
    plan_sig = dict(tpe_ptr="*i32", s_tr=i32, s_te=i32, tpe_out="*i64", alloc_out="*i64", etc_out="*i32",
                    seg_out="*i64", cu_out="*i64", rb_out="*i64", ob_out="*i64", cum_out="*i64", R=i32, E=i32,
                    EPN=i32, B=i32, CAP=i32, x_tpe="*i32", x_table="*i64", x_sig="*i64", x_epoch="*i64", x_board=i64,
                    x_timeout_ns=i64, me=i32)
    place_sig = dict(ids_ptr="*i32", exs_ptr="*i32", tot_ptr="*i32", ob_ptr="*i64", cum_ptr="*i64", rb_ptr="*i64",
                     dest_ptr="*i64", row_ptr="*i64", rank=i32, N=i32, E=i32, R=i32)
    cases += [
        ("plan(E/R=192: rule 4 by a sort)", dp._plan_kernel, plan_sig, dict(small._plan_consts, EXCHANGE=False)),
        ("plan(E/R=192: rule 4 by a sort, counts exchanged)", dp._plan_kernel, plan_sig,
         dict(small._plan_consts, EXCHANGE=True)),
        ("plan(E/R=192: rule 4 pairwise in column chunks)", dp._plan_kernel, plan_sig,
         dict(chunked._plan_consts, EXCHANGE=False)),
        ("plan(E/R=48: rule 4 pairwise, one tile)", dp._plan_kernel, plan_sig, dict(pairwise._plan_consts, EXCHANGE=True)),
        ("place(direct, no histogram)", dp._place_kernel, place_sig, dict(small._place_consts)),
        ("plan", dp._plan_kernel, plan_sig, dict(planner._plan_consts, EXCHANGE=True)),
        ("hist", dp._hist_kernel, dict(ids_ptr="*i32", exs_ptr="*i32", tot_ptr="*i32", N=i32, E=i32),
         dict(planner._hist_consts)),
        ("place", dp._place_kernel,
         dict(ids_ptr="*i32", exs_ptr="*i32", tot_ptr="*i32", ob_ptr="*i64", cum_ptr="*i64", rb_ptr="*i64",
              dest_ptr="*i64", row_ptr="*i64", rank=i32, N=i32, E=i32, R=i32), dict(planner._place_consts)),
    ]
    return cases


def _ids(cases):
    """The test ids of a case builder (``_kernels``, ``_shipped``): one id naming the error where it fails."""
    try:
        return [c[0] for c in cases()]
    except Exception as exc:  # pragma: no cover - reported by the test below
        return [f"import-failed:{type(exc).__name__}"]


@pytest.mark.parametrize("name", _ids(_kernels))
def test_kernel_compiles_for_sm90(name):
    """A kernel that passes the interpreter but cannot be compiled (would fail at its first GPU launch); and
    swapped tiles (weight blocks of 64+ columns on the M side) that do not run Hopper's warpgroup MMA, their
    point (the unswapped 16-row tiles compile to the per-warp ``mma.sync``)."""
    case = {c[0]: c for c in _kernels()}[name]
    fn, sig, constexprs = case[1:4]
    warps = case[4] if len(case) > 4 else 4
    signature = dict(sig)
    for key in constexprs:
        signature[key] = "constexpr"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                              options=dict(num_warps=warps))
    assert ".entry" in compiled.asm["ptx"]
    if "swapped" in name:
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and "mma.sync" not in ptx, f"{name}: swapped tiles compiled to the per-warp MMA"


# ------------------------------------------------------------------------------------------------------------
# the tiles the product ships, compiled as a Hopper GPU compiles them at their launch
# ------------------------------------------------------------------------------------------------------------

#: the shared memory one block may opt into on Hopper (H100, H200)
SMEM_PER_BLOCK = 227 * 1024
#: groups per launch (the kernels' ``GP2``): E/R + B at EP=8 for the shipped shapes is 17-49
GROUPS = 64
#: arguments the launch's values specialize (Triton's JIT): unit strides become the constant 1, and pointers,
#: row strides and the dimensions (multiples of 16 at every shape) are known divisible by 16. The
#: unspecialized compile of ``test_kernel_compiles_for_sm90`` cannot vectorize the weight loads and leaves
#: every pointer-load main loop unpipelined, which no GPU runs.
UNIT_STRIDES = ("s_gk", "s_uk", "s_dk")
DIVISIBLE = ("stride_xm", "stride_am", "stride_om", "s_gn", "s_un", "s_dn", "N", "K", "H", "I")


def _shipped():
    """``(label, kernel, signature, launch meta)`` for each kernel launch the shipped tiles make on a Hopper GPU
    (options resolved as ``expert_ffn_triton`` resolves them there, on the layer's call: the engine's row ends,
    tails left, padded steps; the unpadded form too where it differs; the gate/up tiles over weights stored in
    halves, the replicated layout's, and interleaved, the symmetric layout's: ``W13I``): every entry of every
    device section of tuning.json, and the generic tiles at the shape ``bench_levers --lever generic`` measures
    them on, which has no entry."""
    import json
    from importlib import resources

    from vllm_moonep.common.grouped_gemm import triton_fused, triton_kernels as tk
    from vllm_moonep.tools.bench_levers import UNTUNED_SHAPE

    table = json.loads(resources.files("vllm_moonep.common.grouped_gemm").joinpath("tuning.json").read_text())
    entries = [(f"{dev} {e['shape']} {e['tokens_per_rank']}", e["H"], e["I"], e)
               for dev, sec in table["devices"].items() for e in sec.get("tiles", [])]  # a same_as section has none
    H, I = UNTUNED_SHAPE["H"], UNTUNED_SHAPE["I"]
    entries += [(f"generic {name} at H={H} I={I}", H, I, cfg) for name, cfg in tk.DEFAULT_CONFIGS.items()]
    out = []
    for label, H, I, e in entries:
        gu, dn = e["gate_up"], e["down"]
        if e.get("fused"):
            for w13i in (False, True):
                meta = tk.fused_meta(e, H, I, GROUPS, dot_f32=False, skip=True, tma1=bool(gu.get("tma")),
                                     tma2=bool(dn.get("tma")), w13i=w13i, zero_tail=False, has_ends=True)
                out.append((f"{label} one launch{' interleaved' if w13i else ''}", triton_fused.fused_kernel,
                            FUSED_SIG, meta))
            continue
        for kind, fn, sig, c, build in (("gate_up", tk._gate_up_kernel, GATE_UP_SIG, gu, tk.gate_up_meta),
                                         ("down", tk._down_kernel, DOWN_SIG, dn, tk.down_meta)):
            tma = bool(c.get("tma"))
            ws = tma and tk._ws(c)
            for skip in (True, False):
                flat = tk._flat(c, ws, skip)
                if not skip and not flat:
                    continue  # the unpadded form compiles to the same loops
                for w13i in ((False, True) if kind == "gate_up" else (False,)):
                    extra = dict(w13i=w13i) if kind == "gate_up" else dict(zero_tail=False)
                    meta = build(c, H, I, GROUPS, dot_f32=False, skip=skip, tma=tma, ws=ws, flat=flat,
                                 streamk=bool(c.get("streamk")), **extra)
                    out.append((f"{label} {kind}{'' if skip else ' unpadded'}{' interleaved' if w13i else ''}", fn,
                                sig, meta))
    return out


@pytest.mark.parametrize("name", _ids(_shipped))
def test_shipped_tiles_pipeline_and_fit_hopper(name):
    """Each launch of the shipped tiles, compiled with the specialization and the warps and stages it launches
    with. Catches: a main loop the pipeliner leaves synchronous (a load it cannot make asynchronous: right
    results, several times slower, invisible on CPU), and a tile set whose stages exceed what one block may hold
    (it fails at its first launch). Not checked: that ``progs_per_sm`` programs reside together; where fewer
    do, the rest run as a second wave, which measured faster for the generic "mid" tiles."""
    _, fn, sig, meta = {c[0]: c for c in _shipped()}[name]
    constexprs = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}
    signature = dict(sig)
    attrs = {}
    for key in signature:
        if key in UNIT_STRIDES:
            constexprs[key] = 1
        elif signature[key].startswith("*") or key in DIVISIBLE:
            attrs[(fn.arg_names.index(key),)] = [["tt.divisibility", 16]]
    for key in constexprs:
        signature[key] = "constexpr"
    stages = meta["num_stages"]
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                       options=dict(num_warps=meta["num_warps"], num_stages=stages))
    ptx, shared = k.asm["ptx"], k.metadata.shared
    tma = constexprs.get("TMA", False) or constexprs.get("TMA1", False)
    assert stages > 1 and ("cp.async.bulk.tensor" if tma else "cp.async.cg") in ptx, \
        f"{name}: {stages} stages asked, but the main loop's loads are not asynchronous (not pipelined)"
    # every operand block of a main-loop step held in stages - 1 buffers at least: a weight load left
    # synchronous beside asynchronous row loads holds one (seen with the unit strides not specialized)
    step = _step_bytes(fn.__name__, constexprs)
    assert shared >= (stages - 1) * step, (f"{name}: {shared} B of shared memory for {stages} stages of "
                                           f"{step} B operand blocks: some operand is not multi-buffered")
    assert shared <= SMEM_PER_BLOCK, f"{name}: {shared} B of shared memory, above Hopper's {SMEM_PER_BLOCK} per block"


def _step_bytes(kernel: str, cx: dict) -> int:
    """Bytes of the bf16 operand blocks one main-loop step loads: the rows' ``[BM, BK]`` and the weights' (gate/up:
    gate and up, ``[BN, BK]`` each; down: one); the one launch, the larger of its two loops' (they share memory)."""
    if kernel == "fused_kernel":
        return 2 * max((cx["BM1"] + 2 * cx["BN1"]) * cx["BK1"], (cx["BM2"] + cx["BN2"]) * cx["BK2"])
    weights = 2 if kernel == "_gate_up_kernel" else 1
    return 2 * (cx["BM"] + weights * cx["BN"]) * cx["BK"]
