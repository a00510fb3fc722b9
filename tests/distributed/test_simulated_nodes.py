"""Simulated nodes (``VLLM_MOONEP_RANKS_PER_NODE``) and the hybrid transport on real ranks.

4 CPU ranks as 2 simulated nodes of 2 (the CI form; the same functions run on CUDA ranks below):
the hybrid transport writes rows one-sided to the node peer (host heap over the node's ranks)
and sends the rest by all-to-all, in the same dispatch and combine. Checked against the
contract's planner transcription (``tests/reference_planner.py``), the dense reference, and the
collective transport bit for bit; bad input refused on every rank; a node peer that never
signals named within the bound; the symmetric layout's prefetch across simulated nodes by the
host heap's emulated RMA (a peer view across nodes refused); ``moonep-ab`` on 2 simulated nodes.
Agreement on every rank: uneven nodes leave torch's group names in step (a later ``new_group``
works), a node heap failing on one node or an invalid ``VLLM_MOONEP_RANKS_PER_NODE`` on one rank
raises on every rank promptly, a node peer that stops before combine is named in the combine phase;
CUDA graphs stay off only where simulated nodes split the EP group.

Rank functions run in the cached pools of ``tests.conftest.ranks``; ``call_with_env`` (``vllm_moonep.testing.launch``) sets the
variables of one case inside the rank processes and restores them after, so every case here
shares one pool of 4 processes.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.distributed.test_engine import (
    bad_inputs_then_valid,
    combine_accumulates_in_fp32,
    per_expert_scale,
    prefetch_slots,
    traceable_rows,
)
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.engine import Buffer, MoonEPCollectiveTimeout, MoonEPInputError, MoonEPUnavailableError
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV, NodeMap, resolve_nodes
from vllm_moonep.testing.launch import RankFailure, call_with_env, launched_world_size, run_on_ranks
from vllm_moonep.testing.routing import route

#: the transport under test in test_engine's rank functions, and 2 simulated nodes of 2 ranks
HYBRID = {"VLLM_MOONEP_TEST_TRANSPORT": "hybrid", RANKS_PER_NODE_ENV: "2"}
CUDA = {"VLLM_MOONEP_TEST_DEVICE": "cuda"}

spawned_only = pytest.mark.skipif(launched_world_size() is not None, reason="needs spawned ranks (4 on one host)")


def _dev():
    return torch.device(os.environ.get("VLLM_MOONEP_TEST_DEVICE", "cpu"))


def _inputs(S, E, K, H, sigma, seed, rank, dtype):
    ids, w = route(S, E, K, sigma=sigma, seed=seed, rank=rank)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(seed * 31 + rank)).to(dtype)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    d = _dev()
    return x.to(d), w.to(d), ids.to(d), tpe.to(d)


# ------------------------------------------------------------------------------ node identity
def test_node_map_blocks_and_refusals():
    """A simulated node map that does not split ranks into equal blocks, or lets a simulated node span
    real hosts (its ranks could not map each other's memory), accepted."""
    m = NodeMap.blocks(4, 2)
    assert m.node_of == (0, 0, 1, 1) and m.num_nodes == 2 and m.node_ranks(3) == (2, 3) and m.shares_nodes
    assert not NodeMap.blocks(4, 1).shares_nodes and NodeMap.blocks(4, 4).num_nodes == 1
    assert NodeMap.from_hosts([7, 7, 9, 9, 7]).node_of == (0, 0, 1, 1, 0)
    with pytest.raises(MoonEPInputError, match="does not divide the group's 4 ranks"):
        NodeMap.blocks(4, 3)
    with pytest.raises(MoonEPInputError, match="spans real hosts"):
        resolve_nodes([1, 2, 2, 2], 2)
    assert resolve_nodes([1, 1, 2, 2], 2).simulated and resolve_nodes([1, 1, 2, 2], None).node_of == (0, 0, 1, 1)


def test_auto_and_explicit_transports_across_nodes():
    """auto picking a transport that cannot reach peers on other nodes (symmetric), or losing the
    one-sided path for node peers (collective where hybrid applies); symmetric across nodes accepted."""
    from vllm_moonep.engine import resolve_transport

    two_by_two, alone, one = NodeMap.blocks(4, 2), NodeMap.blocks(4, 1), NodeMap.blocks(4, 4)
    assert resolve_transport("auto", "cuda", nodes=two_by_two)[0] == "hybrid"
    assert resolve_transport("auto", "cuda", nodes=alone)[0] == "collective"
    assert resolve_transport("auto", "cuda", nodes=one)[0] == "symmetric"
    assert resolve_transport("auto", "cpu", nodes=two_by_two)[0] == "collective"
    assert resolve_transport("collective", "cuda", nodes=two_by_two)[0] == "collective"
    assert resolve_transport("hybrid", "cpu", nodes=one)[0] == "hybrid"
    with pytest.raises(MoonEPInputError, match="transport='symmetric' needs every peer"):
        resolve_transport("symmetric", "cuda", nodes=two_by_two)


def config_refusals():
    """Every rank must refuse together: symmetric across simulated nodes, a block size that does not
    divide the group, ranks that disagree on the block size."""
    r = dist.get_rank()
    out = {}
    for name, env, kw in (("symmetric", {RANKS_PER_NODE_ENV: "2"}, {"transport": "symmetric"}),
                          ("indivisible", {RANKS_PER_NODE_ENV: "3"}, {"transport": "hybrid"}),
                          ("disagree", {RANKS_PER_NODE_ENV: "2" if r < 2 else "4"}, {"transport": "hybrid"})):
        try:
            call_with_env(env, Buffer, 16, 8, 2, 8, 4, None, 4, 2, device="cpu", **kw)
            out[name] = ""
        except MoonEPInputError as exc:
            out[name] = str(exc)
    return out


@spawned_only
def test_bad_node_configurations_refused_on_every_rank():
    """A buffer built with transport='symmetric' across simulated nodes, an indivisible block size, or
    ranks disagreeing on it (each would plan peers into memory it cannot reach) instead of every rank
    raising one clear error."""
    res = ranks(4, config_refusals)
    for o in res:
        assert "transport='symmetric' needs every peer" in o["symmetric"], o
        assert "does not divide the group's 4 ranks" in o["indivisible"], o
        assert "differs across ranks" in o["disagree"] and "VLLM_MOONEP_RANKS_PER_NODE" in o["disagree"], o


# ------------------------------------------------------------------------------ the hybrid transport
def same_as_collective(S, H, K, E, B, tp, sigmas, seed):
    """The hybrid and collective transports on the same inputs, several steps of other routing: the
    shard (real and padding rows), cu_seqlens, slots, and combine's outputs and weights must be equal
    bit for bit. Also the shard's rows past the plan keep a sentinel (nobody wrote outside the plan)."""
    r, R = dist.get_rank(), dist.get_world_size()
    dev = _dev()
    hyb = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=dev, transport="hybrid")
    col = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=dev, transport="collective")
    assert hyb.transport_name == "hybrid" and col.transport_name == "collective"
    node = hyb.nodes.node_ranks(r)
    heap = hyb._hyb.heap
    # the receive buffers live on a heap over this node's ranks only (one-sided writes stay inside a node)
    assert (heap is None) == (len(node) == 1) and (heap is None or heap.world_size == len(node))
    stats = {"local": 0, "remote": 0}
    for step, sigma in enumerate(sigmas):
        x, w, ids, tpe = _inputs(S, E, K, H, sigma, seed + step, r, torch.bfloat16)
        # sentinel in every shard row of this rank before the step: rows past cu[-1] must keep it
        hyb._hyb.buf["recv_x"].fill_(77.0)
        dist.barrier()  # every rank filled its own before any row moves
        xh, wh, cuh, ph = hyb.dispatch(x, w, ids, tpe)
        xc, wc, cuc, pc = col.dispatch(x, w, ids, tpe)
        used = int(cuc[-1])
        assert torch.equal(cuh, cuc) and torch.equal(ph.experts_to_copy, pc.experts_to_copy)
        assert torch.equal(xh[:used].view(torch.int16), xc[:used].view(torch.int16)), "shard rows differ"
        assert torch.equal(wh[:used], wc[:used]), "route weights differ"
        assert bool((xh[used:] == 77.0).all()), "a row past the plan's last segment was written"
        flows = ph.global_plan.flows().cpu()
        stats["local"] += sum(int(flows[s, r]) for s in node if s != r)
        stats["remote"] += sum(int(flows[s, r]) for s in range(R) if s not in node)
        # a row-specific output (weight and position dependent), bf16
        y = (xh.float() * (1.0 + 3.0 * wh[:, None]) + 0.25).to(torch.bfloat16)
        yc = y.clone()  # the hybrid shard is the heap buffer: the collective gets its own copy
        oh, rwh, _ = hyb.combine(ph, y, wh)
        oc, rwc, _ = col.combine(pc, yc, wc)
        assert torch.equal(oh.view(torch.int16), oc.view(torch.int16)), "combine outputs differ from the collective"
        assert torch.equal(rwh, rwc) and torch.equal(rwh.cpu(), w.cpu())
    hyb.destroy()
    col.destroy()
    return stats


