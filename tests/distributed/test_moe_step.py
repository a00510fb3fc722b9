"""A full MoonEP MoE step (pad, dispatch, prefetch, grouped GEMM, combine) with the replicated
layout on R gloo ranks, against the dense float32 reference on full weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.engine import MoonEPInputError
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.weights import local_experts


def _setup(E, H, I, K, B, max_tokens, seed=0, tp=128, device="cpu", impl="reference"):
    r, R = dist.get_rank(), dist.get_world_size()
    w13, w2 = global_weights(E, H, I, seed)
    lw13, lw2 = local_experts(w13, w2, r, R)
    layout = ReplicatedWeightLayout(lw13.to(device), lw2.to(device), E, B)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=tp, device=device),
                            max_tokens_per_rank=max_tokens, engine="builtin")
    return MoonEPMoE(pool, layout, impl=impl), w13, w2


def step_matrix(m_list, H, I, E, K, sigma, device="cpu", impl="reference"):
    r = dist.get_rank()
    moe, w13, w2 = _setup(E, H, I, K, B=4, max_tokens=512, device=device, impl=impl)
    errs, slots = [], 0
    for m in m_list:
        x, ids, w = rank_inputs(m, E, K, H, sigma=sigma, seed=m, rank=r)
        out = moe.forward(x.to(device), ids.to(device), w.to(device), num_tokens_across_dp=m)
        assert out.device.type == torch.device(device).type
        errs.append(check_against_dense(out.cpu(), x, ids, w, w13, w2))
        slots += int((moe.last.experts_to_copy >= 0).sum())
    moe.pool.destroy()
    moe.layout.destroy()
    return max(errs), slots


@pytest.mark.parametrize("R", [2, 3, 4])
def test_replicated_step_matches_dense_with_skew(R):
    """A step that drifts from the dense reference under skewed routing, or skew that never fills a slot (the slot path untested)."""
    E = 30 if R == 3 else 32
    res = ranks(R, step_matrix, [1, 37, 100], 128, 256, E, 4, 2.5)
    assert all(s > 0 for _, s in res), "skewed routing must fill prefetch slots"


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("impl", ["reference", "grouped_mm", "triton"])
def test_replicated_step_matches_dense_cuda(R, impl):
    """A CUDA expert kernel (reference, grouped_mm, triton) or device transfer that breaks the step on GPUs."""
    res = ranks(R, step_matrix, [1, 37, 100, 512], 256, 512, 32, 4, 2.5, "cuda", impl)
    assert all(s > 0 for _, s in res)


def test_replicated_step_larger_shapes():
    """Accumulation or rounding error that shows only at vLLM's larger shapes (H=768, a full 512-token step)."""
    # vLLM's in-tree matrix tops out at (H, I) = (768, 2048); CPU budget: one rank count
    res = ranks(2, step_matrix, [512], 768, 256, 32, 4, 1.0)
    assert res[0][0] < 2e-2


def decode_step_home_routing():
    r, R = dist.get_rank(), dist.get_world_size()
    E, H, I, K = 16, 128, 128, 2
    epn = E // R
    moe, w13, w2 = _setup(E, H, I, K, B=2, max_tokens=256, tp=16)
    x, _, w = rank_inputs(1, E, K, H, sigma=0.0, seed=3, rank=r)
    ids = torch.tensor([[r * epn, r * epn + 1]], dtype=torch.int64)  # this rank's own experts
    out = moe.forward(x, ids, w, num_tokens_across_dp=1)
    check_against_dense(out, x, ids, w, w13, w2)
    res = (moe.pool.pad_expert, int((moe.last.experts_to_copy >= 0).sum()), moe.last.capacity)
    moe.pool.destroy()
    return res


