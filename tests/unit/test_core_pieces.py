"""Pool capacities, padding and sanitizing, engine selection, the core importing without vLLM."""

import os
import subprocess
import sys

import pytest
import torch

from tests.hide_vllm import HIDE_VLLM

from vllm_moonep.common import capacity_for, pad_to_capacity, sanitize_routing, tokens_per_expert
from vllm_moonep.common.pool import MoonEPBufferPool
from vllm_moonep.engine import (
    Buffer,
    MoonEPBuffer,
    MoonEPInputError,
    MoonEPUnavailableError,
    dispatched_rows,
    make_buffer,
    resolve_engine,
)
from vllm_moonep.engine.select import RealMoonEPBuffer


def test_capacity_is_power_of_two_with_floor_and_cap():
    """A capacity below the token count, off the power-of-two ladder or above the maximum, or a count over the maximum
    accepted."""
    assert capacity_for(0, 4096) == 128
    assert capacity_for(1, 4096) == 128
    assert capacity_for(128, 4096) == 128
    assert capacity_for(129, 4096) == 256
    assert capacity_for(4000, 4096) == 4096
    assert capacity_for(3000, 3000) == 3000  # capped at a non-power-of-two maximum
    assert capacity_for(10, 64) == 64  # a maximum below the 128 floor wins
    with pytest.raises(MoonEPInputError, match="capacity exceeded"):
        capacity_for(4097, 4096)


def test_pool_makes_buffers_lazily_and_reuses_them():
    """A pool that makes buffers up front or one per token count (without bound), or whose destroy leaves buffers
    alive."""
    pool = MoonEPBufferPool(dict(H=128, K=2, E=8, num_ep_ranks=1, B=2, device="cpu"), max_tokens_per_rank=1024, engine="builtin")
    assert pool.buffers == {}
    for n in (1, 100, 128, 129, 700, 1024, 5, 300):
        cap, buf = pool.get(n)
        assert buf.S == cap == capacity_for(n, 1024)
    assert sorted(pool.buffers) == [128, 256, 512, 1024]
    assert len(pool.buffers) <= pool.max_buffers == 4
    bufs = list(pool.buffers.values())
    pool.destroy()
    assert all(b.destroyed for b in bufs) and pool.buffers == {}
    pool.destroy()


def test_sanitize_and_pad():
    """A negative id (or its weight) kept, padding rows that are not zeros, or tokens_per_expert that misses the
    padded rows."""
    ids = torch.tensor([[1, -1], [2, 3]])
    w = torch.tensor([[0.5, 0.5], [0.3, 0.7]], dtype=torch.float64)
    sid, sw = sanitize_routing(ids, w)
    assert sid.dtype == torch.int32 and sw.dtype == torch.float32
    assert sid.tolist() == [[1, 0], [2, 3]] and sw[0, 1] == 0
    x = torch.randn(2, 4).to(torch.bfloat16)
    px, pid, pw, s = pad_to_capacity(x, ids, w, 5)
    assert s == 2 and px.shape == (5, 4) and pid.shape == (5, 2)
    assert torch.equal(px[:2], x) and bool((px[2:] == 0).all()) and bool((pid[2:] == 0).all()) and bool((pw[2:] == 0).all())
    assert tokens_per_expert(pid, 4).tolist() == [7, 1, 1, 1]
    _, pid3, _, _ = pad_to_capacity(x, ids, w, 5, pad_expert=3)  # the rank's own home expert (invalid ids too)
    assert bool((pid3[2:] == 3).all()) and tokens_per_expert(pid3, 4).tolist() == [0, 1, 1, 8]
    with pytest.raises(MoonEPInputError, match="capacity exceeded"):
        pad_to_capacity(x, ids, w, 1)
    with pytest.raises(MoonEPInputError, match="same shape"):
        sanitize_routing(ids, w[:, :1])


