"""The symmetric layout on R gloo CPU ranks over the host heap: aliasing, barrier visibility,
prefetch, full MoE steps against the dense reference and the replicated layout (bitwise), skew
that fills slots, overflow reads (B < epn), a slot pool shared by several layers, memory
accounting against measurement, and teardown errors."""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.engine import MoonEPInputError, MoonEPStateError
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.symmetric import HostHeap, SharedSlotPool, SymmetricWeightLayout, destroy_in_order
from vllm_moonep.common.grouped_gemm import interleave_w13
from vllm_moonep.testing.weights import local_experts

H, I, K = 128, 128, 2


def _shm_files(prefix: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def _pool(E, R, B, max_tokens=256, tp=128):
    return MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=tp, device="cpu"),
                            max_tokens_per_rank=max_tokens, engine="builtin")


# ---------------------------------------------------------------------------- heap semantics
def heap_visibility():
    r, R = dist.get_rank(), dist.get_world_size()
    heap = HostHeap()
    h = heap.allocate((4, 8), torch.float32, "vis")
    h.tensor.fill_(-1.0)
    heap.barrier()
    h.tensor.fill_(float(r))  # every rank writes its own allocation ...
    dist.barrier()  # ... and the write is done everywhere, but no heap barrier yet
    peer = (r + 1) % R
    stale = heap.peer_view(h, peer).clone()
    heap.barrier()
    fresh = heap.peer_view(h, peer).clone()
    assert torch.equal(stale, torch.full((4, 8), -1.0)), "a read without a heap barrier must see the old data"
    assert torch.equal(fresh, torch.full((4, 8), float(peer))), "after the barrier the peer's write is visible"
    # own view is the local tensor
    assert heap.peer_view(h, r) is h.tensor
    files_while_live = _shm_files(heap.prefix)
    heap.free(h)
    heap.close()
    return files_while_live


@pytest.mark.parametrize("R", [2, 3])
def test_host_heap_barrier_visibility_and_no_shm_garbage(R):
    """A host heap barrier that does not publish peers' writes (or reads that never go stale), or /dev/shm files left behind."""
    res = ranks(R, heap_visibility)
    assert all(files == [] for files in res), f"/dev/shm files must be unlinked once mapped: {res}"


def heap_collective_errors():
    r = dist.get_rank()
    heap = HostHeap()
    a = heap.allocate((2,), torch.float32, "a")
    b = heap.allocate((3,), torch.float32, "b")
    msgs = []
    # ranks disagree on the allocation: all raise, nothing allocated
    with pytest.raises(MoonEPInputError, match="same allocation") as ei:
        heap.allocate((2 + r,), torch.float32, "c")
    msgs.append(str(ei.value))
    assert len(heap.live()) == 2
    # ranks free different allocations
    with pytest.raises(MoonEPStateError, match="same allocation") as ei:
        heap.free(a if r == 0 else b)
    msgs.append(str(ei.value))
    # out of order (LIFO)
    with pytest.raises(MoonEPStateError, match="out-of-order free of #0 'a'") as ei:
        heap.free(a)
    msgs.append(str(ei.value))
    # leak
    with pytest.raises(MoonEPStateError, match=r"leaked.*'a'.*'b'") as ei:
        heap.close()
    msgs.append(str(ei.value))
    # still usable after every error
    c = heap.allocate((2,), torch.float32, "c")
    heap.free(c)
    heap.free(b)
    heap.free(a)
    with pytest.raises(MoonEPStateError, match="double free of allocation #0 'a'"):
        heap.free(a)
    heap.close()
    heap.close()  # idempotent
    assert heap.live() == []
    return msgs


def test_host_heap_collective_errors():
    """Ranks disagreeing on an allocation or free, a non-LIFO free, a leak or a double free unnoticed, or the heap unusable after."""
    res = ranks(2, heap_collective_errors)
    assert "rank 0" in res[0][0] and "rank 1" in res[0][0]


