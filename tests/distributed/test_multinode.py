"""The multi-node launch path: under ``torchrun --nnodes 2`` (scripts/torchrun_loopback.sh)
these run on the launched group; without a multi-node launch they skip."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.conftest import ranks
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.weights import local_experts

pytestmark = pytest.mark.multi_node


def launched_topology():
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "-1"))),
        "backend": dist.get_backend(),
    }


def test_two_agents_form_one_group():
    """The ranks of two torchrun agents forming two groups, or all coming from one agent (no multi-node launch
    tested)."""
    info = ranks(2, launched_topology)
    assert [i["rank"] for i in info] == [0, 1]
    assert sorted(i["node"] for i in info) == [0, 1], "each rank must come from its own torchrun agent"


def moe_step_across_nodes():
    r, R = dist.get_rank(), dist.get_world_size()
    E, H, I, K = 16, 128, 128, 4
    w13, w2 = global_weights(E, H, I, 3)
    layout = ReplicatedWeightLayout(*local_experts(w13, w2, r, R), E, 4)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=4, token_padding=16, device="cpu"), 256, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="reference")
    x, ids, w = rank_inputs(50, E, K, H, sigma=2.0, seed=5, rank=r)
    out = moe.forward(x, ids, w)
    check_against_dense(out, x, ids, w, w13, w2)
    used = int((moe.last.experts_to_copy >= 0).sum())
    pool.destroy()
    return used


def test_moe_step_across_nodes():
    """A MoE step across nodes differing from the dense reference, or its ranks disagreeing on the plan."""
    used = ranks(2, moe_step_across_nodes)
    assert used[0] == used[1] and used[0] > 0
