"""The measuring helpers without ranks: the difference between measured and accounted memory
attributed to causes (and said only above 10%), the tensor bytes a configuration holds (each
storage once, heap allocations apart), a fresh measurement seeing a real allocation and its
release, and how NVSHMEM RMA gets are cut to fit their scratch buffer."""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.common.memory import (EXPLAIN_ABOVE, MiB, UNATTRIBUTED, explain_difference, held_tensor_bytes,
                                       peak_rss, release_freed_memory, reset_peak, resident_bytes)
from vllm_moonep.engine.heaps import HostHeap
from vllm_moonep.engine.heaps.nvshmem_heap import rma_chunks


def test_difference_is_explained_only_above_ten_percent_and_attributed():
    """'measured MiB' stood next to the accounting with no word on why the two differed."""
    small = explain_difference(105 * MiB, 100 * MiB, [])
    assert small["why"] is None and small["relative"] == pytest.approx(0.05) and EXPLAIN_ABOVE == 0.10
    big = explain_difference(210 * MiB, 100 * MiB, [("staging copy", 100 * MiB)])
    assert big["why"].startswith("measured 210.0 MiB vs accounted 100.0 MiB (+110%): staging copy +100.0 MiB")
    assert big["unexplained"] == 10 * MiB and f"{UNATTRIBUTED} +10.0 MiB" in big["why"]
    fully = explain_difference(200 * MiB, 100 * MiB, [("a", 60 * MiB), ("b", 40 * MiB), ("tiny", 1)])
    assert fully["unexplained"] == -1 and "not attributed" not in fully["why"] and "tiny" not in fully["why"]
    less = explain_difference(50 * MiB, 100 * MiB, [])
    assert "(-50%)" in less["why"] and f"{UNATTRIBUTED} -50.0 MiB" in less["why"]
    assert "nothing accounted" in explain_difference(8 * MiB, 0, [])["why"]


def test_held_tensor_bytes_counts_each_storage_once_and_heap_allocations_apart():
    """Views and adopted parameters (tensors aliasing heap rows) counted twice would hide a real leak."""

    class Layout:
        pass

    heap = HostHeap(staging=True)
    try:
        h = heap.allocate((4, 256), torch.bfloat16, "rows")
        lay = Layout()
        lay.full = torch.zeros(1024, dtype=torch.float32)  # 4096 bytes
        lay.view = lay.full[:10]  # the same storage
        lay.pair = (torch.zeros(16, dtype=torch.uint8), lay.full)
        lay.handle = h
        param = torch.zeros(4, 256, dtype=torch.bfloat16)
        param.data = h.tensor  # adopted: the parameter is the heap's memory
        got = held_tensor_bytes(lay, [param])
        assert got == {"torch": 4096 + 16, "heap": 4 * 256 * 2, "heap_allocations": 1}
        assert held_tensor_bytes(heap)["heap"] == 2048  # a heap's live allocations, through its ledger
        heap.free(h)
        assert held_tensor_bytes(lay)["heap"] == 0  # a freed allocation holds nothing
    finally:
        heap.close(force=True)


def test_resident_bytes_sees_an_allocation_and_its_release():
    """RSS growth read without releasing freed memory kept transients (114 MiB measured against 72)."""
    release_freed_memory("cpu")
    base = resident_bytes("cpu")
    t = torch.ones(64 * MiB // 4)  # 64 MiB, touched
    release_freed_memory("cpu")
    grown = resident_bytes("cpu") - base
    assert 60 * MiB <= grown <= 70 * MiB, grown
    del t
    release_freed_memory("cpu")
    assert resident_bytes("cpu") - base < 4 * MiB


def test_reset_peak_says_whether_the_peak_restarted():
    """A refused /proc/self/clear_refs left VmHWM at the lifetime peak, read as the build's peak
    (moonep-ab's peak column too high, silently)."""
    big = torch.ones(64 * MiB // 4)  # 64 MiB touched, then freed: a peak above what follows
    del big
    release_freed_memory("cpu")
    before = peak_rss()
    ok = reset_peak("cpu")
    after = peak_rss()
    assert isinstance(ok, bool)
    if before is None or after is None:
        pytest.skip("no /proc/self/status VmHWM here")
    if ok:
        assert after <= before - 32 * MiB, (before, after)
    else:
        assert after == before


def test_rma_chunks_cover_every_byte_once_within_the_scratch():
    """A peer row read by RMA through a scratch smaller than the row was copied only in part."""
    for rows, row_bytes, scratch in (([3, 1, 2, 0], 10, 25), ([2, 0], 100, 30), ([5], 64, 64), ([], 8, 8)):
        batches = rma_chunks(rows, row_bytes, scratch)
        covered = {}
        for batch in batches:
            used = batch[-1][1] + batch[-1][3]
            assert used <= scratch
            for src, scr, dst, n in batch:
                assert dst - batch[0][2] == scr, "the scratch prefix maps onto one contiguous destination range"
                for k in range(n):
                    assert dst + k not in covered
                    covered[dst + k] = src + k
        want = {i * row_bytes + k: r * row_bytes + k for i, r in enumerate(rows) for k in range(row_bytes)}
        assert covered == want, (rows, row_bytes, scratch)
    with pytest.raises(Exception, match="must be > 0"):
        rma_chunks([0], 0, 8)