# ---------------------------------------------------------------------------- aliasing / prefetch
def aliasing_and_prefetch(E, B):
    r, R = dist.get_rank(), dist.get_world_size()
    epn = E // R
    w13, w2 = global_weights(E, H, I, seed=3)
    lw13, lw2 = local_experts(w13, w2, r, R)
    heap = HostHeap()
    layout = SymmetricWeightLayout(lw13, lw2, E, B, heap=heap)
    # the framework's parameters become heap memory
    p13 = torch.nn.Parameter(lw13.clone(), requires_grad=False)
    p2 = torch.nn.Parameter(lw2.clone(), requires_grad=False)
    layout.adopt_parameters(p13, p2)
    assert p13.data_ptr() == layout.home_w13.data_ptr() and p2.data_ptr() == layout.home_w2.data_ptr()
    s13 = interleave_w13(w13)  # the heap's rows: gate and up interleaved
    for q in range(R):  # logical rows [0,E) alias the home ranks' memory
        assert torch.equal(layout.peer_w13(q)[:epn], s13[q * epn:(q + 1) * epn])
        assert torch.equal(layout.peer_w2(q)[:epn], w2[q * epn:(q + 1) * epn])
    # a write through the owner's parameter is visible to peers after the barrier, not before
    marker = float(100 + r)
    with torch.no_grad():
        p13[0, 0, :4] = marker
    dist.barrier()
    peer = (r + 1) % R
    before = float(layout.peer_w13(peer)[0, 0, 0])
    layout.publish()
    after = float(layout.peer_w13(peer)[0, 0, 0])
    assert before != 100 + peer and after == 100 + peer, (before, after)
    with torch.no_grad():  # restore
        p13[0, 0, :4] = lw13[0, 0, :4]
    layout.publish()
    # prefetch: each rank's slots get remote experts (the table is the same on every rank); -1 slots untouched
    table = torch.full((R, B), -1, dtype=torch.int32)
    for q in range(R):
        remote = [e for e in range(E) if e // epn != q]
        for b in range(0, B, 2):  # every other slot used
            table[q, b] = remote[(3 * q + b) % len(remote)]
    sentinel = torch.tensor(-7.5, dtype=torch.bfloat16)
    layout.slots_w13.fill_(sentinel)
    layout.slots_w2.fill_(sentinel)
    layout.prefetch(None, SimpleNamespace(experts_to_copy=table))
    for b in range(B):
        e = int(table[r, b])
        if e >= 0:
            assert torch.equal(layout.slots_w13[b].view(torch.int16), s13[e].view(torch.int16)), f"slot {b} <- {e}"
            assert torch.equal(layout.slots_w2[b].view(torch.int16), w2[e].view(torch.int16))
        else:
            assert bool((layout.slots_w13[b] == sentinel).all()) and bool((layout.slots_w2[b] == sentinel).all())
    # with the dispatched rows: a planned slot whose rows all have weight 0 (padding) stays as it
    # was; one with a weight-0 row next to a real one is copied. Segments: E home ones of 1 row,
    # then slot b's of b+1 rows; slot 0's row has weight 0, every other slot's first row too.
    cu = torch.tensor([1] * E + [b + 1 for b in range(B)], dtype=torch.int32).cumsum(0).to(torch.int32)
    w = torch.ones(int(cu[-1]))
    for b in range(B):
        w[int(cu[E + b - 1])] = 0.0
    layout.slots_w13.fill_(sentinel)
    layout.slots_w2.fill_(sentinel)
    layout.prefetch(None, SimpleNamespace(experts_to_copy=table), rows=(cu, w))
    for b in range(B):
        e = int(table[r, b])
        if e >= 0 and b > 0:
            assert torch.equal(layout.slots_w13[b].view(torch.int16), s13[e].view(torch.int16)), f"slot {b} <- {e}"
        else:  # unplanned, or planned with only padding rows (slot 0)
            assert bool((layout.slots_w13[b] == sentinel).all()) and bool((layout.slots_w2[b] == sentinel).all()), b
    # bad plan: clear error, layout usable
    with pytest.raises(MoonEPInputError, match="outside"):
        layout.prefetch(None, SimpleNamespace(experts_to_copy=torch.full((R, B), E, dtype=torch.int32)))
    with pytest.raises(MoonEPInputError, match=r"\[R="):
        layout.prefetch(None, SimpleNamespace(experts_to_copy=torch.zeros(R + 1, B, dtype=torch.int32)))
    # bad dispatched rows (an index error, or segments read past the table, without these checks)
    good = SimpleNamespace(experts_to_copy=table)
    for bad in ((cu[:-1], w), (cu.float(), w), (cu, w.double()), (cu, w[:, None]), cu, (cu, None)):
        with pytest.raises(MoonEPInputError, match=r"rows must be \(cu_seqlens: int \[E\+B="):
            layout.prefetch(None, good, rows=bad)
    layout.prefetch(None, good, rows=(cu, w))  # still usable
    gw = layout.grouped_weights()
    assert gw.dense_groups is not None and gw.dense_groups.tolist() == list(range(r * epn, (r + 1) * epn)) + list(range(E, E + B))
    layout.destroy()
    layout.destroy()  # idempotent
    heap.close()
    return True


@pytest.mark.parametrize("R,E,B", [(2, 8, 4), (3, 12, 4), (4, 8, 3)])
def test_aliasing_adoption_and_bitwise_prefetch(R, E, B):
    """Adopted parameters not aliasing the heap, peer writes seen without publish, a non-bitwise prefetch, -1 slots written."""
    assert all(ranks(R, aliasing_and_prefetch, E, B))


def _slot_experts(layout, w13):
    """The global expert each slot holds (bitwise, in the stored order), ``-1`` for none."""
    s13 = interleave_w13(w13)
    return [next((e for e in range(w13.shape[0]) if torch.equal(layout.slots_w13[b], s13[e])), -1)
            for b in range(layout.num_slots)]


def prefetch_checks_the_plan(transport):
    """prefetch(buffer, plan) with a plan that is not the buffer's latest: refused, slots untouched."""
    from vllm_moonep.engine import Buffer

    r, R = dist.get_rank(), dist.get_world_size()
    E, B, S = 8, 4, 16
    epn = E // R
    w13, w2 = global_weights(E, H, I, seed=5)
    layout = SymmetricWeightLayout(*local_experts(w13, w2, r, R), E, B, heap="host")
    buf = Buffer(S, H, K, E, R, B=B, token_padding=8, device="cpu", transport=transport)
    other = Buffer(S, H, K, E, R, B=B, token_padding=8, device="cpu", transport=transport)

    def dispatch(on, hot):  # every token to experts hot, hot+1: their home rank's peers need slots
        ids = torch.tensor([[hot, hot + 1]] * S, dtype=torch.int32)
        tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
        return on.dispatch(torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16),
                           torch.full((S, K), 0.5), ids, tpe)[3]

    plan0, plan1 = dispatch(buf, 0), dispatch(buf, epn)  # rank 0's experts hot, then rank 1's
    foreign = dispatch(other, epn)
    assert plan0.experts_to_copy[r].tolist() != plan1.experts_to_copy[r].tolist()
    sentinel = torch.tensor(-7.5, dtype=torch.bfloat16)
    layout.slots_w13.fill_(sentinel)
    layout.slots_w2.fill_(sentinel)
    for bad, match in ((plan0, r"SymmetricWeightLayout.prefetch: the plan is from dispatch #0, but this buffer has "
                               r"dispatched since \(latest #1\)"),
                       (foreign, "SymmetricWeightLayout.prefetch: the plan was not made by this buffer's dispatch"),
                       (None, "the plan was not made by this buffer's dispatch"),
                       (SimpleNamespace(experts_to_copy=plan1.experts_to_copy), "not made by this buffer")):
        with pytest.raises(MoonEPStateError, match=match):
            layout.prefetch(buf, bad)
        assert bool((layout.slots_w13 == sentinel).all()) and bool((layout.slots_w2 == sentinel).all())
    # an engine buffer that cannot say whether the plan is its latest: refused, not trusted
    with pytest.raises(MoonEPInputError, match="has no check_plan"):
        layout.prefetch(SimpleNamespace(), plan1)
    layout.prefetch(buf, plan1)  # the latest plan: the slots get its experts
    want = plan1.experts_to_copy[r].tolist()
    assert _slot_experts(layout, w13) == want
    assert any(e >= 0 for e in plan1.experts_to_copy.reshape(-1).tolist())  # the test moved experts
    other.destroy()
    buf.destroy()
    with pytest.raises(MoonEPStateError, match="SymmetricWeightLayout.prefetch: the buffer was destroyed"):
        layout.prefetch(buf, plan1)
    layout.destroy()
    return True


