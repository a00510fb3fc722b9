"""Faults the way serving fails in production, on real gloo ranks (fresh spawned pools, since a
killed rank or a failed collective leaves a process group unusable):

- gloo's ``work.wait(timeout)``: what it does when a peer is late (the basis of the bound);
- a rank process that exits between dispatch and combine: the survivors raise
  ``MoonEPCollectiveTimeout`` naming the op, the step and the dead rank, fast;
- a rank that stops calling (sleeps; here rank 0, which hosts the store): the peer raises within
  the timeout naming it as alive-but-absent; then every rank tears down after the failed step
  (idempotent, before the process group, local: the symmetric layout's heap too), rebuilds the process group and a fresh set of
  buffers/pools/layouts in the same process, and gets bitwise the same output as before;
- a peer that never loads its weights: the replicated layout's load-time all-gather is bounded;
- a rank that rejects its input: its peers refuse the step with it (the MoE step's routing checks, through the
  step's buffer), or time out naming it where nothing carries the refusal (the symmetric transport);
- the store's host (rank 0) exits: the survivor still raises promptly, saying why it cannot name it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.engine import MoonEPInputError, MoonEPStateError
from vllm_moonep.engine.faults.arrival_board import ArrivalBoard
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.launch import RankFailure, launched_world_size, run_on_ranks
from vllm_moonep.testing.weights import local_experts

# slow: each case waits out a collective's bound in fresh processes (scripts/test.sh runs them as its own stage)
pytestmark = [pytest.mark.skipif(launched_world_size() is not None, reason="fault injection needs spawned ranks"),
              pytest.mark.slow]

TIMEOUT_S = 3.0
ENV = {"VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S), "VLLM_MOONEP_TEST_GROUP_TIMEOUT_S": "20"}
#: what the survivors may take beyond the bound: the diagnosis of a transport error (probe) and
#: scheduling noise on a 2-core machine
SLACK_S = 2.0
E, H, I, K, B, TP, MAX_TOKENS = 12, 128, 128, 2, 2, 8, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh(R, fn, *args):
    return run_on_ranks(R, fn, *args, env=ENV, fresh=True, allow_failures=True, timeout_s=120)


def _build(seed=0, group=None, layout_kind="replicated"):
    r, R = dist.get_rank(), dist.get_world_size()
    w13, w2 = global_weights(E, H, I, seed)
    lw13, lw2 = local_experts(w13, w2, r, R)
    if layout_kind == "symmetric":  # on a host heap the layout makes and owns (its own transport on the group)
        from vllm_moonep.symmetric import SymmetricWeightLayout

        layout = SymmetricWeightLayout(lw13, lw2, E, B, group, heap="host")
    else:
        layout = ReplicatedWeightLayout(lw13, lw2, E, B, group)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=TP, device="cpu", group=group),
                            max_tokens_per_rank=MAX_TOKENS, engine="builtin", min_capacity=16)
    return MoonEPMoE(pool, layout, impl="reference"), w13, w2


def _step_inputs(step):
    return rank_inputs(20 + 7 * step, E, K, H, sigma=2.0, seed=500 + step, rank=dist.get_rank())


def _teardown(moe, twice=True):
    for _ in range(2 if twice else 1):
        moe.pool.destroy()
        moe.layout.destroy()


def _rebuild_group(port):
    """Destroy the (failed) default group and make a fresh one on ``port`` (same ranks)."""
    r, R = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=R,
                            timeout=datetime.timedelta(seconds=20))


def _timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def _describe(exc, elapsed):
    return {
        "type": type(exc).__name__ if exc else None,
        "msg": str(exc) if exc else "",
        "missing": getattr(exc, "missing", None),
        "op": getattr(exc, "op", None),
        "step": getattr(exc, "step", None),
        "timed_out": getattr(exc, "timed_out", None),
        "elapsed": elapsed,
    }


# ------------------------------------------------------------------------------ gloo semantics
def gloo_wait_semantics():
    r = dist.get_rank()
    out = {}
    # 1) a peer 2.5 s late, a 1 s wait: RuntimeError "timed out" after ~1 s; the work stays
    #    pending and a second wait completes it with the right data
    t = torch.full((4,), float(r))
    parts = [torch.empty(4) for _ in range(2)]
    if r == 1:
        time.sleep(2.5)
    t0 = time.monotonic()
    work = dist.all_gather(parts, t, async_op=True)
    if r == 0:
        try:
            work.wait(timeout=datetime.timedelta(seconds=1.0))
            out["first"] = "completed"
        except RuntimeError as exc:
            out["first"] = str(exc)
        out["first_elapsed"] = time.monotonic() - t0
        out["second"] = work.wait(timeout=datetime.timedelta(seconds=10))
    else:
        work.wait(timeout=datetime.timedelta(seconds=10))
    out["data_ok"] = all(bool((p == q).all()) for q, p in enumerate(parts))
    # 2) through the transport: a peer late by more than the first wait but within the bound
    #    (inside the probe window) completes without error
    from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives

    tr = BoundedCollectives(timeout_s=TIMEOUT_S)
    board = tr.board
    if r == 1:
        time.sleep(TIMEOUT_S - 0.5 * board.probe_s)
    exc, el = _timed(tr.all_gather, torch.tensor([r]), "late peer within the bound")
    out["late_within_bound"] = (None if exc is None else str(exc), el)
    tr.close()
    tr.close()
    out["boards_after_close"] = ArrivalBoard.live_boards()
    return out


def test_gloo_wait_timeout_semantics_and_late_peer_within_bound():
    """The bounded wait relying on gloo semantics it does not have (a timed-out wait dropping its work), or failing a
    peer late but within the bound."""
    res = _fresh(2, gloo_wait_semantics)
    assert not any(isinstance(x, RankFailure) for x in res), res
    r0 = res[0]
    assert "timed out" in r0["first"].lower(), r0
    assert 0.9 <= r0["first_elapsed"] < 2.0, r0
    assert r0["second"] is True and r0["data_ok"] and res[1]["data_ok"]
    for r in res:
        assert r["late_within_bound"][0] is None, r
        assert r["boards_after_close"] == 0


# ------------------------------------------------------------------------------ a rank dies
class _DieInPrefetch:
    """Fault injection: the victim's process exits between dispatch and combine at ``at_step``."""

    def __init__(self, inner, victim, at_step):
        self._inner, self._victim, self._at = inner, victim, at_step

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prefetch(self, buffer, plan, rows=None):
        if dist.get_rank() == self._victim and plan.step == self._at:
            os._exit(17)
        self._inner.prefetch(buffer, plan, rows)


