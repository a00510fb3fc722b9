"""The built-in engine on R real ranks (gloo): rows land where the contract says, combine sums,
route weights come back, prefetch copies, bad input is rejected and the next step still works."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.reference_planner import reference_placement, reference_plan
from vllm_moonep.engine import Buffer, MoonEPInputError, MoonEPStateError
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.testing.routing import route


def _device():
    """CPU by default; the GPU suite runs the same functions with VLLM_MOONEP_TEST_DEVICE=cuda
    (every rank process on the one GPU, gloo moving CUDA tensors)."""
    return torch.device(os.environ.get("VLLM_MOONEP_TEST_DEVICE", "cpu"))


def _inputs(S, E, K, H, sigma, seed, rank, dtype):
    ids, w = route(S, E, K, sigma=sigma, seed=seed, rank=rank)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(S, H, generator=g).to(dtype)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    dev = _device()
    return x.to(dev), w.to(dev), ids.to(dev), tpe.to(dev)


def _transport():
    """The transport under test: ``auto`` by default (collective on CPU ranks, symmetric between
    GPUs of one node); the symmetric cases set VLLM_MOONEP_TEST_TRANSPORT for their ranks."""
    return os.environ.get("VLLM_MOONEP_TEST_TRANSPORT", "auto")


GPU_ENV = {"VLLM_MOONEP_TEST_DEVICE": "cuda"}
#: the same checks over the symmetric transport (CPU ranks: the host heap)
SYM_ENV = {"VLLM_MOONEP_TEST_TRANSPORT": "symmetric"}


def cuda_params(transports=("symmetric", "collective")):
    """``(env, launch)`` of every CUDA case: each transport on both placements, every rank process on
    the one GPU (gloo moving CUDA tensors; the symmetric transport on PyTorch symmetric memory across
    them) and one GPU per rank (NCCL; skipped with fewer GPUs than ranks). The collective transport
    once wrote unused prefetch slots on CUDA only, while the CUDA cases ran the default (symmetric)."""
    placements = (("shared-gpu", {}, pytest.mark.gpu),
                  ("gpu-per-rank", {"backend": "nccl", "device": "cuda"}, pytest.mark.multi_gpu))
    return [pytest.param({**GPU_ENV, "VLLM_MOONEP_TEST_TRANSPORT": t}, launch, marks=mark, id=f"{t}-{where}")
            for t in transports for where, launch, mark in placements]


#: the CPU cases of tests that also run on CUDA: ``(env, launch)`` as ``cuda_params``
CPU_PARAMS = [pytest.param(None, {}, id="collective"), pytest.param(SYM_ENV, {}, id="host-heap")]


def traceable_rows(S, H, K, E, B, tp, sigma, seed, uncombined_first=False, num_tokens=None):
    """Encode (source rank, token) in the hidden values and check every row's position.
    ``uncombined_first``: a dispatch of other routing (no combine) comes first, so its real rows
    must not show through this step's padding. ``num_tokens``: tokens from there on are padding
    (``Buffer.dispatch``'s extension): the GPU symmetric transport leaves their rows at 0 and
    the outputs of the real tokens must not change; other transports move them as usual."""
    r, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=_device(), dtype=torch.float32, transport=_transport())
    if uncombined_first:
        x0, w0, ids0, tpe0 = _inputs(S, E, K, H, 0.0, seed + 1, r, torch.float32)
        buf.dispatch(x0 + 1000.0, w0, ids0, tpe0)
    _, w, ids, tpe = _inputs(S, E, K, H, sigma, seed, r, torch.float32)
    x = torch.zeros(S, H)
    x[:, 0] = r + 1
    x[:, 1] = torch.arange(S, dtype=torch.float32)
    x[:, 2:] = torch.randn(S, H - 2, generator=torch.Generator().manual_seed(r))
    xn, wn, cu, plan = buf.dispatch(x.to(_device()), w, ids, tpe, num_tokens=num_tokens)
    assert xn.device.type == _device().type and cu.device.type == _device().type
    # whose rows stay put: every source's tokens from num_tokens on, on the GPU symmetric path
    kept = num_tokens if num_tokens is not None and _device().type == "cuda" and buf.transport_name == "symmetric" \
        else S
    xn, wn, cu, w = xn.cpu(), wn.cpu(), cu.cpu(), w.cpu()
    plan_cpu_etc = plan.experts_to_copy.cpu()
    # the reference plan, from every rank's routing (regenerated from the shared seeds)
    all_ids = [route(S, E, K, sigma=sigma, seed=seed, rank=q)[0] for q in range(R)]
    all_w = [route(S, E, K, sigma=sigma, seed=seed, rank=q)[1] for q in range(R)]
    tpe_all = [torch.bincount(i.reshape(-1).long(), minlength=E).tolist() for i in all_ids]
    ref = reference_plan(tpe_all, S, K, B, tp)
    dests, rows = reference_placement(tpe_all, [i.reshape(-1).tolist() for i in all_ids], ref)
    assert cu.dtype == torch.int32 and cu.tolist() == ref["cu"][r]
    # rows per segment, padding included (vLLM's expert_num_tokens): a wrong or stale count from the
    # GPU row kernel, which writes them so that prepare launches nothing for them
    if _device().type == "cuda" and buf.transport_name == "symmetric":
        assert plan.rows is not None, "the GPU dispatch kernel did not hand over its rows per segment"
    rows_pg = plan.rows_per_group
    assert rows_pg.dtype == torch.int32 and rows_pg.tolist() == torch.diff(cu, prepend=cu.new_zeros(1)).tolist()
    assert plan_cpu_etc.tolist() == ref["etc"]
    real = torch.zeros(buf.NvS, dtype=torch.bool)
    for q in range(R):
        for i, (d, row) in enumerate(zip(dests[q], rows[q])):
            if d != r:
                continue
            real[row] = True
            if i // K >= kept:  # a padding token's entry: not moved, its row reads as padding
                assert xn[row].abs().sum().item() == 0 and wn[row].item() == 0, (q, i, row)
                continue
            assert xn[row, 0].item() == q + 1 and xn[row, 1].item() == i // K, (q, i, row)
            assert wn[row].item() == all_w[q].reshape(-1)[i].item()
    assert int(real.sum()) == S * K
    end = int(cu[-1])
    pad = ~real[:end]
    assert bool((xn[:end][pad] == 0).all()) and bool((wn[:end][pad] == 0).all())
    # where each segment's entries end (the expert kernels take it in place of their trim launch): an end
    # before an entry drops that row's output, one past the last entry computes padding (or, past the
    # segment, the next segment's rows)
    if _device().type == "cuda" and buf.transport_name == "symmetric":
        ends = plan.live_ends
        assert ends is not None and ends.dtype == torch.int32, "the GPU dispatch kernel did not hand over its ends"
        starts = [0] + cu.tolist()[:-1]
        want = [s0 + int(real[s0:e0].nonzero().max()) + 1 if bool(real[s0:e0].any()) else s0
                for s0, e0 in zip(starts, cu.tolist())]
        assert ends.cpu().tolist() == want
    else:
        assert plan.live_ends is None  # the kernels find them themselves
    # route weights come back exactly; identity expert sums K copies
    out, rw, _ = buf.combine(plan, xn.to(_device()), wn.to(_device()))
    n = S if num_tokens is None else num_tokens  # outputs of the padding tokens are unspecified
    assert torch.equal(rw.cpu()[:n], w[:n])
    torch.testing.assert_close(out.cpu()[:n], K * x[:n], rtol=0, atol=1e-5)
    buf.destroy()
    return plan.slots_used


@pytest.mark.parametrize("env", [None, SYM_ENV], ids=["collective", "symmetric"])
@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("sigma", [0.0, 2.5])
def test_rows_land_where_the_plan_says(R, sigma, env):
    """A row at the wrong shard position, a padding row not zeroed, or a weight that did not travel
    with its row (either transport)."""
    E = 12 if R == 3 else 16
    slots = ranks(R, traceable_rows, 24, 16, 4, E, E // R, 8, sigma, 7 + R, env=env)
    assert len(set(slots)) == 1
    if sigma > 0:
        assert slots[0] > 0, "skewed routing must use prefetch slots"


@pytest.mark.parametrize("env,launch", cuda_params())
@pytest.mark.parametrize("R", [2, 4])
def test_rows_land_where_the_plan_says_cuda(R, env, launch):
    """The same on CUDA: the symmetric transport's kernels and the collective one."""
    slots = ranks(R, traceable_rows, 24, 16, 4, 16, 16 // R, 8, 2.5, 7 + R, env=env, **launch)
    assert len(set(slots)) == 1 and slots[0] > 0, "skewed routing must use prefetch slots"


@pytest.mark.parametrize("env,launch", CPU_PARAMS + cuda_params())
@pytest.mark.parametrize("num_tokens", [None, 0, 5, 24])
def test_padding_tokens_stay_put(num_tokens, env, launch):
    """Buffer.dispatch(num_tokens=n): rows of tokens at or past n that moved anyway on the GPU path
    (or real tokens' rows that did not), or real tokens' outputs that changed with it."""
    ranks(2, traceable_rows, 24, 16, 4, 16, 8, 8, 2.5, 11, False, num_tokens, env=env, **launch)


@pytest.mark.parametrize("env,launch", CPU_PARAMS + cuda_params())
def test_padding_reads_zero_after_a_dispatch_with_no_combine(env, launch):
    """Combine turns the rows it reads back into padding; a dispatch that follows a dispatch with
    no combine must clear that dispatch's rows itself, else they show through as padding."""
    ranks(2, traceable_rows, 24, 16, 4, 16, 8, 8, 2.5, 9, True, env=env, **launch)


def per_expert_scale(S, H, K, E, B, tp, sigma, seed):
    """An expert that scales its segment by a per-expert factor matches the dense computation (bf16)."""
    r, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=_device(), transport=_transport())
    x, w, ids, tpe = _inputs(S, E, K, H, sigma, seed, r, torch.bfloat16)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    xn, wn, cu, x, w, ids = xn.cpu(), wn.cpu(), cu.cpu(), x.cpu(), w.cpu(), ids.cpu()
    factor = torch.linspace(0.5, 2.0, E)
    etc = plan.experts_to_copy[r].cpu()
    y = torch.zeros_like(xn)
    start = 0
    for g, end in enumerate(cu.tolist()):
        e = g if g < E else int(etc[g - E])
        if end > start:
            assert e >= 0
            y[start:end] = (xn[start:end].float() * factor[e] * wn[start:end, None]).to(torch.bfloat16)
        start = end
    out, _, _ = buf.combine(plan, y.to(_device()))
    out = out.cpu()
    y_rows = (x.float()[:, None, :] * (factor[ids.long()] * w)[:, :, None]).to(torch.bfloat16).float()
    ref = y_rows.sum(dim=1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    return plan.slots_used


@pytest.mark.parametrize("env", [None, SYM_ENV], ids=["collective", "symmetric"])
@pytest.mark.parametrize("R", [2, 3, 4])
def test_per_expert_scale_matches_dense(R, env):
    """An output row combined into the wrong token, or an expert applied to another's rows."""
    E = 12 if R == 3 else 16
    slots = ranks(R, per_expert_scale, 40, 32, 3, E, E // R, 16, 3.0, 5, env=env)
    assert slots[0] > 0


@pytest.mark.parametrize("env,launch", cuda_params())
@pytest.mark.parametrize("R", [2, 4])
def test_per_expert_scale_matches_dense_cuda(R, env, launch):
    """The same on CUDA: an output row combined into the wrong token, or an expert applied to another's rows."""
    slots = ranks(R, per_expert_scale, 40, 32, 3, 16, 16 // R, 16, 3.0, 5, env=env, **launch)
    assert slots[0] > 0


def prefetch_slots(epr, K, S, B, tp, sigma, seed):
    """Dispatch skewed routing, then prefetch ``[E+B, 128, 128]`` bf16 weights (16K elements a row,
    four of the copy kernel's blocks) whose slot rows hold a sentinel: every used slot must become
    its expert's row, byte for byte, and every unused (-1) slot and home row must stay as it was."""
    r, R = dist.get_rank(), dist.get_world_size()
    E, H, dev = epr * R, 128, _device()
    buf = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=dev, transport=_transport())
    x, w, ids, tpe = _inputs(S, E, K, H, sigma, seed, r, torch.bfloat16)
    _, _, _, plan = buf.dispatch(x, w, ids, tpe)
    g = torch.Generator().manual_seed(99)
    # distinct bytes per expert and position: a row copied from the wrong expert or offset differs
    gate, up, down = (torch.randn(E + B, 128, 128, generator=g).to(torch.bfloat16).to(dev) for _ in range(3))
    sentinel = torch.tensor(-7.0, dtype=torch.bfloat16, device=dev)
    for t in (gate, up, down):
        t[E:] = sentinel
    before = [t.clone() for t in (gate, up, down)]
    buf.prefetch_weight(plan=plan, full_gate_weight=gate, full_up_weight=up, full_down_weight=down)
    etc = plan.experts_to_copy[r].tolist()
    assert isinstance(etc, list) and len(etc) == B
    for name, t, t0 in zip(("gate", "up", "down"), (gate, up, down), before):
        assert torch.equal(t[:E].view(torch.int16), t0[:E].view(torch.int16)), f"{name}: a home row was written"
        for b, e in enumerate(etc):
            if e >= 0:
                assert torch.equal(t[E + b].view(torch.int16), t0[e].view(torch.int16)), \
                    f"{name}: slot {b} is not a copy of expert {e} (slots {etc})"
            else:
                assert bool((t[E + b] == sentinel).all()), f"{name}: unused slot {b} was written (slots {etc})"
    buf.destroy()
    return [e >= 0 for e in etc]


#: (R, experts per rank, K, S, B, token_padding): the shapes on which the collective transport's
#: prefetch wrote unused slots on CUDA (the host plan's experts_to_copy was a transposed view, and
#: the copy kernel read a rank's row of it as contiguous ids); the last, B=1, passed even then
PREFETCH_SHAPES = [(2, 4, 4, 16, 2, 8), (3, 3, 3, 17, 2, 16), (4, 4, 8, 32, 4, 16), (3, 5, 4, 11, 3, 1),
                   (4, 2, 2, 9, 1, 4)]


def _check_prefetch(shape, env, launch):
    R, epr, K, S, B, tp = shape
    used = ranks(R, prefetch_slots, epr, K, S, B, tp, 3.0, 21 + R, env=env, **launch)
    flat = [u for rank in used for u in rank]
    assert any(flat), "skewed routing must use some slot"
    if B > 1:
        assert not all(flat), "some slot must stay unused to check the sentinel"


@pytest.mark.parametrize("env,launch", CPU_PARAMS)
@pytest.mark.parametrize("shape", PREFETCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefetch_copies_used_slots_and_leaves_unused(shape, env, launch):
    """prefetch_weight copying the wrong expert into a slot, or writing an unused (-1) slot or a home row."""
    _check_prefetch(shape, env, launch)


@pytest.mark.parametrize("env,launch", cuda_params())
@pytest.mark.parametrize("shape", PREFETCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefetch_copies_used_slots_and_leaves_unused_cuda(shape, env, launch):
    """The same on CUDA, where the copy is a Triton kernel reading the plan's slot ids by pointer:
    a slot filled with the wrong expert, or an unused slot or a home row written."""
    _check_prefetch(shape, env, launch)


def bad_inputs_then_valid():
    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 16, 8, 2, 4 * R
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device=_device(), transport=_transport())
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 3, r, torch.bfloat16)
    cases = {
        "fp16 hidden": ((x.half(), w, ids, tpe), "must be torch.bfloat16"),
        "short hidden": ((x[:-1], w, ids, tpe), "callers pad"),
        "int64 ids": ((x, w, ids.long(), tpe), "int32"),
        "id out of range": ((x, w, torch.where(ids == ids[0, 0], E, ids), tpe), f"must be in [0, {E})"),
        "negative id": ((x, w, torch.where(ids == ids[0, 0], -1, ids), tpe), "sanitize"),
        "tpe sum": ((x, w, ids, tpe + 1), "must be S*K"),
        "tpe mismatch": ((x, w, ids, tpe.roll(1)), "not the bincount"),
        "nan weight": ((x, torch.full_like(w, float("nan")), ids, tpe), "non-finite"),
        "fp64 weights": ((x, w.double(), ids, tpe), "float32"),
    }
    msgs = {}
    for name, (args, needle) in cases.items():
        with pytest.raises(MoonEPInputError) as ei:
            buf.dispatch(*args)
        assert needle in str(ei.value), (name, str(ei.value))
        msgs[name] = str(ei.value)
    for bad in (S + 1, -1, True, 2.0):
        with pytest.raises(MoonEPInputError, match="num_tokens must be an int in"):
            buf.dispatch(x, w, ids, tpe, num_tokens=bad)
    # a foreign plan and a destroyed buffer are state errors
    other = Buffer(S, H, K, E, R, B=2, token_padding=4, device=_device(), transport=_transport())
    _, _, _, foreign = other.dispatch(x, w, ids, tpe)
    with pytest.raises(MoonEPStateError):
        buf.combine(foreign, torch.zeros(buf.NvS, H, dtype=torch.bfloat16))
    other.combine(foreign, torch.zeros(other.NvS, H, dtype=torch.bfloat16))
    other.destroy()
    other.destroy()  # idempotent
    with pytest.raises(MoonEPStateError):
        other.dispatch(x, w, ids, tpe)
    # the next valid step on the same buffer is still right
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    with pytest.raises(MoonEPInputError):
        buf.combine(plan, xn[:, :-1])
    out, rw, _ = buf.combine(plan, xn, wn)
    torch.testing.assert_close(out.float(), (K * x.float()).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(rw, w)
    return len(msgs)


@pytest.mark.parametrize("env", [None, SYM_ENV], ids=["collective", "symmetric"])
@pytest.mark.parametrize("R", [2, 3])
def test_bad_inputs_raise_and_next_step_works(R, env):
    """A rejected call that left a half-sent step behind (the next valid step would then be wrong)."""
    assert ranks(R, bad_inputs_then_valid, env=env) == [9] * R


def config_mismatch():
    r, R = dist.get_rank(), dist.get_world_size()
    try:
        Buffer(16, 8 if r == 0 else 16, 2, 8, R, device=_device(), transport=_transport())
    except MoonEPInputError as exc:
        return str(exc)
    return ""


def test_config_mismatch_across_ranks_is_reported():
    """Ranks whose buffers differ in shape exchanging rows anyway instead of being told which setting differs."""
    msgs = ranks(2, config_mismatch)
    assert all("differs across ranks" in m for m in msgs)


def config_mismatch_in_E():
    """E differing across ranks (8 and Kimi-K2's 384), within one frame block (host_plan.FRAME_BLOCK): the
    frames' sizes match."""
    r, R = dist.get_rank(), dist.get_world_size()
    try:
        Buffer(16, 8, 2, 8 if r == 0 else 384, R, device=_device(), transport=_transport())
    except MoonEPInputError as exc:
        return str(exc)
    return ""


def test_config_mismatch_in_E_is_reported():
    """The construction check is framed like dispatch's counts (its size follows E's block): ranks that
    disagree on E must still be told, not meet with frames of different sizes (blocks of 64 words made
    8 and 384 differ: gloo aborted the process)."""
    msgs = ranks(2, config_mismatch_in_E)
    assert all("differs across ranks" in m for m in msgs)


def capacity_disagreement():
    """Ranks on buffers of different capacity S (a token count that differs across ranks, e.g. vLLM's
    num_tokens_across_dp, picks a pool's buffer): one rank constructs while its peers dispatch, or
    each dispatches on its own buffer. Every rank refuses, naming it; the next agreed step works."""
    r, R = dist.get_rank(), dist.get_world_size()
    H, K, E = 8, 2, 4 * R
    # the host-planned transports (collective, hybrid) exchange counts in a collective; the symmetric one
    # exchanges nothing per step (a disagreement there is a device wait that times out, naming the peer)
    kw = dict(B=2, token_padding=4, device=_device(), dtype=torch.float32, transport="collective")

    def good_step(buf):
        x, w, ids, tpe = _inputs(buf.S, E, K, H, 1.0, 7, r, torch.float32)
        xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
        out, rw, _ = buf.combine(plan, xn, wn)
        return torch.equal(out, K * x) and torch.equal(rw, w)

    small = Buffer(16, H, K, E, R, **kw)
    x, w, ids, tpe = _inputs(16, E, K, H, 1.0, 3, r, torch.float32)
    if r == 1:  # this rank builds the 32-token buffer while its peers dispatch on the 16-token one
        peers = "; ".join(f"rank {q} is dispatching on a buffer of S=16" for q in range(R) if q != 1)
        with pytest.raises(MoonEPInputError, match=rf"Buffer.__init__: {peers}, while this rank constructs one of "
                                                   r"S=32: ranks that disagree on the step's token count"):
            Buffer(32, H, K, E, R, **kw)
    else:
        with pytest.raises(MoonEPInputError, match=r"dispatch: rank 1 is constructing a MoonEP Buffer of S=32, while "
                                                   r"this rank dispatches on a buffer of S=16: ranks that disagree"):
            small.dispatch(x, w, ids, tpe)
    ok = [good_step(small)]  # nothing was moved: the agreed step works on every rank
    large = Buffer(32, H, K, E, R, **kw)
    with pytest.raises(MoonEPInputError, match=r"dispatch: the ranks disagree on the step's capacity: S per rank "
                                               + str([32 if q == 1 else 16 for q in range(R)]).replace("[", r"\[")):
        if r == 1:
            xl, wl, idsl, tpel = _inputs(32, E, K, H, 1.0, 3, r, torch.float32)
            large.dispatch(xl, wl, idsl, tpel)
        else:
            small.dispatch(x, w, ids, tpe)
    ok += [good_step(large), good_step(small)]
    large.destroy()
    small.destroy()
    return ok


@pytest.mark.parametrize("R", [2, 3])
def test_ranks_on_buffers_of_different_capacity_are_told(R):
    """One rank constructing a larger buffer while its peers dispatched: the construction check met the
    counts all-gather (sizes 10 vs E: gloo aborted the process with "Received data size doesn't match",
    and the other rank read the counts as a configuration); both dispatching on different buffers blamed
    tokens_per_expert. Now every rank names the disagreement and the next agreed step works."""
    assert ranks(R, capacity_disagreement) == [[True] * 3] * R


def world_size_mismatch():
    with pytest.raises(MoonEPInputError, match="does not match the process group"):
        Buffer(16, 8, 2, 24, dist.get_world_size() + 1, device=_device(), transport=_transport())
    return True


def test_world_size_mismatch():
    """A num_ep_ranks that is not the process group's size accepted (rows planned for ranks that do not exist)."""
    assert ranks(2, world_size_mismatch) == [True, True]


def combine_accumulates_in_fp32(S, H, K, E):
    """bf16 expert rows, combined: must equal the fp32 sum of each token's K rows rounded once."""
    r, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(S, H, K, E, R, B=E // R, token_padding=4, device=_device(), transport=_transport())
    x, w, ids, tpe = _inputs(S, E, K, H, 3.0, 17, r, torch.bfloat16)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    # a row-specific bf16 output: each row scaled by its route weight and a per-expert factor
    y = (xn.float() * (1.0 + 3.0 * wn[:, None])).to(torch.bfloat16)
    out, _, _ = buf.combine(plan, y)
    rows = (x.float()[:, None, :] * (1.0 + 3.0 * w[:, :, None])).to(torch.bfloat16)  # [S, K, H] bf16
    acc = torch.zeros(S, H, dtype=torch.float32, device=x.device)
    for k in range(K):  # fp32 accumulation in k order, one final rounding
        acc += rows[:, k].float()
    exact = torch.equal(out, acc.to(torch.bfloat16))
    # the same rows summed in bf16 step by step must differ somewhere (the test can tell)
    naive = rows[:, 0].clone()
    for k in range(1, K):
        naive = naive + rows[:, k]
    return exact, not torch.equal(naive, acc.to(torch.bfloat16))


@pytest.mark.parametrize("env", [None, SYM_ENV], ids=["collective", "symmetric"])
@pytest.mark.parametrize("R", [2, 3])
def test_combine_accumulates_in_fp32_and_rounds_once(R, env):
    """combine summing a token's K bf16 rows in bf16 (rounding every partial sum) instead of in fp32, rounded once."""
    res = ranks(R, combine_accumulates_in_fp32, 64, 64, 3, 6 * R, env=env)
    assert all(exact for exact, _ in res), "combine is not an fp32 sum rounded once to bf16"
    assert any(distinguishing for _, distinguishing in res)


def counts_short_on_one_rank():
    """Rank 0's counts miss S*K (what an id >= E gives on CUDA, where the count drops it). On the symmetric
    transport's host executor rank 1 reads the counts table late (a delay after its wait): rank 0, refusing at
    once, must not write the next step's counts into that table before rank 1 has read this one."""
    from vllm_moonep.engine.transports.symmetric import SymmetricTransport

    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 16, 8, 2, 8
    buf = Buffer(S, H, K, E, R, B=4, token_padding=4, device="cpu", check_inputs=False, transport=_transport(),
                 timeout_s=20)
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 5, r, torch.bfloat16)
    bad = tpe.clone()
    if r == 0:
        bad[int(ids[0, 0])] -= 1
    if r == 1 and isinstance(buf.transport, SymmetricTransport):
        wait = buf.transport._wait_host

        def slow_reader(phase):
            wait(phase)
            if phase == "counts":
                time.sleep(0.5)

        buf.transport._wait_host = slow_reader
    with pytest.raises(MoonEPInputError, match=r"rank\(s\) \[0\] does not sum to S\*K"):
        buf.dispatch(x, w, ids, bad)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)  # the next valid step on the same buffer
    out, rw, _ = buf.combine(plan, xn, wn)
    ok = torch.equal(rw, w) and torch.allclose(out.float(), (K * x.float()).to(torch.bfloat16).float(), rtol=1e-2,
                                                 atol=1e-2)
    buf.destroy()
    return ok


@pytest.mark.parametrize("env", [None, SYM_ENV], ids=["collective", "host-heap"])
def test_counts_that_miss_s_times_k_are_refused_on_every_rank(env):
    """Without host input checks (the GPU default), a count missing rows (ids outside [0, E)) planned
    an impossible step (out-of-bounds placement, or an IndexError on one rank and a peer left waiting); every
    rank must refuse it together before any row moves, and the next step be right (on the host heap: a rank
    that refused could overwrite a slower peer's counts table with the next step's, which the peer then planned
    from and waited on forever)."""
    assert ranks(2, counts_short_on_one_rank, env=env) == [True, True]


def one_rank_refuses(transport):
    """Rank 0 alone passes each bad input (the Buffer's checks); then every rank makes the same valid step. Its
    peers are already in the call's first exchange: they must refuse it with rank 0, naming it, not complete it
    with rank 0's next call (on one buffer shared by the layers, the next layer's rows)."""
    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 16, 8, 2, 4 * R
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device=_device(), dtype=torch.float32, transport=transport,
                 timeout_s=20)
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 11, r, torch.float32)
    bad = {"nan weight": ((x, torch.full_like(w, float("nan")), ids, tpe), {}),
           "id out of range": ((x, w, torch.where(ids == ids[0, 0], E, ids), tpe), {}),
           "fp64 weights": ((x, w.double(), ids, tpe), {}),
           "num_tokens": ((x, w, ids, tpe), {"num_tokens": S + 1})}
    seen = []
    for name, (args, kw) in bad.items():
        if r == 0:
            with pytest.raises(MoonEPInputError) as ei:
                buf.dispatch(*args, **kw)
            assert "refused their input" not in str(ei.value), (name, str(ei.value))
        else:
            with pytest.raises(MoonEPInputError, match=r"dispatch: rank\(s\) \[0\] refused their input to this "
                                                       r"dispatch \(their own error says why\), so every rank refuses "
                                                       "it: nothing moved"):
                buf.dispatch(x, w, ids, tpe)
        xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)  # the next step, the same on every rank
        out, rw, _ = buf.combine(plan, xn * 2, wn)
        seen.append(bool(torch.equal(out, 2 * K * x) and torch.equal(rw, w)))
    buf.destroy()
    return seen


@pytest.mark.parametrize("transport,R,env", [("collective", 2, None), ("collective", 3, None),
                                             ("hybrid", 4, {RANKS_PER_NODE_ENV: "2"})],
                         ids=["collective-R2", "collective-R3", "hybrid-R4-2-nodes"])
def test_one_rank_refusing_its_input_is_refused_by_every_rank(transport, R, env):
    """A rank that refused its own input raised before the counts all-gather its peers were already in, so their
    call completed with that rank's next one (two calls mixed: with one buffer shared by the layers, rows of
    another layer, silently; or a timeout one call later naming the wrong step). The transports that plan on the
    host send a refusal frame in its place: every rank refuses the call and the next step is right."""
    assert ranks(R, one_rank_refuses, transport, env=env) == [[True] * 4] * R