@pytest.mark.parametrize("transport", ["collective", "symmetric"])
def test_prefetch_refuses_a_plan_that_is_not_the_buffers_latest(transport):
    """SymmetricWeightLayout.prefetch took a stale plan (the buffer dispatched since) or another
    buffer's and silently left the wrong experts in the slots (the replicated layout refused it)."""
    assert ranks(2, prefetch_checks_the_plan, transport) == [True, True]


# ---------------------------------------------------------------------------- full MoE step
def moe_step_vs_dense_and_replicated(E, B, sigma, m_list, seed):
    r, R = dist.get_rank(), dist.get_world_size()
    epn = E // R
    w13, w2 = global_weights(E, H, I, seed=seed)
    lw13, lw2 = local_experts(w13, w2, r, R)
    pool = _pool(E, R, B)
    sym = SymmetricWeightLayout(lw13, lw2, E, B)  # heap: auto -> host
    rep = ReplicatedWeightLayout(lw13, lw2, E, B)
    moe_s = MoonEPMoE(pool, sym, impl="reference")
    moe_r = MoonEPMoE(pool, rep, impl="reference")
    slots_used, overflow_rows, errs = 0, 0, []
    for i, m in enumerate(m_list):
        x, ids, w = rank_inputs(m, E, K, H, sigma=max(sigma, 0.0), seed=seed * 100 + i, rank=r)
        if sigma < 0:  # every token to rank 0's experts: the quota spans several of them
            g = torch.Generator().manual_seed(seed * 31 + i * 7 + r)
            ids = torch.stack([torch.randperm(epn, generator=g)[:K] for _ in range(m)]).to(torch.int32)
        out_s = moe_s.forward(x, ids, w, num_tokens_across_dp=m)
        info = moe_s.last
        out_r = moe_r.forward(x, ids, w, num_tokens_across_dp=m)
        assert torch.equal(out_s.view(torch.int16), out_r.view(torch.int16)), "symmetric must equal replicated bitwise"
        assert torch.equal(info.experts_to_copy, moe_r.last.experts_to_copy)
        errs.append(check_against_dense(out_s, x, ids, w, w13, w2))
        slots_used += int((info.experts_to_copy[r] >= 0).sum())
        # overflow: a remote expert's own segment (g < E, owner != r) holds rows on this rank
        cu = info.cu_seqlens.tolist()
        starts = [0] + cu[:-1]
        for g in range(E):
            if g // epn != r and cu[g] > starts[g]:
                overflow_rows += cu[g] - starts[g]
    t = torch.tensor([slots_used, overflow_rows])
    dist.all_reduce(t)
    assert sym.dense_weights == (B >= epn)
    sym.destroy()
    rep.destroy()
    pool.destroy()
    return max(errs), int(t[0]), int(t[1])


