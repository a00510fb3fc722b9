"""``impl="quack"`` (quack-kernels' varlen GEMM, an optional extra) without quack and without a GPU:
the core imports without it, an explicit request names the import error, ``auto`` never picks it
where it cannot run and picks it only where the GPU's policy (``tuning.json``'s ``auto`` regimes) lists the shape and step size, an explicit impl's
own errors propagate (no fallback), and the data plumbing of ``quack_impl`` (cu_seqlens_m, the
gate/up view, the transposes) through a torch stand-in for quack's two calls."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from vllm_moonep.common.grouped_gemm import GroupedWeights, api, available_impls, expert_ffn, policy, probes, resolve_impl
from vllm_moonep.common.grouped_gemm.weights import interleave_gate_up
from vllm_moonep.engine import MoonEPInputError
from vllm_moonep.engine import defaults as defaults_mod
from vllm_moonep.testing.reference import expert_ffn_float64

EPI = "vllm_moonep.common.grouped_gemm.quack_epilogue"
TRITON = "vllm_moonep.common.grouped_gemm.triton_kernels"


def _case(lens, I=16, H=32, seed=0, w13=False, interleaved=False):
    g = torch.Generator().manual_seed(seed)
    G = len(lens)
    gate = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    up = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(G, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    cu = torch.tensor(lens).cumsum(0).to(torch.int32)
    n = int(cu[-1]) + 5
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    rw = torch.rand(n, generator=g)
    if interleaved:  # the symmetric layout's w13 [G, 2I, H]: gate row j at 2j, up row j at 2j + 1
        w = GroupedWeights.of_w13(interleave_gate_up(gate, up), down, interleaved=True)
    elif w13:  # vLLM's w13 [G, 2I, H]: gate and up as views of one tensor
        one = torch.cat([gate, up], dim=1)
        ar = torch.arange(G)
        w = GroupedWeights([one[:, :I]], [one[:, I:]], [down], torch.zeros(G, dtype=torch.int64), ar, ar)
    else:
        w = GroupedWeights.contiguous(gate, up, down)
    return x, rw, cu, w


def _measured(mp, impl, H, I, from_tokens, to_tokens=None):
    """Every device's policy says ``impl`` was measured faster at ``(H, I)`` from ``from_tokens`` on."""
    pol = policy.DevicePolicy("test", (), (policy.Regime(impl, H, I, from_tokens, to_tokens),))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)


@pytest.fixture
def fresh(monkeypatch):
    """Each case probes imports afresh and says its choices afresh."""
    monkeypatch.setattr(probes, "_IMPORTS", {})
    monkeypatch.setattr(defaults_mod, "_SAID", set())
    return monkeypatch