def test_ids_past_int32_stay_past_E_where_they_are_not_checked():
    """On CUDA (no host read to refuse them) the cast to int32 wrapped an int64 id of 2**32 + 3 to expert 3 and
    -(2**32) + 2 to expert 2: tokens went to experts their router never chose. The CPU path refuses them
    (test_validation's sanitize_ids_wrap); the CUDA path is _sanitize itself, run here on CPU tensors."""
    from vllm_moonep.common.padding import _sanitize

    ids = torch.tensor([[2**32 + 3, 1], [-(2**32) + 2, 2**40]])
    sid, sw = _sanitize(ids, torch.full((2, 2), 0.5), pad_expert=5)
    assert sid.tolist() == [[2**31 - 1, 1], [5, 2**31 - 1]]  # past E: dispatch's own checks see them
    assert sw.tolist() == [[0.5, 0.5], [0.0, 0.5]]


def test_engine_selection():
    """engine='auto' taking a moonep package that is absent, or engine='moonep' silently falling back to the built-in
    engine."""
    assert resolve_engine("builtin")[0] == "builtin"
    name, why = resolve_engine("auto")
    assert name == "builtin" and "moonep" in why  # the real package is not installed here
    with pytest.raises(MoonEPUnavailableError, match="engine='moonep' was requested"):
        make_buffer(16, 128, 2, 8, 1, engine="moonep", device="cpu")
    with pytest.raises(MoonEPInputError, match="engine must be one of"):
        resolve_engine("deepep")
    assert isinstance(make_buffer(16, 128, 2, 8, 1, engine="auto", device="cpu"), Buffer)