@spawned_only
@pytest.mark.parametrize("rpn", [2, 1, 4], ids=["2x2", "4x1", "1x4"])
def test_hybrid_is_bit_identical_to_collective(rpn):
    """A row written one-sided to the wrong row or rank, a local peer routed through the all-to-all
    (or a remote one through a peer write), stale rows or signals reused across steps, or a combine
    that sums in another order than the collective transport (2x2: both paths; 4x1: every peer remote,
    no heap; 1x4: every peer on the node, no all-to-all)."""
    stats = ranks(4, call_with_env, {RANKS_PER_NODE_ENV: str(rpn)}, same_as_collective, 32, 64, 4, 16, 4, 8,
                  [0.0, 2.5, 1.0], 3)
    local, remote = sum(s["local"] for s in stats), sum(s["remote"] for s in stats)
    assert (local > 0) == (rpn > 1) and (remote > 0) == (rpn < 4), stats


def slow_node_peer(S, H, K, E, B, tp, seed):
    """Rank 1 starts moving its rows 0.4 s late, in dispatch and then in combine: every rank's shard,
    read the moment its dispatch returns, and its combine's output must still be complete (the
    node-local waits, not luck, order the one-sided writes before the reads)."""
    r, R = dist.get_rank(), dist.get_world_size()
    dev = _dev()
    hyb = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=dev, transport="hybrid")
    col = Buffer(S, H, K, E, R, B=B, token_padding=tp, device=dev, transport="collective")
    if r == 1:
        inner = hyb._hyb
        for name in ("dispatch", "combine"):
            def late(*args, _f=getattr(inner, name)):
                time.sleep(0.4)
                return _f(*args)
            setattr(inner, name, late)
    x, w, ids, tpe = _inputs(S, E, K, H, 2.0, seed, r, torch.bfloat16)
    xh, wh, cuh, ph = hyb.dispatch(x, w, ids, tpe)
    snap_x, snap_w = xh.clone(), wh.clone()  # before any other collective could order the peers' writes
    xc, wc, cuc, pc = col.dispatch(x, w, ids, tpe)
    used = int(cuc[-1])
    ok_dispatch = torch.equal(snap_x[:used].view(torch.int16), xc[:used].view(torch.int16)) and torch.equal(
        snap_w[:used], wc[:used])
    y = (xh.float() * 2.0 + 1.0).to(torch.bfloat16)
    yc = (xc.float() * 2.0 + 1.0).to(torch.bfloat16)
    oh, _, _ = hyb.combine(ph, y)
    oh = oh.clone()
    oc, _, _ = col.combine(pc, yc)
    ok_combine = torch.equal(oh.view(torch.int16), oc.view(torch.int16))
    hyb.destroy()
    col.destroy()
    return ok_dispatch, ok_combine