@pytest.fixture
def no_quack(fresh):
    """quack as if not installed, wherever this runs (also where an earlier test imported it)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "quack"] + ["quack"]:
        fresh.setitem(sys.modules, name, None)
    fresh.delitem(sys.modules, EPI, raising=False)
    return fresh


def test_quack_impl_imports_without_importing_quack():
    """The optional dependency imported at package or module import: the core would need quack."""
    code = (
        "import sys\n"
        "import vllm_moonep.common.grouped_gemm as gg\n"
        "import vllm_moonep.common.grouped_gemm.quack_impl as qi\n"
        "assert 'quack' in gg.IMPLS and callable(qi.expert_ffn_quack) and callable(qi.quack_unusable)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('quack', 'cutlass'))\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_explicit_quack_without_quack_names_the_import_error(no_quack):
    """impl='quack' where quack is missing said only 'cannot run', or fell back to another impl."""
    x, rw, cu, w = _case([3, 0, 5])
    with pytest.raises(MoonEPInputError, match=r"impl='quack' cannot run here: quack-kernels does not import "
                                               r"\(ModuleNotFoundError: [^)]*quack"):
        expert_ffn(x, rw, cu, w, impl="quack")
    assert "quack" not in available_impls(x, w)
    from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack

    with pytest.raises(MoonEPInputError, match="quack-kernels does not import"):
        expert_ffn_quack(x, rw, cu, w)


def test_quack_unusable_reasons(fresh):
    """quack_unusable gave no reason, or the wrong one, for a CPU device, an old GPU, fp32, or no dense tensor."""
    from vllm_moonep.common.grouped_gemm.quack_impl import quack_unusable

    x, rw, cu, w = _case([3, 0, 5])
    real = quack_unusable(x, w)
    assert real is not None  # CPU rows at least
    fresh.setitem(sys.modules, EPI, types.ModuleType(EPI))  # quack "imports"
    fresh.setattr(probes, "_IMPORTS", {})
    assert "need a CUDA GPU of sm_90 or newer, the rows are on cpu" in quack_unusable(x, w)
    fresh.setattr(probes, "cuda_capability", lambda t: (8, 0))
    assert "sm_80" in quack_unusable(x, w)
    fresh.setattr(probes, "cuda_capability", lambda t: (9, 0))
    assert quack_unusable(x, w) is None
    assert "bf16" in quack_unusable(x.float(), w)
    table = GroupedWeights(w.gate, w.up, w.down, w.group_pool, w.group_row, None)
    assert "dense_groups" in quack_unusable(x, table)


def test_auto_takes_quack_only_from_the_measured_tokens_on(fresh, caplog):
    """auto picking quack without a measurement or below the measured step size, not picking it from
    there on, picking it where it cannot run, or importing quack (seconds) to decide a shape or step
    size nobody listed."""
    x, rw, cu, w = _case([3, 0, 5])

    def must_not_probe(*a):
        raise AssertionError("auto probed quack where no auto regime lists the shape and step size")

    fresh.setattr(api, "quack_unusable", must_not_probe)
    assert resolve_impl("auto", x, w, 10**6) != "quack"  # shape not listed
    _measured(fresh, "quack", w.hidden, w.intermediate, 64)
    assert resolve_impl("auto", x, w, 63) != "quack" and resolve_impl("auto", x, w) != "quack"  # below / unknown
    # listed and usable: quack, and the reason says so
    fresh.setattr(api, "quack_unusable", lambda x, w: None)
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        assert resolve_impl("auto", x, w, 64) == "quack"
        assert resolve_impl("auto", x, w, 4096) == "quack"
    said = [r.getMessage() for r in caplog.records if "-> quack" in r.getMessage()]
    assert len(said) == 1 and "tuning.json" in said[0] and "from 64 tokens" in said[0], said


def test_startup_line_names_each_auto_regime(fresh):
    """The plugin's start-up line said kernel=triton for Kimi-K2 layers that take quack from 4096 tokens
    per rank: it probed auto with 128x128 dummy weights and no step size."""
    from vllm_moonep.vllm_plugin.checks import resolve_kernel

    cpu = torch.device("cpu")
    _measured(fresh, "quack", 7168, 2048, 4096)
    fresh.setattr(api, "triton_unusable", lambda x: None)  # as on a GPU
    fresh.setattr(api, "quack_unusable", lambda x, w: None)
    assert resolve_kernel("auto", cpu, True, (7168, 2048)) == "triton below 4096 tokens per rank, quack from 4096"
    assert resolve_kernel("auto", cpu, True, (2048, 768)) == "triton"  # a shape nobody measured
    assert resolve_kernel("auto", cpu) == "triton"
    assert resolve_kernel("triton", cpu, True, (7168, 2048)) == "triton"  # asked for: what was asked
    fresh.setattr(api, "quack_unusable", lambda x, w: "quack-kernels does not import")
    assert resolve_kernel("auto", cpu, True, (7168, 2048)) == "triton"


def test_bench_names_where_a_library_won():
    """The bench's auto regimes starting where quack lost at a larger point, ending a run at a point it lost, leaving
    a run open that stops before the largest point, or naming a shape it never beat at both routings."""
    from vllm_moonep.tools.bench_experts import SHAPES, auto_entries, faster_regimes

    def rows(shape, wins, col="quack"):
        return [{"shape": shape, "tokens": t, "triton_us": 10.0, f"{col}_us": 9.0 if won else 11.0}
                for t, won in wins for _ in ("balanced", "skewed")]

    kimi, qwen = SHAPES["kimi-k2"], SHAPES["qwen3-30b-a3b"]
    got = faster_regimes(rows("kimi-k2", [(1, True), (256, False), (1024, True), (4096, True)])
                         + rows("qwen3-30b-a3b", [(16, True), (64, True), (1024, False), (4096, False)]), "quack")
    assert got == {(kimi["H"], kimi["I"]): [(1, 1), (1024, None)], (qwen["H"], qwen["I"]): [(16, 64)]}
    mixed = rows("kimi-k2", [(4096, True)])
    mixed[1]["quack_us"] = 12.0  # lost on the other routing
    assert faster_regimes(mixed, "quack") == {}
    entries = auto_entries(rows("qwen3-30b-a3b", [(16, False), (64, True)], "deepgemm"))
    assert entries == [{"H": qwen["H"], "I": qwen["I"], "impl": "deepgemm", "from_tokens": 64, "to_tokens": None}]


def test_a_library_must_win_by_more_than_the_points_control():
    """A library 3% faster at a point where the Triton call timed twice in the same rounds read 5% apart was taken
    into auto (the margin alone is 1%): the win is inside that point's noise. Rows without a control (older JSON)
    keep the 1% margin."""
    from vllm_moonep.tools.bench_experts import KEEP_MARGIN, SHAPES, faster_regimes, noise_band

    kimi = SHAPES["kimi-k2"]
    assert noise_band(None) == KEEP_MARGIN and noise_band(1.004) == KEEP_MARGIN and noise_band(float("nan")) == KEEP_MARGIN
    assert noise_band(1.05) == pytest.approx(0.05) and noise_band(0.96) == pytest.approx(0.04)

    def rows(control):
        return [{"shape": "kimi-k2", "tokens": 4096, "routing": r, "triton_us": 100.0, "deepgemm_us": 97.0,
                 **({} if control is None else {"control_ratio": control})} for r in ("balanced", "skewed")]

    assert faster_regimes(rows(1.05), "deepgemm") == {}
    assert faster_regimes(rows(0.95), "deepgemm") == {}
    assert faster_regimes(rows(1.01), "deepgemm") == {(kimi["H"], kimi["I"]): [(4096, None)]}
    assert faster_regimes(rows(None), "deepgemm") == {(kimi["H"], kimi["I"]): [(4096, None)]}


def test_auto_never_picks_quack_when_absent(no_quack, caplog):
    """Where quack is not installed, auto picked it (then failed at the first layer) because an auto regime
    listed the shape; or it dropped it silently."""
    x, rw, cu, w = _case([3, 0, 5])
    _measured(no_quack, "quack", w.hidden, w.intermediate, 1)
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        out = expert_ffn(x, rw, cu, w, impl="auto", tokens=1)
    assert torch.isfinite(out[: int(cu[-1])]).all()
    said = [r.getMessage() for r in caplog.records if "impl=auto" in r.getMessage()]
    assert len(said) == 1 and "-> quack" not in said[0], said
    assert "quack was measured faster at this shape and step size but cannot run: quack-kernels does not import" in said[0]


def test_explicit_triton_names_its_import_error(fresh):
    """impl='triton' on a GPU where the kernels do not import said only 'cannot run here' (not the import error)."""
    x, rw, cu, w = _case([3, 0, 5])
    fresh.setattr(probes, "cuda_capability", lambda t: (9, 0))
    fresh.setitem(sys.modules, TRITON, None)
    with pytest.raises(MoonEPInputError, match=r"impl='triton' cannot run here: the Triton kernels do not import "
                                               r"\(ModuleNotFoundError: import of " + TRITON.replace(".", r"\.")):
        resolve_impl("triton", x, w)


@pytest.mark.parametrize("impl", ["triton", "quack"])
def test_explicit_impl_errors_propagate_without_fallback(fresh, impl):
    """An explicit impl whose kernel fails to compile or launch was replaced by another impl (the error hidden)."""
    x, rw, cu, w = _case([3, 0, 5])
    fresh.setattr(probes, "cuda_capability", lambda t: (9, 0))

    def broken(*a, **k):
        raise RuntimeError(f"{impl} compile failed: out of shared memory")

    fake = types.ModuleType(TRITON if impl == "triton" else EPI)
    fake.expert_ffn_triton = fake.gemm = fake.swiglu_route = broken
    fresh.setitem(sys.modules, fake.__name__, fake)
    with pytest.raises(RuntimeError, match=f"{impl} compile failed"):
        expert_ffn(x, rw, cu, w, impl=impl)


# ------------------------------------------------------------------------------------------------
# quack_impl's plumbing through a stand-in for quack's two calls, with quack's documented semantics
# (quack.gemm_interface.gemm_ref): B is (L, K, N); group i is rows [cu_m[i], cu_m[i+1]); with
# concat_layout=("B",) B's N is [gate; up] and the gated epilogue pairs column j of each half; without it
# the epilogue pairs adjacent columns 2j, 2j + 1 (quack's own gemm_swiglu reference: preact[..., ::2],
# preact[..., 1::2]).
# ------------------------------------------------------------------------------------------------


def _stand_in(calls):
    def _segments(cu_m):
        c = cu_m.tolist()
        assert c[0] == 0 and cu_m.dtype == torch.int32, c
        return list(zip(c[:-1], c[1:]))

    def gemm(A, B, out=None, *, out_dtype=None, cu_seqlens_m=None, tuned=True):
        calls.append(("gemm", tuple(B.shape), out_dtype, tuned))
        assert B.shape[0] == cu_seqlens_m.numel() - 1
        if out is None:
            out = torch.empty(A.shape[0], B.shape[-1], dtype=out_dtype or A.dtype)
        for i, (a, b) in enumerate(_segments(cu_seqlens_m)):
            out[a:b] = (A[a:b].float() @ B[i].float()).to(out.dtype)
        return out

    class SwigluRoute:
        def __call__(self, A, B, C=None, *, out, store_d, tuned, cu_seqlens_m, route_w, concat_layout=None):
            calls.append(("swiglu_route", tuple(B.shape), concat_layout, store_d, tuned))
            assert C is None and not store_d and concat_layout in (("B",), None)
            act, n = out["act"], B.shape[-1] // 2
            for i, (a, b) in enumerate(_segments(cu_seqlens_m)):
                acc = A[a:b].float() @ B[i].float()
                g, u = (acc[:, :n], acc[:, n:]) if concat_layout else (acc[:, 0::2], acc[:, 1::2])
                act[a:b] = (F.silu(g) * u * route_w[a:b, None].float()).to(act.dtype)
            return out

    mod = types.ModuleType(EPI)
    mod.gemm, mod.swiglu_route = gemm, SwigluRoute()
    return mod


@pytest.mark.parametrize("w13", ["halves", "interleaved", None], ids=["w13-views-fused", "w13-interleaved-fused",
                                                                     "separate-split"])
@pytest.mark.parametrize("lens", [[3, 0, 0, 17, 5], [0, 0, 40], [1, 1, 1]])
def test_quack_plumbing_matches_float64(fresh, w13, lens):
    """quack_impl handing quack the wrong cu_seqlens_m (no leading 0, int64, END offsets), B untransposed, gate and
    up swapped in the concat, the route weight dropped, the view of w13 not found (a copy or the split form), or
    interleaved weights handed over as halves (concat_layout: gate and up columns mixed)."""
    x, rw, cu, w = _case(lens, w13=w13 == "halves", interleaved=w13 == "interleaved", seed=len(lens))
    calls: list = []
    fresh.setattr(probes, "cuda_capability", lambda t: (9, 0))
    fresh.setitem(sys.modules, EPI, _stand_in(calls))
    one = w.gate_up_as_one() if w13 == "halves" else w.gate_up_interleaved()
    assert (one is not None) == (w13 is not None)
    assert w.gate_up_as_one() is None or w13 == "halves"
    if w13 == "halves":
        assert one.data_ptr() == w.gate[0].data_ptr() and torch.equal(one[:, 16:], w.up[0])  # a view, no copy
    elif w13 == "interleaved":
        assert one.data_ptr() == w.gate[0].data_ptr() and torch.equal(one[:, 1::2], w.up[0])
    out = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl="quack", out=out)
    end = int(cu[-1])
    ref = expert_ffn_float64(x, rw, cu, w)
    assert torch.isfinite(out[:end]).all()
    rel = float((out[:end].double() - ref[:end]).norm() / ref[:end].norm())
    assert rel < 1e-2, rel
    G, I, H = len(lens), 16, 32
    if w13:
        concat = ("B",) if w13 == "halves" else None
        assert calls == [("swiglu_route", (G, H, 2 * I), concat, False, False), ("gemm", (G, I, H), None, False)]
    else:
        assert [c[:3] for c in calls] == [("gemm", (G, H, I), torch.float32), ("gemm", (G, H, I), torch.float32),
                                          ("gemm", (G, I, H), None)]


def test_quack_plumbing_dense_groups_subset(fresh):
    """A dense source whose pool 0 serves only some groups (the symmetric layout's [home ; slots]): the groups were
    not mapped to cu_seqlens_m through dense_groups."""
    from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack

    x, rw, cu, w = _case([0, 0, 6, 9, 0, 4], w13=True, seed=3)
    # pool 0 rows 0..2 serve groups 2, 3, 5; the others are empty
    sub = [t[[2, 3, 5]] for t in (w.gate[0], w.up[0], w.down[0])]
    one = torch.cat([sub[0], sub[1]], dim=1)
    gp = torch.tensor([-1, -1, 0, 0, -1, 0])
    gr = torch.tensor([-1, -1, 0, 1, -1, 2])
    ws = GroupedWeights([one[:, :16]], [one[:, 16:]], [sub[2]], gp, gr, torch.tensor([2, 3, 5]))
    calls: list = []
    fresh.setattr(probes, "cuda_capability", lambda t: (9, 0))
    fresh.setitem(sys.modules, EPI, _stand_in(calls))
    out = expert_ffn_quack(x, rw, cu, ws)
    ref = expert_ffn_float64(x, rw, cu, ws)
    end = int(cu[-1])
    assert float((out[:end].double() - ref[:end]).norm() / ref[:end].norm()) < 1e-2
    assert calls[0][1] == (3, 32, 32)


_COMPILE_CHILD = r'''
import pathlib, sys
import torch
from vllm_moonep.common.grouped_gemm import GroupedWeights, probes
from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack

probes.cuda_capability = lambda t: (9, 0)  # the CPU rows pass for an sm_90 GPU's
cache = pathlib.Path(sys.argv[1])
H, I, G, M = 512, 256, 4, 300
x = torch.randn(M, H).bfloat16()
rw = torch.rand(M)
cu = torch.tensor([100, 100, 250, 290], dtype=torch.int32)
w13 = torch.randn(G, 2 * I, H).bfloat16()
down = torch.randn(G, H, I).bfloat16()
ar = torch.arange(G)
fused = GroupedWeights([w13[:, :I]], [w13[:, I:]], [down], torch.zeros(G, dtype=torch.int64), ar, ar)
split = GroupedWeights.contiguous(w13[:, :I].contiguous(), w13[:, I:].contiguous(), down)
for name, w in (("fused", fused), ("split", split)):
    before = len(list(cache.rglob("*.o")))
    try:
        expert_ffn_quack(x, rw, cu, w)  # compiles, then cannot launch on CPU tensors
    except Exception as exc:
        print(name, "stopped at launch:", type(exc).__name__, str(exc)[:120])
    print(name, "compiled", len(list(cache.rglob("*.o"))) - before)
from vllm_moonep.common.grouped_gemm.quack_epilogue import gemm
before = len(list(cache.rglob("*.o")))
try:
    gemm(torch.empty(M, I, dtype=torch.bfloat16), down.mT, out=torch.empty(M, H, dtype=torch.bfloat16),
         cu_seqlens_m=torch.tensor([0, 100, 100, 250, 290], dtype=torch.int32), tuned=False)
except Exception as exc:
    print("down stopped at launch:", type(exc).__name__, str(exc)[:120])
print("down compiled", len(list(cache.rglob("*.o"))) - before)
'''


def test_quack_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The kernels impl='quack' asks quack for (the fused swiglu_route epilogue with gate/up concatenated and a varlen
    route-weight column; the split form's fp32-out GEMM; the down GEMM) failing to trace or compile for sm_90a: found
    only at the first GPU run. quack compiles without a GPU for QUACK_ARCH / CUTE_DSL_ARCH; the launch then fails."""
    import importlib.util

    if importlib.util.find_spec("quack") is None:
        pytest.skip("quack-kernels is not installed (the optional extra)")
    import os

    env = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", QUACK_CACHE_DIR=str(tmp_path / "quack"),
               PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(tmp_path / "quack")], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("fused", "split", "down"):
        assert f"{name} compiled 1" in out.stdout, out.stdout + out.stderr[-3000:]