def test_core_imports_without_vllm(tmp_path):
    """A core package that imports vLLM (hidden here by a meta-path blocker) cannot run on the GPU test machine."""
    code = HIDE_VLLM + (
        "from vllm_moonep.engine import Buffer\n"
        "import vllm_moonep.common, vllm_moonep.replicated, vllm_moonep.symmetric\n"
        "import vllm_moonep.common.grouped_gemm, vllm_moonep.common.moe_step\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
        "b = Buffer(16, 128, 2, 8, 1, device='cpu')\n"
        "print('ok', b.num_dispatched_rows)\n"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("ok")


def test_multicast_policy(monkeypatch):
    """A GPU heap starting with NVLink multicast turned back on without the user's opt-in."""
    from vllm_moonep.engine.multicast import check_multicast_off

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("VLLM_MOONEP_ALLOW_MULTICAST", raising=False)
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE"):
        check_multicast_off("test heap")
    monkeypatch.setenv("VLLM_MOONEP_ALLOW_MULTICAST", "1")
    check_multicast_off("test heap")
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_config_bounds_single_process():
    """A bound of the contract not enforced at construction, a wrong default B, or NvS missing from _ctx (vLLM reads it there)."""
    with pytest.raises(MoonEPInputError, match="divisible"):
        Buffer(16, 8, 2, 9, 2, device="cpu")
    with pytest.raises(MoonEPInputError, match="top-k"):
        Buffer(16, 8, 33, 8, 1, device="cpu")
    with pytest.raises(MoonEPInputError, match="B .prefetch slots."):
        Buffer(16, 8, 2, 8, 1, B=0, device="cpu")
    with pytest.raises(MoonEPInputError, match="token_padding"):
        Buffer(16, 8, 2, 8, 1, token_padding=0, device="cpu")
    with pytest.raises(MoonEPInputError, match="2\\*\\*24"):
        Buffer(2**20, 8, 32, 8, 1, device="cpu")
    b = Buffer(16, 8, 2, 8, 1, device="cpu")
    assert b.B == 8 and b.num_dispatched_rows == 16 * 2 + 127 * 2 * 8
    assert b._ctx["NvS"] == b.num_dispatched_rows


def test_dispatched_rows_from_either_engine():
    """Code that reads NvS only through the public property would fail on the real moonep Buffer, which keeps it in _ctx only."""
    b = Buffer(16, 8, 2, 8, 1, device="cpu")
    assert isinstance(b, MoonEPBuffer)
    assert dispatched_rows(b) == b.num_dispatched_rows == 16 * 2 + 127 * 2 * 8

    class RealMoonEPLike:  # the real package's Buffer: the shape only in _ctx
        _ctx = {"NvS": 123}

    assert not isinstance(RealMoonEPLike(), MoonEPBuffer)
    assert dispatched_rows(RealMoonEPLike()) == 123


def test_layout_and_pool_must_agree_before_any_collective():
    """A layout and a buffer pool that disagree on E or B found only inside a collective, after a buffer was made."""
    from tests.moe_fixtures import global_weights
    from vllm_moonep.common import MoonEPMoE
    from vllm_moonep.replicated import ReplicatedWeightLayout

    w13, w2 = global_weights(8, 128, 128)
    layout = ReplicatedWeightLayout(w13, w2, 8, 4)
    pool = MoonEPBufferPool(dict(H=128, K=2, E=8, num_ep_ranks=1, B=2, device="cpu"), 128, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="reference")
    x = torch.randn(4, 128).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    w = torch.full((4, 2), 0.5)
    with pytest.raises(MoonEPInputError, match="B=4 slots, the buffer pool E=8, B=2"):
        moe.forward(x, ids, w)
    assert pool.buffers == {}, "no buffer (a collective) may be made for a mismatched step"
    good = MoonEPMoE(MoonEPBufferPool(dict(H=128, K=2, E=8, num_ep_ranks=1, B=4, device="cpu"), 128, engine="builtin"),
                     layout, impl="reference")
    assert good.forward(x, ids, w).shape == (4, 128)


def test_buffer_heap_bytes_are_its_receive_and_landing_areas():
    """moonep-ab reported no memory for the engine's own buffers (a set per capacity on the heap,
    outside the layouts' accounting); a wrong sum would under-report it."""
    S, H, K, E, B, tp = 8, 64, 2, 8, 4, 4
    buf = Buffer(S, H, K, E, 1, B=B, device="cpu", transport="symmetric", token_padding=tp)
    n = buf.NvS
    # counts [R,E] i32, recv_x [NvS,H] bf16, recv_w f32, recv_src i32, comb_x [S*K,H] bf16, comb_w f32, sig [5,R] i64
    assert buf.heap_bytes == E * 4 + n * H * 2 + n * 4 + n * 4 + S * K * H * 2 + S * K * 4 + 5 * 8
    buf.destroy()
    assert buf.heap_bytes == 0
    coll = Buffer(S, H, K, E, 1, B=B, device="cpu", transport="collective", token_padding=tp)
    assert coll.heap_bytes == 0  # sized per step, nothing held
    coll.destroy()


def test_padding_tails_written_unless_the_engine_never_reads_them():
    """The expert compute leaving the segments' padding tails unwritten (``zero_tail=False``) behind an
    engine whose combine might read them (any engine but the built-in one, which says it reads entry
    rows only) or without the plan's ends of entries (a weight-0 entry, which combine reads, would pass
    for tail); or writing them where both hold (2-80 MB per step for nothing)."""
    from types import SimpleNamespace

    from vllm_moonep.common.moe_step import DispatchState

    cu = torch.tensor([4], dtype=torch.int32)
    with_ends = SimpleNamespace(live_ends=torch.tensor([3], dtype=torch.int32))
    without = SimpleNamespace(live_ends=None)  # the built-in engine's plan off the GPU symmetric transport
    ours = Buffer(16, 8, 2, 8, 1, device="cpu")
    try:
        assert not DispatchState(ours, with_ends, 4, 4, 1, cu).tails_read  # type: ignore[arg-type]
        assert DispatchState(ours, without, 4, 4, 1, cu).tails_read  # type: ignore[arg-type]
    finally:
        ours.destroy()

    class OtherEngine:  # a contract engine that says nothing about what its combine reads (the real moonep)
        pass

    assert DispatchState(RealMoonEPBuffer(OtherEngine()), with_ends, 4, 4, 1, cu).tails_read  # type: ignore[arg-type]


def test_buffer_options_are_validated_on_every_transport():
    """num_sms=-3 ran 1 program and num_sms='many' raised a bare ValueError on the symmetric transport, both
    passed on the collective one; heap='hots' was silently ignored on the collective transport; check_inputs='no'
    checked ids."""
    from vllm_moonep.symmetric import HostHeap

    for transport in ("collective", "symmetric"):
        for bad in (-3, 0, "many", 2.5, True):
            with pytest.raises(MoonEPInputError, match=r"num_sms \(SMs of the symmetric transport's row kernels\) "
                                                       r"must be None or a positive int, got " + repr(bad)):
                Buffer(16, 8, 2, 8, 1, device="cpu", transport=transport, num_sms=bad)
        for bad, shown in (("hots", "'hots'"), (3, "int")):
            with pytest.raises(MoonEPInputError, match=r"heap must be None, a SymmetricHeap or one of \('auto', "
                                                       r"'host', 'torch', 'nvshmem'\), got " + shown):
                Buffer(16, 8, 2, 8, 1, device="cpu", transport=transport, heap=bad)
        for bad in ("no", 0, None):  # 'no' is truthy: it checked ids while it said not to
            with pytest.raises(MoonEPInputError, match=r"check_inputs must be True or False, got " + repr(bad)):
                Buffer(16, 8, 2, 8, 1, device="cpu", transport=transport, check_inputs=bad)
        b = Buffer(16, 8, 2, 8, 1, device="cpu", transport=transport, num_sms=2, heap="host")  # the next good one
        assert b.row_programs == (None if transport == "collective" else 2 * 4)
        b.destroy()
    heap = HostHeap()  # a heap object stays accepted (the collective transport has no use for it)
    Buffer(16, 8, 2, 8, 1, device="cpu", transport="collective", heap=heap).destroy()
    heap.close()


def test_plans_of_destroyed_buffers_stay_refused_when_an_address_comes_back():
    """A plan named its buffer by id(): once a buffer was collected, a new one at its address and step
    accepted its plan (combine then used the old routing)."""
    import gc

    from vllm_moonep.engine import MoonEPStateError

    S, H, K, E = 16, 8, 2, 8
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1]] * S, dtype=torch.int32)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    w = torch.full((S, K), 0.5)
    stale: dict[int, object] = {}  # address -> the plan (dispatch #0) of a buffer destroyed there
    owners, reused = [], 0
    for n in range(80):
        b = Buffer(S, H, K, E, 1, B=4, token_padding=4, device="cpu", dtype=torch.float32)
        xn, wn, _, plan = b.dispatch(x, w, ids, tpe)
        old = stale.get(id(b))
        if old is not None:  # the same address and step: only the owner token tells them apart
            reused += 1
            with pytest.raises(MoonEPStateError, match="Buffer.combine: the plan was not made by this buffer's dispatch"):
                b.combine(old, xn, wn)
        out, _, _ = b.combine(plan, xn, wn)  # the buffer's own plan still works
        assert torch.equal(out, K * x)
        stale[id(b)] = plan
        owners.append(plan.owner)
        b.destroy()
        del b, plan
        if n % 5 == 4:
            gc.collect()
    # CPython hands freed addresses out again (about 2 in 3 buffers here: the refusal above runs); with
    # id() as the owner, the owners repeat as the addresses do
    assert len(set(owners)) == len(owners), f"owner tokens must never repeat ({reused} addresses came back)"