def rank_dies_mid_step(victim, at_step):
    moe, w13, w2 = _build()
    moe.layout = _DieInPrefetch(moe.layout, victim, at_step)
    for step in range(at_step):
        x, ids, w = _step_inputs(step)
        check_against_dense(moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS), x, ids, w, w13, w2)
    x, ids, w = _step_inputs(at_step)
    exc, elapsed = _timed(moe.forward, x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    out = _describe(exc, elapsed)
    # the group is unusable now: the next step is refused at once, it never hangs or returns output
    exc2, el2 = _timed(moe.forward, x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    out["next"] = (type(exc2).__name__, str(exc2), el2)
    _teardown(moe)  # works after a failed step, twice
    return out


def test_rank_exit_mid_step_survivors_name_it():
    """A rank that dies mid-step hanging the survivors, or their error not naming the dead rank, the operation and the
    step."""
    res = _fresh(3, rank_dies_mid_step, 2, 2)
    assert isinstance(res[2], RankFailure) and res[2].status == "died" and res[2].exitcode == 17, res[2]
    for r in (0, 1):
        o = res[r]
        assert o["type"] == "MoonEPCollectiveTimeout", o
        assert o["missing"] == [2], o
        assert o["op"] == "combine: all_to_all(hidden)" and o["step"] == 2, o
        assert "'combine: all_to_all(hidden)'" in o["msg"] and "at step 2" in o["msg"], o["msg"]
        assert "did not answer: rank 2" in o["msg"], o["msg"]
        assert "dead or frozen" in o["msg"], o["msg"]
        assert o["elapsed"] < TIMEOUT_S + SLACK_S, o
        assert o["next"][0] == "MoonEPStateError" and "unusable" in o["next"][1] and o["next"][2] < 0.5, o["next"]


# ------------------------------------------------------------------------------ a rank stops calling
def rank_stops_calling_then_rebuild(port, layout_kind):
    r = dist.get_rank()
    moe, w13, w2 = _build(layout_kind=layout_kind)
    x, ids, w = _step_inputs(0)
    first = moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    check_against_dense(first, x, ids, w, w13, w2)
    out = {}
    x1, ids1, w1 = _step_inputs(1)
    if r == 0:
        time.sleep(2 * TIMEOUT_S)  # rank 0 (the store's host) stops calling for a while
    exc, elapsed = _timed(moe.forward, x1, ids1, w1, num_tokens_across_dp=MAX_TOKENS)
    out["fail"] = _describe(exc, elapsed)
    # teardown after the failed step: idempotent, before the process group, no collective (the
    # symmetric layout's heap frees locally: the group's arrival board says it is broken)
    exc, out["teardown_s"] = _timed(_teardown, moe)
    out["teardown"] = _describe(exc, out["teardown_s"])
    heap = getattr(moe.layout, "heap", None)
    out["heap_released"] = heap is None or (heap.closed and heap.live() == [])
    with pytest.raises(MoonEPStateError):
        moe.pool.get(1)
    with pytest.raises(MoonEPStateError):
        moe.layout.grouped_weights()
    t_rb = time.monotonic()
    _rebuild_group(port)
    out["rebuild_s"] = time.monotonic() - t_rb
    # a fresh set in the same process: correct, and bitwise what the first set produced
    moe2, _, _ = _build(layout_kind=layout_kind)
    again = moe2.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    out["bitwise_after_rebuild"] = torch.equal(first, again)
    out2 = moe2.forward(x1, ids1, w1, num_tokens_across_dp=MAX_TOKENS)
    check_against_dense(out2, x1, ids1, w1, w13, w2)
    _teardown(moe2)
    out["boards_left"] = ArrivalBoard.live_boards()
    return out


@pytest.mark.parametrize("layout_kind", ["replicated", "symmetric"])
def test_rank_stops_calling_then_teardown_and_recreate(layout_kind):
    """A rank that stops calling leaving its peer waiting forever, or a group rebuilt after teardown computing other
    bits or leaking arrival boards. Symmetric: the layout's heap frees were collective after the failed step, so
    its destroy() was refused ("the process group is unusable") and the heap kept every allocation."""
    res = _fresh(2, rank_stops_calling_then_rebuild, _free_port(), layout_kind)
    assert not any(isinstance(x, RankFailure) for x in res), res
    for r in res:
        assert r["teardown"]["type"] is None, r["teardown"]
        assert r["heap_released"] and r["teardown_s"] < 1.0, r
    o = res[1]["fail"]  # the rank that kept calling
    assert o["type"] == "MoonEPCollectiveTimeout" and o["timed_out"], o
    assert o["op"] == "dispatch: all_gather(tokens_per_expert)" and o["step"] == 1, o
    assert o["missing"] == [0] and "did not answer: rank 0" in o["msg"] and "alive" in o["msg"], o["msg"]
    assert "timed out after" in o["msg"] and "at step 1" in o["msg"], o["msg"]
    assert TIMEOUT_S - 0.2 <= o["elapsed"] < TIMEOUT_S + SLACK_S, o
    # the late rank got matched against the peer's pending gather, then waited alone: it names rank 1
    o0 = res[0]["fail"]
    assert o0["type"] == "MoonEPCollectiveTimeout" and o0["missing"] == [1], o0
    assert o0["elapsed"] < TIMEOUT_S + SLACK_S, o0
    for r in res:
        assert r["bitwise_after_rebuild"] is True
        assert r["boards_left"] == 0


# ------------------------------------------------------------------------------ load time, bad input, recreate
def load_and_input_faults(port1, port2):
    r = dist.get_rank()
    out = {}
    # 1) rank 1 never loads: rank 0's load-time all-gather is bounded and names it
    if r == 0:
        w13, w2 = global_weights(E, H, I, 0)
        lw13, lw2 = local_experts(w13, w2, r, 2)
        exc, el = _timed(ReplicatedWeightLayout, lw13, lw2, E, B, timeout_s=2.0)  # the argument beats the env
        out["load"] = _describe(exc, el)
    else:
        time.sleep(2.0 + 1.0)
    _rebuild_group(port1)
    # 2) rank 1 passes ids out of range: it raises MoonEPInputError before any row moves and tells rank 0
    #    (the step's buffer carries its refusal), which refuses the step too, naming it, instead of hanging;
    #    the next step is right on both, in the same group
    moe, w13, w2 = _build()
    x, ids, w = _step_inputs(0)
    bad = ids.clone()
    if r == 1:
        bad[0, 0] = E
    exc, el = _timed(moe.forward, x, bad, w, num_tokens_across_dp=MAX_TOKENS)
    out["input"] = _describe(exc, el)
    check_against_dense(moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS), x, ids, w, w13, w2)
    out["next_step_right"] = True
    # 3) both ranks refuse, at different checks (rank 0 its routing, rank 1 its hidden states' width): each must tell
    #    the other, or the told one's frame pairs with the other's next call; then two layers sharing the pool run
    #    two right steps
    moe_b, w13_b, w2_b = _build(seed=1)
    moe_b.pool.destroy()
    moe_b.pool = moe.pool
    bad0 = ids.clone()
    bad0[0, 0] = E
    exc, el = (_timed(moe.forward, x, bad0, w, num_tokens_across_dp=MAX_TOKENS) if r == 0
               else _timed(moe.forward, x[:, :-1], ids, w, num_tokens_across_dp=MAX_TOKENS))
    out["both"] = _describe(exc, el)
    for step in (1, 2):
        xs, ids_s, ws = _step_inputs(step)
        for m, a, b in ((moe, w13, w2), (moe_b, w13_b, w2_b)):
            check_against_dense(m.forward(xs, ids_s, ws, num_tokens_across_dp=MAX_TOKENS), xs, ids_s, ws, a, b)
    out["both_then_right"] = True
    moe_b.layout.destroy()
    # 4) rank 1's step count itself is refused (not an int): the step's buffer cannot be known, so nothing tells
    #    rank 0, which waits out the bound naming it (the group is then unusable: rebuilt below)
    exc, el = _timed(moe.forward, x, ids, w, num_tokens_across_dp="64" if r == 1 else MAX_TOKENS)
    out["untold"] = _describe(exc, el)
    _teardown(moe)
    _rebuild_group(port2)
    moe, w13, w2 = _build()
    x, ids, w = _step_inputs(0)
    check_against_dense(moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS), x, ids, w, w13, w2)
    _teardown(moe)
    return out


