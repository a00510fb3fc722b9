"""``impl="deepgemm"`` without DeepGEMM and without a GPU: the core imports without it, an explicit
request names why it cannot run, ``auto`` takes it only inside a measured regime of the GPU's policy,
and the data plumbing of ``deepgemm_impl`` (the groups' ends through ``dense_groups``, the per-row
layout, the ``w13`` view, the split form, exact zeros for weight-0 rows) through a torch stand-in
that computes what DeepGEMM's two contiguous layouts define, checked against the float64 reference.
The swiglu_route kernel itself runs under Triton's interpreter against its torch twin."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn, interleave_gate_up, policy, probes, resolve_impl
from vllm_moonep.common.grouped_gemm import deepgemm_impl
from vllm_moonep.engine import MoonEPInputError
from vllm_moonep.engine import defaults as defaults_mod
from vllm_moonep.testing.reference import expert_ffn_float64

ALIGN = 128


def _stand_in(calls: list, align: int = ALIGN) -> types.ModuleType:
    """DeepGEMM's contiguous grouped GEMM as its two layouts define it, in float32 torch: ``psum`` (group ``j``
    covers ``[round_up(end[j-1], align), end[j])``) and per-row group indices (``-1``: skipped, left as it was)."""
    m = types.ModuleType("deep_gemm")
    m.__version__ = "stand-in"
    m.get_mk_alignment_for_contiguous_layout = lambda: align

    def gemm(a, b, d, layout, use_psum_layout=False):
        calls.append((use_psum_layout, tuple(b.shape), layout.dtype))
        assert a.is_contiguous() and b.is_contiguous() and d.is_contiguous(), "DeepGEMM takes dense operands"
        assert layout.dtype == torch.int32
        if use_psum_layout:
            start = 0
            for j, end in enumerate(layout.tolist()):
                s = -(-start // align) * align
                if end > s:
                    d[s:end] = (a[s:end].float() @ b[j].float().T).to(d.dtype)
                start = end
        else:
            for j in range(b.shape[0]):
                rows = (layout == j).nonzero().flatten()
                if rows.numel():
                    d[rows] = (a[rows].float() @ b[j].float().T).to(d.dtype)

    m.m_grouped_bf16_gemm_nt_contiguous = gemm
    return m


def _case(lens, groups_used, G, I=128, H=128, seed=0, w13=True):
    """Segments of ``lens`` rows (multiples of the padding, ALIGN unless a test says) for the groups ``groups_used`` of ``G`` (others empty);
    pool 0 holds one row per used group, as the symmetric layout's ``[home ; slots]``; padding rows hold NaN
    (stale memory) with weight 0."""
    g = torch.Generator().manual_seed(seed)
    n0 = len(groups_used)
    gate = (torch.randn(n0, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    up = (torch.randn(n0, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(n0, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    per_group = [0] * G
    for grp, n in zip(groups_used, lens):
        per_group[grp] = n
    cu = torch.tensor(per_group).cumsum(0).to(torch.int32)
    n = int(cu[-1]) + 7
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    rw = torch.rand(n, generator=g)
    start = 0
    for grp, length in zip(groups_used, lens):
        live = max(1, length - 37)  # each segment: live rows, then its padding tail
        s0 = int(cu[grp]) - length
        x[s0 + live:s0 + length] = float("nan")
        rw[s0 + live:s0 + length] = 0.0
        start += length
    pool_group = torch.full((G,), -1, dtype=torch.int64)
    pool_row = torch.full((G,), -1, dtype=torch.int64)
    for j, grp in enumerate(groups_used):
        pool_group[grp], pool_row[grp] = 0, j
    dense = torch.tensor(groups_used, dtype=torch.int64)
    if w13 == "interleaved":  # the symmetric layout's order: gate row j at 2j, up row j at 2j + 1
        one = interleave_gate_up(gate, up)
        w = GroupedWeights([one[:, 0::2]], [one[:, 1::2]], [down], pool_group, pool_row, dense)
    elif w13:
        one = torch.cat([gate, up], dim=1)
        w = GroupedWeights([one[:, :I]], [one[:, I:]], [down], pool_group, pool_row, dense)
    else:
        w = GroupedWeights([gate], [up], [down], pool_group, pool_row, dense)
    return x, rw, cu, w


@pytest.fixture
def as_sm90(monkeypatch):
    """CPU rows pass for an sm_90 GPU's; DeepGEMM resolves to the stand-in (vLLM's copy as absent)."""
    calls: list = []
    monkeypatch.setattr(probes, "_IMPORTS", {})
    monkeypatch.setattr(defaults_mod, "_SAID", set())
    monkeypatch.setattr(probes, "cuda_capability", lambda t: (9, 0))
    monkeypatch.setitem(sys.modules, "vllm.third_party.deep_gemm", None)
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in(calls))
    return monkeypatch, calls


@pytest.mark.parametrize("layout", ["psum", "rows"])
@pytest.mark.parametrize("w13", [True, "interleaved", False], ids=["w13-view", "w13-interleaved", "separate"])
def test_deepgemm_plumbing_matches_float64(as_sm90, layout, w13):
    """deepgemm_impl handing DeepGEMM cu_seqlens itself instead of pool rows' ends (groups not in dense_groups),
    a per-row layout off by one or without -1 past the end, gate and up swapped or the w13 view missed (a copy), an
    interleaved w13's output split in halves (gate and up columns mixed), the route weight dropped, or NaN from a
    padding tail reaching an output through a weight of 0."""
    mp, calls = as_sm90
    x, rw, cu, w = _case([256, 128, 384], [1, 3, 4], G=6, w13=w13)
    out = torch.full_like(x, 7.0)
    if layout == deepgemm_impl.ROW_LAYOUT:  # the dispatcher's path
        expert_ffn(x, rw, cu, w, impl="deepgemm", out=out)
    else:
        deepgemm_impl.expert_ffn_deepgemm(x, rw, cu, w, out=out, layout=layout)
    end = int(cu[-1])
    ref = expert_ffn_float64(x.nan_to_num(), rw, cu, w)
    assert torch.isfinite(out[:end]).all(), "a padding tail's NaN reached the output"
    assert float((out[:end].double() - ref[:end]).norm() / ref[:end].norm()) < 1e-2
    assert (out[:end][rw[:end] == 0] == 0).all(), "weight-0 rows must be exactly 0"
    assert (out[end:] == 7.0).all(), "rows past the last segment were written"
    assert all(c[0] == (layout == "psum") for c in calls)
    assert [c[1] for c in calls] == ([(3, 256, 128)] if w13 else [(3, 128, 128)] * 2) + [(3, 128, 128)]


def test_deepgemm_unusable_reasons(as_sm90):
    """deepgemm_unusable gave no reason, or the wrong one, for CPU rows, an older GPU, fp32, no dense tensor, dense
    rows out of group order, a shape off DeepGEMM's 128 multiples, an M alignment that does not divide the padding,
    or DeepGEMM not importing (naming both places looked in)."""
    mp, calls = as_sm90
    x, rw, cu, w = _case([128], [0], G=2)
    assert deepgemm_impl.deepgemm_unusable(x, w) is None
    mp.setattr(probes, "cuda_capability", lambda t: None)
    assert "need a CUDA GPU" in deepgemm_impl.deepgemm_unusable(x, w)
    mp.setattr(probes, "cuda_capability", lambda t: (8, 0))
    assert "sm_80" in deepgemm_impl.deepgemm_unusable(x, w)
    mp.setattr(probes, "cuda_capability", lambda t: (9, 0))
    assert "bf16" in deepgemm_impl.deepgemm_unusable(x.float(), w)
    assert "dense_groups" in deepgemm_impl.deepgemm_unusable(
        x, GroupedWeights(w.gate, w.up, w.down, w.group_pool, w.group_row, None))
    x2, _, _, w2 = _case([128, 128], [0, 1], G=2)
    backwards = GroupedWeights(w2.gate, w2.up, w2.down, w2.group_pool, w2.group_row, torch.tensor([1, 0]))
    assert "ascending" in deepgemm_impl.deepgemm_unusable(x2, backwards)
    x3, _, _, w3 = _case([128], [0], G=1, I=96)
    assert "multiples of 128" in deepgemm_impl.deepgemm_unusable(x3, w3)
    mp.setitem(sys.modules, "deep_gemm", _stand_in(calls, align=256))
    mp.setattr(probes, "_IMPORTS", {})
    assert "does not divide" in deepgemm_impl.deepgemm_unusable(x, w)
    mp.setitem(sys.modules, "deep_gemm", None)
    mp.setattr(probes, "_IMPORTS", {})
    why = deepgemm_impl.deepgemm_unusable(x, w)
    assert "vllm.third_party.deep_gemm" in why and "deep_gemm:" in why
    with pytest.raises(MoonEPInputError, match="impl='deepgemm' cannot run here: DeepGEMM does not import"):
        resolve_impl("deepgemm", x, w)


def test_deepgemm_without_a_gpu_names_why_and_imports_nothing(monkeypatch):
    """impl='deepgemm' on CPU rows imported vLLM (seconds) to find out it cannot run, or said only 'cannot run'."""
    monkeypatch.setattr(probes, "_IMPORTS", {})
    x, rw, cu, w = _case([128], [0], G=1)
    with pytest.raises(MoonEPInputError, match="DeepGEMM's GEMMs need a CUDA GPU"):
        expert_ffn(x, rw, cu, w, impl="deepgemm")
    assert not [k for k in probes._IMPORTS if "deep_gemm" in k], "probed DeepGEMM's import on CPU rows"


def test_auto_takes_deepgemm_only_inside_its_measured_regime(as_sm90, caplog):
    """auto taking DeepGEMM outside the tokens per rank its regime lists (below it, above its end, or with the step
    size unknown), not taking it inside, or saying so without the regime."""
    mp, calls = as_sm90
    x, rw, cu, w = _case([128], [0], G=1)
    pol = policy.DevicePolicy("test", (), (policy.Regime("deepgemm", w.hidden, w.intermediate, 16, 256),))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)
    from vllm_moonep.common.grouped_gemm import api

    mp.setattr(api, "triton_unusable", lambda x: None)  # as on a GPU
    assert [resolve_impl("auto", x, w, t) for t in (15, 257, None)] == ["triton"] * 3
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        assert resolve_impl("auto", x, w, 16) == "deepgemm" and resolve_impl("auto", x, w, 256) == "deepgemm"
    said = [r.getMessage() for r in caplog.records if "-> deepgemm" in r.getMessage()]
    assert len(said) == 1 and "from 16 to 256 tokens per rank" in said[0], said
    assert api.auto_regimes(x, w) == [(0, "triton"), (16, "deepgemm"), (257, "triton")]


def test_auto_regimes_list_what_auto_takes_in_token_order(as_sm90):
    """Regimes that overlap (a bounded one listed before an open-ended one that starts inside it) listed by regime,
    not by tokens: a start point out of order and one that auto never takes there (what the plugin's start-up line
    then said). Every start listed must be where auto changes, in ascending order."""
    mp, calls = as_sm90
    x, rw, cu, w = _case([128], [0], G=1)
    pol = policy.DevicePolicy("test", (), (policy.Regime("quack", w.hidden, w.intermediate, 100, 500),
                                           policy.Regime("deepgemm", w.hidden, w.intermediate, 200)))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)
    from vllm_moonep.common.grouped_gemm import api

    mp.setattr(api, "triton_unusable", lambda x: None)  # as on a GPU
    mp.setattr(api, "quack_unusable", lambda x, w: None)  # as where quack is installed
    got = api.auto_regimes(x, w)
    assert got == [(0, "triton"), (100, "quack"), (501, "deepgemm")], got
    for t in (0, 99, 100, 200, 500, 501, 4096):  # and each entry is what a call at those tokens resolves to
        assert resolve_impl("auto", x, w, t) == [impl for start, impl in got if start <= t][-1], t


def test_auto_takes_the_next_measured_library_where_the_first_cannot_run(as_sm90, caplog):
    """Where the policy lists quack before DeepGEMM for the same step sizes and quack is not installed, auto fell back
    to Triton (DeepGEMM, also measured faster, never taken), or took DeepGEMM without saying quack could not run."""
    mp, calls = as_sm90
    x, rw, cu, w = _case([128], [0], G=1)
    pol = policy.DevicePolicy("test", (), (policy.Regime("quack", w.hidden, w.intermediate, 1024),
                                           policy.Regime("deepgemm", w.hidden, w.intermediate, 1024)))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)
    from vllm_moonep.common.grouped_gemm import api

    mp.setattr(api, "triton_unusable", lambda x: None)
    mp.setattr(api, "quack_unusable", lambda x, w: "quack-kernels does not import")
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        assert resolve_impl("auto", x, w, 2048) == "deepgemm"
    said = [r.getMessage() for r in caplog.records if "impl=auto" in r.getMessage()]
    assert len(said) == 1 and "quack was measured faster at this shape and step size but cannot run" in said[0], said


_INTERP_CHILD = r'''
import torch
from vllm_moonep.common.grouped_gemm.deepgemm_act import swiglu_route, swiglu_route_torch
g = torch.Generator().manual_seed(3)
M = 37
for I in (160, 1152):  # one partial column block; two, the second partial (BLOCK 1024)
    h = torch.randn(M, 2 * I, generator=g).bfloat16()
    h[5:9] = float("nan")
    rw = torch.rand(M, generator=g)
    rw[5:9] = 0.0
    rw[20] = 0.0
    for g_, u_ in ((h[:, :I], h[:, I:]), (h[:, 0::2], h[:, 1::2])):  # halves; even and odd columns (interleaved)
        got = torch.full((M, I), 9.0).bfloat16()
        want = torch.empty(M, I).bfloat16()
        swiglu_route(g_, u_, rw, got)
        swiglu_route_torch(g_, u_, rw, want)
        assert torch.isfinite(got).all(), "NaN of a weight-0 row reached act"
        assert (got[rw == 0] == 0).all()
        d = (got.float() - want.float()).abs().max().item()
        assert d <= 2 ** -6 * want.float().abs().max().item(), (I, d)
        # the weights as a column of a [T, 2] tensor (stride 2), as vLLM's topk_weights reach it: each row its own
        # weight, not its neighbour's (a unit-stride read gives row r the weight of row r // 2 or 0)
        both = torch.stack([rw, torch.full_like(rw, 7.0)], 1)
        got_s = torch.full((M, I), 9.0).bfloat16()
        swiglu_route(g_, u_, both[:, 0], got_s)
        assert torch.equal(got_s, got), ("a strided route_w read at unit stride", I)
print("ok", d)
'''


def test_swiglu_route_kernel_matches_its_torch_twin_under_the_interpreter():
    """The activation kernel reading up at the wrong offset (a strided half of h) or ignoring a column stride (the
    even and odd columns of an interleaved w13's h), a row's weight from the wrong row (or a strided route_w at unit
    stride),
    a masked column tail, or NaN of a padding row surviving a weight of 0."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP_CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("paired", [False, True], ids=["halves", "pairs"])
def test_swiglu_route_kernel_compiles_for_sm90_with_wide_pair_loads(paired):
    """The activation kernel refused by the compiler (what the interpreter accepts: the reshape and split of the
    pairs), or the pairs of an interleaved w13's output read with narrower than 16-byte loads (strided loads of g
    and u do not vectorize: the reason the pairs path exists), with the specialization a launch gets."""
    triton = pytest.importorskip("triton")
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_moonep.common.grouped_gemm.deepgemm_act import swiglu_route_kernel

    i32 = "i32"
    sig = dict(g_ptr="*bf16", u_ptr="*bf16", rw_ptr="*fp32", act_ptr="*bf16", I=i32, stride_g=i32, stride_u=i32,
               stride_a=i32, col_g=i32, col_u=i32, BLOCK="constexpr", PAIRED="constexpr")
    div16 = ("g_ptr", "u_ptr", "act_ptr", "I", "stride_g", "stride_u", "stride_a")
    attrs = {(swiglu_route_kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    cx = dict(BLOCK=1024, PAIRED=paired)
    if not paired:  # the halves of h: unit column strides, as the launch specializes them
        cx.update(col_g=1, col_u=1)
        sig.update(col_g="constexpr", col_u="constexpr")
    ptx = triton.compile(ASTSource(fn=swiglu_route_kernel, signature=sig, constexprs=cx, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    loads = [ld for ld in re.findall(r"ld\.global[\w.]*", ptx) if ".b16" in ld or ".v4" in ld or ".v2" in ld]
    wide = [ld for ld in loads if ".v4." in ld]
    assert wide, f"no 16-byte loads of g/u: {sorted(set(loads))}"


def test_deepgemm_down_needs_both_the_triton_kernels_and_deepgemm(as_sm90):
    """impl='deepgemm_down' where only one of its two halves can run: refused with that half's reason (DeepGEMM's
    own; the Triton kernels need a CUDA device), never another path; and under batch invariance, as every library
    path is."""
    from vllm_moonep.common.grouped_gemm import IMPLS, api

    assert "deepgemm_down" in IMPLS
    mp, _calls = as_sm90
    x, rw, cu, w = _case([128, 0, 256], [0, 2], 3)
    assert api.impl_unusable("deepgemm_down", x, w) is None  # both halves pass their probes here
    assert "bf16" in api.impl_unusable("deepgemm_down", x.float(), w)  # DeepGEMM's reason
    mp.setattr(probes, "cuda_capability", lambda t: None)
    g = torch.Generator().manual_seed(0)
    w = GroupedWeights.contiguous(*(torch.randn(2, 128, 128, generator=g).bfloat16() for _ in range(3)))
    x = torch.randn(4, 128, generator=g).bfloat16()
    assert "need a CUDA device" in api.impl_unusable("deepgemm_down", x, w)
    with pytest.raises(MoonEPInputError, match="impl='deepgemm_down' cannot run here: the Triton kernels need a CUDA"):
        expert_ffn(x, torch.ones(4), torch.tensor([2, 4], dtype=torch.int32), w, impl="deepgemm_down")
    with pytest.raises(MoonEPInputError, match="batch invariance runs"):
        expert_ffn(x, torch.ones(4), torch.tensor([2, 4], dtype=torch.int32), w, impl="deepgemm_down",
                   batch_invariant=True)


def test_deepgemm_paths_refuse_segments_their_alignment_does_not_divide(as_sm90, caplog):
    """Segments padded to 64 rows (``token_padding=64``) handed to DeepGEMM, whose psum layout starts each group at
    the previous end rounded up to 128: a group's first 64 rows were never computed (the sentinel below shows it).
    The dispatcher must refuse both DeepGEMM paths naming the padding and write nothing; auto must pass over a
    DeepGEMM regime saying why; a padding that 128 divides still runs; a padding that is no positive int is
    refused as such."""
    mp, _calls = as_sm90
    from vllm_moonep.common.grouped_gemm import api

    mp.setattr(api, "triton_unusable", lambda x: None)  # as on a GPU (deepgemm_down's other half)
    x, rw, cu, w = _case([64, 192, 128], [0, 1, 3], G=4)
    # what the check prevents: DeepGEMM told nothing of the padding reads group 1's rows 64..127 as no group's
    out = torch.full_like(x, 7.0)
    deepgemm_impl.expert_ffn_deepgemm(x, rw, cu, w, out=out)
    assert (out[64:128] == 7.0).all(), "the stand-in no longer shows what a 64-row padding does to DeepGEMM"
    out = torch.full_like(x, 7.0)
    for impl in ("deepgemm", "deepgemm_down"):
        with pytest.raises(MoonEPInputError, match=rf"impl='{impl}' cannot run here: DeepGEMM's M alignment \(128\) "
                                                   r"does not divide the segments' padding \(token_padding=64\)"):
            expert_ffn(x, rw, cu, w, impl=impl, out=out, token_padding=64)
    assert (out == 7.0).all(), "a refused call wrote its output"
    pol = policy.DevicePolicy("test", (), (policy.Regime("deepgemm", w.hidden, w.intermediate, 1024),))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        assert resolve_impl("auto", x, w, 2048, token_padding=64) == "triton"
    said = [r.getMessage() for r in caplog.records if "impl=auto" in r.getMessage()]
    assert len(said) == 1 and "deepgemm was measured faster" in said[0] and "token_padding=64" in said[0], said
    assert api.auto_regimes(x, w, 64) == [(0, "triton")]
    assert api.auto_regimes(x, w, 256) == [(0, "triton"), (1024, "deepgemm")]
    assert resolve_impl("deepgemm", x, w, token_padding=256) == "deepgemm"
    for bad in (0, -128, 64.0, True):
        with pytest.raises(MoonEPInputError, match="token_padding must be an int >= 1"):
            expert_ffn(x, rw, cu, w, impl="reference", out=out, token_padding=bad)
        assert "must be an int >= 1" in deepgemm_impl.deepgemm_unusable(x, w, bad)  # 0 % 128 == 0 passed it


@pytest.mark.parametrize("tp", [64, 128])
def test_moe_step_hands_its_pools_padding_to_the_expert_compute(as_sm90, tp):
    """A MoE step whose pool pads segments to 64 rows ran impl='deepgemm' as if they were padded to 128 (the step
    did not pass its padding on): it must refuse naming it; at 128 the step runs DeepGEMM's path (the stand-in)
    and matches the dense float32 MoE."""
    from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
    from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
    from vllm_moonep.replicated import ReplicatedWeightLayout

    _mp, calls = as_sm90
    E, H, I, K, B = 8, 128, 128, 2, 2
    w13, w2 = global_weights(E, H, I, seed=5)
    layout = ReplicatedWeightLayout(w13.clone(), w2.clone(), E, B)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, token_padding=tp, device="cpu"), 64,
                            engine="builtin")
    try:
        assert pool.token_padding == tp
        moe = MoonEPMoE(pool, layout, impl="deepgemm")
        x, ids, w = rank_inputs(40, E, K, H, sigma=1.0, seed=9, rank=0)
        if tp == 64:
            with pytest.raises(MoonEPInputError, match="token_padding=64"):
                moe.forward(x, ids, w)
            assert not calls, "DeepGEMM ran on segments it cannot read"
        else:
            check_against_dense(moe.forward(x, ids, w), x, ids, w, w13, w2)
            assert calls, "the step did not run DeepGEMM's path"
    finally:
        pool.destroy()
        layout.destroy()


def test_plugin_refuses_impl_deepgemm_with_a_padding_it_cannot_read(as_sm90):
    """impl='deepgemm' with token_padding=64 passed the worker's check (it probed with the default padding) and
    failed at the first forward; the start-up line named DeepGEMM for auto's regimes it would pass over."""
    from vllm_moonep.engine import MoonEPUnavailableError
    from vllm_moonep.vllm_plugin import checks
    from vllm_moonep.vllm_plugin.options import MoonEPOptions

    mp, _calls = as_sm90
    with pytest.raises(MoonEPUnavailableError, match=r"impl='deepgemm' cannot run on this worker.*token_padding=64") as e:
        checks.check_worker(MoonEPOptions(impl="deepgemm", token_padding=64, engine="builtin"), torch.device("cpu"))
    offered = str(e.value).split("available here: ")[1]
    assert "deepgemm" not in offered and "reference" in offered, offered  # the list at the same padding
    checks.check_worker(MoonEPOptions(impl="deepgemm", token_padding=256, engine="builtin"), torch.device("cpu"))
    pol = policy.DevicePolicy("test", (), (policy.Regime("deepgemm", 128, 128, 1024),))
    mp.setattr(policy, "policy_of", lambda x, path=None: pol)
    from vllm_moonep.common.grouped_gemm import api

    mp.setattr(api, "triton_unusable", lambda x: None)
    dev = torch.device("cpu")
    assert checks.resolve_kernel("auto", dev, shape=(128, 128)) == "triton below 1024 tokens per rank, deepgemm from 1024"
    assert checks.resolve_kernel("auto", dev, shape=(128, 128), token_padding=64) == "triton"