@pytest.mark.parametrize("R,E", [(2, 8), (3, 12), (4, 16)])
def test_moe_step_symmetric_equals_dense_and_replicated_with_skew(R, E):
    """A symmetric step not bitwise equal to the replicated one or off the dense reference, or overflow reads with B >= E/R."""
    B = E // R  # B = epn: the dense [home ; slots] path
    res = ranks(R, moe_step_vs_dense_and_replicated, E, B, 2.5, [100, 37], 11)
    err, slots, overflow = res[0]
    assert slots > 0, "skewed routing must fill prefetch slots"
    assert overflow == 0, "B >= epn must never need overflow reads"
    assert err < 2e-2


def test_moe_step_overflow_reads_owner_rows():
    """A remote expert without a slot (B < E/R) not read in place from its owner's rows."""
    # B = 1 < epn = 4, all tokens routed to rank 0's experts: rank 1 computes several of them,
    # one gets the slot, the others are read in place from rank 0 through the heap
    res = ranks(2, moe_step_vs_dense_and_replicated, 8, 1, -1.0, [128, 100], 5)
    err, slots, overflow = res[0]
    assert slots > 0
    assert overflow > 0, "the overflow path (a remote expert's segment read from the owner) must be exercised"


# ---------------------------------------------------------------------------- shared slot pool
def shared_slot_pool_layers(E, B, L):
    r, R = dist.get_rank(), dist.get_world_size()
    heap = HostHeap()
    slot_pool = SharedSlotPool(B, H, I, heap=heap, device="cpu")
    layers, weights = [], []
    for layer in range(L):
        w13, w2 = global_weights(E, H, I, seed=40 + layer)
        lw13, lw2 = local_experts(w13, w2, r, R)
        layers.append(SymmetricWeightLayout(lw13, lw2, E, heap=heap, slot_pool=slot_pool))
        weights.append((w13, w2, lw13, lw2))
    assert all(lay.num_slots == B and not lay.dense_weights for lay in layers)
    pool = _pool(E, R, B)
    slots = 0
    for step in range(2):
        for layer, lay in enumerate(layers):  # layers run one at a time, sharing the slots
            w13, w2, lw13, lw2 = weights[layer]
            x, ids, w = rank_inputs(64, E, K, H, sigma=2.5, seed=step * 10 + layer, rank=r)
            moe = MoonEPMoE(pool, lay, impl="reference")
            out = moe.forward(x, ids, w, num_tokens_across_dp=64)
            assert slot_pool.holder is lay
            check_against_dense(out, x, ids, w, w13, w2)
            slots += int((moe.last.experts_to_copy[r] >= 0).sum())
            rep = ReplicatedWeightLayout(lw13, lw2, E, B)
            out_r = MoonEPMoE(pool, rep, impl="reference").forward(x, ids, w, num_tokens_across_dp=64)
            assert torch.equal(out.view(torch.int16), out_r.view(torch.int16))
            rep.destroy()
    # a layer whose slots were overwritten by another layer's prefetch refuses to compute
    with pytest.raises(MoonEPStateError, match="another layer's experts"):
        layers[0].grouped_weights()
    # memory: L layers + one pool == the formula with a shared pool
    total = sum((lay.memory_report() for lay in layers[1:]), layers[0].memory_report()) + slot_pool.memory_report()
    assert heap.local_bytes() == total.resident  # what the heap holds, not the formula again
    # teardown: the pool cannot go before the layers (LIFO)
    with pytest.raises(MoonEPStateError, match="out-of-order"):
        slot_pool.destroy()
    destroy_in_order(slot_pool, *layers)
    assert heap.live() == []
    heap.close()
    pool.destroy()
    t = torch.tensor([slots])
    dist.all_reduce(t)
    return int(t[0])