def test_the_real_moonep_adapter_checks_plans_it_handed_out():
    """A layout that fills its own slots asks the buffer whether the plan is its latest dispatch's; the
    adapter of the real package must answer from what it knows (the plans its dispatch returned)."""
    from types import SimpleNamespace

    from vllm_moonep.engine import MoonEPStateError, check_plan

    class Inner:  # the real package's Buffer as far as the adapter uses it
        def dispatch(self, *args):
            return args[0], args[1], args[2], SimpleNamespace(experts_to_copy=torch.zeros(1, 1))

        def destroy(self):
            pass

    buf = RealMoonEPBuffer(Inner())
    x = torch.zeros(1)
    with pytest.raises(MoonEPStateError, match="op: the plan is not the one this buffer's latest dispatch returned"):
        check_plan(buf, SimpleNamespace(experts_to_copy=None), "op")  # before any dispatch
    first = buf.dispatch(x, x, x, x)[3]
    check_plan(buf, first, "op")
    second = buf.dispatch(x, x, x, x)[3]
    with pytest.raises(MoonEPStateError, match="latest dispatch"):
        check_plan(buf, first, "op")  # stale
    assert buf.check_plan(second, "op") is second
    buf.destroy()
    with pytest.raises(MoonEPStateError, match="op: the buffer was destroyed"):
        check_plan(buf, second, "op")
    with pytest.raises(MoonEPInputError, match="op: SimpleNamespace has no check_plan"):
        check_plan(SimpleNamespace(), second, "op")  # type: ignore[arg-type]
