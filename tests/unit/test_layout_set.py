"""``LayoutSet`` / ``build_layouts`` in a world of one (host heap): heap-order teardown with slot
pools of several shapes, who closes the heap, adopted parameters, the memory report against what
the heap really holds, and the set's refusals."""

from __future__ import annotations

import pytest
import torch

from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.engine import MoonEPInputError, MoonEPStateError
from vllm_moonep.layouts import LAYOUT_KINDS, LayoutSet, build_layouts, layout_kind
from vllm_moonep.symmetric import HostHeap

E, B, K = 4, 2, 2


def _layers(shapes, seed=0):
    """Global weights per layer and ``(w13, w2)`` copies for the set (world of one: all experts local)."""
    full = [global_weights(E, H, I, seed=seed + n) for n, (H, I) in enumerate(shapes)]
    return full, [(w13.clone(), w2.clone()) for w13, w2 in full]


def test_shared_set_frees_in_heap_order_with_pools_of_two_shapes():
    """A teardown that freed a slot pool before the layers after it (or the layers oldest first)
    is refused by the LIFO heap; a heap the set made must be closed, and every layer destroyed."""
    shapes = [(128, 128), (128, 128), (128, 256), (128, 128)]
    _, local = _layers(shapes)
    layouts = build_layouts("symmetric-shared", local, E, B)
    assert layouts.owns_heap and isinstance(layouts.heap, HostHeap)
    assert sorted(layouts.slot_pools) == [(128, 128), (128, 256)]
    assert [lay.slot_pool for lay in layouts.layouts] == [layouts.slot_pools[s] for s in shapes]
    heap = layouts.heap
    # the heap holds, allocation by allocation, what the set accounts (not the formula again)
    assert heap.local_bytes() == layouts.memory_report().resident
    assert len(heap.live()) == 2 * (len(shapes) + 2)
    layouts.destroy()
    assert heap.closed and heap.live() == []
    for lay in layouts.layouts:
        with pytest.raises(MoonEPStateError, match="destroyed"):
            lay.grouped_weights()
    layouts.destroy()  # idempotent
    with pytest.raises(MoonEPStateError, match="destroyed"):
        layouts.add_layer(*local[0])


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_each_kind_steps_like_the_dense_reference(kind):
    """A set whose layers were wired to the wrong weights, slots or slot pool would compute another
    layer's experts: every layer of every kind checked against the dense MoE."""
    full, local = _layers([(128, 128)] * 3, seed=7)
    layouts = build_layouts(kind, local, E, B, **({} if kind == "replicated" else {"heap_kind": "host"}))
    pool = MoonEPBufferPool(dict(H=128, K=K, E=E, num_ep_ranks=1, B=B, device="cpu"), 128, engine="builtin")
    try:
        assert len(layouts) == 3 and all(lay.kind == ("replicated" if kind == "replicated" else "symmetric")
                                         for lay in layouts.layouts)
        for n, lay in enumerate(layouts.layouts):
            x, ids, w = rank_inputs(40, E, K, 128, sigma=1.0, seed=n, rank=0)
            check_against_dense(MoonEPMoE(pool, lay, impl="reference").forward(x, ids, w), x, ids, w, *full[n])
    finally:
        pool.destroy()
        layouts.destroy()


def test_a_given_heap_stays_open_and_parameters_are_adopted():
    """The set closed a heap the caller still used, or kept a second copy of adopted parameters."""
    _, local = _layers([(128, 128)] * 2)
    params = [tuple(torch.nn.Parameter(t, requires_grad=False) for t in pair) for pair in local]
    heap = HostHeap()
    layouts = LayoutSet("symmetric", E, B, heap=heap, adopt_parameters=True)
    for p13, p2 in params:  # layer by layer, as vLLM loads them
        layouts.add_layer(p13, p2)
    assert not layouts.owns_heap and layouts.slot_pools == {}
    for (p13, p2), lay in zip(params, layouts.layouts):
        assert p13.data_ptr() == lay.home_w13.data_ptr() and p2.data_ptr() == lay.home_w2.data_ptr()
    layouts.destroy()
    assert not heap.closed and heap.live() == []
    heap.close()


def test_replicated_set_reports_the_local_copy_only_when_kept():
    """keeps_local_params=False (the plugin: vLLM rebinds its parameters) must drop the home rows
    from the report; the default keeps them."""
    _, local = _layers([(128, 128)])
    kept = build_layouts("replicated", local, E, B)
    dropped = build_layouts("replicated", local, E, B, keeps_local_params=False)
    assert kept.heap is None and dropped.heap is None
    bpe = 3 * 128 * 128 * 2  # one bf16 expert: gate, up and down of H = I = 128
    got = kept.memory_report()
    assert (got.home_rows, got.replicated_rows, got.slots) == (E * bpe, E * bpe, B * bpe)
    got = dropped.memory_report()
    assert (got.home_rows, got.replicated_rows, got.slots) == (0, E * bpe, B * bpe)
    kept.destroy()
    dropped.destroy()