def test_shared_slot_pool_across_layers():
    """A layer computing with another layer's shared slots, accounting that differs from the heap, or the pool freed first."""
    assert ranks(2, shared_slot_pool_layers, 8, 4, 3)[0] > 0


# ---------------------------------------------------------------------------- memory
def _fix_malloc():
    """Large allocations straight from mmap (and back to the OS on free) so RSS deltas are exact."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also stops glibc's dynamic threshold)
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_accounting(E, B, Hm, Im):
    _fix_malloc()
    r, R = dist.get_rank(), dist.get_world_size()
    epn = E // R
    w13, w2 = global_weights(E, Hm, Im, seed=1)
    lw13, lw2 = local_experts(w13, w2, r, R)
    del w13, w2
    bpe = 3 * Hm * Im * 2
    ReplicatedWeightLayout(lw13, lw2, E, B).destroy()  # warm up gloo's buffers for this size
    dist.barrier()
    rss0 = _rss()
    rep = ReplicatedWeightLayout(lw13, lw2, E, B)
    dist.barrier()
    rss_rep = _rss() - rss0
    rep_bytes = sum(t.nbytes for t in (rep.full_gate_weight, rep.full_up_weight, rep.full_down_weight))
    rep_report = rep.memory_report()
    rep.destroy()
    del rep
    dist.barrier()
    # warm up the heap path too (its first use maps files and builds Python state)
    warm = HostHeap(staging=False)
    SymmetricWeightLayout(lw13, lw2, E, B, heap=warm).destroy()
    warm.close()
    dist.barrier()
    rss1 = _rss()
    heap = HostHeap(staging=False)  # staging would double the owner's bytes (private + shared copy)
    sym = SymmetricWeightLayout(lw13, lw2, E, B, heap=heap)
    dist.barrier()
    rss_sym = _rss() - rss1
    sym_report = sym.memory_report()
    measured = sym.measured_bytes()
    # the report's parts are the rows the layout holds (epn home rows, B slots, nothing replicated)
    assert sym_report.home_rows == epn * bpe and sym_report.slots == B * bpe and sym_report.replicated_rows == 0
    # measured tensor bytes == accounted resident (the replicated report also counts the caller's params)
    assert rep_bytes == rep_report.replicated_rows + rep_report.slots
    assert measured["layout_bytes"] == sym_report.resident
    sym.destroy()
    heap.close()
    return rss_rep, rss_sym, rep_report.replicated_rows + rep_report.slots, sym_report.resident


def test_memory_accounted_matches_measured():
    """An accounting that drifts from what the layouts really hold (tensor bytes and RSS growth in
    fresh processes), e.g. a forgotten copy or a slot counted twice."""
    E, B, Hm, Im = 16, 4, 512, 512
    # fresh processes: RSS growth in a reused rank process would be hidden by freed pages of earlier tests
    res = ranks(4, memory_accounting, E, B, Hm, Im, fresh=True)
    for rss_rep, rss_sym, acc_rep, acc_sym in res:
        # right sign and size: the symmetric layout holds (epn + B) rows, the replicated (E + B)
        assert rss_sym < rss_rep
        assert abs((rss_rep - rss_sym) - (acc_rep - acc_sym)) < 0.25 * (acc_rep - acc_sym), (rss_rep, rss_sym, acc_rep, acc_sym)
        assert abs(rss_sym - acc_sym) < 0.25 * acc_sym + (1 << 20), (rss_sym, acc_sym)


# ---------------------------------------------------------------------------- teardown errors
class _NoPeerHeap(HostHeap):
    """A heap that cannot address peers (like ranks on another node)."""

    def addressable(self, rank: int) -> bool:
        return rank == self.rank


def teardown_and_addressability():
    r, R = dist.get_rank(), dist.get_world_size()
    E = 8
    w13, w2 = global_weights(E, H, I, seed=2)
    lw13, lw2 = local_experts(w13, w2, r, R)
    heap = HostHeap()
    a = SymmetricWeightLayout(lw13, lw2, E, 4, heap=heap, name="layer0")
    b = SymmetricWeightLayout(lw13, lw2, E, 4, heap=heap, name="layer1")
    msgs = []
    with pytest.raises(MoonEPStateError, match=r"out-of-order free of #1 'layer0.w2'.*next allocation to free is #3 'layer1.w2'") as ei:
        a.destroy()
    msgs.append(str(ei.value))
    a.grouped_weights()  # still alive and usable
    with pytest.raises(MoonEPStateError, match=r"leaked.*layer0.w13.*layer1.w2") as ei:
        heap.close()
    msgs.append(str(ei.value))
    b.destroy()
    a.destroy()
    a.destroy()
    with pytest.raises(MoonEPStateError, match="destroyed"):
        a.grouped_weights()
    assert heap.live() == []
    heap.close()
    # overflow without peer access: refused at construction, heap usable
    nph = _NoPeerHeap()
    with pytest.raises(MoonEPInputError, match=r"B=2 slots < epn=4.*cannot address every peer"):
        SymmetricWeightLayout(lw13, lw2, E, 2, heap=nph)
    assert nph.live() == []
    ok = SymmetricWeightLayout(lw13, lw2, E, 4, heap=nph)  # B >= epn needs no overflow reads
    assert ok.grouped_weights().dense_groups is not None
    ok.destroy()
    nph.close()
    # bad inputs: clear errors, nothing allocated
    heap = HostHeap()
    with pytest.raises(MoonEPInputError, match="BF16"):
        SymmetricWeightLayout(lw13.float(), lw2.float(), E, 4, heap=heap)
    with pytest.raises(MoonEPInputError, match="holds 4 experts"):
        SymmetricWeightLayout(lw13, lw2, 2 * E, 4, heap=heap)
    with pytest.raises(MoonEPInputError, match="w2 must be"):
        SymmetricWeightLayout(lw13, lw2[:, :, :64], E, 4, heap=heap)
    sp = SharedSlotPool(4, H, I, heap=heap)
    with pytest.raises(MoonEPInputError, match="differs from the shared slot pool"):
        SymmetricWeightLayout(lw13, lw2, E, 2, heap=heap, slot_pool=sp)
    lay = SymmetricWeightLayout(lw13, lw2, E, heap=heap, slot_pool=sp)
    with pytest.raises(MoonEPInputError, match="adopt_parameters: w13_param must be"):
        lay.adopt_parameters(torch.nn.Parameter(lw13[:1].clone(), requires_grad=False), lw2.clone())
    destroy_in_order(sp, lay)
    assert heap.live() == []
    heap.close()
    return msgs


def test_teardown_order_double_free_leaks_and_overflow_refusal():
    """Layouts freed out of LIFO order, leaks unnoticed, overflow allowed on a heap that cannot reach peers, bad weights accepted."""
    res = ranks(2, teardown_and_addressability)
    assert "LIFO" in res[0][0]