@spawned_only
@pytest.mark.parametrize("rpn", [4, 2], ids=["1x4", "2x2"])
def test_a_slow_node_peer_is_waited_for(rpn):
    """A dispatch or combine that returns before a slow node peer's one-sided rows have landed (a
    missing or too-early node-local wait: the shard or the output then misses that peer's rows). 1x4:
    no all-to-all that could order the writes by accident."""
    res = ranks(4, call_with_env, {RANKS_PER_NODE_ENV: str(rpn)}, slow_node_peer, 32, 64, 4, 16, 4, 8, 13)
    assert res == [(True, True)] * 4, res


@spawned_only
@pytest.mark.parametrize("sigma", [0.0, 2.5])
def test_rows_land_where_the_plan_says_hybrid(sigma):
    """A row at another position than the contract's planner gives it, a padding row not zeroed, or a
    weight that did not travel with its row, on 2 simulated nodes (test_engine's check)."""
    slots = ranks(4, call_with_env, HYBRID, traceable_rows, 24, 16, 4, 16, 4, 8, sigma, 11)
    if sigma > 0:
        assert slots[0] > 0, "skewed routing must use prefetch slots"


@spawned_only
def test_dense_scale_fp32_sum_prefetch_and_bad_inputs_hybrid():
    """On 2 simulated nodes: an output combined into the wrong token (dense check), a sum of bf16
    partials instead of one fp32 rounding, a slot filled with the wrong expert, or a rejected call that
    left a half-sent step behind."""
    assert ranks(4, call_with_env, HYBRID, per_expert_scale, 40, 32, 3, 16, 4, 16, 3.0, 5)[0] > 0
    res = ranks(4, call_with_env, HYBRID, combine_accumulates_in_fp32, 64, 64, 3, 24)
    assert all(exact for exact, _ in res) and any(d for _, d in res)
    assert any(any(u) for u in ranks(4, call_with_env, HYBRID, prefetch_slots, 4, 4, 64, 4, 8, 3.0, 21))
    assert ranks(4, call_with_env, HYBRID, bad_inputs_then_valid) == [9] * 4