def test_load_time_and_bad_input_faults_then_recreate():
    """A peer missing at weight load leaving the others hanging without naming it; a MoE step whose routing one rank
    refused left its peer waiting out the bound (and the group unusable) instead of refusing the step with it; two
    ranks refusing at different checks (one told, one not) left the ranks a call apart, every later output wrong;
    a step count refused before the step's buffer is known must still leave the peer a bounded wait naming the
    rank."""
    res = _fresh(2, load_and_input_faults, _free_port(), _free_port())
    assert not any(isinstance(x, RankFailure) for x in res), res
    load = res[0]["load"]
    assert load["type"] == "MoonEPCollectiveTimeout" and load["missing"] == [1], load
    assert load["op"] == "ReplicatedWeightLayout: all_gather(w13)" and "set-up" in load["msg"], load
    assert 1.8 <= load["elapsed"] < 2.0 + SLACK_S, load
    assert res[1]["input"]["type"] == "MoonEPInputError" and "topk_ids must be in [0, 12)" in res[1]["input"]["msg"], res[1]
    o = res[0]["input"]
    assert o["type"] == "MoonEPInputError" and "rank(s) [1] refused their input" in o["msg"], o
    assert o["elapsed"] < TIMEOUT_S, o  # told, not timed out
    assert all(x["next_step_right"] for x in res), res
    assert "topk_ids must be in" in res[0]["both"]["msg"] and "hidden states must be" in res[1]["both"]["msg"], res
    assert all(x["both_then_right"] for x in res), res
    assert res[1]["untold"]["type"] == "MoonEPInputError", res[1]
    o = res[0]["untold"]
    assert o["type"] == "MoonEPCollectiveTimeout" and o["missing"] == [1], o
    assert o["op"] == "dispatch: all_gather(tokens_per_expert)" and o["elapsed"] < TIMEOUT_S + SLACK_S, o


def symmetric_peer_refuses():
    """The symmetric transport on the host heap: rank 1 alone refuses its input (a NaN weight) and makes no further
    call; rank 0's dispatch waits for its counts."""
    from vllm_moonep.engine import Buffer

    r = dist.get_rank()
    buf = Buffer(16, H, K, E, 2, B=B, token_padding=TP, device="cpu", dtype=torch.float32, transport="symmetric",
                 heap="host", group=dist.group.WORLD)
    x, ids, w = rank_inputs(16, E, K, H, sigma=1.0, seed=31, rank=r)
    ids32 = ids.to(torch.int32)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    if r == 1:
        w = torch.full_like(w, float("nan"))
    exc, el = _timed(buf.dispatch, x.float().contiguous(), w.float().contiguous(), ids32.contiguous(), tpe)
    out = {"dispatch": _describe(exc, el)}
    exc, el = _timed(buf.destroy)  # the group failed on both ranks: local
    out["destroy"] = _describe(exc, el)
    buf.destroy()
    return out


