"""The GPU path of a whole MoE step (dispatch, prefetch, expert compute, combine) with no host
synchronization, and captured in a CUDA graph: replays on new inputs of the same token count
match the dense reference. Symmetric transport (auto on GPUs of one node), both layouts.

Runs with 2 and 4 processes sharing one GPU (gloo group, PyTorch symmetric memory with
overlapping devices) and with one GPU per rank (NCCL) where there are several.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.weights import local_experts

SHARED_GPU_ENV = {"VLLM_MOONEP_TEST_DEVICE": "cuda", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
                  "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": "60"}
NCCL_ENV = {"VLLM_MOONEP_TEST_DEVICE": "cuda", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": "60"}


def _build(layout_kind, E, H, I, K, B, max_tokens, dev):
    r, R = dist.get_rank(), dist.get_world_size()
    w13, w2 = global_weights(E, H, I, 3)
    lw13, lw2 = (t.to(dev) for t in local_experts(w13, w2, r, R))
    if layout_kind == "replicated":
        layout = ReplicatedWeightLayout(lw13, lw2, E, B)
    else:
        from vllm_moonep.symmetric import SymmetricWeightLayout

        layout = SymmetricWeightLayout(lw13, lw2, E, B, heap="torch")
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev, transport="symmetric"), max_tokens,
                            engine="builtin")
    return MoonEPMoE(pool, layout, impl="auto"), w13, w2


def _sync_free_step(moe, x, ids, w, tokens):
    """One eager MoE step with any host synchronization raising (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return moe.forward(x, ids, w, num_tokens_across_dp=tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_step(layout_kind, B, tokens, replays):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, I, K = 8 * R, 256, 512, 4
    moe, w13, w2 = _build(layout_kind, E, H, I, K, B, 256, dev)
    x0, ids0, w0 = rank_inputs(tokens, E, K, H, sigma=2.5, seed=11, rank=r)
    x_s, ids_s, w_s = x0.to(dev), ids0.to(dev), w0.to(dev)
    res = {"slots": 0}
    # eager warm-up: makes the buffer of this capacity (collective, synchronizing) and compiles kernels
    for _ in range(2):
        out = moe.forward(x_s, ids_s, w_s, num_tokens_across_dp=tokens)
    check_against_dense(out.cpu(), x0, ids0, w0, w13, w2)
    # 1) no host synchronization anywhere in the step; eager dispatch and combine now replay the
    # buffer's private graphs (engine/transports/eager_graphs.py), captured at the warm-up's second call
    replays = _replays(moe)
    check_against_dense(_sync_free_step(moe, x_s, ids_s, w_s, tokens).cpu(), x0, ids0, w0, w13, w2)
    # eager steps on new routings and new input tensors, served by those graphs
    eager_errs = []
    for i in range(2):
        x, ids, w = rank_inputs(tokens, E, K, H, sigma=1.0 + i, seed=50 + i, rank=r)
        out = moe.forward(x.to(dev), ids.to(dev), w.to(dev), num_tokens_across_dp=tokens)
        eager_errs.append(check_against_dense(out.cpu(), x, ids, w, w13, w2))
    # the same input tensors refilled with new routings: the dispatch graph that reads its inputs
    # in place (their addresses repeat) must see the new values, not the captured ones
    inplace = sum(buf._sym.inplace.replays for buf in moe.pool.buffers.values())
    x_f, ids_f, w_f = x_s.clone(), ids_s.clone(), w_s.clone()  # x_s & co. keep step 0's inputs
    for i in range(3):
        x, ids, w = rank_inputs(tokens, E, K, H, sigma=2.0 + i, seed=70 + i, rank=r)
        x_f.copy_(x)
        ids_f.copy_(ids)
        w_f.copy_(w)
        out = moe.forward(x_f, ids_f, w_f, num_tokens_across_dp=tokens)
        eager_errs.append(check_against_dense(out.cpu(), x, ids, w, w13, w2))
    res["inplace_replays"] = sum(buf._sym.inplace.replays for buf in moe.pool.buffers.values()) - inplace
    res["eager_replays"] = _replays(moe) - replays
    res["eager_err"] = max(eager_errs)
    # 1b) the private graphs off: the same sync-free step launches every engine kernel through
    # its compiled C launcher (engine/launch.py)
    for buf in moe.pool.buffers.values():
        buf._sym.graphs.enabled = buf._sym.inplace.enabled = False
    launchers = _engine_launchers(moe)
    hits = [ln.hits for ln in launchers]
    check_against_dense(_sync_free_step(moe, x_s, ids_s, w_s, tokens).cpu(), x0, ids0, w0, w13, w2)
    from vllm_moonep.engine.launch import FAST_LAUNCH

    res["fast"] = (FAST_LAUNCH, len(launchers), sum(ln.hits > h and ln.fast for ln, h in zip(launchers, hits)))
    for buf in moe.pool.buffers.values():
        buf._sym.graphs.enabled = buf._sym.inplace.enabled = True
    # 2) the whole step in one CUDA graph, replayed on new routing (new plans, new slots)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.forward(x_s, ids_s, w_s, num_tokens_across_dp=tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = moe.forward(x_s, ids_s, w_s, num_tokens_across_dp=tokens)
    errs = []
    for i in range(replays):
        x, ids, w = rank_inputs(tokens, E, K, H, sigma=0.5 + i, seed=100 + i, rank=r)
        x_s.copy_(x)
        ids_s.copy_(ids)
        w_s.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        errs.append(check_against_dense(out_s.cpu(), x, ids, w, w13, w2))
        res["slots"] += int((moe.last.experts_to_copy >= 0).sum())  # the planner rewrites it in place each replay
    for buf in moe.pool.buffers.values():
        buf.check_errors(sync=True)
    res["max_err"] = max(errs)
    del graph
    moe.pool.destroy()
    moe.layout.destroy()
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("layout_kind,B", [("replicated", 8), ("symmetric", 8), ("symmetric", 2)])
def test_step_is_sync_free_and_graph_replays_match_dense_shared_gpu(R, layout_kind, B):
    """A host synchronization left in dispatch/prefetch/experts/combine (sync debug mode raises), or
    a step that bakes one plan into the graph (replays on new routing would then miss the dense
    reference). B=2 < epn exercises overflow rows read from the owners' memory. Eager steps replay
    the buffer's private graphs: replays on new routings are checked too."""
    res = ranks(R, graph_step, layout_kind, B, 100, 3, env=SHARED_GPU_ENV)
    assert all(x["max_err"] < 2e-2 for x in res)
    _assert_fast_launch_taken(res)
    _assert_eager_graphs(res)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("layout_kind,B", [("replicated", 16), ("symmetric", 16), ("symmetric", 4)])
def test_step_is_sync_free_and_graph_replays_match_dense_nccl(layout_kind, B):
    """The same, one GPU per rank over NVLink (NCCL group)."""
    R = 2
    if torch.cuda.device_count() < R:
        pytest.skip(f"needs {R} GPUs")
    res = ranks(R, graph_step, layout_kind, B, 200, 3, env=NCCL_ENV, backend="nccl")
    assert all(x["max_err"] < 2e-2 for x in res)
    _assert_fast_launch_taken(res)
    _assert_eager_graphs(res)


def _replays(moe):
    """Eager dispatch/combine calls served by the buffers' private graphs so far (copying their
    inputs, or reading them in place)."""
    return sum(buf._sym.graphs.replays + buf._sym.inplace.replays for buf in moe.pool.buffers.values())


def _assert_eager_graphs(res):
    """Eager calls that never replay the private graphs (a key that never repeats, a capture that
    failed and switched them off), or replays that compute the wrong step (inputs not copied into
    the graph's static tensors, an address baked in that changed)."""
    from vllm_moonep.engine.transports.eager_graphs import EAGER_GRAPHS

    for x in res:
        assert x["eager_err"] < 2e-2
        if EAGER_GRAPHS:
            assert x["eager_replays"] >= 3, f"eager dispatches of the new routings were not replayed: {x['eager_replays']}"
            assert x["inplace_replays"] >= 1, "refilled input tensors were never dispatched by the in-place graph"


def _engine_launchers(moe):
    """The launchers of every engine kernel a step runs: the transport's (plan, dispatch_rows,
    combine_rows, reduce for small batches), the prefetch row copy and the padding kernel."""
    from vllm_moonep.common import pad_kernel
    from vllm_moonep.engine import row_copy

    out = []
    for buf in moe.pool.buffers.values():
        out += buf._sym.step_launchers
    out.append(row_copy._copy_rows_kernel)
    out.append(pad_kernel._launcher)
    return out


def _assert_fast_launch_taken(res):
    """A fast launch that silently fell back (a Triton whose runner takes other arguments, a grid
    the runner cannot read: the row copy's 2-D grid did) or a key that never repeats would leave the
    eager step paying Triton's dispatch for that kernel: each must have hit its runner in the
    sync-free step."""
    for on, n, used in (x["fast"] for x in res):
        # these steps place at most 8 sub-blocks of entries: the planner's histogram kernel is skipped
        assert n == 6, f"expected 6 engine launchers (transport 4 incl. the plan, row copy 1, padding 1), found {n}"
        assert used == (n if on else 0), f"{used} of {n} engine kernels used the compiled launcher (fast launch on: {on})"


def device_wait_times_out():
    """Rank 1 stops calling after one step; rank 0's device-side wait must give up and report."""
    import time

    from vllm_moonep.engine import Buffer

    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    S, H, K, E = 16, 128, 2, 8
    buf = Buffer(S, H, K, E, R, B=4, token_padding=8, device=dev, transport="symmetric", timeout_s=2.0,
                 check_inputs=False)
    g = torch.Generator().manual_seed(r)
    ids = torch.randint(0, E, (S, K), generator=g, dtype=torch.int32).to(dev)
    w = torch.rand(S, K, generator=g).to(dev)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16).to(dev)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    xn, _, _, plan = buf.dispatch(x, w, ids, tpe)
    buf.combine(plan, xn)
    buf.check_errors(sync=True)
    out = {}
    if r == 0:
        t0 = time.monotonic()
        buf.dispatch(x, w, ids, tpe)  # returns at once: the wait runs on the device
        out["launch_s"] = time.monotonic() - t0
        try:
            buf.check_errors(sync=True)
            out["error"] = None
        except Exception as exc:
            out["error"] = type(exc).__name__
            out["msg"] = str(exc)
            out["missing"] = getattr(exc, "missing", None)
        out["elapsed_s"] = time.monotonic() - t0
        try:
            buf.dispatch(x, w, ids, tpe)
            out["after"] = None
        except Exception as exc:
            out["after"] = type(exc).__name__
    else:
        time.sleep(6.0)
    return out


@pytest.mark.gpu
def test_device_wait_is_bounded_and_names_the_peer():
    """A spin-wait that hangs the GPU when a peer stops calling, or an error that does not name it."""
    from vllm_moonep.testing.launch import run_on_ranks

    res = run_on_ranks(2, device_wait_times_out, env=SHARED_GPU_ENV, fresh=True, allow_failures=True, timeout_s=120)
    r0 = res[0]
    assert isinstance(r0, dict), r0
    assert r0["error"] == "MoonEPCollectiveTimeout" and r0["missing"] == [1], r0
    assert "first rank 1" in r0["msg"] and "token counts" in r0["msg"], r0
    assert r0["launch_s"] < 1.0 and 2.0 <= r0["elapsed_s"] < 8.0, r0
    assert r0["after"] in ("MoonEPStateError", "MoonEPCollectiveTimeout"), r0