def counts_short_on_one_rank_hybrid():
    """Rank 2's counts miss S*K (an id >= E on CUDA, where the count drops it): every rank must refuse
    before any row moves (no peer write, no all-to-all), and the next step must be right."""
    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 16, 8, 2, 8
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device=_dev(), check_inputs=False, transport="hybrid")
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 5, r, torch.bfloat16)
    bad = tpe.clone()
    if r == 2:
        bad[int(ids[0, 0])] -= 1
    shard = buf._hyb.buf["recv_x"]
    shard.fill_(5.0)
    dist.barrier()
    with pytest.raises(MoonEPInputError, match=r"rank\(s\) \[2\] does not sum to S\*K"):
        buf.dispatch(x, w, ids, bad)
    dist.barrier()  # every rank refused: had any peer moved rows, they would be in the shard now
    untouched = bool((shard == 5.0).all())
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    out, rw, _ = buf.combine(plan, xn, wn)
    ok = torch.equal(rw, w) and torch.allclose(out.float(), (K * x.float()).to(torch.bfloat16).float(), rtol=1e-2,
                                                 atol=1e-2)
    buf.destroy()
    return untouched, ok


@spawned_only
def test_bad_counts_refused_on_every_rank_before_a_row_moves_hybrid():
    """One rank's bad counts (no host check, the GPU default) planned and moved on some ranks while
    others refused (rows written into a peer that then raised), instead of every rank refusing."""
    assert ranks(4, call_with_env, {RANKS_PER_NODE_ENV: "2"}, counts_short_on_one_rank_hybrid) == [(True, True)] * 4


# ------------------------------------------------------------------------------ the symmetric layout
def symmetric_layout_across_nodes(B):
    """A MoE step with the symmetric layout (host heap over the EP group) and the hybrid transport on 2
    simulated nodes: prefetch reads owners on the other node by the heap's emulated RMA."""
    from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
    from vllm_moonep.symmetric import SymmetricWeightLayout
    from vllm_moonep.testing.weights import local_experts

    r, R = dist.get_rank(), dist.get_world_size()
    E, H, I, K = 16, 128, 128, 4
    w13, w2 = global_weights(E, H, I, 4)
    lw13, lw2 = local_experts(w13, w2, r, R)
    if B < E // R:  # overflow reads the owners' rows in place: impossible across nodes, refused
        with pytest.raises(MoonEPInputError, match="cannot address every peer"):
            SymmetricWeightLayout(lw13, lw2, E, B, None, heap="host")
        return None
    layout = SymmetricWeightLayout(lw13, lw2, E, B, None, heap="host")
    heap = layout.heap
    other = (r + 2) % R  # a rank of the other simulated node
    assert not heap.peers_addressable and heap.addressable(r ^ 1) and not heap.addressable(other)
    with pytest.raises(MoonEPUnavailableError, match=f"rank {other}'s memory is not addressable"):
        heap.peer_view(layout._w13, other)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=16, device="cpu",
                                 transport="hybrid"), 128, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="reference")
    remote_slots = 0
    for step in range(2):
        x, ids, w = rank_inputs(60 + 9 * step, E, K, H, sigma=2.5, seed=40 + step, rank=r)
        out = moe.forward(x, ids, w)
        check_against_dense(out, x, ids, w, w13, w2)
        etc = moe.last.experts_to_copy[r].tolist()
        remote_slots += sum(1 for e in etc if e >= 0 and not heap.addressable(e // (E // R)))
    pool.destroy()
    layout.destroy()
    return remote_slots


@spawned_only
@pytest.mark.parametrize("B", [4, 2])
def test_symmetric_layout_across_simulated_nodes(B):
    """The symmetric layout reading an owner on another node through a peer view (possible only on one
    host; across real nodes it fails), a slot filled wrong by the RMA path, or a step off the dense
    reference; with B < E/R the layout must refuse (overflow reads need every peer addressable)."""
    res = ranks(4, call_with_env, HYBRID, symmetric_layout_across_nodes, B)
    if B == 4:
        assert sum(res) > 0, "no slot was filled from the other simulated node: the RMA path did not run"


# ------------------------------------------------------------------------------ faults
TIMEOUT_S = 3.0
SLACK_S = 2.0


def node_peer_never_signals():
    """Rank 1 (rank 0's node peer) writes its rows at step 1 but never signals, as a process that
    died between the two would; rank 0's wait must give up within the bound naming rank 1. A second
    buffer (another capacity, as a pool holds) is where rank 1 calls next."""
    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 8, 16, 2, 8
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device="cpu", transport="hybrid")
    other = Buffer(2 * S, H, K, E, R, B=2, token_padding=4, device="cpu", transport="hybrid")
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 9, r, torch.bfloat16)
    x2, w2, ids2, tpe2 = _inputs(2 * S, E, K, H, 1.0, 10, r, torch.bfloat16)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)  # step 0: everyone
    buf.combine(plan, xn)
    out = {}

    def outcome(key, fn):  # None when fn returned, else (error type, message, its missing ranks); and the time
        t0 = time.monotonic()
        try:
            fn()
            out[key] = None
        except Exception as exc:
            out[key] = (type(exc).__name__, str(exc), getattr(exc, "missing", None))
        out[f"{key}_s"] = time.monotonic() - t0

    if r == 1:
        buf._hyb._signal = lambda phase: None
    outcome("dispatch", lambda: buf.dispatch(x, w, ids, tpe))
    if r == 0:
        outcome("after", lambda: buf.dispatch(x, w, ids, tpe))
    if r == 1:  # its step completed; once rank 0 has given up, its next call (on the other buffer) is told at once
        time.sleep(TIMEOUT_S + SLACK_S)  # a step that starts after the give-up (one already in the all-gather waits)
        outcome("next", lambda: other.dispatch(x2, w2, ids2, tpe2))
        outcome("then", lambda: other.dispatch(x2, w2, ids2, tpe2))  # told once; then the group's failure, whole
    # newest first, as a pool does; ranks 0 and 1: local (their group failed; rank 1 told by rank 0's entry)
    outcome("teardown", lambda: (other.destroy(), buf.destroy()))
    return out


