"""Batch invariance of the whole MoE step (``MoonEPMoE(batch_invariant=True)``, what
``VLLM_BATCH_INVARIANT=1`` turns on): the same probe tokens on every rank, in steps whose other
tokens change their number (so the pool's capacity and the tiles' tokens per rank change), their
routing (steps that send every token to rank 0's experts, so the plan serves those experts from
the other ranks' slots and overflow rows) and the probe's place among them. The probe's output must
be the same bits in every step, on both layouts, and right against the dense float32 reference.
The steps' bf16 outputs round away most last-bit differences of the float32 sums, so this checks the
whole step's plumbing (slots, overflow rows, combine); the expert compute's own bits are checked in
float32 and with large probes in ``tests/unit/test_batch_invariance.py``, the combine's order here with
values whose fp32 sum only one order gets right."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_rows_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.symmetric import SymmetricWeightLayout
from vllm_moonep.testing.weights import local_experts

E, H, I, K, B = 16, 128, 256, 4, 4
PROBE = 3
#: segments padded to one row: a segment's rows, and so the matmuls' rows, follow the step's tokens exactly
TP = 1
#: (other tokens per rank, every token to rank 0's experts): capacities 128 to 512, cold and hot
STEPS = [(1, False), (61, True), (200, False), (450, True), (29, True), (300, False)]


def _hot_ids(m: int, epn: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(epn, generator=g)[:K] for _ in range(m)]).to(torch.int32)


def probe_across_steps(layout_kind: str, device: str, impl: str, invariant: bool, transport: str = "auto"):
    r, R = dist.get_rank(), dist.get_world_size()
    epn = E // R
    w13, w2 = global_weights(E, H, I, seed=5)
    lw13, lw2 = (t.to(device) for t in local_experts(w13, w2, r, R))
    layout = (ReplicatedWeightLayout(lw13, lw2, E, B) if layout_kind == "replicated"
              else SymmetricWeightLayout(lw13, lw2, E, B))
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=TP, device=device,
                                 transport=transport), max_tokens_per_rank=512, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl=impl, batch_invariant=invariant)
    px, _, pw = rank_inputs(PROBE, E, K, H, sigma=0.0, seed=77, rank=r)
    pids = _hot_ids(PROBE, epn, seed=1000 + r)  # rank 0's experts: the ones the hot steps spread
    probes, caps, moved = [], [], 0
    for i, (m, hot) in enumerate(STEPS):
        x, ids, w = rank_inputs(m, E, K, H, sigma=1.0, seed=300 + i, rank=r)
        if hot:
            ids = _hot_ids(m, epn, seed=500 + 10 * i + r)
        at = (13 * i + 5 * r) % (m + 1)  # the probe's place among this step's tokens
        X = torch.cat([x[:at], px, x[at:]])
        IDS = torch.cat([ids[:at], pids, ids[at:]])
        W = torch.cat([w[:at], pw, w[at:]])
        out = moe.forward(X.to(device), IDS.to(device), W.to(device)).cpu()
        check_rows_against_dense(out, X, IDS, W, w13, w2)
        probes.append(out[at:at + PROBE])
        caps.append(moe.last.capacity)
        # rows of rank 0's experts computed on another rank (their slots or overflow segments)
        cu = moe.last.cu_seqlens.cpu().tolist()
        starts = [0] + cu[:-1]
        moved += sum(cu[g] - starts[g] for g in range(len(cu)) if r != 0 and (g < epn or g >= E))
    same = [bool(torch.equal(p.view(torch.int16), probes[0].view(torch.int16))) for p in probes]
    layout.destroy()
    pool.destroy()
    return same, caps, moved


@pytest.mark.parametrize("layout_kind", ["replicated", "symmetric"])
@pytest.mark.parametrize("R,transport,env", [(2, "collective", None), (4, "collective", None), (2, "symmetric", None),
                                             (4, "hybrid", {RANKS_PER_NODE_ENV: "2"})],
                         ids=["R2-collective", "R4-collective", "R2-symmetric", "R4-hybrid-2-nodes"])
def test_probe_tokens_same_bits_in_every_step(R, transport, env, layout_kind):
    """A token's MoE output that follows the step's other tokens by more than bf16 rounding hides (a slot or
    overflow row computing another value than its home row, a combine taking in other tokens' rows, rows
    lost or misplaced against the dense reference) on any transport. The last bits are checked where they
    show: the expert compute in float32 (tests/unit/test_batch_invariance.py) and the combine's order
    (``test_combine_sums_each_token_k_ascending``)."""
    res = ranks(R, probe_across_steps, layout_kind, "cpu", "auto", True, transport, env=env)
    for r, (same, caps, moved) in enumerate(res):
        assert all(same), f"rank {r}: the probe's output changed in steps {[i for i, s in enumerate(same) if not s]}"
        assert len(set(caps)) >= 3, f"rank {r}: the steps must span capacities, got {caps}"
    assert sum(moved for _, _, moved in res) > 0, "the hot steps must compute rank 0's experts on other ranks"


#: route weights that name an entry's k, and the expert output each k's rows get: summed k ascending in fp32,
#: (1e8 - 1e8) + 1 = 1; in any other order the 1 meets one of the 1e8 first and rounds away: 0
K_CODE = {0.25: 1e8, 0.5: -1e8, 0.75: 1.0}


def combine_order(transport: str):
    from vllm_moonep.engine import Buffer

    r, R = dist.get_rank(), dist.get_world_size()
    S, H, Kc, Ec, Bc = 24, 8, 3, 4 * R, 2
    buf = Buffer(S, H, Kc, Ec, R, B=Bc, token_padding=4, device="cpu", dtype=torch.float32, transport=transport)
    g = torch.Generator().manual_seed(40 + r)
    hot = torch.randperm(Ec // R, generator=g)[:Kc]  # rank 0's experts: the plan moves some into slots
    ids = torch.stack([hot if t % 2 else torch.randperm(Ec, generator=g)[:Kc] for t in range(S)]).to(torch.int32)
    w = torch.tensor(list(K_CODE))[None, :].expand(S, Kc).contiguous()
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=Ec).to(torch.int32)
    xn, wn, cu, plan = buf.dispatch(torch.randn(S, H, generator=g), w, ids, tpe)
    y = torch.zeros_like(xn)
    for code, val in K_CODE.items():
        y[wn == code] = val
    out, _, _ = buf.combine(plan, y)
    slots = int((plan.experts_to_copy >= 0).sum())
    buf.destroy()
    return sorted(set(out.reshape(-1).tolist())), slots


@pytest.mark.parametrize("R,transport,env", [(2, "collective", None), (2, "symmetric", None),
                                             (4, "hybrid", {RANKS_PER_NODE_ENV: "2"})],
                         ids=["R2-collective", "R2-symmetric", "R4-hybrid-2-nodes"])
def test_combine_sums_each_token_k_ascending(R, transport, env):
    """A combine whose K-sum runs in another order than k ascending (a reduction whose order follows the
    tensor's shape, or the entries' arrival): outputs of 1e8, -1e8 and 1 for k = 0, 1, 2 sum to exactly 1
    only in that order; in any other they give 0."""
    res = ranks(R, combine_order, transport, env=env)
    for r, (values, _) in enumerate(res):
        assert values == [1.0], f"rank {r}: the tokens' sums came out {values}, not the k-ascending 1"
    assert sum(slots for _, slots in res) > 0, "the hot tokens must put rows in slots"


@pytest.mark.gpu
@pytest.mark.parametrize("layout_kind", ["replicated", "symmetric"])
def test_probe_tokens_same_bits_in_every_step_cuda(layout_kind):
    """The whole step on the GPU path (the Triton tiles, picked by the step's tokens per rank, the engine's
    device planner and transport), on two processes sharing the GPU."""
    res = ranks(2, probe_across_steps, layout_kind, "cuda", "triton", True)
    for r, (same, caps, _) in enumerate(res):
        assert all(same), f"rank {r}: the probe's output changed in steps {[i for i, s in enumerate(same) if not s]}"