def test_build_layouts_frees_what_it_built_when_a_layer_fails():
    """A failed layer left the earlier layers' heap allocations live (a leak that also blocks every
    later LIFO free on the heap)."""
    _, local = _layers([(128, 128)])
    bad = (local[0][0].float(), local[0][1])
    heap = HostHeap()
    with pytest.raises(MoonEPInputError, match="BF16"):
        build_layouts("symmetric-shared", [local[0], bad], E, B, heap=heap)
    assert heap.live() == [] and not heap.closed
    heap.close()


def test_refusals_and_kind_names():
    """A set that took a heap it never uses, or a kind it cannot build, failed later and far away."""
    with pytest.raises(MoonEPInputError, match="kind must be one of"):
        LayoutSet("sharded", E, B)
    with pytest.raises(MoonEPInputError, match="num_slots must be a positive int"):
        LayoutSet("symmetric", E, 0)
    with pytest.raises(MoonEPInputError, match="heap_kind must be one of"):
        LayoutSet("symmetric", E, B, heap_kind="shmem")
    heap = HostHeap()
    with pytest.raises(MoonEPInputError, match="heap do.es. not apply to a replicated set"):
        LayoutSet("replicated", E, B, heap=heap)
    heap.close()
    # options the kind never reads were silently ignored (moonep-ab passed adopt_parameters to the
    # replicated set, the soak timeout_s to the symmetric one)
    with pytest.raises(MoonEPInputError, match="heap_kind, adopt_parameters do.es. not apply to a replicated set"):
        LayoutSet("replicated", E, B, heap_kind="host", adopt_parameters=True)
    with pytest.raises(MoonEPInputError, match="keeps_local_params, timeout_s do.es. not apply to a symmetric set"):
        LayoutSet("symmetric", E, B, keeps_local_params=False, timeout_s=5.0)
    assert layout_kind("replicated") == "replicated"
    assert layout_kind("symmetric") == "symmetric" and layout_kind("symmetric", True) == "symmetric-shared"
    with pytest.raises(MoonEPInputError, match="needs the symmetric weight layout"):
        layout_kind("replicated", True)


@pytest.mark.parametrize("kind", ["symmetric", "symmetric-shared"])
def test_add_layer_checks_the_weights_before_the_heap_and_slot_pool(kind):
    """A w2 that is not 3-D was read for the slot pool's shape before any check (a bare IndexError), and
    a refused layer had already made the heap, or a slot pool of its shape that stayed allocated."""
    _, local = _layers([(128, 128), (128, 256)])
    (w13, w2), (w13b, w2b) = local
    ls = LayoutSet(kind, E, B)
    bad = [((w13, w2[0]), r"w13 must be \[epn, 2I, H\] and w2 \[epn, H, I\], got \[4, 256, 128\], \[128, 128\]"),
           ((w13.float(), w2.float()), "BF16 expert weights only"),
           ((w13.tolist(), w2), "LayoutSet.add_layer: w13_local and w2_local must be tensors, got list, Tensor"),
           ((w13, w2[:, :, :64].contiguous()), r"w2 must be \[epn=4, H=128, I=128\]")]
    for args, match in bad:
        with pytest.raises(MoonEPInputError, match=match):
            ls.add_layer(*args)
        assert ls.heap is None and ls.slot_pools == {} and len(ls) == 0 and ls.device is None
    ls.add_layer(w13, w2)
    heap = ls.heap
    live = list(heap.live())
    # later refusals: by the checks (before the heap), or by the layout after a slot pool of a new shape
    # was made for it (weights on another device than the heap): nothing of theirs stays allocated
    for args, match in bad[:1] + [((w13b.to("meta"), w2b.to("meta")), "the weights are on meta")]:
        with pytest.raises(MoonEPInputError, match=match):
            ls.add_layer(*args)
        assert heap.live() == live and len(ls) == 1
        assert sorted(ls.slot_pools) == ([(128, 128)] if kind == "symmetric-shared" else [])
    lay = ls.add_layer(w13b, w2b)  # the next good layer, of the new shape
    assert len(ls) == 2 and lay.intermediate_size == 256 and ls.device == torch.device("cpu")
    ls.destroy()
    assert heap.closed and heap.live() == []