@pytest.mark.slow  # waits out the bound in fresh processes
@spawned_only
def test_node_peer_that_never_signals_is_named_within_the_bound():
    """A node-local wait that hangs forever, or gives up without naming the node peer that never
    signalled; a buffer that keeps stepping after it; a teardown that hangs on the absent peer; a node
    peer not told that the rank gave up (its next step, also on another buffer of the group, waits out
    a bound in the EP group's all-gather that rank never joins, and its teardown another in the node
    heap's collective free)."""
    env = {RANKS_PER_NODE_ENV: "2", "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S),
           "VLLM_MOONEP_TEST_GROUP_TIMEOUT_S": "20"}
    res = run_on_ranks(4, node_peer_never_signals, env=env, fresh=True, allow_failures=True, timeout_s=120)
    assert not any(isinstance(o, RankFailure) for o in res), res
    r0 = res[0]
    assert r0["dispatch"] is not None and r0["dispatch"][0] == "MoonEPCollectiveTimeout", r0
    assert r0["dispatch"][2] == [1] and "first rank 1" in r0["dispatch"][1], r0
    assert "wait for node peers' rows" in r0["dispatch"][1], r0
    assert TIMEOUT_S <= r0["dispatch_s"] <= TIMEOUT_S + SLACK_S, r0
    assert r0["after"][0] == "MoonEPStateError" and r0["teardown"] is None and r0["teardown_s"] < 1.0, r0
    # the other node never waits on rank 1's signal: its step completed
    assert res[2]["dispatch"] is None and res[3]["dispatch"] is None, res
    # rank 1 saw rank 0's signal and finished its step; then rank 0's gave_up entry ends its next call at once,
    # naming rank 0, and its teardown is local
    r1 = res[1]
    assert r1["dispatch"] is None and r1["next"] is not None, r1
    assert r1["next"][0] == "MoonEPCollectiveTimeout" and r1["next"][2] == [0], r1
    assert "rank 0 on this node had given up on the group" in r1["next"][1], r1
    assert r1["next_s"] < 1.0 and r1["teardown"] is None and r1["teardown_s"] < 1.0, r1
    assert r1["then"][0] == "MoonEPStateError", r1
    assert "unusable after an earlier failure (hybrid transport: \"dispatch: the step's counts\" abandoned at step 0, " \
           "node peers [0] gave up on the group)" in r1["then"][1], r1


# ------------------------------------------------------------------------------ moonep-ab
@spawned_only
def test_moonep_ab_on_two_simulated_nodes(tmp_path):
    """moonep-ab on 4 ranks as 2 simulated nodes with the hybrid transport: a configuration off the dense
    reference fails the run; the record says which transport and nodes ran."""
    from vllm_moonep.tools import ab

    res = ab.run_ab(preset="tiny", ranks=4, layers=1, tokens=(16,), maxvios=(2.0,), steps=1, warmup=0, check_steps=1,
                    configs=["replicated", "symmetric"], out_dir=str(tmp_path), plots=False, progress=False,
                    ranks_per_node=2, transport="hybrid")
    assert res["environment"]["ranks_per_node"] == 2 and res["environment"]["transport"] == "hybrid", res["environment"]
    errs = [p["ref_rel_err"] for c in res["configs"].values() for p in c["points"]]
    assert not res["failures"] and len(errs) == 2 and max(errs) < ab.MAX_REF_ERR, (res["failures"], errs)
    assert "2 simulated nodes of 2 ranks" in ab.format_table(res)


