"""Single-process checks of the symmetric heaps (ledger, LIFO rule, cleanup, factory, refusals)
and of the symmetric layout in a world of one rank."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE, WeightLayout
from vllm_moonep.common.grouped_gemm import interleave_w13
from vllm_moonep.engine import MoonEPInputError, MoonEPStateError, MoonEPUnavailableError
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.symmetric import HostHeap, SharedSlotPool, SymmetricWeightLayout, make_heap
from vllm_moonep.engine.heaps import host as host_mod

H, I = 128, 128


def _files(heap: HostHeap) -> list[str]:
    return [f for f in os.listdir(heap.shm_dir) if f.startswith(heap.prefix)]


def test_ledger_lifo_double_free_leak_and_usable_after_errors():
    """The host heap freeing out of LIFO order, closing over live allocations, reusing a live tag or freeing another
    heap's allocation."""
    heap = HostHeap()
    a = heap.allocate((2, 3), torch.float32, "a")
    b = heap.allocate((4,), torch.bfloat16, "b")
    assert [h.tag for h in heap.live()] == ["a", "b"]
    assert heap.local_bytes() == 2 * 3 * 4 + 4 * 2
    assert heap.peer_view(a, 0) is a.tensor
    with pytest.raises(MoonEPStateError, match=r"out-of-order free of #0 'a'.*next allocation to free is #1 'b'"):
        heap.free(a)
    with pytest.raises(MoonEPStateError, match=r"leaked.*#0 'a'.*#1 'b'"):
        heap.close()
    with pytest.raises(MoonEPInputError, match="tag 'a' is already live"):
        heap.allocate((1,), torch.float32, "a")
    with pytest.raises(MoonEPInputError, match="non-empty string"):
        heap.allocate((1,), torch.float32, "")
    with pytest.raises(MoonEPInputError, match="negative dimension"):
        heap.allocate((-1,), torch.float32, "neg")
    with pytest.raises(MoonEPInputError, match="rank must be in"):
        heap.peer_view(a, 1)
    other = HostHeap()
    with pytest.raises(MoonEPInputError, match="belongs to another heap"):
        other.free(a)
    other.close()
    assert len(heap.live()) == 2  # nothing changed
    heap.free(b)
    heap.free(a)
    with pytest.raises(MoonEPStateError, match="double free of allocation #1 'b'"):
        heap.free(b)
    with pytest.raises(MoonEPStateError, match="was freed"):
        heap.peer_view(a, 0)
    heap.close()
    heap.close()
    with pytest.raises(MoonEPStateError, match="closed"):
        heap.allocate((1,), torch.float32, "late")


def test_close_force_frees_everything_lifo_and_leaves_no_files():
    """A forced close leaving allocations live or /dev/shm files behind."""
    heap = HostHeap()
    hs = [heap.allocate((8,), torch.float32, f"t{i}") for i in range(3)]
    assert _files(heap) == []  # unlinked as soon as every rank mapped them
    heap.close(force=True)
    assert heap.live() == [] and all(h.freed and h.tensor is None for h in hs)


def test_context_manager_and_zero_size_allocation():
    """A zero-size allocation that cannot be made or freed, or a heap left open after its with block."""
    with HostHeap() as heap:
        z = heap.allocate((0, 4), torch.float32, "empty")
        assert z.tensor.shape == (0, 4)
        heap.free(z)
    assert heap.closed


def test_atexit_cleanup_removes_pending_files(tmp_path):
    """/dev/shm files of a process that exits before unlinking them left behind."""
    path = tmp_path / "vllm_moonep_pending"
    path.write_bytes(b"x")
    host_mod._PENDING.add(str(path))
    host_mod._cleanup_pending()
    assert not path.exists() and str(path) not in host_mod._PENDING


def test_staging_hides_writes_until_barrier_even_alone():
    """Host-heap writes visible to peers before the barrier (staging models the real heaps' ordering), even in a world
    of one."""
    heap = HostHeap()
    h = heap.allocate((3,), torch.float32, "s")
    h.tensor.fill_(5.0)
    shared = h._impl["shared"][0]
    assert float(shared.sum()) == 0.0
    heap.barrier()
    assert float(shared.sum()) == 15.0
    heap.free(h)
    heap.close()


def test_make_heap_kinds_and_refusals(monkeypatch):
    """make_heap accepting an unknown kind or a device it cannot serve, or a GPU heap starting with multicast on."""
    heap = make_heap("auto", device="cpu")
    assert isinstance(heap, HostHeap)
    heap.close()
    with pytest.raises(MoonEPInputError, match="heap kind must be one of"):
        make_heap("shmem")
    with pytest.raises(MoonEPInputError, match="device must be cpu"):
        HostHeap(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(MoonEPUnavailableError, match="CUDA"):
            make_heap("torch")
    # a GPU heap refuses to start with multicast enabled unless the user opts in
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("VLLM_MOONEP_ALLOW_MULTICAST", raising=False)
    with pytest.raises(RuntimeError, match="multicast"):
        make_heap("torch")


@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is not None, reason="nvshmem4py is installed here")
def test_nvshmem_heap_unavailable_names_the_extra():
    """Asking for the NVSHMEM heap without nvshmem4py failing without naming the extra to install."""
    with pytest.raises(MoonEPUnavailableError, match=r"nvshmem4py does not import.*vllm-moonep\[nvshmem\]"):
        make_heap("nvshmem")


