"""Expert memory measured, not assumed: each symmetric layout built in fresh rank processes (the
home rows adopted as the framework's parameters, as the vLLM plugin does), on a host heap without
staging copies, holds what its accounting says: the RSS growth of building it is within 10% of
the accounted resident bytes. (moonep-ab measures every configuration the same way:
test_ab.py; the GPU heaps: test_multi_gpu.py.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import global_weights
from vllm_moonep.common.memory import MiB, release_freed_memory, resident_bytes
from vllm_moonep.layouts import build_layouts
from vllm_moonep.symmetric import HostHeap, SymmetricWeightLayout
from vllm_moonep.testing.launch import launched_world_size
from vllm_moonep.testing.weights import local_experts

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="measures in fresh spawned rank processes")

#: every thread's allocations in glibc's main arena, whose freed pages malloc_trim returns
FRESH_ENV = {"MALLOC_ARENA_MAX": "1"}


def measure_symmetric(shared: bool, E: int, B: int, H: int, I: int, L: int):
    """RSS growth of building ``L`` layers (and the shared pool) from a baseline taken after start-up
    and a warm-up of the group; the accounted bytes; the heap's live bytes."""
    r, R = dist.get_rank(), dist.get_world_size()
    full = [global_weights(E, H, I, seed=l) for l in range(L)]
    warm = HostHeap(staging=False)  # first use of the heap path (Python state, gloo pairs)
    SymmetricWeightLayout(*local_experts(*full[0], r, R), E, B, heap=warm).destroy()
    warm.close()
    dist.barrier()
    release_freed_memory("cpu")
    base = resident_bytes("cpu")
    local = [local_experts(w13, w2, r, R) for w13, w2 in full]
    heap = HostHeap(staging=False)
    # adopted: the parameters are the heap's home rows now
    layouts = build_layouts("symmetric-shared" if shared else "symmetric", local, E, B, heap=heap,
                            adopt_parameters=True)
    dist.barrier()
    release_freed_memory("cpu")
    grown = resident_bytes("cpu") - base
    accounted = layouts.memory_report().resident
    live = heap.local_bytes()
    layouts.destroy()
    assert heap.live() == [] and not heap.closed, "the set frees what it allocated and leaves the caller's heap open"
    heap.close()
    return grown, accounted, live


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer-slots", "shared-slot-pool"])
def test_symmetric_layout_holds_what_it_accounts(shared):
    """The memory tests compared a layout's report with the formula that produced it (they could
    not disagree); measured in a fresh process, the layout must hold what it reports."""
    for grown, accounted, live in ranks(2, measure_symmetric, shared, 16, 4, 512, 512, 3, env=FRESH_ENV, fresh=True):
        assert live == accounted
        assert abs(grown - accounted) <= 0.10 * accounted + MiB, (grown / MiB, accounted / MiB)