def symmetric_all_refuse():
    """The symmetric transport on the host heap: a good step, then every rank refuses the same bad input (a NaN
    weight), then the good step again."""
    from vllm_moonep.engine import Buffer

    r = dist.get_rank()
    buf = Buffer(16, H, K, E, 2, B=B, token_padding=TP, device="cpu", dtype=torch.float32, transport="symmetric",
                 heap="host", group=dist.group.WORLD)
    x, ids, w = rank_inputs(16, E, K, H, sigma=1.0, seed=37, rank=r)
    x, w, ids32 = x.float().contiguous(), w.float().contiguous(), ids.to(torch.int32).contiguous()
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)

    def step():
        xn, _, _, plan = buf.dispatch(x, w, ids32, tpe)
        return buf.combine(plan, xn)[0]

    before = step()
    exc, el = _timed(buf.dispatch, x, torch.full_like(w, float("nan")), ids32, tpe)
    out = {"refused": _describe(exc, el)}
    exc, _ = _timed(step)
    out["after"] = type(exc).__name__ if exc else None
    out["same"] = exc is None and torch.equal(step(), before)
    buf.destroy()
    return out


def test_a_refusal_on_every_rank_keeps_the_symmetric_group():
    """Every rank refusing the same bad input must leave the symmetric buffer usable (nothing moved, nothing given
    up): a refusal that gave up on the group anyway broke it for an error every rank had raised itself."""
    for r in _fresh(2, symmetric_all_refuse):
        assert not isinstance(r, RankFailure), r.detail
        assert r["refused"]["type"] == "MoonEPInputError" and "non-finite" in r["refused"]["msg"], r
        assert r["refused"]["elapsed"] < 1.0, r  # as soon as the peer's refusal shows, not after a bound
        assert r["after"] is None and r["same"], r


def refusal_nobody_hears():
    """Rank 0 refuses its input on the collective transport while rank 1 makes no MoonEP call (it sleeps past the
    bound): the refusal frame meets no peer."""
    from vllm_moonep.engine import Buffer

    r = dist.get_rank()
    buf = Buffer(16, H, K, E, 2, B=B, token_padding=TP, device="cpu", dtype=torch.float32, transport="collective",
                 group=dist.group.WORLD)
    out = None
    if r == 0:
        x, ids, w = rank_inputs(16, E, K, H, sigma=1.0, seed=33, rank=r)
        tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
        exc, el = _timed(buf.dispatch, x.float(), torch.full_like(w, float("nan")), ids.to(torch.int32), tpe)
        out = {**_describe(exc, el), "cause": type(exc.__cause__).__name__ if exc is not None else None}
    else:
        time.sleep(TIMEOUT_S + 1.0)
    buf.destroy()
    return out


def test_a_refusal_no_peer_hears_raises_the_input_error():
    """A refusal frame that meets no peer (gone, or in another collective) timed out, and the timeout took the place
    of the rank's own input error: the input error must be what is raised, with the failed telling as its cause."""
    res = _fresh(2, refusal_nobody_hears)
    assert not any(isinstance(x, RankFailure) for x in res), res
    o = res[0]
    assert o["type"] == "MoonEPInputError" and "non-finite" in o["msg"], o
    assert o["cause"] == "MoonEPCollectiveTimeout" and TIMEOUT_S - 0.2 <= o["elapsed"] < TIMEOUT_S + SLACK_S, o


def test_a_peer_refusing_alone_on_the_symmetric_transport_is_named():
    """The symmetric transport has no frame to carry a refusal (docs/VALIDATION.md): a rank that refused its input
    alone left its peers waiting out the whole bound (300 s by default) and then blaming a rank that had not
    answered, or, had it called again within the bound, pairing with its next call. It gives up on the group
    instead: the peer's dispatch ends at once naming it and why, and both teardowns are local."""
    res = _fresh(2, symmetric_peer_refuses)
    assert not any(isinstance(x, RankFailure) for x in res), res
    assert res[1]["dispatch"]["type"] == "MoonEPInputError" and "non-finite" in res[1]["dispatch"]["msg"], res[1]
    o = res[0]["dispatch"]
    assert o["type"] == "MoonEPCollectiveTimeout" and o["missing"] == [1] and o["timed_out"] is False, o
    assert "rank 1 had given up on the group (it refused its input to a dispatch" in o["msg"], o
    assert o["elapsed"] < 1.0, o
    for r in res:
        assert r["destroy"]["type"] is None and r["destroy"]["elapsed"] < 1.0, r["destroy"]