def test_layout_world_of_one_matches_dense_and_replicated():
    """The symmetric layout in a world of one differing from the replicated layout or the dense MoE, holding other
    than it accounts, or usable after destroy."""
    E, K, B = 4, 2, 2
    w13, w2 = global_weights(E, H, I, seed=9)
    lay = SymmetricWeightLayout(w13.clone(), w2.clone(), E, B, heap="host")  # owns its heap
    rep = ReplicatedWeightLayout(w13.clone(), w2.clone(), E, B)
    assert isinstance(lay, WeightLayout) and lay.kind == "symmetric"
    assert lay.heap.local_bytes() == lay.memory_report().resident  # accounted == what the heap holds
    gw = lay.grouped_weights()
    assert gw.dense_groups.tolist() == [0, 1, 2, 3, 4, 5]
    # the home rows hold each expert's gate and up interleaved (the order the Triton tiles read as one weight)
    assert torch.equal(lay.home_w13, interleave_w13(w13)) and torch.equal(lay.home_w2, w2)
    assert gw.interleaved and torch.equal(gw.gate[0][:E], w13[:, :I]) and torch.equal(gw.up[0][:E], w13[:, I:])
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, device="cpu"), 128, engine="builtin")
    x, ids, w = rank_inputs(50, E, K, H, sigma=1.0, seed=1, rank=0)
    out = MoonEPMoE(pool, lay, impl="reference").forward(x, ids, w)
    out_r = MoonEPMoE(pool, rep, impl="reference").forward(x, ids, w)
    assert torch.equal(out.view(torch.int16), out_r.view(torch.int16))
    check_against_dense(out, x, ids, w, w13, w2)
    heap = lay.heap
    lay.destroy()
    assert heap.closed and heap.live() == []
    with pytest.raises(MoonEPStateError, match="destroyed"):
        lay.prefetch(None, None)
    pool.destroy()


def test_adopt_parameters_makes_parameters_heap_memory():
    """adopt_parameters leaving the parameters on their own storage (a second copy), or taking a parameter of the
    wrong shape."""
    E = 2
    w13, w2 = global_weights(E, H, I, seed=4)
    heap = HostHeap()
    lay = SymmetricWeightLayout(torch.zeros_like(w13), torch.zeros_like(w2), E, 1, heap=heap)
    p13, p2 = torch.nn.Parameter(w13.clone(), requires_grad=False), torch.nn.Parameter(w2.clone(), requires_grad=False)
    lay.adopt_parameters(p13, p2)  # copies the loaded values in (w13 interleaved), then rebinds
    assert p13.data_ptr() == lay.home_w13.data_ptr() and p2.data_ptr() == lay.home_w2.data_ptr()
    assert torch.equal(lay.home_w13, interleave_w13(w13))
    gw = lay.grouped_weights()
    assert torch.equal(gw.gate[0][:E], w13[:, :I]) and torch.equal(gw.up[0][:E], w13[:, I:])
    with torch.no_grad():
        p2.mul_(2)
    assert torch.equal(lay.home_w2, w2 * 2)
    with pytest.raises(MoonEPInputError, match="w2_param must be"):
        lay.adopt_parameters(p13, torch.zeros(E, H, I))
    lay.destroy()
    heap.close()


def test_slot_pool_validation():
    """A shared slot pool with no slots or a non-tile size, or serving a layer of another shape; its destroy not
    idempotent."""
    heap = HostHeap()
    with pytest.raises(MoonEPInputError, match="num_slots must be a positive int"):
        SharedSlotPool(0, H, I, heap=heap)
    with pytest.raises(MoonEPInputError, match="multiple of 128"):
        SharedSlotPool(2, 100, I, heap=heap)
    sp = SharedSlotPool(2, H, I, heap=heap)
    w13, w2 = global_weights(2, 2 * H, I, seed=0)
    with pytest.raises(MoonEPInputError, match="shared slot pool holds experts of H=128"):
        SymmetricWeightLayout(w13, w2, 2, heap=heap, slot_pool=sp)
    assert len(heap.live()) == 2
    sp.destroy()
    sp.destroy()
    heap.close()


def test_owner_teardown_after_a_forced_close_and_a_retried_destroy_are_no_ops():
    """After heap.close(force=True) (what the 'leaked' message advises), every owner's destroy()
    raised 'the heap was closed' for good; and a layout destroy retried after its first free went
    through freed that allocation again ('double free'), so the layout could never be destroyed."""
    E, B = 4, 2
    w13, w2 = global_weights(E, H, I, seed=3)
    heap = make_heap("host")
    first = SymmetricWeightLayout(w13.clone(), w2.clone(), E, B, heap=heap)
    second = SymmetricWeightLayout(w13.clone(), w2.clone(), E, B, heap=heap)
    heap.free(second._w2)  # a teardown that stopped after its first free (the second raised)
    second.destroy()  # the retry frees what is left and completes
    with pytest.raises(MoonEPStateError, match="destroyed"):
        second.grouped_weights()
    assert len(heap.live()) == 2
    heap.close(force=True)
    first.destroy()  # the heap already released its memory: nothing to do, no error
    assert heap.closed and heap.live() == []
    with pytest.raises(MoonEPStateError, match="closed"):
        heap.allocate((4,), torch.int32, "after_close")