@spawned_only
def test_bench_dispatch_on_two_simulated_nodes(tmp_path):
    """bench_dispatch's --ranks-per-node not reaching the ranks (the figure would be one node's), or its
    record not saying which transport and nodes the figures were measured on."""
    import json

    from vllm_moonep.tools import bench_dispatch

    out = tmp_path / "rows.json"
    assert bench_dispatch.main(["--preset", "qwen3-30b-a3b", "--ranks", "4", "--ranks-per-node", "2", "--transport",
                                "hybrid", "--tokens", "2", "--maxvio", "2", "--iters", "2", "--warmup", "1",
                                "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["transport"] == "hybrid" and run["ranks_per_node"] == 2, run
    assert run["rows"][0]["dispatch_us"] > 0 and run["rows"][0]["a2a_us"] > 0
    with pytest.raises(SystemExit):
        bench_dispatch.main(["--ranks", "4", "--ranks-per-node", "3"])


# ------------------------------------------------------------------------------ CUDA
#: python -m pytest tests/distributed/test_simulated_nodes.py -k cuda  (one GPU: 4 processes share it
#: over gloo, torch heap over each simulated node; two GPUs: one simulated node per GPU over NCCL)
@pytest.mark.gpu
@spawned_only
def test_hybrid_cuda_processes_sharing_one_gpu():
    """The hybrid transport on CUDA tensors, 4 processes on one GPU as 2 simulated nodes (torch heap over
    each node, gloo all-to-all): not bit-identical to the collective transport, rows not where the planner
    says, a slow node peer's rows read before they landed (stream ordering), bad counts not refused on
    every rank before a row moves."""
    env = {**HYBRID, **CUDA}
    stats = ranks(4, call_with_env, env, same_as_collective, 32, 256, 4, 16, 4, 8, [0.0, 2.5, 1.0], 3, env=env)
    assert sum(s["local"] for s in stats) > 0 and sum(s["remote"] for s in stats) > 0
    ranks(4, call_with_env, env, traceable_rows, 24, 16, 4, 16, 4, 8, 2.5, 11, env=env)
    assert ranks(4, call_with_env, env, slow_node_peer, 32, 256, 4, 16, 4, 8, 13, env=env) == [(True, True)] * 4
    assert ranks(4, call_with_env, env, counts_short_on_one_rank_hybrid, env=env) == [(True, True)] * 4
    assert ranks(4, call_with_env, env, auto_transport_name, env=env) == ["hybrid"] * 4


def auto_transport_name():
    """The transport a real Buffer with transport='auto' takes on this rank's device (simulated nodes set)."""
    buf = Buffer(16, 64, 2, 8, dist.get_world_size(), B=2, token_padding=4, device=_dev(), transport="auto")
    name = buf.transport_name
    buf.destroy()
    return name


@pytest.mark.gpu
@spawned_only
def test_symmetric_layout_torch_heap_across_simulated_nodes_cuda():
    """The symmetric layout on the torch heap across 2 simulated nodes of one GPU: prefetch by the torch
    heap's emulated RMA, a step against the dense reference."""
    env = {**HYBRID, **CUDA}
    res = ranks(4, call_with_env, env, symmetric_layout_across_nodes_cuda, env=env)
    assert sum(res) > 0


def symmetric_layout_across_nodes_cuda():
    from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
    from vllm_moonep.symmetric import SymmetricWeightLayout
    from vllm_moonep.testing.weights import local_experts

    r, R = dist.get_rank(), dist.get_world_size()
    E, H, I, K, B = 16, 128, 128, 4, 4
    dev = torch.device("cuda", torch.cuda.current_device())
    w13, w2 = global_weights(E, H, I, 4)
    lw13, lw2 = (t.to(dev) for t in local_experts(w13, w2, r, R))
    layout = SymmetricWeightLayout(lw13, lw2, E, B, None, heap="torch")
    assert not layout.heap.peers_addressable
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=16, device=dev,
                                 transport="hybrid"), 128, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="reference")
    remote = 0
    for step in range(2):
        x, ids, w = rank_inputs(60 + 9 * step, E, K, H, sigma=2.5, seed=40 + step, rank=r)
        out = moe.forward(x.to(dev), ids.to(dev), w.to(dev))
        check_against_dense(out, x, ids, w, w13, w2)
        etc = moe.last.experts_to_copy[r].tolist()
        remote += sum(1 for e in etc if e >= 0 and not layout.heap.addressable(e // (E // R)))
    pool.destroy()
    layout.destroy()
    return remote


@pytest.mark.multi_gpu
@spawned_only
def test_hybrid_nccl_one_simulated_node_per_gpu():
    """Two GPUs over NCCL, one simulated node each (explicit hybrid: every peer remote, NCCL all-to-all,
    no heap): bit-identical to the collective transport, rows where the planner says."""
    env = {**CUDA, "VLLM_MOONEP_TEST_TRANSPORT": "hybrid", RANKS_PER_NODE_ENV: "1"}
    stats = ranks(2, with_env, env, same_as_collective, 32, 256, 4, 16, 8, 8, [0.0, 2.5, 1.0], 3, env=env,
                  backend="nccl", device="cuda")
    assert sum(s["remote"] for s in stats) > 0
    ranks(2, with_env, env, traceable_rows, 24, 16, 4, 16, 8, 8, 2.5, 11, env=env, backend="nccl", device="cuda")


# ------------------------------------------------------------------------------ agreement on every rank
def uneven_nodes_then_new_group():
    """Hosts [0, 1, 2] and [3] (the host id the Buffer all-gathers patched): a hybrid buffer (node
    subgroup over ranks 0-2 only, rank 3 alone), one step against the collective transport, destroy;
    then an ordinary world-wide group must form and work (bounded by a short group timeout)."""
    import datetime

    from vllm_moonep.engine import buffer as buffer_mod

    r = dist.get_rank()
    real = buffer_mod.host_id
    buffer_mod.host_id = lambda: 1 if r < 3 else 2
    try:
        stats = same_as_collective(16, 32, 2, 8, 2, 4, [1.5], 7)
    finally:
        buffer_mod.host_id = real
    g = dist.new_group(list(range(4)), timeout=datetime.timedelta(seconds=15))
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)
    return stats, float(t)


@spawned_only
def test_uneven_nodes_keep_torch_group_names_in_step():
    """Node subgroups made only by their members (use_local_synchronization): ranks then disagree on
    torch's group counter and the next ordinary new_group hangs (names differ per rank)."""
    res = ranks(4, uneven_nodes_then_new_group, timeout_s=90)
    assert [t for _, t in res] == [4.0] * 4, res
    assert sum(s["local"] for s, _ in res) > 0 and sum(s["remote"] for s, _ in res) > 0, res


def setup_failure_on_one_node():
    """Node 1 (ranks 2, 3) cannot make its node heap (MemoryError): every rank must raise promptly,
    naming ranks 2 and 3; then a buffer on the same group works. Also heap kinds the hybrid transport
    refuses are refused on ranks alone on their node too (4 nodes of 1: no heap is made anywhere)."""
    from vllm_moonep.engine import heaps

    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 8, 16, 2, 8
    real = heaps.make_heap
    out = {}
    if r >= 2:
        def refused(*a, **k):
            raise MemoryError("injected: no memory for the node heap")
        heaps.make_heap = refused
    t0 = time.monotonic()
    try:
        Buffer(S, H, K, E, R, B=2, token_padding=4, device="cpu", transport="hybrid", timeout_s=30)
        out["failed"] = None
    except Exception as exc:
        out["failed"] = (type(exc).__name__, str(exc))
    finally:
        heaps.make_heap = real
    out["elapsed"] = time.monotonic() - t0
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device="cpu", transport="hybrid", timeout_s=30)
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 9, r, torch.bfloat16)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    o, rw, _ = buf.combine(plan, xn, wn)
    out["next_ok"] = torch.equal(rw, w)
    buf.destroy()
    out["heap_kinds"] = {}
    for kind in ("nvshmem", "torch"):
        try:
            call_with_env({RANKS_PER_NODE_ENV: "1"}, Buffer, S, H, K, E, R, B=2, token_padding=4, device="cpu",
                     transport="hybrid", heap=kind, timeout_s=30).destroy()
            out["heap_kinds"][kind] = None
        except MoonEPInputError as exc:
            out["heap_kinds"][kind] = str(exc)
    return out