@pytest.mark.parametrize("R", [2, 4])
def test_decode_padding_stays_on_its_rank(R):
    """Padding routed to one expert for every rank: a 1-token step's 127 padding tokens per rank
    overfill that expert's home, and the plan prefetches it to every other rank on every step."""
    res = ranks(R, decode_step_home_routing)
    assert [p for p, _, _ in res] == [r * (16 // R) for r in range(R)], res
    assert all(cap == 128 for _, _, cap in res), res
    assert all(slots == 0 for _, slots, _ in res), f"padding made the plan prefetch experts: {res}"


def varying_counts(counts):
    r = dist.get_rank()
    E, H, I, K = 16, 128, 128, 2
    moe, w13, w2 = _setup(E, H, I, K, B=2, max_tokens=1024, tp=16)
    caps = []
    for i, m in enumerate(counts):
        x, ids, w = rank_inputs(m, E, K, H, sigma=1.0, seed=100 + i, rank=r)
        out = moe.forward(x, ids, w)
        check_against_dense(out, x, ids, w, w13, w2)
        caps.append(moe.last.capacity)
    n_buffers = len(moe.pool.buffers)
    moe.pool.destroy()
    return caps, n_buffers


def test_pool_switches_capacity_between_steps():
    """A pool that picks the wrong power-of-two capacity for a step, or makes buffers instead of reusing them."""
    counts = [1, 200, 1024, 129, 64, 600, 3]
    res = ranks(2, varying_counts, counts)
    caps, n_buffers = res[0]
    assert caps == [128, 256, 1024, 256, 128, 1024, 128]
    assert n_buffers <= 4  # log2(1024/128) + 1


def every_capacity_at_first_use():
    """A pool made with make_all_at_first_use: its buffers after the first get, and whether later gets of other
    sizes reused them (the same objects) or made new ones."""
    R = dist.get_world_size()
    pool = MoonEPBufferPool(dict(H=128, K=2, E=8, num_ep_ranks=R, B=2, token_padding=32, device="cpu"), 600,
                            make_all_at_first_use=True)
    first = pool.get(3)[0]
    made = {c: id(b) for c, b in pool.buffers.items()}
    sizes = {c: b.S for c, b in pool.buffers.items()}
    later = [pool.get(n)[0] for n in (600, 129, 300, 1)]
    reused = all(id(pool.buffers[c]) == made[c] for c in later) and len(pool.buffers) == len(made)
    pool.destroy()
    return first, sorted(made), sizes, later, reused


def test_pool_makes_every_capacity_at_its_first_use():
    """A pool that makes a capacity at a later step (inside vLLM: after the KV cache was sized from a profile that
    never saw it, so it must fit what the KV cache left), a buffer of the wrong size under a capacity, or a later
    step that builds instead of reusing."""
    first, caps, sizes, later, reused = ranks(2, every_capacity_at_first_use)[0]
    assert first == 128 and caps == [128, 256, 512, 600], caps
    assert sizes == {c: c for c in caps}, sizes
    assert later == [600, 256, 512, 128] and reused


def dp_different_counts():
    r, R = dist.get_rank(), dist.get_world_size()
    E, H, I, K = 16, 128, 128, 4
    moe, w13, w2 = _setup(E, H, I, K, B=4, max_tokens=256, tp=32)
    mine = [3, 150, 0, 77][r]
    counts = [3, 150, 0, 77][:R]
    x, ids, w = rank_inputs(mine, E, K, H, sigma=2.0, seed=8, rank=r)
    out = moe.forward(x, ids, w, num_tokens_across_dp=max(counts))
    assert out.shape == (mine, H)
    check_against_dense(out, x, ids, w, w13, w2)
    return moe.last.capacity


@pytest.mark.parametrize("R", [2, 4])
def test_dp_ranks_with_different_token_counts(R):
    """DP ranks with different token counts picking different capacities (mismatched collectives) or returning padding rows."""
    caps = ranks(R, dp_different_counts)
    assert len(set(caps)) == 1 and caps[0] == 256


def top1_router_weight_on_input():
    r = dist.get_rank()
    E, H, I = 16, 128, 128
    moe, w13, w2 = _setup(E, H, I, 1, B=2, max_tokens=128, tp=8)
    x, ids, w = rank_inputs(20, E, 1, H, sigma=1.0, seed=4, rank=r)
    out = moe.forward(x, ids, w, apply_router_weight_on_input=True)
    # reference: weight applied to the input (rounded to bf16 as the caller would), FFN, no output weight
    xw = (x * w.to(torch.bfloat16))
    check_against_dense(out, xw, ids, torch.ones_like(w), w13, w2)
    with pytest.raises(MoonEPInputError, match="top-1"):
        x2, ids2, w2_ = rank_inputs(4, E, 2, H, sigma=0.0, seed=4, rank=r)
        moe.forward(x2, ids2, w2_, apply_router_weight_on_input=True)
    return True


def test_top1_apply_router_weight_on_input():
    """The router weight applied twice or not at all with apply_router_weight_on_input, or top-k > 1 accepted there."""
    assert ranks(2, top1_router_weight_on_input) == [True, True]


def bad_step_then_good():
    r = dist.get_rank()
    E, H, I, K = 16, 128, 128, 2
    moe, w13, w2 = _setup(E, H, I, K, B=2, max_tokens=128, tp=8)
    x, ids, w = rank_inputs(10, E, K, H, sigma=0.5, seed=1, rank=r)
    with pytest.raises(MoonEPInputError, match="BF16"):
        moe.forward(x.half(), ids, w)
    with pytest.raises(MoonEPInputError, match="capacity exceeded"):
        big, bids, bw = rank_inputs(129, E, K, H, sigma=0.5, seed=1, rank=r)
        moe.forward(big, bids, bw)
    bad_ids = ids.clone()
    bad_ids[0, 0] = -1  # invalid id: sanitized to expert 0 with weight 0, not an error
    out = moe.forward(x, bad_ids, w)
    w_ref = w.clone()
    w_ref[0, 0] = 0
    check_against_dense(out, x, torch.where(bad_ids < 0, 0, bad_ids), w_ref, w13, w2)
    out = moe.forward(x, ids, w)
    check_against_dense(out, x, ids, w, w13, w2)
    return True


def test_bad_step_then_good_step():
    """A refused step (non-BF16, capacity exceeded) that leaves the layer unusable, or an invalid id (-1) not routed with weight 0."""
    assert ranks(2, bad_step_then_good) == [True, True]


def layout_validation():
    r, R = dist.get_rank(), dist.get_world_size()
    w13, w2 = global_weights(8, 128, 128)
    lw13, lw2 = local_experts(w13, w2, r, R)
    cases = [
        (lambda: ReplicatedWeightLayout(lw13.float(), lw2.float(), 8, 2), "BF16"),
        (lambda: ReplicatedWeightLayout(lw13, lw2, 9, 2), "divisible"),
        (lambda: ReplicatedWeightLayout(lw13, lw2, 8, 0), "positive"),
        (lambda: ReplicatedWeightLayout(lw13[:, :, :64], lw2[:, :64], 8, 2), "multiples of 128"),
        (lambda: ReplicatedWeightLayout(lw13, lw2[:, :, :64], 8, 2), "w2 must be"),
    ]
    for make, needle in cases:
        with pytest.raises(MoonEPInputError, match=needle):
            make()
    lay = ReplicatedWeightLayout(lw13, lw2, 8, 2)
    assert torch.equal(lay.full_gate_weight[:8], w13[:, :128]) and torch.equal(lay.full_down_weight[:8], w2)
    rep = lay.memory_report()
    assert rep.replicated_rows == 8 * 3 * 128 * 128 * 2 and rep.slots == 2 * 3 * 128 * 128 * 2
    lay.destroy()
    lay.destroy()
    return True


def test_replicated_layout_validation_and_contents():
    """A replicated layout that accepts bad weights, gathers experts out of order, misreports its bytes or fails a second destroy."""
    assert ranks(2, layout_validation) == [True, True]
