"""``expert_ffn(batch_invariant=True)``: the same probe rows in steps that differ in everything
else (the segment they sit in, their place in it, the other groups, the step's tokens per rank)
come out as the same bits; without it they do not, which is what gives the check its power.

On the CPU the probe runs in float32: a bf16 output rounds away the last bits where BLAS kernels
chosen by the matmul's rows differ, so bf16 would hide what the check looks for. On a GPU the rows
are bf16 at a shape with tile entries, and the probe is large enough (tens of thousands of outputs)
for tiles that reduce in another order to show in the rounded bits."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn, resolve_impl
from vllm_moonep.common.grouped_gemm import invariance
from vllm_moonep.engine import MoonEPInputError
from vllm_moonep.testing.reference import expert_ffn_float64

PROBE_GROUP = 2


def _tensors(G, I, H, dtype, device):
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).to(device)  # noqa: E731
    return mk(G, I, H), mk(G, I, H), mk(G, H, I)


def _weights(G, I, H, dtype, device):
    return GroupedWeights.contiguous(*_tensors(G, I, H, dtype, device))


def _case(lens, before, probe_x, probe_w, H, seed):
    """Rows for segment lengths ``lens`` (the probe group's length counts the probe), the probe rows after
    ``before`` other rows of the probe group: ``(x, route_w, cu, probe_slice)``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    x = torch.randn(n, H, generator=g).to(probe_x.dtype).to(probe_x.device)
    rw = torch.rand(n, generator=g).to(probe_x.device)
    at = sum(lens[:PROBE_GROUP]) + before
    p = probe_x.shape[0]
    x[at:at + p] = probe_x
    rw[at:at + p] = probe_w
    cu = torch.tensor(lens).cumsum(0).to(torch.int32).to(probe_x.device)
    return x, rw, cu, slice(at, at + p)


def _probe_outputs(cases, w, impl, invariant, tokens_of):
    outs = []
    for i, (x, rw, cu, sl) in enumerate(cases):
        out = expert_ffn(x, rw, cu, w, impl=impl, tokens=tokens_of[i], batch_invariant=invariant)
        outs.append(out[sl].clone())
    return outs


def _same(outs):
    return [bool(torch.equal(o, outs[0])) for o in outs]


# --------------------------------------------------------------------------------------------- CPU
CPU_LENS = [  # G = 4; the probe group (2) holds the 3 probe rows plus `before` others at least
    ([0, 0, 3, 0], 0),
    ([5, 1, 4, 9], 1),
    ([2, 0, 70, 1], 40),
    ([31, 7, 8, 0], 5),
    ([0, 3, 130, 2], 127),
]


def _cpu_cases(dtype):
    H = 64
    g = torch.Generator().manual_seed(3)
    px = torch.randn(3, H, generator=g).to(dtype)
    pw = torch.rand(3, generator=g)
    return [_case(lens, before, px, pw, H, seed=20 + i) for i, (lens, before) in enumerate(CPU_LENS)]


def test_reference_probe_rows_same_bits():
    """The reference path's matmuls sized by the segment under batch invariance (a CPU BLAS picks its kernel by
    the rows), rows of a segment's last block lost or mixed with the zero fill, or results off float64."""
    w = _weights(4, 96, 64, torch.float32, "cpu")
    cases = _cpu_cases(torch.float32)
    outs = _probe_outputs(cases, w, "reference", True, [None] * len(cases))
    assert all(_same(outs)), f"the probe's bits changed in cases {[i for i, s in enumerate(_same(outs)) if not s]}"
    for x, rw, cu, sl in cases:
        out = expert_ffn(x, rw, cu, w, impl="reference", batch_invariant=True)
        ref = expert_ffn_float64(x, rw, cu, w)
        n = int(cu[-1])
        assert float((out[:n].double() - ref[:n]).norm() / ref[:n].norm()) < 1e-5


def test_reference_probe_rows_change_without_invariance():
    """What the check above catches: one matmul per segment gives the probe other bits as the segment's rows
    change (skips on a CPU whose BLAS happens to give the same bits at every row count)."""
    w = _weights(4, 96, 64, torch.float32, "cpu")
    outs = _probe_outputs(_cpu_cases(torch.float32), w, "reference", False, [None] * len(CPU_LENS))
    if all(_same(outs)):
        pytest.skip("this CPU's BLAS gave the probe the same bits at every row count")


@pytest.mark.parametrize("impl", ["grouped_mm", "quack", "deepgemm"])
def test_library_impls_refused_under_invariance(impl):
    """A library kernel, which picks its tiles per problem size, run under batch invariance without a word."""
    w = _weights(4, 32, 64, torch.bfloat16, "cpu")
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(MoonEPInputError, match="batch_invariant=True.*per problem size"):
        expert_ffn(x, torch.ones(8), torch.tensor([2, 4, 6, 8], dtype=torch.int32), w, impl=impl,
                   batch_invariant=True)


def test_auto_under_invariance_takes_no_library_kernel(monkeypatch, caplog):
    """``auto`` under batch invariance taking a measured library regime (quack, DeepGEMM), a path other than
    triton where triton runs, or saying nothing; on a CPU the reference path in fixed-size matmuls, said."""
    from vllm_moonep.common.grouped_gemm import api, policy
    from vllm_moonep.engine import defaults

    w = _weights(4, 32, 64, torch.bfloat16, "cpu")
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(defaults, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="vllm_moonep"):
        assert resolve_impl("auto", x, w, 4096, batch_invariant=True) == "reference"
    assert any("batch invariant" in r.getMessage() and f"{invariance.ROW_BLOCK} rows" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    pol = policy.DevicePolicy("test", (), (policy.Regime("quack", w.hidden, w.intermediate, 1),
                                           policy.Regime("deepgemm", w.hidden, w.intermediate, 1)))
    monkeypatch.setattr(policy, "policy_of", lambda x, path=None: pol)
    monkeypatch.setattr(api, "triton_unusable", lambda x: None)  # as on a GPU
    monkeypatch.setattr(api, "quack_unusable", lambda x, w: None)
    monkeypatch.setattr(api, "deepgemm_unusable", lambda x, w: None)
    assert resolve_impl("auto", x, w, 4096) == "quack"  # the regime, without invariance
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_moonep"):
        assert resolve_impl("auto", x, w, 4096, batch_invariant=True) == "triton"
    assert any("-> triton" in r.getMessage() and "never a library kernel" in r.getMessage() for r in caplog.records)


def test_triton_path_drops_the_options_under_invariance(monkeypatch):
    """``expert_ffn_triton`` launching a tile entry's stream-K under batch invariance, dropping it without it,
    dropping swap-AB (measured bit-equal: the GPU case below), or dropping stream-K without saying so (the
    launches are recorded, not run: no GPU here)."""
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk

    opts = {"BM": 16, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 2, "progs_per_sm": 1}
    entry = {"gate_up": {**opts, "swap": True, "streamk": True}, "down": {**opts, "streamk": True}}
    launched = []
    monkeypatch.setattr(tk, "select_config", lambda *a, **k: entry)
    monkeypatch.setattr(tk, "_launch_trim", lambda *a, **k: None)
    monkeypatch.setattr(tk, "_launch_gate_up", lambda *a, **k: launched.append(("gate_up", a[6])))
    monkeypatch.setattr(tk, "_launch_down", lambda *a, **k: launched.append(("down", a[6])))
    from vllm_moonep.engine import defaults

    monkeypatch.setattr(defaults, "_SAID", set())
    w = _weights(2, 32, 64, torch.bfloat16, "cpu")
    x, rw, cu = torch.zeros(8, 64, dtype=torch.bfloat16), torch.ones(8), torch.tensor([4, 8], dtype=torch.int32)
    for invariant in (True, False):
        launched.clear()
        tk.expert_ffn_triton(x, rw, cu, w, tokens=4, batch_invariant=invariant)
        got = {kind: {o for o in ("swap", "streamk") if c.get(o)} for kind, c in launched}
        want = ({"gate_up": {"swap"}, "down": set()} if invariant
                else {"gate_up": {"swap", "streamk"}, "down": {"streamk"}})
        assert got == want, (invariant, got)
    assert any("batch invariant" in m and "without streamk" in m for m in defaults._SAID), defaults._SAID


# --------------------------------------------------------------------------------------------- GPU
#: (H, I) of the shapes with tile entries from 1 to 4096 tokens per rank, whose tiles differ: Qwen3-30B-A3B
#: (BM 16-128, TMA, the flat down kernel) and Kimi-K2 (also the warp-specialized gate/up and the 64-token
#: entry's swap-AB)
GPU_SHAPES = {"qwen3-30b-a3b": (2048, 768), "kimi-k2": (7168, 2048)}
GPU_TOKENS = [1, 16, 64, 256, 1024, 4096]
GPU_LENS = [([0, 0, 512, 0, 0, 0, 0, 0], 0), ([64, 3, 600, 1, 0, 0, 0, 9], 77), ([0, 0, 1100, 256, 5, 0, 0, 0], 300),
            ([1, 1, 513, 1, 1, 1, 1, 1], 1), ([700, 0, 2048, 0, 0, 128, 0, 0], 1024), ([9, 40, 640, 2, 0, 0, 7, 0], 128)]


def _gpu_cases(H):
    g = torch.Generator().manual_seed(4)
    px = torch.randn(512, H, generator=g).to(torch.bfloat16).cuda()
    pw = torch.rand(512, generator=g).cuda()
    return [_case(lens, before, px, pw, H, seed=40 + i) for i, (lens, before) in enumerate(GPU_LENS)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_triton_probe_rows_same_bits_gpu(shape, monkeypatch):
    """A tile config that sums a row's K in another order (the tiles follow the step's tokens per rank: 1-4096
    pick different ones at these shapes), or a row's output depending on its place in its tile or segment. The
    control: the same rows with the hidden columns permuted (x and gate/up alike: the same sums in another
    order) must change the probe's bits, else equal bits would say nothing (skips if they do not). The gate/up
    launches are recorded: at Kimi-K2's shape one must take swap-AB, or the case no longer covers it."""
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk

    launched = []
    real = tk._launch_gate_up
    monkeypatch.setattr(tk, "_launch_gate_up", lambda *a, **k: launched.append(dict(a[6])) or real(*a, **k))
    H, I = GPU_SHAPES[shape]
    gate, up, down = _tensors(8, I, H, torch.bfloat16, "cuda")
    w = GroupedWeights.contiguous(gate, up, down)
    cases = _gpu_cases(H)
    outs = _probe_outputs(cases, w, "triton", True, GPU_TOKENS)
    if shape == "kimi-k2":
        assert any(c.get("swap") for c in launched), f"no gate/up launch took swap-AB: {launched}"
    assert all(_same(outs)), f"the probe's bits changed at tokens {[GPU_TOKENS[i] for i, s in enumerate(_same(outs)) if not s]}"
    x, rw, cu, sl = cases[0]
    ref = expert_ffn_float64(x, rw, cu, w)
    assert float((outs[0].double() - ref[sl]).norm() / ref[sl].norm()) < 1e-2
    perm = torch.randperm(H, generator=torch.Generator().manual_seed(9)).cuda()
    wp = GroupedWeights.contiguous(gate[..., perm].contiguous(), up[..., perm].contiguous(), down)
    permuted = expert_ffn(x[:, perm].contiguous(), rw, cu, wp, impl="triton", tokens=GPU_TOKENS[0],
                          batch_invariant=True)[sl]
    if torch.equal(permuted, outs[0]):
        pytest.skip("summing the hidden columns in another order gave the probe the same bits: no control")


def test_invariant_tiles_drop_what_was_not_measured_equal():
    """A shipped tile entry keeping stream-K under batch invariance (it cuts a row's sum between programs), or
    losing an option that was measured equal (swap-AB, TMA, warp specialization, the flat down kernel)."""
    from vllm_moonep.common.grouped_gemm import policy

    entries = [e for sec in policy.load_table()["devices"].values() for e in sec.get("tiles", [])]
    both = {"BM": 32, "BN": 64, "BK": 128, "tma": True, "swap": True, "streamk": True}
    entries.append({"shape": "synthetic", "gate_up": both, "down": {**both, "flat": True}, "fused": {"num_warps": 4}})
    for e in entries:
        cfg = {k: e[k] for k in ("gate_up", "down", "fused") if k in e}
        inv = invariance.invariant_tiles(cfg)
        for k in ("gate_up", "down"):
            assert "streamk" not in inv[k], (e["shape"], e.get("tokens_per_rank"), k, inv[k])
            assert {o: v for o, v in cfg[k].items() if o != "streamk"} == inv[k]
        assert inv.get("fused") == cfg.get("fused")


def test_moe_step_refuses_a_library_impl_at_construction():
    """``MoonEPMoE(batch_invariant=True, impl=<library>)`` accepted, to fail only at its first step."""
    from vllm_moonep.common import MoonEPMoE

    with pytest.raises(MoonEPInputError, match="MoonEPMoE: batch_invariant=True: impl='deepgemm'"):
        MoonEPMoE(None, None, impl="deepgemm", batch_invariant=True)  # type: ignore[arg-type]
