"""Batch invariance of the whole MoE step (``MoonEPMoE(batch_invariant=True)``, what
``VLLM_BATCH_INVARIANT=1`` turns on): the same probe tokens on every rank, in steps whose other
tokens change their number (so the pool's capacity and the tiles' tokens per rank change), their
routing (steps that send every token to rank 0's experts, so the plan serves those experts from
the other ranks' slots and overflow rows) and the probe's place among them. The probe's output must
be the same bits in every step, on both layouts, and right against the dense float32 reference.
The steps' bf16 outputs round away most last-bit differences of the float32 sums, so this checks the
whole step's plumbing (slots, overflow rows, combine); the expert compute's own bits are checked in
float32 and with large probes in ``tests/unit/test_batch_invariance.py``."""

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
    """A token's MoE output that follows the step's other tokens under batch invariance: the CPU
    expert compute's matmuls sized by the segment (a BLAS picks its kernel by the rows), a slot or
    overflow row that computes differently from its home row, or a transport's combine whose sum
    takes in more than the token's own rows."""
    res = ranks(R, probe_across_steps, layout_kind, "cpu", "auto", True, transport, env=env)
    for r, (same, caps, moved) in enumerate(res):
        assert all(same), f"rank {r}: the probe's output changed in steps {[i for i, s in enumerate(same) if not s]}"
        assert len(set(caps)) >= 3, f"rank {r}: the steps must span capacities, got {caps}"
    assert sum(moved for _, _, moved in res) > 0, "the hot steps must compute rank 0's experts on other ranks"


@pytest.mark.gpu
@pytest.mark.parametrize("layout_kind", ["replicated", "symmetric"])
def test_probe_tokens_same_bits_in_every_step_cuda(layout_kind):
    """The whole step on the GPU path (the Triton tiles, picked by the step's tokens per rank, the engine's
    device planner and transport), on two processes sharing the GPU."""
    res = ranks(2, probe_across_steps, layout_kind, "cuda", "triton", True)
    for r, (same, caps, _) in enumerate(res):
        assert all(same), f"rank {r}: the probe's output changed in steps {[i for i, s in enumerate(same) if not s]}"