# ------------------------------------------------------------------------------ the store's host dies
def store_host_dies():
    moe, w13, w2 = _build()
    x, ids, w = _step_inputs(0)
    moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    if dist.get_rank() == 0:
        os._exit(19)
    x, ids, w = _step_inputs(1)
    exc, el = _timed(moe.forward, x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    out = _describe(exc, el)
    _teardown(moe)
    return out


def test_store_host_dies_survivor_raises_promptly():
    """The survivor hanging when the rank that hosts the rendezvous store dies, instead of raising promptly and saying
    so."""
    res = _fresh(2, store_host_dies)
    assert isinstance(res[0], RankFailure) and res[0].exitcode == 19
    o = res[1]
    assert o["type"] == "MoonEPCollectiveTimeout", o
    assert o["op"].startswith("dispatch") and o["step"] == 1, o
    assert "rendezvous store" in o["msg"] and "global rank 0" in o["msg"], o["msg"]
    assert o["elapsed"] < TIMEOUT_S + SLACK_S, o


def _with_store_host_frozen(fn):
    """``fn()`` on rank 1 while rank 0, the rendezvous store's host, is stopped (its store thread with it);
    rank 0 is killed afterwards and never returns."""
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 0:
        time.sleep(120)
        os._exit(0)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        return fn()
    finally:
        os.kill(pids[0], signal.SIGKILL)


def store_host_frozen():
    moe, w13, w2 = _build()
    x, ids, w = _step_inputs(0)
    moe.forward(x, ids, w, num_tokens_across_dp=MAX_TOKENS)
    x, ids, w = _step_inputs(1)
    exc, el = _with_store_host_frozen(lambda: _timed(moe.forward, x, ids, w, num_tokens_across_dp=MAX_TOKENS))
    out = _describe(exc, el)
    _teardown(moe)
    return out


def test_store_host_frozen_survivor_raises_within_the_bound():
    """A survivor whose collective timed out then waited on the rendezvous store for the store's own timeout (20 s
    here, minutes by default) when the store's host is alive but frozen (stopped, or stuck tearing its group down):
    the arrival board's reads were unbounded (a CI run's teardown took 23 s against a 3 s bound). It must raise within
    the bound plus the slack and say the store did not answer."""
    res = _fresh(2, store_host_frozen)
    assert isinstance(res[0], RankFailure), res[0]
    o = res[1]
    assert o["type"] == "MoonEPCollectiveTimeout", o
    assert o["op"].startswith("dispatch") and o["step"] == 1, o
    assert "rendezvous store did not answer within" in o["msg"] and "global rank 0" in o["msg"], o["msg"]
    assert o["elapsed"] < TIMEOUT_S + SLACK_S, o


def store_host_frozen_at_release():
    coll = BoundedCollectives()  # the default group: its arrival board publishes to rank 0's store
    coll.barrier("warm-up")
    exc, elapsed = _with_store_host_frozen(lambda: _timed(coll.close))  # a healthy group: the board tidies its key
    return {"error": None if exc is None else repr(exc), "elapsed": elapsed, "live_boards": ArrivalBoard.live_boards()}


def test_release_returns_within_the_bound_when_the_store_host_is_frozen():
    """A teardown on a healthy group that waited on the rendezvous store for the store's own timeout (20 s here,
    minutes by default) when the store's host is frozen or stuck tearing down: releasing the arrival board deleted
    its key with an unbounded store call (a CI run's node-heap teardown took 23 s against a 3 s bound). The release
    must return within the board's read bound plus the publisher's join, and leave no board running."""
    res = _fresh(2, store_host_frozen_at_release)
    assert isinstance(res[0], RankFailure), res[0]
    o = res[1]
    assert not isinstance(o, RankFailure), o  # rank 1 hung in the release past the harness's own limit
    assert o["error"] is None and o["live_boards"] == 0, o
    assert o["elapsed"] < SLACK_S, o


# ------------------------------------------------------------------------------ configuration
def test_timeout_configuration_is_validated(monkeypatch):
    """A zero, negative, non-finite or non-numeric timeout (argument or VLLM_MOONEP_COLLECTIVE_TIMEOUT_S) accepted."""
    from vllm_moonep.engine.faults.timeouts import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout_s

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert collective_timeout_s() == 7.5 and collective_timeout_s(2) == 2.0
    for bad in ("0", "-1", "nan", "inf", "abc"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(MoonEPInputError, match=TIMEOUT_ENV):
            collective_timeout_s()
    monkeypatch.delenv(TIMEOUT_ENV)
    with pytest.raises(MoonEPInputError, match="timeout_s"):
        collective_timeout_s(0)


# ------------------------------------------------------------------------------ symmetric heap collectives
def symmetric_load_peer_missing(port):
    """Rank 1 never builds its symmetric layout: rank 0's heap collective is bounded and names it;
    the heap's teardown after the failure is local; a fresh set works after a new group."""
    from vllm_moonep.symmetric import SymmetricWeightLayout, make_heap

    r = dist.get_rank()
    out = {}
    w13, w2 = global_weights(E, H, I, 0)
    lw13, lw2 = local_experts(w13, w2, r, 2)
    if r == 0:
        heap = make_heap("host")  # both ranks make the heap (collective) ...
        exc, el = _timed(SymmetricWeightLayout, lw13, lw2, E, B, heap=heap)  # ... only rank 0 allocates
        out["load"] = _describe(exc, el)
        heap.close(force=True)  # local only: the group is broken, the peer may be gone
        out["closed"] = heap.closed and heap.live() == []
    else:
        heap = make_heap("host")
        time.sleep(TIMEOUT_S + 1.0)
        heap.close(force=True)
    _rebuild_group(port)
    heap = make_heap("host")
    lay = SymmetricWeightLayout(lw13, lw2, E, B, heap=heap)
    lay.destroy()
    heap.close()
    out["rebuilt"] = heap.live() == []
    return out


def test_symmetric_heap_collectives_are_bounded():
    """A symmetric heap's collectives waiting forever for a peer that never builds its layout."""
    res = _fresh(2, symmetric_load_peer_missing, _free_port())
    assert not any(isinstance(x, RankFailure) for x in res), res
    load = res[0]["load"]
    assert load["type"] == "MoonEPCollectiveTimeout" and load["missing"] == [1], load
    assert "HostHeap" in load["op"], load
    assert load["elapsed"] < TIMEOUT_S + SLACK_S, load
    assert res[0]["closed"] and res[0]["rebuilt"] and res[1]["rebuilt"]


def layout_set_peer_leaves_mid_teardown():
    """Both ranks build a symmetric-shared LayoutSet; rank 1 then stops (never tears down) while
    rank 0 destroys its set: the first free's collective gives up within the bound, and the rest of
    the set still goes (locally)."""
    from vllm_moonep.layouts import build_layouts

    r = dist.get_rank()
    local = []
    for n in range(2):
        w13, w2 = global_weights(E, H, I, 30 + n)
        local.append(local_experts(w13, w2, r, 2))
    layouts = build_layouts("symmetric-shared", local, E, B, heap_kind="host")
    heap = layouts.heap
    if r == 1:
        time.sleep(TIMEOUT_S + SLACK_S + 1.0)
        return {}
    exc, elapsed = _timed(layouts.destroy)
    out = _describe(exc, elapsed)
    out["heap_released"] = heap.closed and heap.live() == []
    out["layers_destroyed"] = [lay._destroyed for lay in layouts.layouts]
    exc2, _ = _timed(layouts.destroy)  # the retry after the error: nothing left, no error
    out["retry"] = type(exc2).__name__ if exc2 else None
    return out


def test_layout_set_teardown_finishes_when_a_peer_leaves_mid_teardown():
    """A peer gone during teardown: the first heap free timed out and the set's teardown stopped there,
    keeping every later layer's and slot pool's memory; its heap.close() then raised 'leaked' over the
    real error."""
    res = _fresh(2, layout_set_peer_leaves_mid_teardown)
    r0 = res[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["type"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1], r0
    assert r0["elapsed"] < TIMEOUT_S + SLACK_S, r0
    assert r0["heap_released"] and r0["layers_destroyed"] == [True, True] and r0["retry"] is None, r0


def heap_force_close_peer_leaves():
    """Rank 1 stops after both ranks allocated; rank 0 force-closes its heap: the first free's
    collective gives up within the bound, and the rest is released and the heap closed anyway."""
    from vllm_moonep.engine.heaps import make_heap

    heap = make_heap("host")
    for n in range(3):
        heap.allocate((16,), torch.int32, f"a{n}")
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + SLACK_S + 1.0)
        return {}
    exc, elapsed = _timed(heap.close, force=True)
    out = _describe(exc, elapsed)
    out["closed"] = heap.closed and heap.live() == []
    return out


def test_heap_force_close_finishes_when_a_peer_leaves():
    """heap.close(force=True) with a peer gone stopped at its first free: the heap stayed open holding
    the later allocations (a buffer's teardown force-closes the heap it made this way)."""
    r0 = _fresh(2, heap_force_close_peer_leaves)[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["type"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1], r0
    assert r0["elapsed"] < TIMEOUT_S + SLACK_S and r0["closed"], r0


# ------------------------------------------------------------------------------ symmetric transport
def symmetric_rank_stops_calling(then):
    """Rank 1 skips dispatch #1; rank 0's wait for its counts must give up within the bound and name it.
    ``then``: rank 0 tries another dispatch before its teardown, or tears down at once; rank 1, past the
    bound, calls dispatch #1 late before its teardown, or tears down at once."""
    from vllm_moonep.engine import Buffer

    r, R = dist.get_rank(), dist.get_world_size()
    S, Hs, Ks, Es = 8, 16, 2, 8
    buf = Buffer(S, Hs, Ks, Es, R, B=Es // R, token_padding=4, device="cpu", transport="symmetric")
    g = torch.Generator().manual_seed(r)
    ids = torch.randint(0, Es, (S, Ks), generator=g, dtype=torch.int32)
    w = torch.rand(S, Ks, generator=g)
    x = torch.randn(S, Hs, generator=g).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=Es).to(torch.int32)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)  # step 0: both ranks
    buf.combine(plan, xn)
    out = {}
    if r == 0:
        exc, elapsed = _timed(buf.dispatch, x, w, ids, tpe)  # step 1: rank 1 never comes
        out = _describe(exc, elapsed)
        if then == "dispatch":
            exc2, _ = _timed(buf.dispatch, x, w, ids, tpe)  # and the buffer refuses further steps
            out["after"] = type(exc2).__name__ if exc2 else None
        heap = buf._sym.heap
        exc3, out["teardown_s"] = _timed(buf.destroy)  # local after the failure
        out["teardown"] = type(exc3).__name__ if exc3 else None
        out["heap_released"] = heap.closed and heap.live() == []
    else:
        time.sleep(TIMEOUT_S + SLACK_S + 1.0)
        if then == "dispatch":
            exc, elapsed = _timed(buf.dispatch, x, w, ids, tpe)
            out["late"] = _describe(exc, elapsed)
        heap = buf._sym.heap
        exc, elapsed = _timed(buf.destroy)
        out.update(teardown=_describe(exc, elapsed), heap_released=heap.closed and heap.live() == [])
    return out


@pytest.mark.parametrize("then", ["dispatch", "destroy"])
def test_symmetric_transport_wait_is_bounded_and_names_the_peer(then):
    """A device/host-side signal wait that hangs forever, or reports without naming the peer that
    never signalled, when a rank stops calling. Then teardown: with no call after the failed one,
    the buffer did not know its group had failed, so destroy() waited on a collective free for the
    absent peer (until it came, or the bound) instead of releasing its memory at once."""
    res = _fresh(2, symmetric_rank_stops_calling, then)
    r0 = res[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["type"] == "MoonEPCollectiveTimeout", r0
    assert r0["missing"] == [1] and "token counts" in r0["op"], r0
    assert "first rank 1" in r0["msg"] and "timed out" in r0["msg"]
    assert TIMEOUT_S <= r0["elapsed"] <= TIMEOUT_S + SLACK_S, r0
    if then == "dispatch":
        assert r0["after"] in ("MoonEPStateError", "MoonEPCollectiveTimeout"), r0
    assert r0["teardown"] is None and r0["heap_released"] and r0["teardown_s"] < 1.0, r0
    # rank 0 gave up on the group, and said so in rank 1's signal memory. A late dispatch on rank 1 that wrote its
    # counts, took rank 0's (sent before it gave up) and then waited out another full bound for rows that never
    # come, naming rank 0 as absent; or a teardown whose collective free waited the bound for rank 0 (gone): both
    # now end at once, the dispatch naming rank 0 as the rank that gave up, the teardown local and quiet
    r1 = res[1]
    assert not isinstance(r1, RankFailure), r1
    if then == "dispatch":
        late = r1["late"]
        assert late["type"] == "MoonEPCollectiveTimeout" and late["timed_out"] is False, late
        assert "rank 0 had given up on the group" in late["msg"] and "token counts" in late["op"], late
        assert late["elapsed"] < 1.0, late
    assert r1["teardown"]["type"] is None and r1["teardown"]["elapsed"] < 1.0 and r1["heap_released"], r1


# ------------------------------------------------------------------------------ on CUDA, both transports
def _cuda_buffer_and_inputs(transport: str, **buffer_kw):
    """A 16-token buffer of 2 slots on this rank's GPU over the default group, and this rank's inputs for it."""
    from vllm_moonep.engine import Buffer
    from vllm_moonep.testing.routing import route

    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    S, Hs, Ks, Es = 16, 128, 2, 8
    buf = Buffer(S, Hs, Ks, Es, R, B=2, token_padding=8, device=dev, transport=transport, timeout_s=TIMEOUT_S,
                 **buffer_kw)
    ids, w = route(S, Es, Ks, sigma=1.0, seed=3, rank=r)
    x = torch.randn(S, Hs, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=Es).to(torch.int32)
    return buf, tuple(t.to(dev) for t in (x, w, ids, tpe))


def cuda_rank_stops_calling(transport):
    """Both ranks run step 0 on CUDA tensors; then rank 1 stops calling. Rank 0's step 1 must give
    up within the bound naming rank 1 (the collective transport raises from the collective; the
    symmetric one's device-side wait records, and ``check_errors(sync=True)`` raises), and both
    ranks' teardown must release their memory within the bound."""
    r = dist.get_rank()
    buf, (x, w, ids, tpe) = _cuda_buffer_and_inputs(transport)
    xn, _, _, plan = buf.dispatch(x, w, ids, tpe)
    buf.combine(plan, xn)
    torch.cuda.synchronize()
    if r == 0:
        def step():
            buf.dispatch(x, w, ids, tpe)
            buf.check_errors(sync=True)

        exc, elapsed = _timed(step)
        out = _describe(exc, elapsed)
        exc2, out["teardown_s"] = _timed(buf.destroy)
        out["teardown"] = type(exc2).__name__ if exc2 else None
    else:
        time.sleep(TIMEOUT_S + SLACK_S + 1.0)
        exc, elapsed = _timed(buf.destroy)
        out = {"teardown": _describe(exc, elapsed)}
    return out


def _cuda_fault_params():
    placements = (("shared-gpu", {}, pytest.mark.gpu),
                  ("gpu-per-rank", {"backend": "nccl", "device": "cuda"}, pytest.mark.multi_gpu))
    return [pytest.param(t, launch, marks=mark, id=f"{t}-{where}")
            for t in ("symmetric", "collective") for where, launch, mark in placements]


@pytest.mark.parametrize("transport,launch", _cuda_fault_params())
def test_rank_stops_calling_on_cuda_is_bounded_and_names_the_peer(transport, launch):
    """On CUDA (every CUDA engine case runs both transports): a wait that hangs when a rank stops
    calling, one that reports without naming it, or a teardown that then waits on the absent peer."""
    res = run_on_ranks(2, cuda_rank_stops_calling, transport, env=ENV, fresh=True, allow_failures=True,
                       timeout_s=120, **launch)
    r0 = res[0]
    assert not isinstance(r0, RankFailure), r0
    assert r0["type"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1], r0
    assert TIMEOUT_S - 0.2 <= r0["elapsed"] < TIMEOUT_S + SLACK_S, r0
    assert r0["teardown"] is None and r0["teardown_s"] < 1.0, r0
    r1 = res[1]
    assert not isinstance(r1, RankFailure), r1
    assert r1["teardown"]["elapsed"] < TIMEOUT_S + SLACK_S, r1


def cuda_rank_gives_up_under_graph_replay():
    """Both ranks capture one symmetric step (dispatch + combine) in a CUDA graph, as vLLM does, and replay it
    once together; then rank 1 stalls past the bound while rank 0 replays three more steps with no host check
    between (a graph replay runs none). Returns each rank's error after its replays, their timings, and the
    teardown."""
    r = dist.get_rank()
    # no host-side input check: it reads the ids on the host, which a capture refuses (the MoE step checks its own)
    buf, (x, w, ids, tpe) = _cuda_buffer_and_inputs("symmetric", check_inputs=False)
    for _ in range(2):  # compiles, and makes the buffer's own eager graphs
        xn, _, _, plan = buf.dispatch(x, w, ids, tpe)
        buf.combine(plan, xn)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        xn, _, _, plan = buf.dispatch(x, w, ids, tpe)
        buf.combine(plan, xn)
    g.replay()
    torch.cuda.synchronize()
    out = {}
    if r == 0:
        t0 = time.monotonic()
        g.replay()  # rank 1 is not there: the counts wait times out
        torch.cuda.synchronize()
        out["first_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        out["more_s"] = time.monotonic() - t0
    else:
        time.sleep(2 * TIMEOUT_S + SLACK_S)
        t0 = time.monotonic()
        g.replay()  # late: rank 0 has given up, and replayed three steps since
        torch.cuda.synchronize()
        out["late_s"] = time.monotonic() - t0
    exc, _ = _timed(buf.check_errors, sync=True)
    out.update(_describe(exc, 0.0))
    del g
    exc, out["teardown_s"] = _timed(buf.destroy)
    out["teardown"] = type(exc).__name__ if exc else None
    return out


def cuda_rank_refuses():
    """One symmetric step on CUDA together; then rank 1 refuses its input to the next dispatch (``refuse_step``, as
    the MoE step does for its own checks) while rank 0 dispatches."""
    r = dist.get_rank()
    buf, (x, w, ids, tpe) = _cuda_buffer_and_inputs("symmetric")
    xn, _, _, plan = buf.dispatch(x, w, ids, tpe)
    buf.combine(plan, xn)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.monotonic()
    if r == 0:
        def step():
            buf.dispatch(x, w, ids, tpe)
            buf.check_errors(sync=True)

        exc, _ = _timed(step)
    else:
        exc, _ = _timed(buf.refuse_step)
    out = _describe(exc, time.monotonic() - t0)
    exc, out["teardown_s"] = _timed(buf.destroy)
    out["teardown"] = type(exc).__name__ if exc else None
    return out


@pytest.mark.parametrize("launch", [pytest.param({}, marks=pytest.mark.gpu, id="shared-gpu"),
                                    pytest.param({"backend": "nccl", "device": "cuda"}, marks=pytest.mark.multi_gpu,
                                                 id="gpu-per-rank")])
def test_a_rank_that_gave_up_stops_writing_into_its_peers_under_graph_replay(launch):
    """A rank whose device wait timed out went on replaying its steps (no host check runs between replays): it
    wrote each later step's counts and rows into a peer still in the failed step, whose waits its signals then
    satisfied, so the late peer returned another step's rows with a clean error board; and each of the failed
    rank's later waits still spun before leaving. Now the rank that gave up says so in every peer's signal
    memory and writes nothing more: the late peer's step ends at once naming it, and the later replays are
    instant. Teardown is local on both."""
    res = run_on_ranks(2, cuda_rank_gives_up_under_graph_replay, env=ENV, fresh=True, allow_failures=True,
                       timeout_s=120, **launch)
    r0, r1 = res
    for rr in res:
        assert not isinstance(rr, RankFailure), rr.detail
    assert r0["type"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1] and r0["timed_out"], r0
    assert TIMEOUT_S - 0.2 <= r0["first_s"] < TIMEOUT_S + SLACK_S and r0["more_s"] < 0.5, r0
    assert r1["type"] == "MoonEPCollectiveTimeout" and r1["timed_out"] is False, r1
    assert "rank 0 had given up on the group" in r1["msg"] and "token counts" in r1["op"], r1
    assert r1["late_s"] < 0.5, r1
    for rr in res:
        assert rr["teardown"] is None and rr["teardown_s"] < 1.0, rr


@pytest.mark.parametrize("launch", [pytest.param({}, marks=pytest.mark.gpu, id="shared-gpu"),
                                    pytest.param({"backend": "nccl", "device": "cuda"}, marks=pytest.mark.multi_gpu,
                                                 id="gpu-per-rank")])
def test_a_refusal_on_the_symmetric_transport_reaches_the_peer_on_cuda(launch):
    """A one-rank refusal on the GPU symmetric transport: the peer's device wait ran out the bound and blamed a rank
    that had not answered. The refusing rank's give-up, written into the peer's signal memory through its peer view,
    must end the peer's step at once, naming it and why."""
    res = run_on_ranks(2, cuda_rank_refuses, env=ENV, fresh=True, allow_failures=True, timeout_s=120, **launch)
    r0, r1 = res
    assert not isinstance(r0, RankFailure) and not isinstance(r1, RankFailure), res
    assert r0["type"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1] and r0["timed_out"] is False, r0
    assert "it refused its input to a dispatch" in r0["msg"] and r0["elapsed"] < TIMEOUT_S - 1.0, r0
    assert r1["type"] is None, r1  # refuse_step tells; the caller raises its own input error
    for rr in res:
        assert rr["teardown"] is None and rr["teardown_s"] < 1.0, rr


# ------------------------------------------------------------------------------ allocation refused
def heap_allocation_refused_on_one_rank():
    """Rank 1 runs under a real address-space limit, so its allocator refuses a 1 GiB allocation
    that rank 0's accepts; then both ranks allocate something small and read each other's."""
    import resource

    from vllm_moonep.engine.heaps import make_heap

    r = dist.get_rank()
    heap = make_heap("host", staging=False)
    if r == 1:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
    out = {}
    # 1 GiB: rank 1 cannot even map its own file (the local part, before any collective)
    exc, out["elapsed"] = _timed(heap.allocate, (1 << 30,), torch.uint8, "too_big")
    out["big"] = (type(exc).__name__, str(exc)) if exc else None
    # 512 MiB: every rank maps its own file, then rank 1 cannot map its peer's (inside the publish)
    exc, out["elapsed_peer"] = _timed(heap.allocate, (512 << 20,), torch.uint8, "peer_too_big")
    out["peer"] = (type(exc).__name__, str(exc)) if exc else None
    small = heap.allocate((4,), torch.int32, "small")
    small.tensor.fill_(r + 1)
    heap.barrier()
    out["small"] = heap.peer_view(small, 1 - r).tolist()
    heap.free(small)
    heap.close()
    return out


def test_heap_allocation_refused_on_one_rank_fails_on_every_rank_and_the_heap_stays_usable():
    """A rank whose allocator refused (its own memory, or mapping a peer's) left its peer in the
    publishing collective until a watchdog killed the job (seen on 2 H200s: a 2-minute NCCL hang
    building a Kimi-K2 buffer); every rank must raise one error naming the rank and the cause,
    promptly, and allocate again afterwards."""
    res = _fresh(2, heap_allocation_refused_on_one_rank)
    assert not any(isinstance(x, RankFailure) for x in res), res
    for x in res:
        for case, tag, took in (("big", "'too_big'", "elapsed"), ("peer", "'peer_too_big'", "elapsed_peer")):
            assert x[case] is not None and x[case][0] == "MoonEPUnavailableError", x
            assert "rank 1:" in x[case][1] and "rank 0:" not in x[case][1] and tag in x[case][1], x
            assert x[took] < TIMEOUT_S, x
    assert res[0]["small"] == [2] * 4 and res[1]["small"] == [1] * 4