@spawned_only
def test_setup_failure_on_one_node_raises_on_every_rank():
    """A node heap that fails on one node only while the other node's ranks get a working buffer (and time
    out at their first dispatch); a heap kind refused only on ranks that share a node."""
    res = ranks(4, call_with_env, {RANKS_PER_NODE_ENV: "2"}, setup_failure_on_one_node, timeout_s=120)
    for o in res:
        assert o["failed"] is not None and o["failed"][0] == "MoonEPUnavailableError", o
        assert "rank(s) [2, 3]" in o["failed"][1] and "injected: no memory" in o["failed"][1], o
        assert o["elapsed"] < 10.0 and o["next_ok"], o
        assert "NVSHMEM" in (o["heap_kinds"]["nvshmem"] or ""), o
        assert "does not fit device cpu" in (o["heap_kinds"]["torch"] or ""), o


def bad_ranks_per_node_on_one_rank():
    """Rank 3 has VLLM_MOONEP_RANKS_PER_NODE='x', the others '2': the buffer and a heap must refuse on
    every rank, naming rank 3's value (not raise on rank 3 alone while the others wait)."""
    from vllm_moonep.engine.heaps import make_heap

    r, R = dist.get_rank(), dist.get_world_size()
    env = {RANKS_PER_NODE_ENV: "x" if r == 3 else "2"}
    out = {}
    for name, fn in (("buffer", lambda: Buffer(8, 16, 2, 8, R, B=2, token_padding=4, device="cpu",
                                                transport="hybrid", timeout_s=30)),
                     ("heap", lambda: make_heap("host", device="cpu"))):
        t0 = time.monotonic()
        try:
            call_with_env(env, fn).destroy() if name == "buffer" else call_with_env(env, fn).close()
            out[name] = None
        except MoonEPInputError as exc:
            out[name] = str(exc)
        out[name + "_s"] = time.monotonic() - t0
    return out


