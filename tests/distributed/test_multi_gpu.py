"""NCCL, one GPU per rank: the engine's all-to-all transport, the MoE step with both layouts
(PyTorch symmetric memory over NVLink for the symmetric one), against the same references as on
CPU. Skipped with fewer than 2 GPUs; run with ``pytest -m multi_gpu`` on a multi-GPU machine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.distributed.test_engine import traceable_rows
from tests.moe_fixtures import check_against_dense, global_weights, local_experts, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.replicated import ReplicatedWeightLayout

pytestmark = pytest.mark.multi_gpu

NCCL_ENV = {"VLLM_MOONEP_TEST_DEVICE": "cuda", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def step_both_layouts(layout_kind, B):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, I, K = 8 * R, 256, 512, 4
    w13, w2 = global_weights(E, H, I, 2)
    lw13, lw2 = (t.to(dev) for t in local_experts(w13, w2, r, R))
    heap = None
    if layout_kind == "replicated":
        layout = ReplicatedWeightLayout(lw13, lw2, E, B)
    else:
        from vllm_moonep.symmetric import SymmetricWeightLayout, make_heap

        heap = make_heap("torch", device=dev)
        layout = SymmetricWeightLayout(lw13, lw2, E, B, heap=heap)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev), 512, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="auto")
    slots = 0
    for m in (1, 100, 512):
        x, ids, w = rank_inputs(m, E, K, H, sigma=2.5, seed=m, rank=r)
        out = moe.forward(x.to(dev), ids.to(dev), w.to(dev), num_tokens_across_dp=512)
        check_against_dense(out.cpu(), x, ids, w, w13, w2)
        slots += int((moe.last.experts_to_copy >= 0).sum())
    pool.destroy()
    layout.destroy()
    if heap is not None:
        heap.close()
    return slots


@pytest.mark.parametrize("R", [2, 4, 8])
def test_nccl_dispatch_rows_land_where_the_plan_says(R):
    if _gpus() < R:
        pytest.skip(f"needs {R} GPUs, have {_gpus()}")
    slots = ranks(R, traceable_rows, 24, 16, 4, 8 * R, 4, 8, 2.5, 7, env=NCCL_ENV, backend="nccl")
    assert slots[0] > 0


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("layout_kind,B", [("replicated", 8), ("symmetric", 8), ("symmetric", 2)])
def test_nccl_moe_step_both_layouts(R, layout_kind, B):
    if _gpus() < R:
        pytest.skip(f"needs {R} GPUs, have {_gpus()}")
    slots = ranks(R, step_both_layouts, layout_kind, B, env=NCCL_ENV, backend="nccl")
    assert all(s > 0 for s in slots)
