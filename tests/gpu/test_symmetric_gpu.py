"""The symmetric layout on PyTorch symmetric memory (``TorchSymmHeap``, CUDA backend).

World size 1, and 2 processes sharing one GPU (gloo group, overlapping devices allowed; see
``docs/TESTING.md``): real cross-process peer views, barrier visibility, bitwise
prefetch, overflow reads of the owner's rows, full MoE steps against the dense reference and the
replicated layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common.grouped_gemm import interleave_w13
from vllm_moonep.testing.weights import local_experts

pytestmark = pytest.mark.gpu

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
H, I, K = 128, 128, 2


def _device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def heap_peer_views():
    from vllm_moonep.engine.heaps import TorchSymmHeap, make_heap

    dev = _device()
    r, R = dist.get_rank(), dist.get_world_size()
    heap = make_heap("auto", device=dev)
    assert isinstance(heap, TorchSymmHeap)
    a = heap.allocate((4, 256), torch.float32, "a")
    b = heap.allocate((3, 128), torch.bfloat16, "b")
    a.tensor.fill_(float(r + 1))
    b.tensor.fill_(float(10 * (r + 1)))
    heap.barrier()
    for q in range(R):
        va, vb = heap.peer_view(a, q), heap.peer_view(b, q)
        assert va.device == dev and tuple(va.shape) == (4, 256)
        assert bool((va == q + 1).all()), f"rank {r} sees rank {q}'s allocation a wrong"
        assert bool((vb == 10 * (q + 1)).all()), f"rank {r} sees rank {q}'s allocation b wrong"
    # the view aliases the peer's memory: a later write by the owner shows after the next barrier
    heap.barrier()
    a.tensor[0, 0] = 100.0 + r
    heap.barrier()
    for q in range(R):
        assert float(heap.peer_view(a, q)[0, 0]) == 100.0 + q
    heap.device_barrier()
    torch.cuda.synchronize()
    with pytest.raises(Exception, match="out-of-order"):
        heap.free(a)
    heap.free(b)
    heap.free(a)
    heap.close()
    return True


@pytest.mark.parametrize("R", [1, 2])
def test_torch_symm_heap_peer_views(R):
    """Peer views of PyTorch symmetric memory aliasing the wrong rank or stale after a barrier, or a free out of LIFO
    order accepted."""
    assert all(ranks(R, heap_peer_views, env=ENV))


def layout_prefetch_and_steps(E, B, sigma, seed):
    from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
    from vllm_moonep.common.grouped_gemm import available_impls
    from vllm_moonep.engine.heaps import TorchSymmHeap
    from vllm_moonep.replicated import ReplicatedWeightLayout
    from vllm_moonep.symmetric import SymmetricWeightLayout

    dev = _device()
    r, R = dist.get_rank(), dist.get_world_size()
    epn = E // R
    w13, w2 = global_weights(E, H, I, seed=seed)
    w13, w2 = w13.to(dev), w2.to(dev)
    lw13, lw2 = local_experts(w13, w2, r, R)
    heap = TorchSymmHeap(device=dev)
    sym = SymmetricWeightLayout(lw13, lw2, E, B, heap=heap)
    p13 = torch.nn.Parameter(lw13.clone(), requires_grad=False)
    p2 = torch.nn.Parameter(lw2.clone(), requires_grad=False)
    sym.adopt_parameters(p13, p2)
    assert p13.data_ptr() == sym.home_w13.data_ptr()
    s13 = interleave_w13(w13)  # the heap's rows: gate and up interleaved
    for q in range(R):
        assert torch.equal(sym.peer_w13(q)[:epn], s13[q * epn:(q + 1) * epn])
        assert torch.equal(sym.peer_w2(q)[:epn], w2[q * epn:(q + 1) * epn])
    # prefetch through real peer views: bitwise; -1 slots untouched
    table = torch.full((R, B), -1, dtype=torch.int32)
    for q in range(R):
        remote = [e for e in range(E) if e // epn != q] or list(range(E))
        for b in range(0, B, 2):
            table[q, b] = remote[(b + q) % len(remote)]
    sentinel = torch.tensor(-3.25, dtype=torch.bfloat16, device=dev)
    sym.slots_w13.fill_(sentinel)
    sym.slots_w2.fill_(sentinel)
    sym.prefetch(None, SimpleNamespace(experts_to_copy=table.to(dev)))
    for b in range(B):
        e = int(table[r, b])
        if e >= 0:
            assert torch.equal(sym.slots_w13[b].view(torch.int16), s13[e].view(torch.int16))
            assert torch.equal(sym.slots_w2[b].view(torch.int16), w2[e].view(torch.int16))
        else:
            assert bool((sym.slots_w13[b] == sentinel).all())
    # the copy kernel's live rule: slot 0's only row has weight 0 (padding): not copied; every
    # other planned slot has a real row after a weight-0 one: copied
    cu = torch.tensor([1] * E + [b + 1 for b in range(B)]).cumsum(0).to(torch.int32)
    w = torch.ones(int(cu[-1]))
    for b in range(B):
        w[int(cu[E + b - 1])] = 0.0
    sym.slots_w13.fill_(sentinel)
    sym.slots_w2.fill_(sentinel)
    sym.prefetch(None, SimpleNamespace(experts_to_copy=table.to(dev)), rows=(cu.to(dev), w.to(dev)))
    for b in range(B):
        e = int(table[r, b])
        if e >= 0 and b > 0:
            assert torch.equal(sym.slots_w2[b].view(torch.int16), w2[e].view(torch.int16)), b
        else:
            assert bool((sym.slots_w13[b] == sentinel).all()) and bool((sym.slots_w2[b] == sentinel).all()), b
    # full steps: symmetric == replicated bitwise (reference compute), both close to dense
    rep = ReplicatedWeightLayout(lw13, lw2, E, B)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev), 256, engine="builtin")
    moe_s = MoonEPMoE(pool, sym, impl="reference")
    moe_r = MoonEPMoE(pool, rep, impl="reference")
    slots = overflow = 0
    for i, m in enumerate([128, 77]):
        x, ids, w = rank_inputs(m, E, K, H, sigma=max(sigma, 0.0), seed=seed + i, rank=r)
        if sigma < 0:  # everything to rank 0's experts: with B < epn, rank 1 overflows
            g = torch.Generator().manual_seed(seed * 31 + i + r)
            ids = torch.stack([torch.randperm(epn, generator=g)[:K] for _ in range(m)]).to(torch.int32)
        x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
        out_s = moe_s.forward(x, ids, w, num_tokens_across_dp=m)
        cu = moe_s.last.cu_seqlens.tolist()
        slots += int((moe_s.last.experts_to_copy[r] >= 0).sum())
        out_r = moe_r.forward(x, ids, w, num_tokens_across_dp=m)
        assert torch.equal(out_s.view(torch.int16), out_r.view(torch.int16))
        check_against_dense(out_s, x, ids, w, w13, w2)
        starts = [0] + cu[:-1]
        overflow += sum(cu[g] - starts[g] for g in range(E) if g // epn != r)
        if "grouped_mm" in available_impls(x, sym.grouped_weights()):
            out_g = MoonEPMoE(pool, sym, impl="grouped_mm").forward(x, ids, w, num_tokens_across_dp=m)
            check_against_dense(out_g, x, ids, w, w13, w2)
    pool.destroy()
    rep.destroy()
    sym.destroy()
    assert heap.live() == []
    heap.close()
    t = torch.tensor([slots, overflow])
    dist.all_reduce(t)
    return int(t[0]), int(t[1])


def test_symmetric_layout_world_of_one_on_gpu():
    """The symmetric layout on one GPU rank (no peers) adopting, prefetching or stepping unlike the replicated layout
    and the dense MoE."""
    ranks(1, layout_prefetch_and_steps, 4, 4, 1.0, 3, env=ENV)


def test_symmetric_layout_two_processes_one_gpu_dense_path():
    """Prefetch through peer views of PyTorch symmetric memory copying the wrong expert (B >= E/R: slots only, no
    overflow)."""
    slots, overflow = ranks(2, layout_prefetch_and_steps, 8, 4, 2.5, 7, env=ENV)[0]
    assert slots > 0 and overflow == 0


def test_symmetric_layout_two_processes_one_gpu_overflow_reads():
    """With B < E/R, a remote expert without a slot read from the wrong row of its owner's memory, or not at all."""
    slots, overflow = ranks(2, layout_prefetch_and_steps, 8, 1, -1.0, 5, env=ENV)[0]
    assert slots > 0 and overflow > 0