@spawned_only
def test_invalid_ranks_per_node_on_one_rank_refused_everywhere():
    """An invalid VLLM_MOONEP_RANKS_PER_NODE raising only on its rank, before the all-gather that makes
    ranks agree (the others time out), in the buffer or in a heap's node agreement."""
    res = ranks(4, bad_ranks_per_node_on_one_rank, timeout_s=120)
    for o in res:
        for name in ("buffer", "heap"):
            assert o[name] is not None and "rank(s) [3] have ['x']" in o[name], (name, o)
            assert o[name + "_s"] < 10.0, o


def node_peer_stops_before_combine():
    """One simulated node of 4 (no all-to-all): rank 1 dispatches at step 1 and never combines; the
    others' combine wait must give up within the bound naming rank 1 and the combine phase."""
    r, R = dist.get_rank(), dist.get_world_size()
    S, H, K, E = 8, 16, 2, 8
    buf = Buffer(S, H, K, E, R, B=2, token_padding=4, device="cpu", transport="hybrid")
    x, w, ids, tpe = _inputs(S, E, K, H, 1.0, 9, r, torch.bfloat16)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    buf.combine(plan, xn)
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    out = {"combine": None}
    t0 = time.monotonic()
    if r != 1:
        try:
            buf.combine(plan, xn)
        except Exception as exc:
            out["combine"] = (type(exc).__name__, str(exc), getattr(exc, "missing", None), getattr(exc, "op", None))
    out["elapsed"] = time.monotonic() - t0
    try:
        buf.destroy()
    except Exception as exc:
        out["teardown"] = type(exc).__name__
    return out


@pytest.mark.slow  # waits out the bound in fresh processes
@spawned_only
def test_node_peer_that_stops_before_combine_is_named():
    """A combine-phase wait that hangs, or gives up without naming the node peer that stopped between
    dispatch and combine, or names the dispatch phase."""
    env = {RANKS_PER_NODE_ENV: "4", "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S),
           "VLLM_MOONEP_TEST_GROUP_TIMEOUT_S": "20"}
    res = run_on_ranks(4, node_peer_stops_before_combine, env=env, fresh=True, allow_failures=True, timeout_s=120)
    assert not any(isinstance(o, RankFailure) for o in res), res
    for r in (0, 2, 3):
        o = res[r]
        assert o["combine"] is not None and o["combine"][0] == "MoonEPCollectiveTimeout", (r, o)
        # the first to time out gives up on the group and the others leave then: each still names rank 1
        assert o["combine"][2] == [1] and "first rank 1" in o["combine"][1], (r, o)
        assert "combine: wait for node peers' outputs" in o["combine"][1], (r, o)
        # the others leave at the first one's bound, which started up to a scheduling delay before theirs
        assert TIMEOUT_S - 0.5 <= o["elapsed"] <= TIMEOUT_S + SLACK_S, (r, o)
    assert max(res[r]["elapsed"] for r in (0, 2, 3)) >= TIMEOUT_S, res


def test_graphs_stay_off_only_where_simulated_nodes_split_the_group(monkeypatch):
    """CUDA graphs turned off by VLLM_MOONEP_RANKS_PER_NODE even when it equals the EP group's size (one
    node: the symmetric transport), or kept where it splits the group or is invalid."""
    from types import SimpleNamespace

    from vllm_moonep.vllm_plugin.cudagraphs import simulated_split

    pc = SimpleNamespace(data_parallel_size=2, tensor_parallel_size=2, prefill_context_parallel_size=1)
    for value, split in (("", False), ("4", False), ("2", True), ("1", True), ("x", True), ("0", True)):
        monkeypatch.setenv(RANKS_PER_NODE_ENV, value)
        assert (simulated_split(pc) is not None) == split, (value, simulated_split(pc))


@pytest.mark.multi_gpu
@spawned_only
def test_hybrid_nccl_one_simulated_node_of_two_gpus():
    """Two GPUs over NCCL as one simulated node of 2 (explicit hybrid: the one-sided path across distinct
    GPUs through the torch heap, no all-to-all): bit-identical to the collective transport."""
    env = {**CUDA, RANKS_PER_NODE_ENV: "2"}
    stats = ranks(2, with_env, env, same_as_collective, 32, 256, 4, 16, 8, 8, [0.0, 2.5, 1.0], 3, env=env,
                  backend="nccl", device="cuda")
    assert sum(s["local"] for s in stats) > 0 and sum(s["remote"] for s in stats) == 0, stats
